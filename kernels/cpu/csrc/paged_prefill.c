/* Paged prefill attention on CPU (fp32): the new rows of each sequence against its cached keys and
 * values, causally, many rows at once.
 *
 * Why not the decode kernel once per row (what prefill used before): a prefill step has tens to
 * hundreds of new rows per sequence, all against the same keys. One row at a time, each key's dot
 * products are a horizontal sum per (row, head) and each row reads the whole context again. Here a
 * task takes up to 16 consecutive rows of one sequence and one KV head, i.e. 16 x G query vectors
 * (G = the GQA group), and makes both products small matrix products held in vector registers:
 *
 * - q . k: the task's query vectors are transposed once into lanes (qt[d][v]); for KEYS keys at a
 *   time, each of the key's elements is broadcast against two vectors of query lanes, so KEYS x 2
 *   vector accumulators with no horizontal sums (AVX-512: 8 keys x 32 lanes; AVX2: 6 x 16). Scores
 *   land as s[key][v].
 * - softmax per query vector across keys, in those lanes; row r sees keys [0, ctx_r) with
 *   ctx_r = seq_len - q_len + r + 1, the rest get probability exactly 0. With a sliding window W
 *   (args.window > 0) it sees keys [ctx_r - W, ctx_r) only, and a task reads keys from the block
 *   holding its first row's first one (earlier blocks may have been released).
 * - p . v: 4 query vectors x PIECE elements of the value row (AVX-512: 64, head_dim cut in pieces
 *   of up to 64; AVX2: 16) are the accumulators; each value row is read once per 4 query vectors.
 *
 * Results equal the reference (kernels/reference.py) within fp32 rounding (tests/kernels/
 * test_cpu_prefill_native.py). Used by kernels/cpu/attention.py for fp32 caches whose head_dim is a multiple of
 * 16, and for int8 caches (kernels/quant.py: each row head_dim int8 values then its fp32 scale) with
 * fp32 queries: each tile's keys are widened and scaled once, each value row as it is read; the per-row decode kernel still serves bf16 and other head sizes. Called through ctypes with the decode kernel's
 * argument struct (num_seqs = sequences, q/out strides per token row); kernels/cpu/native.py
 * checks the tensors first and kernels/checks.py the index values once per step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fastexp.h"
#include "vector_width.h"

typedef struct {  /* the same layout as paged_decode.c's DecodeArgs (checked at load, through it) */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    int64_t q_seq_stride, q_head_stride;
    int64_t o_seq_stride, o_head_stride;
    int64_t c_block_stride, c_slot_stride, c_head_stride;
    int64_t bt_stride;
    float scale;
    int num_threads;
    int generic_only;
    int64_t window;  /* sliding window (0: none): row at position p sees keys p - window + 1 .. p */
} PrefillArgs;

/* Register tiles in vectors of the build's width (VW, vector_width.h), sized so every accumulator
 * has a register of its own (16-float tiles written for AVX-512's 32 registers spilled on the AVX2
 * build and ran many times slower than torch's SDPA; docs/kernels.md):
 * - KEYS: keys per q.k tile, KEYS x 2 accumulators (AVX-512 8 x 2 of 32 registers; else 6 x 2 of 16);
 * - PIECE: value elements per p.v tile, 4 x PIECE / VW accumulators (AVX-512 4 x 4; else 4 x 2). */
#if VW == 16
#define KEYS 8
#define PIECE 64
#else
#define KEYS 6
#define PIECE (2 * VW)
#endif
typedef int8_t cvu __attribute__((vector_size(VW), aligned(1)));

/* Rows per task: 16, or 32 when 16 rows' query vectors would leave lanes of the last 32 unused
 * (an odd group: 16 x 3 = 48 of 64 lanes; 32 x 3 = 96 fills three pairs). */
static inline int64_t rows_per_task(int64_t G) { return G % 2 ? 32 : 16; }
/* query lanes are padded to a multiple of 32 (qk_tile's two vectors) */

typedef struct { int64_t seq, head, row0; } Task;

/* s[t][lanes c*VW .. (c + Z)*VW) for keys t0 .. t0+KEYS (rows `keys[]`), Z = 1 or 2 lane vectors. */
static inline __attribute__((always_inline)) void qk_tile(const int Z, const float *restrict qt, int64_t lanes,
                                                          const float *const keys[KEYS], int64_t D,
                                                          float *restrict s, int64_t t0, int64_t c) {
    vf acc[KEYS][2];
    for (int j = 0; j < KEYS; j++)
        for (int z = 0; z < Z; z++) acc[j][z] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf qv[2];
        for (int z = 0; z < Z; z++) qv[z] = *(const vf *)(qt + d * lanes + (c + z) * VW);
        #pragma GCC unroll 8
        for (int j = 0; j < KEYS; j++) {
            const float kd = keys[j][d];
            for (int z = 0; z < Z; z++) acc[j][z] += kd * qv[z];
        }
    }
    for (int j = 0; j < KEYS; j++)
        for (int z = 0; z < Z; z++) *(vf *)(s + (t0 + j) * lanes + (c + z) * VW) = acc[j][z];
}

/* out vectors v0 .. v0+4 (probabilities in s[t][v]) over values: elements d0 .. d0 + VW * ZD of each
 * value row (ZD, 1 to PIECE / VW, a constant at each call site: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void pv_tile(const int ZD, const int I8, const float *restrict s,
                                                          int64_t lanes, int64_t ctx, const void *restrict v_cache,
                                                          const int32_t *restrict table, const PrefillArgs *a,
                                                          int64_t head, int64_t v0, int64_t d0,
                                                          float *restrict acc_out /* [4][PIECE] */) {
    vf acc[4][PIECE / VW];
    for (int i = 0; i < 4; i++)
        for (int z = 0; z < ZD; z++) acc[i][z] = (vf){0};
    const int64_t BS = a->block_size;
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t at = (int64_t)table[t / BS] * a->c_block_stride + (t % BS) * a->c_slot_stride
            + head * a->c_head_stride;
        vf vv[PIECE / VW];
        if (I8) { /* the row's int8 values widened, times its scale (after the head_dim values) */
            const int8_t *vr = (const int8_t *)v_cache + at;
            float vs;
            memcpy(&vs, vr + a->head_dim, sizeof(float));
            for (int z = 0; z < ZD; z++) vv[z] = __builtin_convertvector(*(const cvu *)(vr + d0 + z * VW), vf) * vs;
        } else {
            const float *vr = (const float *)v_cache + at + d0;
            for (int z = 0; z < ZD; z++) vv[z] = *(const vfu *)(vr + z * VW);
        }
        const float *p = s + t * lanes + v0;
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const float pi = p[i];
            for (int z = 0; z < ZD; z++) acc[i][z] += pi * vv[z];
        }
    }
    for (int i = 0; i < 4; i++)
        for (int z = 0; z < ZD; z++) *(vfu *)(acc_out + i * PIECE + z * VW) = acc[i][z];
}

/* The q / out row of the task's row r: itself, or through a prefix problem's row map. */
static inline int64_t row_of(const int32_t *row_map, int64_t i) { return row_map ? row_map[i] : i; }

/* `row_map` NULL: causal prefill, as described above. Else a shared prefix (cascade): the "rows" of
 * sequence s_idx are query rows row_map[query_start_loc[s_idx] ..] of other sequences, each past the
 * prefix, so every row sees all seq_len keys (no mask), and each result is merged into that row's
 * own-part output already in `out` by the two parts' log-sum-exps (own_lse [rows, num_heads]). */
static inline __attribute__((always_inline)) void run_task(
        const PrefillArgs *a, const Task *task, const float *q, const void *k_cache, const void *v_cache,
        const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens, float *out, float *work,
        int64_t max_ctx, const int32_t *row_map, const float *own_lse, const int I8) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim, BS = a->block_size;
    const int64_t s_idx = task->seq, h = task->head, r0 = task->row0;
    const int64_t q_begin = query_start_loc[s_idx], q_len = query_start_loc[s_idx + 1] - q_begin;
    const int64_t RT = rows_per_task(G);
    const int64_t L = seq_lens[s_idx], rows = q_len - r0 < RT ? q_len - r0 : RT;
    const int64_t nv = rows * G, lanes = (nv + 31) / 32 * 32;
    /* A sliding window: keys are read from the block holding the first row's first key (`base`
     * tokens in; earlier blocks may have been released), key t below standing for position base + t. */
    const int64_t p0 = L - q_len + r0, W = row_map ? 0 : a->window;
    const int64_t base = W > 0 && p0 - W + 1 > 0 ? (p0 - W + 1) / BS * BS : 0;
    /* the last row's context, and the first key hidden from some rows (none for a prefix) */
    const int64_t ctx = row_map ? L : p0 + rows - base;
    const int64_t first_masked = row_map ? L : p0 + 1 - base;
    const int32_t *table = block_tables + s_idx * a->bt_stride + base / BS;
    float *qt = work, *s = qt + D * lanes, *m = s + (max_ctx + KEYS) * lanes, *sum = m + lanes;
    float *acc = sum + lanes; /* [4][PIECE] */

    /* query vectors (row r, head g) -> lanes v = r * G + g, scaled; padded lanes are 0 */
    memset(qt, 0, sizeof(float) * D * lanes);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *qr = q + row_of(row_map, q_begin + r0 + r) * a->q_seq_stride + (h * G + g) * a->q_head_stride;
            for (int64_t d = 0; d < D; d++) qt[d * lanes + r * G + g] = qr[d] * a->scale;
        }
    /* scores, KEYS keys at a time (past ctx: the last key again; those rows of s are never read,
     * and s has room for them: max_ctx + KEYS rows) */
    float kbuf[I8 ? KEYS : 1][I8 ? D : 1]; /* int8: the tile's keys widened and scaled */
    for (int64_t t0 = 0; t0 < ctx; t0 += KEYS) {
        const float *keys[KEYS];
        for (int j = 0; j < KEYS; j++) {
            const int64_t t = t0 + j < ctx ? t0 + j : ctx - 1;
            const int64_t at = (int64_t)table[t / BS] * a->c_block_stride + (t % BS) * a->c_slot_stride
                + h * a->c_head_stride;
            if (I8) {
                const int8_t *kr = (const int8_t *)k_cache + at;
                float ks;
                memcpy(&ks, kr + D, sizeof(float));
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) kbuf[j][d] = (float)kr[d] * ks;
                keys[j] = kbuf[j];
            } else {
                keys[j] = (const float *)k_cache + at;
            }
        }
        for (int64_t c = 0; c < lanes / VW; c += 2) qk_tile(2, qt, lanes, keys, D, s, t0, c);
    }
    /* causal mask, softmax per lane */
    for (int64_t v = 0; v < lanes; v++) { m[v] = -INFINITY; sum[v] = 0.0f; }
    for (int64_t t = first_masked; t < ctx; t++)
        for (int64_t r = 0; r < rows; r++)
            if (t >= p0 + r + 1 - base)
                for (int64_t g = 0; g < G; g++) s[t * lanes + r * G + g] = -INFINITY;
    if (W > 0) /* row r sees keys from position p0 + r - W + 1 on */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t t = 0; t < p0 + r - W + 1 - base && t < ctx; t++)
                for (int64_t g = 0; g < G; g++) s[t * lanes + r * G + g] = -INFINITY;
    for (int64_t t = 0; t < ctx; t++) {
        const float *st = s + t * lanes;
        #pragma omp simd
        for (int64_t v = 0; v < lanes; v++) m[v] = st[v] > m[v] ? st[v] : m[v];
    }
    for (int64_t t = 0; t < ctx; t++) {
        float *st = s + t * lanes;
        #pragma omp simd
        for (int64_t v = 0; v < lanes; v++) {
            const float e = st[v] == -INFINITY ? 0.0f : exp_nonpos(st[v] - m[v]);
            st[v] = e;
            sum[v] += e;
        }
    }
    /* probabilities x values, 4 query vectors x PIECE elements at a time */
    for (int64_t v0 = 0; v0 < nv; v0 += 4) {
        for (int64_t d0 = 0; d0 < D; d0 += PIECE) {
            const int64_t width = D - d0 < PIECE ? D - d0 : PIECE; /* head_dim is a multiple of 16 */
#if PIECE == 64
            switch (width / VW) {
                case 1: pv_tile(1, I8, s, lanes, ctx, v_cache, table, a, h, v0, d0, acc); break;
                case 2: pv_tile(2, I8, s, lanes, ctx, v_cache, table, a, h, v0, d0, acc); break;
                case 3: pv_tile(3, I8, s, lanes, ctx, v_cache, table, a, h, v0, d0, acc); break;
                default: pv_tile(4, I8, s, lanes, ctx, v_cache, table, a, h, v0, d0, acc); break;
            }
#else /* PIECE divides 16, so every piece is whole */
            pv_tile(PIECE / VW, I8, s, lanes, ctx, v_cache, table, a, h, v0, d0, acc);
#endif
            for (int64_t i = 0; i < 4 && v0 + i < nv; i++) {
                const int64_t v = v0 + i, r = v / G, g = v % G, row = row_of(row_map, q_begin + r0 + r);
                float *o = out + row * a->o_seq_stride + (h * G + g) * a->o_head_stride + d0;
                const float inv = 1.0f / sum[v];
                if (!own_lse) {
                    for (int64_t d = 0; d < width; d++) o[d] = acc[i * PIECE + d] * inv;
                    continue;
                }
                /* softmax over prefix + own keys = the two parts weighted by their normalisers */
                const float lp = m[v] + logf(sum[v]), lo = own_lse[row * a->num_heads + h * G + g];
                const float top = lp > lo ? lp : lo, wp = expf(lp - top), wo = expf(lo - top);
                const float cp = wp * inv / (wp + wo), co = wo / (wp + wo);
                for (int64_t d = 0; d < width; d++) o[d] = acc[i * PIECE + d] * cp + o[d] * co;
            }
        }
    }
}

static void run_task_f32(const PrefillArgs *a, const Task *task, const float *q, const void *k_cache,
                         const void *v_cache, const int32_t *block_tables, const int32_t *query_start_loc,
                         const int32_t *seq_lens, float *out, float *work, int64_t max_ctx, const int32_t *row_map,
                         const float *own_lse) {
    run_task(a, task, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, work, max_ctx, row_map,
             own_lse, 0);
}

static void run_task_i8(const PrefillArgs *a, const Task *task, const float *q, const void *k_cache,
                        const void *v_cache, const int32_t *block_tables, const int32_t *query_start_loc,
                        const int32_t *seq_lens, float *out, float *work, int64_t max_ctx, const int32_t *row_map,
                        const float *own_lse) {
    run_task(a, task, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, work, max_ctx, row_map,
             own_lse, 1);
}

static int prefill(const PrefillArgs *a, const float *q, const void *k_cache, const void *v_cache,
                   const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens, float *out,
                   const int32_t *row_map, const float *own_lse, int i8) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim, HKV = a->num_kv_heads;
    const int64_t RT = rows_per_task(G);
    int64_t max_ctx = 1, num_tasks = 0;
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 0 || (row_map ? seq_lens[s] < 1 : q_len > seq_lens[s])) return -2;
        /* a task's context: at most its rows, the window and the part of a block before it */
        const int64_t w = row_map ? 0 : a->window, bound = RT + w + a->block_size;
        const int64_t ctx = w > 0 && bound < seq_lens[s] ? bound : seq_lens[s];
        max_ctx = ctx > max_ctx ? ctx : max_ctx;
        num_tasks += HKV * ((query_start_loc[s + 1] - query_start_loc[s] + RT - 1) / RT);
    }
    if (num_tasks == 0) return 0;
    const int64_t lanes = (RT * G + 31) / 32 * 32;
    /* floats per thread: qt, s, m and sum, acc; every part a multiple of 16 floats, so each thread's
     * buffers stay 64-byte aligned for the vector loads */
    const int64_t per = D * lanes + (max_ctx + KEYS) * lanes + 2 * lanes + 4 * 64;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    float *work = (float *)aligned_alloc(64, (size_t)(per * threads * sizeof(float) + 63) / 64 * 64);
    Task *tasks = (Task *)malloc(sizeof(Task) * (size_t)num_tasks);
    if (!work || !tasks) { free(work); free(tasks); return -1; }
    int64_t n = 0;
    for (int64_t s = 0; s < a->num_seqs; s++)
        for (int64_t r0 = 0; r0 < query_start_loc[s + 1] - query_start_loc[s]; r0 += RT)
            for (int64_t h = 0; h < HKV; h++) tasks[n++] = (Task){s, h, r0};
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < num_tasks; i++) {
#ifdef _OPENMP
        float *w = work + per * omp_get_thread_num();
#else
        float *w = work;
#endif
        if (i8)
            run_task_i8(a, &tasks[i], q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, w, max_ctx,
                        row_map, own_lse);
        else
            run_task_f32(a, &tasks[i], q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, w,
                         max_ctx, row_map, own_lse);
    }
    free(work);
    free(tasks);
    return 0;
}

/* Returns 0; -1 when scratch memory could not be allocated, -2 when a sequence has fewer cached tokens
 * than new rows or a negative row count (nothing written then). */
int pagedkv_prefill_f32(const PrefillArgs *a, const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens,
                        float *out) {
    return prefill(a, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, NULL, NULL, 0);
}

/* A cascade's shared-prefix part (kernels/cpu/attention.py): "sequence" i is a prefix of seq_lens[i] >= 1 tokens
 * (block_tables row i) and its rows are the query rows row_map[query_start_loc[i] .. query_start_loc[i+1])
 * of the decode batch whose sequences share it; each row attends to all of the prefix, and the result
 * is merged into out[row], which holds the row's own part with its log-sum-exps in own_lse
 * [rows, num_heads] (pagedkv_decode_f32_lse). Returns 0, -1 (no scratch memory), -2 (a negative row
 * count or an empty prefix; nothing written then). */
int pagedkv_prefill_prefix_f32(const PrefillArgs *a, const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens,
                               float *out, const int32_t *row_map, const float *own_lse) {
    return prefill(a, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, row_map, own_lse, 0);
}

/* The same two on int8 caches (rows of head_dim values + an fp32 scale; cache strides in bytes). */
int pagedkv_prefill_i8(const PrefillArgs *a, const float *q, const int8_t *k_cache, const int8_t *v_cache,
                       const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens,
                       float *out) {
    return prefill(a, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, NULL, NULL, 1);
}
int pagedkv_prefill_prefix_i8(const PrefillArgs *a, const float *q, const int8_t *k_cache, const int8_t *v_cache,
                              const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens,
                              float *out, const int32_t *row_map, const float *own_lse) {
    return prefill(a, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, row_map, own_lse, 1);
}
