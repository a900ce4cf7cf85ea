/* Paged decode attention on CPU, reading K/V in place from the blocks of the paged cache.
 *
 * Why C: torch has no paged attention on CPU. Its fused SDPA needs each sequence's K/V contiguous,
 * so the Python path (kernels/cpu.py) first copies every sequence's blocks into gather buffers,
 * bucketed by length, which costs more than the attention itself at decode (a few hundred tokens
 * per sequence, one query each). Here each (sequence, KV head) pair is one task: its `group`
 * query heads are scored against each cached key row where it lies, softmaxed, and the value rows
 * summed, so every K/V element is read once and nothing is copied or padded.
 *
 * Built at install by setup.py, once per instruction-set variant (baseline x86-64, AVX2, AVX-512;
 * generic elsewhere), the variant chosen at run time by kernels/cpu_native.py, which calls it through
 * ctypes with raw pointers; tasks are spread over OpenMP threads (torch's own OpenMP runtime,
 * already loaded in the process). fp32 and bf16 (bf16 widened to fp32 on read; scores and sums
 * in fp32, the output rounded once). The common (group, head_dim) pairs get specialised copies
 * (constants let the compiler keep the accumulators in registers: 1.4x at head_dim 64 and 128;
 * groups 3, 5, 6 and 7 at head_dim 64 for models such as SmolLM2's 9 query over 3 KV heads),
 * and fp32 keys are scored sixteen at a time with one butterfly sum for the sixteen dot products
 * (another 1.3-1.6x): bench/cpu_decode_bench.py.
 * Arguments are validated in Python before the call (kernels/cpu_native.py, check_decode).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fastexp.h"

typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    int64_t q_seq_stride, q_head_stride;                   /* query [num_seqs, num_heads, head_dim] */
    int64_t o_seq_stride, o_head_stride;                   /* out, same shape */
    int64_t c_block_stride, c_slot_stride, c_head_stride;  /* each cache [blocks, block_size, kv_heads, head_dim] */
    int64_t bt_stride;                                     /* block_tables [num_seqs, max_blocks] int32 */
    float scale;
    int num_threads;
    int generic_only;  /* 1: skip the specialised copies (for measuring them against the generic one) */
} DecodeArgs;

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)h << 16;
    return u.f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    union { uint32_t i; float f; } u;
    u.f = f;
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u.i >> 16) | 0x40u);  /* NaN stays NaN */
    u.i += 0x7fffu + ((u.i >> 16) & 1u);
    return (uint16_t)(u.i >> 16);
}

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  /* unaligned loads */
typedef int32_t i16v __attribute__((vector_size(64)));

/* Sixteen vectors -> one vector whose lane j is the sum of p[j]'s lanes: a butterfly of
 * shuffles (15 steps) instead of sixteen horizontal sums. */
static inline v16 sum16(v16 p[16]) {
    const i16v m1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16v m1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16v m2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i16v m2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const i16v m3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i16v m3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const i16v m4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i16v m4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], m1a) + __builtin_shuffle(p[2 * i], p[2 * i + 1], m1b);
    for (int i = 0; i < 4; i++) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], m2a) + __builtin_shuffle(a[2 * i], a[2 * i + 1], m2b);
    for (int i = 0; i < 2; i++) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], m3a) + __builtin_shuffle(b[2 * i], b[2 * i + 1], m3b);
    return __builtin_shuffle(c[0], c[1], m4a) + __builtin_shuffle(c[0], c[1], m4b);
}

/* A K or V row as fp32: in place for fp32 caches, widened into `buf` for bf16. */
static inline const float *row_f32(const void *base, int64_t offset, float *buf, int64_t D, int bf16) {
    if (!bf16) return (const float *)base + offset;
    const uint16_t *p = (const uint16_t *)base + offset;
    for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(p[d]);
    return buf;
}

static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* One (sequence s, KV head h) task. `scores` holds G x ctx floats. G and D are constants in the
 * specialised copies (always_inline + constant arguments). */
static inline __attribute__((always_inline)) void attend(
        const DecodeArgs *restrict a, const void *restrict q, const void *restrict k_cache,
        const void *restrict v_cache, const int32_t *restrict block_tables, int64_t ctx, void *restrict out,
        float *restrict scores, int64_t s, int64_t h, const int64_t G, const int64_t D, const int bf16) {
    const int64_t BS = a->block_size;
    float qf[G * D], acc[G * D], row[D];
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++)
            qf[g * D + d] = load(q, s * a->q_seq_stride + (h * G + g) * a->q_head_stride + d, bf16) * a->scale;
    const int32_t *table = block_tables + s * a->bt_stride;
    for (int64_t t0 = 0; t0 < ctx; t0 += BS) {
        const int64_t base = (int64_t)table[t0 / BS] * a->c_block_stride + h * a->c_head_stride;
        const int64_t n = ctx - t0 < BS ? ctx - t0 : BS;
        int64_t j = 0;
        if (!bf16 && D % 16 == 0) {  /* sixteen keys at a time, their dot products summed together */
            for (; j + 16 <= n; j += 16) {
                for (int64_t g = 0; g < G; g++) {
                    v16 part[16];
                    for (int jj = 0; jj < 16; jj++) {
                        const float *k = (const float *)k_cache + base + (j + jj) * a->c_slot_stride;
                        v16 acc16 = {0};
                        for (int64_t d = 0; d < D; d += 16) acc16 += *(const v16u *)(qf + g * D + d) * *(const v16u *)(k + d);
                        part[jj] = acc16;
                    }
                    *(v16u *)(scores + g * ctx + t0 + j) = sum16(part);
                }
            }
        }
        for (; j < n; j++) {
            const float *restrict k = row_f32(k_cache, base + j * a->c_slot_stride, row, D, bf16);
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; d++) dot += qf[g * D + d] * k[d];
                scores[g * ctx + t0 + j] = dot;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *restrict sg = scores + g * ctx, m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < ctx; t++) m = sg[t] > m ? sg[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < ctx; t++) { float e = exp_nonpos(sg[t] - m); sg[t] = e; sum += e; }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; t++) sg[t] *= inv;
    }
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < ctx; t0 += BS) {
        const int64_t base = (int64_t)table[t0 / BS] * a->c_block_stride + h * a->c_head_stride;
        const int64_t n = ctx - t0 < BS ? ctx - t0 : BS;
        for (int64_t j = 0; j < n; j++) {
            const float *restrict v = row_f32(v_cache, base + j * a->c_slot_stride, row, D, bf16);
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * ctx + t0 + j];
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[g * D + d] += p * v[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t o = s * a->o_seq_stride + (h * G + g) * a->o_head_stride;
        for (int64_t d = 0; d < D; d++) {
            if (bf16) ((uint16_t *)out)[o + d] = f32_to_bf16(acc[g * D + d]);
            else ((float *)out)[o + d] = acc[g * D + d];
        }
    }
}

/* The specialised (G, D) pairs, else the generic copy. */
static void attend_any(const DecodeArgs *a, const void *q, const void *k_cache, const void *v_cache,
                       const int32_t *block_tables, int64_t ctx, void *out, float *scores, int64_t s, int64_t h,
                       int bf16) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim;
#define CASE(GC, DC)                                                                                   \
    if (G == GC && D == DC) {                                                                          \
        if (bf16) attend(a, q, k_cache, v_cache, block_tables, ctx, out, scores, s, h, GC, DC, 1);      \
        else attend(a, q, k_cache, v_cache, block_tables, ctx, out, scores, s, h, GC, DC, 0);           \
        return;                                                                                        \
    }
    if (!a->generic_only) {
        CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64) CASE(8, 64)
        CASE(1, 128) CASE(2, 128) CASE(4, 128) CASE(8, 128)
    }
#undef CASE
    if (bf16) attend(a, q, k_cache, v_cache, block_tables, ctx, out, scores, s, h, G, D, 1);
    else attend(a, q, k_cache, v_cache, block_tables, ctx, out, scores, s, h, G, D, 0);
}

/* Sequences ordered by their first block (then index): sequences sharing a cached prefix run one
 * after another, so the prefix's K/V is still in cache for the next one (1.1-1.3x with four
 * 432-token prefixes interleaved over 64 sequences). */
typedef struct { int32_t first_block; int64_t seq; } SeqKey;

static int by_first_block(const void *x, const void *y) {
    const SeqKey *a = (const SeqKey *)x, *b = (const SeqKey *)y;
    if (a->first_block != b->first_block) return a->first_block < b->first_block ? -1 : 1;
    return (a->seq > b->seq) - (a->seq < b->seq);
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing written then). A sequence
 * of length 0 gets zeros (it attends to nothing). */
static int decode(const DecodeArgs *a, const void *q, const void *k_cache, const void *v_cache,
                  const int32_t *block_tables, const int32_t *seq_lens, void *out, int bf16) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim;
    int64_t max_ctx = 1;
    for (int64_t s = 0; s < a->num_seqs; s++) max_ctx = seq_lens[s] > max_ctx ? seq_lens[s] : max_ctx;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    const int64_t per = G * max_ctx, tasks = a->num_seqs * a->num_kv_heads;
    float *work = (float *)malloc(sizeof(float) * per * threads);
    SeqKey *order = (SeqKey *)malloc(sizeof(SeqKey) * (a->num_seqs > 0 ? a->num_seqs : 1));
    if (!work || !order) { free(work); free(order); return -1; }
    for (int64_t s = 0; s < a->num_seqs; s++) {
        order[s].first_block = seq_lens[s] > 0 ? block_tables[s * a->bt_stride] : INT32_MAX;
        order[s].seq = s;
    }
    qsort(order, (size_t)a->num_seqs, sizeof(SeqKey), by_first_block);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = order[task / a->num_kv_heads].seq, h = task % a->num_kv_heads;
#ifdef _OPENMP
        float *scores = work + per * omp_get_thread_num();
#else
        float *scores = work;
#endif
        if (seq_lens[s] > 0) {
            attend_any(a, q, k_cache, v_cache, block_tables, seq_lens[s], out, scores, s, h, bf16);
        } else {
            for (int64_t g = 0; g < G; g++) {
                const int64_t o = s * a->o_seq_stride + (h * G + g) * a->o_head_stride;
                if (bf16) memset((uint16_t *)out + o, 0, sizeof(uint16_t) * D);
                else memset((float *)out + o, 0, sizeof(float) * D);
            }
        }
    }
    free(work);
    free(order);
    return 0;
}

int pagedkv_decode_f32(const DecodeArgs *a, const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *block_tables, const int32_t *seq_lens, float *out) {
    return decode(a, q, k_cache, v_cache, block_tables, seq_lens, out, 0);
}

int pagedkv_decode_bf16(const DecodeArgs *a, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out) {
    return decode(a, q, k_cache, v_cache, block_tables, seq_lens, out, 1);
}

/* The struct layout the Python side must mirror (checked at load). */
int64_t pagedkv_decode_args_size(void) { return (int64_t)sizeof(DecodeArgs); }
