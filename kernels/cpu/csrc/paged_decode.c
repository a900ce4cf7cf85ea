/* Paged decode attention on CPU, reading K/V in place from the blocks of the paged cache.
 *
 * Why C: torch has no paged attention on CPU. Its fused SDPA needs each sequence's K/V contiguous,
 * so the Python path (kernels/cpu/attention.py) first copies every sequence's blocks into gather buffers,
 * bucketed by length, which costs more than the attention itself at decode (a few hundred tokens
 * per sequence, one query each). Here each sequence is one task (bf16; its KV heads split over a
 * few tasks only when there are too few sequences for the threads), or with fp32 outputs one task
 * per run of its context (decode_split, which also says why): every query head is scored
 * against each cached key row where it lies, softmaxed, and the value rows summed, so every K/V
 * element is read once, block by block with all the task's heads together, and nothing is
 * copied or padded. Rows two blocks ahead are prefetched as the kernel goes.
 *
 * Built at install by setup.py, once per instruction-set variant (baseline x86-64, AVX2, AVX-512;
 * generic elsewhere), the variant chosen at run time by kernels/cpu/native.py, which calls it through
 * ctypes with raw pointers; tasks are spread over OpenMP threads (torch's own OpenMP runtime,
 * already loaded in the process). fp32 and bf16 (bf16 widened to fp32 on read; scores and sums
 * in fp32, the output rounded once), and 8-bit int8 caches with fp32 queries (kernels/quant.py: each
 * row's head_dim int8 values, then its fp32 scale; a row is widened once and its scale folded into
 * the dot product for K and into the probability for V). The common (group, head_dim) pairs get specialised copies
 * (constants let the compiler keep the accumulators in registers, at head_dim 64 and 128;
 * groups 3, 5, 6 and 7 at head_dim 64 for models such as SmolLM2's 9 query over 3 KV heads),
 * and fp32 keys are scored a vector's width (VW) at a time with one butterfly sum for their dot products
 * (each faster than the code it replaced: bench/cpu_decode_bench.py; docs/kernels.md has the
 * figures).
 * With a sliding window (DecodeArgs.window > 0) a sequence's keys are read from the block holding
 * its window's first key on (earlier blocks may have been released), so the work follows the window.
 * Arguments are validated in Python before the call (kernels/cpu/native.py, check_decode).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "decode_args.h"
#include "fastexp.h"
#include "vector_width.h"


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

/* Keys scored per batch: VW, one vector of the build's width (vector_width.h), each key's dot
 * product a vector accumulator, the batch's accumulators reduced together by one butterfly. A
 * 16-key batch of 16-float vectors on the AVX2 build was slower than this one (docs/kernels.md). */
typedef int32_t vi __attribute__((vector_size(VW * 4)));

/* VW vectors -> one vector whose lane j is the sum of p[j]'s lanes: a butterfly of shuffles
 * (VW - 1 steps) instead of VW horizontal sums. Each level adds the two halves of every part. */
static inline vf sum_lanes(vf p[VW]) {
#if VW == 16
    const vi m1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi m1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi m2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi m2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi m3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi m3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi m4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi m4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], m1a) + __builtin_shuffle(p[2 * i], p[2 * i + 1], m1b);
    for (int i = 0; i < 4; i++) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], m2a) + __builtin_shuffle(a[2 * i], a[2 * i + 1], m2b);
    for (int i = 0; i < 2; i++) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], m3a) + __builtin_shuffle(b[2 * i], b[2 * i + 1], m3b);
    return __builtin_shuffle(c[0], c[1], m4a) + __builtin_shuffle(c[0], c[1], m4b);
#elif VW == 8
    const vi m1a = {0, 1, 2, 3, 8, 9, 10, 11}, m1b = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi m2a = {0, 1, 4, 5, 8, 9, 12, 13}, m2b = {2, 3, 6, 7, 10, 11, 14, 15};
    const vi m3a = {0, 2, 4, 6, 8, 10, 12, 14}, m3b = {1, 3, 5, 7, 9, 11, 13, 15};
    vf a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], m1a) + __builtin_shuffle(p[2 * i], p[2 * i + 1], m1b);
    for (int i = 0; i < 2; i++) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], m2a) + __builtin_shuffle(a[2 * i], a[2 * i + 1], m2b);
    return __builtin_shuffle(b[0], b[1], m3a) + __builtin_shuffle(b[0], b[1], m3b);
#else
    const vi m1a = {0, 1, 4, 5}, m1b = {2, 3, 6, 7};
    const vi m2a = {0, 2, 4, 6}, m2b = {1, 3, 5, 7};
    vf a[2];
    for (int i = 0; i < 2; i++) a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], m1a) + __builtin_shuffle(p[2 * i], p[2 * i + 1], m1b);
    return __builtin_shuffle(a[0], a[1], m2a) + __builtin_shuffle(a[0], a[1], m2b);
#endif
}

/* What the cache holds (the query and output are bf16 for KIND_BF16, else fp32). */
#define KIND_F32 0
#define KIND_BF16 1
#define KIND_I8 2 /* int8 rows of head_dim values + an fp32 scale (kernels/quant.py) */

/* A K or V row as fp32 and its scale: in place for fp32 caches (scale 1), widened into `buf` for bf16
 * (scale 1) and int8 (the row's own scale, applied by the caller: once per dot product or probability
 * rather than once per element). */
static inline const float *row_f32(const void *base, int64_t offset, float *buf, int64_t D, int kind,
                                   float *scale) {
    *scale = 1.0f;
    if (kind == KIND_F32) return (const float *)base + offset;
    if (kind == KIND_BF16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(p[d]);
        return buf;
    }
    const int8_t *p = (const int8_t *)base + offset;
    memcpy(scale, p + D, sizeof(float));
    #pragma omp simd
    for (int64_t d = 0; d < D; d++) buf[d] = (float)p[d];
    return buf;
}

static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Blocks ahead of the one being read whose rows are prefetched. The hardware prefetchers stop at
 * each block's end (the next block lies anywhere in the cache), so without this every block
 * starts with a run of cache misses; a steady software prefetch two blocks ahead, a few rows at a
 * time, kept the stream going (bench/cpu_decode_bench.py measures it; docs/kernels.md has the
 * figures). */
#define PREFETCH_BLOCKS 2

/* Prefetch `rows` slots' rows of KV heads h0..h1 (`span` contiguous bytes per slot) from `p`. */
static inline void prefetch_rows(const char *p, int64_t rows, int64_t slot_bytes, int64_t span) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t off = 0; off < span; off += 64) __builtin_prefetch(p + r * slot_bytes + off);
}

/* One task: sequence s, KV heads [h0, h1). Each cached block is read once, its rows of all the
 * task's heads together (contiguous in the [block, slot, head, dim] layout), so every byte the
 * memory system brings in is used: a task per (sequence, head) read every third 256-byte piece of
 * each block for three KV heads, at a third of the bandwidth. `scores` holds (h1 - h0) x G x ctx
 * floats, `qf` and `acc` (h1 - h0) x G x D each. G and D are constants in the specialised copies
 * (always_inline + constant arguments). */
static inline __attribute__((always_inline)) void attend(
        const DecodeArgs *restrict a, const void *restrict q, const void *restrict k_cache,
        const void *restrict v_cache, const int32_t *restrict block_tables, int64_t ctx, void *restrict out,
        float *restrict scores, float *restrict qf, float *restrict acc, float *restrict lse, float *restrict ml,
        int64_t s, int64_t h0, int64_t h1, int64_t skip, const int64_t G, const int64_t D, const int kind) {
    const int bf16 = kind == KIND_BF16;
    const int64_t BS = a->block_size, NH = h1 - h0, esz = kind == KIND_BF16 ? 2 : kind == KIND_I8 ? 1 : 4;
    const int64_t nblocks = (ctx + BS - 1) / BS;
    const int64_t slot_bytes = a->c_slot_stride * esz, span = ((NH - 1) * a->c_head_stride + D) * esz;
    const int64_t head0 = h0 * a->c_head_stride;
    const int32_t *table = block_tables + s * a->bt_stride;
    float row[D];
    for (int64_t hh = 0; hh < NH; hh++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++)
                qf[(hh * G + g) * D + d] =
                    load(q, s * a->q_seq_stride + ((h0 + hh) * G + g) * a->q_head_stride + d, bf16) * a->scale;
    /* q . k for every key, all heads of the task */
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t t0 = b * BS, n = ctx - t0 < BS ? ctx - t0 : BS;
        const int64_t base = (int64_t)table[b] * a->c_block_stride + head0;
        /* the key rows PREFETCH_BLOCKS blocks ahead; in the last blocks, the first value rows (the
         * value pass below starts on them) */
        const int64_t next = b + PREFETCH_BLOCKS;
        const char *ahead = next < nblocks
            ? (const char *)k_cache + ((int64_t)table[next] * a->c_block_stride + head0) * esz
            : next - nblocks < nblocks
            ? (const char *)v_cache + ((int64_t)table[next - nblocks] * a->c_block_stride + head0) * esz
            : 0;
        int64_t j = 0;
        if (kind == KIND_I8 && D % 16 == 0) {  /* the same VW at a time: rows widened once, scales last */
            for (; j + VW <= n; j += VW) {
                if (ahead) prefetch_rows(ahead + j * slot_bytes, VW, slot_bytes, span);
                for (int64_t hh = 0; hh < NH; hh++) {
                    float kw[VW * D] __attribute__((aligned(64)));
                    float ksc[VW] __attribute__((aligned(64)));
                    for (int jj = 0; jj < VW; jj++) {
                        const int8_t *k8 = (const int8_t *)k_cache + base + (j + jj) * a->c_slot_stride
                            + hh * a->c_head_stride;
                        memcpy(&ksc[jj], k8 + D, sizeof(float));
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) kw[jj * D + d] = (float)k8[d];
                    }
                    const vf kscale = *(const vf *)ksc;
                    for (int64_t g = 0; g < G; g++) {
                        const float *qg = qf + (hh * G + g) * D;
                        vf part[VW];
                        for (int jj = 0; jj < VW; jj++) {
                            vf accv = {0};
                            for (int64_t d = 0; d < D; d += VW)
                                accv += *(const vfu *)(qg + d) * *(const vf *)(kw + jj * D + d);
                            part[jj] = accv;
                        }
                        *(vfu *)(scores + (hh * G + g) * ctx + t0 + j) = sum_lanes(part) * kscale;
                    }
                }
            }
        }
        if (kind == KIND_F32 && D % 16 == 0) {  /* VW keys at a time, their dot products summed together */
            for (; j + VW <= n; j += VW) {
                if (ahead) prefetch_rows(ahead + j * slot_bytes, VW, slot_bytes, span);
                for (int64_t hh = 0; hh < NH; hh++) {
                    for (int64_t g = 0; g < G; g++) {
                        const float *qg = qf + (hh * G + g) * D;
                        vf part[VW];
                        for (int jj = 0; jj < VW; jj++) {
                            const float *k = (const float *)k_cache + base + (j + jj) * a->c_slot_stride
                                + hh * a->c_head_stride;
                            vf accv = {0};
                            for (int64_t d = 0; d < D; d += VW) accv += *(const vfu *)(qg + d) * *(const vfu *)(k + d);
                            part[jj] = accv;
                        }
                        *(vfu *)(scores + (hh * G + g) * ctx + t0 + j) = sum_lanes(part);
                    }
                }
            }
        }
        for (; j < n; j++) {
            if (ahead) prefetch_rows(ahead + j * slot_bytes, 1, slot_bytes, span);
            for (int64_t hh = 0; hh < NH; hh++) {
                float ks;
                const float *restrict k =
                    row_f32(k_cache, base + j * a->c_slot_stride + hh * a->c_head_stride, row, D, kind, &ks);
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qf + (hh * G + g) * D;
                    float dot = 0.0f;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d];
                    scores[(hh * G + g) * ctx + t0 + j] = dot * ks;
                }
            }
        }
    }
    /* softmax over keys [skip, ctx): the first `skip` rows of the first block lie before a sliding
     * window (scored with the rest of their block, then left out) */
    for (int64_t r = 0; r < NH * G; r++) {
        float *restrict sg = scores + r * ctx, m = -INFINITY, sum = 0.0f;
        for (int64_t t = skip; t < ctx; t++) m = sg[t] > m ? sg[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = skip; t < ctx; t++) { float e = exp_nonpos(sg[t] - m); sg[t] = e; sum += e; }
        const float inv = 1.0f / sum;
        for (int64_t t = skip; t < ctx; t++) sg[t] *= inv;
        if (lse) lse[s * a->num_heads + h0 * G + r] = m + logf(sum);  /* for a cascade's merge */
        if (ml) { /* for decode_split's merge: the largest score and the sum, unrounded by a log */
            ml[2 * (s * a->num_heads + h0 * G + r)] = m;
            ml[2 * (s * a->num_heads + h0 * G + r) + 1] = sum;
        }
    }
    /* probabilities x values, all heads of the task, block by block */
    for (int64_t i = 0; i < NH * G * D; i++) acc[i] = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t t0 = b * BS, n = ctx - t0 < BS ? ctx - t0 : BS;
        const int64_t base = (int64_t)table[b] * a->c_block_stride + head0;
        const char *ahead = b + PREFETCH_BLOCKS < nblocks
            ? (const char *)v_cache + ((int64_t)table[b + PREFETCH_BLOCKS] * a->c_block_stride + head0) * esz
            : 0;
        for (int64_t j = b == 0 ? skip : 0; j < n; j++) {
            if (ahead) prefetch_rows(ahead + j * slot_bytes, 1, slot_bytes, span);
            for (int64_t hh = 0; hh < NH; hh++) {
                float vs;
                const float *restrict v =
                    row_f32(v_cache, base + j * a->c_slot_stride + hh * a->c_head_stride, row, D, kind, &vs);
                for (int64_t g = 0; g < G; g++) {
                    const float p = scores[(hh * G + g) * ctx + t0 + j] * vs;
                    float *restrict ag = acc + (hh * G + g) * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) ag[d] += p * v[d];
                }
            }
        }
    }
    for (int64_t hh = 0; hh < NH; hh++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t o = s * a->o_seq_stride + ((h0 + hh) * G + g) * a->o_head_stride;
            const float *ag = acc + (hh * G + g) * D;
            for (int64_t d = 0; d < D; d++) {
                if (bf16) ((uint16_t *)out)[o + d] = f32_to_bf16(ag[d]);
                else ((float *)out)[o + d] = ag[d];
            }
        }
}

/* The specialised (G, D) pairs, else the generic copy. */
static void attend_any(const DecodeArgs *a, const void *q, const void *k_cache, const void *v_cache,
                       const int32_t *block_tables, int64_t ctx, void *out, float *scores, float *qf, float *acc,
                       float *lse, float *ml, int64_t s, int64_t h0, int64_t h1, int64_t skip, int kind) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim;
#define ATTEND(GC, DC, K) \
    attend(a, q, k_cache, v_cache, block_tables, ctx, out, scores, qf, acc, lse, ml, s, h0, h1, skip, GC, DC, K)
#define CASE(GC, DC)                                                                                   \
    if (G == GC && D == DC) {                                                                          \
        if (kind == KIND_BF16) ATTEND(GC, DC, KIND_BF16);                                              \
        else if (kind == KIND_I8) ATTEND(GC, DC, KIND_I8);                                             \
        else ATTEND(GC, DC, KIND_F32);                                                                 \
        return;                                                                                        \
    }
    if (!a->generic_only) {
        CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64) CASE(8, 64)
        CASE(1, 128) CASE(2, 128) CASE(4, 128) CASE(8, 128)
    }
#undef CASE
    if (kind == KIND_BF16) ATTEND(G, D, KIND_BF16);
    else if (kind == KIND_I8) ATTEND(G, D, KIND_I8);
    else ATTEND(G, D, KIND_F32);
#undef ATTEND
}

/* Sequences ordered by their first block (then index): sequences sharing a cached prefix run one
 * after another, so the prefix's K/V is still in cache for the next one (docs/kernels.md has the
 * figures, for prefixes interleaved over a batch). */
typedef struct { int32_t first_block; int64_t seq; } SeqKey;

static int by_first_block(const void *x, const void *y) {
    const SeqKey *a = (const SeqKey *)x, *b = (const SeqKey *)y;
    if (a->first_block != b->first_block) return a->first_block < b->first_block ? -1 : 1;
    return (a->seq > b->seq) - (a->seq < b->seq);
}

/* KV heads per task: all of a sequence's (each block read once, contiguously), unless there are
 * too few sequences to keep the threads busy; then the heads are split so that there are about
 * four tasks per thread. */
static int64_t heads_per_task(int64_t num_seqs, int64_t num_kv_heads, int threads) {
    const int64_t want = 4 * (int64_t)threads;
    if (threads <= 1 || num_seqs >= want) return num_kv_heads;
    const int64_t per = num_kv_heads * num_seqs / want;
    return per < 1 ? 1 : per;
}

/* The calling thread's `per` floats of `work` (inside a parallel region). */
static inline float *thread_work(float *work, int64_t per) {
#ifdef _OPENMP
    return work + per * omp_get_thread_num();
#else
    (void)per;
    return work;
#endif
}

/* Sequence s attends to nothing (length 0): zeros for query heads of KV heads [h0, h1), and a
 * log-sum-exp of -inf (weight 0 in a merge). */
static void no_keys(const DecodeArgs *a, void *out, float *lse, int64_t s, int64_t h0, int64_t h1, int bf16) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t o = s * a->o_seq_stride + (h * G + g) * a->o_head_stride;
            if (bf16) memset((uint16_t *)out + o, 0, sizeof(uint16_t) * D);
            else memset((float *)out + o, 0, sizeof(float) * D);
            if (lse) lse[s * a->num_heads + h * G + g] = -INFINITY;
        }
}

/* Each sequence's context is cut into SPLIT_PARTS runs of whole blocks (when it has SPLIT_MIN_BLOCKS
 * blocks a run), each run's heads in as few tasks as keep the threads busy (all of them, one
 * contiguous read per block, when there are as many runs as threads); a run's normalised output is
 * merged per query head by its largest score m_c and its sum l_c of exp(score - m_c): out = sum_c
 * w_c out_c / sum_c w_c with w_c = l_c exp(m_c - M), M the largest m_c. (Merging by the runs'
 * log-sum-exps instead rounded each to fp32 at the scores' magnitude, a relative error of up to 1e-5
 * in the weights where the scores reach the tens: 4-6x the unsplit kernel's error on sharp scores.)
 * Why: a few sequences (one user chatting) give too few tasks to share out: SmolLM2's 3 KV heads
 * were 3 tasks for 2 threads, so the step took two heads' time, each thread reading its head's rows
 * from memory alone. Two runs measured best on 2 threads (docs/kernels.md, "Paged decode attention",
 * has the figures; 4 and 8 were slower, each run's first blocks not prefetched).
 * The cut depends on the sequence's own context only, and a head's arithmetic not on its task, so a
 * sequence's output is the same bits whatever else the batch holds and on any number of threads:
 * every sequence is cut so, however many share the call (a decode step of one sequence and the same
 * sequence among others, or a speculative verification's positions, each a query of its own here,
 * must agree to the bit: worker_svc/model_runner.py says why). One run (short contexts) is the
 * unsplit arithmetic exactly. fp32 outputs only (a bf16 output would be rounded before the merge):
 * bf16 caches keep the one-task-per-head path. */

/* A sliding window (a->window > 0) for the query at position ctx - 1: the first block holding a key
 * it sees, returned (the blocks before it are never read: the block manager may have released them),
 * and in *skip the keys of that block before the window. No window: block 0, nothing skipped. */
static inline int64_t window_first_block(int64_t ctx, int64_t window, int64_t block_size, int64_t *skip) {
    const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
    *skip = lo % block_size;
    return lo / block_size;
}
#define SPLIT_PARTS 2
#define SPLIT_MIN_BLOCKS 2

static int64_t context_parts(int64_t ctx, int64_t block_size) {
    const int64_t nb = (ctx + block_size - 1) / block_size;
    int64_t p = SPLIT_PARTS;
    while (p > 1 && nb < p * SPLIT_MIN_BLOCKS) p /= 2;
    return ctx > 0 ? p : 1;
}

static int decode_split(const DecodeArgs *a, const void *q, const void *k_cache, const void *v_cache,
                        const int32_t *block_tables, const int32_t *seq_lens, float *out, float *lse, int kind) {
    if (a->num_seqs <= 0) return 0; /* no runs to share out (the callers return before, too) */
    const int64_t S = a->num_seqs, H = a->num_heads, HKV = a->num_kv_heads, D = a->head_dim, BS = a->block_size;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    /* per sequence: its first run (first[s], over the sequences in `order`), its runs, and its keys
     * from its window's first block: that block (b_lo), the tokens there (ctx), the keys of it before
     * the window (skip; the first run leaves them out) */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(5 * S + 1));
    SeqKey *order = malloc(sizeof(SeqKey) * (size_t)S);
    if (!first || !order) {
        free(first);
        free(order);
        return -1;
    }
    int64_t *parts = first + S + 1, *b_lo = parts + S, *ctx = b_lo + S, *skip = ctx + S, max_run = 1;
    /* sequences sharing their first blocks run one after the other (their shared rows stay in cache) */
    for (int64_t s = 0; s < S; s++) {
        b_lo[s] = window_first_block(seq_lens[s], a->window, BS, &skip[s]);
        order[s].first_block = seq_lens[s] > 0 ? block_tables[s * a->bt_stride + b_lo[s]] : INT32_MAX;
        order[s].seq = s;
    }
    qsort(order, (size_t)S, sizeof(SeqKey), by_first_block);
    first[0] = 0;
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = order[i].seq;
        ctx[s] = seq_lens[s] - b_lo[s] * BS;
        parts[s] = context_parts(ctx[s], BS);
        first[i + 1] = first[i] + parts[s];
        const int64_t nb = (ctx[s] + BS - 1) / BS, run = (nb + parts[s] - 1) / parts[s] * BS;
        max_run = run > max_run ? run : max_run;
    }
    const int64_t runs = first[S];
    const int64_t want = (threads + runs - 1) / runs; /* head groups per run */
    const int64_t hpt = want <= 1 ? HKV : (HKV + want - 1) / want, groups = (HKV + hpt - 1) / hpt;
    const int64_t G = H / HKV;
    /* per thread: scores (hpt x G x max_run), then qf and acc (hpt x G x D each); per run: out
     * (H x D), the largest score and the sum (H x 2) */
    const int64_t per = hpt * G * max_run + 2 * hpt * G * D;
    float *work = (float *)malloc(sizeof(float) * (size_t)(per * threads + runs * H * (D + 2)));
    if (!work) {
        free(first);
        free(order);
        return -1;
    }
    float *run_out = work + per * threads, *run_ml = run_out + runs * H * D;
    DecodeArgs ac = *a; /* a run's output: [H, D] rows of its own */
    ac.o_seq_stride = H * D;
    ac.o_head_stride = D;
    const int64_t esz = kind == KIND_BF16 ? 2 : 4;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < runs * groups; t++) {
        const int64_t r = t / groups, h0 = (t % groups) * hpt, h1 = h0 + hpt < HKV ? h0 + hpt : HKV;
        int64_t i = 0; /* the run's sequence: order[i], found by bisection over first[] */
        for (int64_t lo = 0, hi = S - 1; lo <= hi;) {
            const int64_t mid = (lo + hi) / 2;
            if (first[mid] <= r) {
                i = mid;
                lo = mid + 1;
            } else {
                hi = mid - 1;
            }
        }
        const int64_t s = order[i].seq;
        if (seq_lens[s] <= 0) continue;
        const int64_t c = r - first[i], p = parts[s], nb = (ctx[s] + BS - 1) / BS;
        const int64_t b0 = nb * c / p, b1 = nb * (c + 1) / p;
        const int64_t end = b1 * BS < ctx[s] ? b1 * BS : ctx[s];
        float *scores = thread_work(work, per);
        float *qf = scores + hpt * G * max_run, *acc = qf + hpt * G * D;
        attend_any(&ac, (const char *)q + s * a->q_seq_stride * esz, k_cache, v_cache,
                   block_tables + s * a->bt_stride + b_lo[s] + b0, end - b0 * BS, run_out + r * H * D, scores, qf,
                   acc, NULL, run_ml + r * H * 2, 0, h0, h1, c == 0 ? skip[s] : 0, kind);
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (S * H * D >= 65536)
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = order[i].seq;
        if (seq_lens[s] <= 0) {
            no_keys(a, out, lse, s, 0, HKV, 0);
            continue;
        }
        for (int64_t h = 0; h < H; h++) {
            float *o = out + s * a->o_seq_stride + h * a->o_head_stride;
            const float *ml = run_ml + (first[i] * H + h) * 2; /* run c's (m, l) at ml[2 * c * H] */
            if (parts[s] == 1) { /* the unsplit arithmetic exactly */
                memcpy(o, run_out + (first[i] * H + h) * D, sizeof(float) * (size_t)D);
                if (lse) lse[s * H + h] = ml[0] + logf(ml[1]);
                continue;
            }
            float m = -INFINITY, sum = 0.0f, w[SPLIT_PARTS];
            for (int64_t c = 0; c < parts[s]; c++) m = fmaxf(m, ml[2 * c * H]);
            for (int64_t c = 0; c < parts[s]; c++) sum += w[c] = ml[2 * c * H + 1] * expf(ml[2 * c * H] - m);
            const float inv = 1.0f / sum;
            for (int64_t d = 0; d < D; d++) {
                float v = 0.0f;
                for (int64_t c = 0; c < parts[s]; c++) v += w[c] * run_out[((first[i] + c) * H + h) * D + d];
                o[d] = v * inv;
            }
            if (lse) lse[s * H + h] = m + logf(sum);
        }
    }
    free(work);
    free(first);
    free(order);
    return 0;
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing written then). A sequence
 * of length 0 gets zeros (it attends to nothing). */
static int decode(const DecodeArgs *a, const void *q, const void *k_cache, const void *v_cache,
                  const int32_t *block_tables, const int32_t *seq_lens, void *out, float *lse, int kind) {
    const int bf16 = kind == KIND_BF16;
    if (!bf16)
        return decode_split(a, q, k_cache, v_cache, block_tables, seq_lens, (float *)out, lse, kind);
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim, HKV = a->num_kv_heads;
    const int64_t BS = a->block_size;
    int64_t max_ctx = 1, skip;  /* the longest context read: from each window's first block */
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t ctx = seq_lens[s] - window_first_block(seq_lens[s], a->window, BS, &skip) * BS;
        max_ctx = ctx > max_ctx ? ctx : max_ctx;
    }
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    const int64_t hpt = heads_per_task(a->num_seqs, HKV, threads);
    const int64_t groups = (HKV + hpt - 1) / hpt, tasks = a->num_seqs * groups;
    /* per thread: scores (hpt x G x max_ctx), then qf and acc (hpt x G x D each) */
    const int64_t per = hpt * G * max_ctx + 2 * hpt * G * D;
    float *work = (float *)malloc(sizeof(float) * per * threads);
    SeqKey *order = (SeqKey *)malloc(sizeof(SeqKey) * (a->num_seqs > 0 ? a->num_seqs : 1));
    if (!work || !order) { free(work); free(order); return -1; }
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t b = window_first_block(seq_lens[s], a->window, BS, &skip);
        order[s].first_block = seq_lens[s] > 0 ? block_tables[s * a->bt_stride + b] : INT32_MAX;
        order[s].seq = s;
    }
    qsort(order, (size_t)a->num_seqs, sizeof(SeqKey), by_first_block);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = order[task / groups].seq, h0 = (task % groups) * hpt;
        const int64_t h1 = h0 + hpt < HKV ? h0 + hpt : HKV;
        float *scores = thread_work(work, per);
        float *qf = scores + hpt * G * max_ctx, *acc = qf + hpt * G * D;
        if (seq_lens[s] > 0) {
            int64_t sk;  /* from the window's first block: the table's row s, shifted by b */
            const int64_t b = window_first_block(seq_lens[s], a->window, BS, &sk);
            attend_any(a, q, k_cache, v_cache, block_tables + b, seq_lens[s] - b * BS, out, scores, qf, acc, lse,
                       NULL, s, h0, h1, sk, kind);
        } else {
            no_keys(a, out, lse, s, h0, h1, bf16);
        }
    }
    free(work);
    free(order);
    return 0;
}

int pagedkv_decode_f32(const DecodeArgs *a, const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *block_tables, const int32_t *seq_lens, float *out) {
    return decode(a, q, k_cache, v_cache, block_tables, seq_lens, out, NULL, KIND_F32);
}
/* fp32 decode that also writes each (sequence, head)'s log-sum-exp of its scaled scores into
 * lse [num_seqs, num_heads] (-inf for a sequence of length 0): the own part of a cascade, merged
 * with its shared prefix's part by pagedkv_prefill_prefix_f32 (kernels/cpu/attention.py). */
int pagedkv_decode_f32_lse(const DecodeArgs *a, const float *q, const float *k_cache, const float *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, float *out, float *lse) {
    return decode(a, q, k_cache, v_cache, block_tables, seq_lens, out, lse, KIND_F32);
}

int pagedkv_decode_bf16(const DecodeArgs *a, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out) {
    return decode(a, q, k_cache, v_cache, block_tables, seq_lens, out, NULL, KIND_BF16);
}

/* int8 caches (rows of head_dim values + an fp32 scale; strides in bytes), fp32 query and output;
 * the _lse form as pagedkv_decode_f32_lse, for a cascade over an int8 cache. */
int pagedkv_decode_i8(const DecodeArgs *a, const float *q, const int8_t *k_cache, const int8_t *v_cache,
                      const int32_t *block_tables, const int32_t *seq_lens, float *out) {
    return decode(a, q, k_cache, v_cache, block_tables, seq_lens, out, NULL, KIND_I8);
}
int pagedkv_decode_i8_lse(const DecodeArgs *a, const float *q, const int8_t *k_cache, const int8_t *v_cache,
                          const int32_t *block_tables, const int32_t *seq_lens, float *out, float *lse) {
    return decode(a, q, k_cache, v_cache, block_tables, seq_lens, out, lse, KIND_I8);
}

/* Quantize on write: token i's K and V rows (fp32 [num_tokens, num_kv_heads, head_dim], row strides
 * in floats) into int8 cache slot slots[i] (-1: skipped), each (token, KV head) row as round-to-nearest-
 * even(x / scale) in [-127, 127] with scale = amax / 127 (0 for an all-zero row), then the scale;
 * the division and rounding are torch's (kernels/quant.py), so both write the same bytes. Cache
 * strides in bytes. */
void pagedkv_write_kv_i8(int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         const float *key, int64_t k_tok_stride, int64_t k_head_stride, const float *value,
                         int64_t v_tok_stride, int64_t v_head_stride, int8_t *k_cache, int8_t *v_cache,
                         int64_t c_block_stride, int64_t c_slot_stride, int64_t c_head_stride, const int64_t *slots,
                         int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        const int64_t at = (slot / block_size) * c_block_stride + (slot % block_size) * c_slot_stride;
        for (int which = 0; which < 2; which++) {
            const float *x0 = which ? value + i * v_tok_stride : key + i * k_tok_stride;
            const int64_t hs = which ? v_head_stride : k_head_stride;
            int8_t *c0 = (which ? v_cache : k_cache) + at;
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const float *x = x0 + h * hs;
                int8_t *row = c0 + h * c_head_stride;
                float amax = 0.0f;
                for (int64_t d = 0; d < head_dim; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
                const float scale = amax / 127.0f, div = scale > 0.0f ? scale : 1.0f;
                for (int64_t d = 0; d < head_dim; d++) {
                    float y = nearbyintf(x[d] / div);
                    y = y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y;
                    row[d] = (int8_t)y;
                }
                memcpy(row + head_dim, &scale, sizeof(float));
            }
        }
    }
}

/* The struct layout the Python side must mirror (checked at load). */
int64_t pagedkv_decode_args_size(void) { return (int64_t)sizeof(DecodeArgs); }
