/* y = x @ W^T for fp32 rows x on CPU, with W held as integers: int4 groups, int8 rows, or GGUF's
 * Q4_K / Q6_K super-blocks as the file holds them (kernels/quant_linear.py owns the formats;
 * kernels/cpu/quant_linear.py calls these; the K-quant part is at the end of this file).
 *
 * Why: a decode step multiplies a few rows by every weight matrix, so its time is the weight bytes
 * over the memory bandwidth. PyTorch's weight-packed int4 / int8 matmuls read their bytes far below
 * the memory's rate at one row on an AVX2 CPU (their vectorised paths are written for
 * AVX-512), so a model held as integers decoded slower than the same model in fp32 at 4-8x the
 * bytes. These kernels stream the integers at the memory's rate (docs/kernels.md has the numbers).
 *
 * int4 (W = (q - 8) * s + z, one fp32 scale s and offset z per 32 inputs of an output row), packed
 * in panels of 16 output rows. Panel p, group g is one 256-byte chunk of nibbles, 8 bytes per input
 * k of the group: byte j holds row 16p + j in its low nibble and row 16p + j + 8 in its high one;
 * its 16 scales then 16 offsets are 32 floats of a second array in the same order. Both arrays are
 * panel-major, so a thread walks its panels front to back as two sequential streams.
 *   8 bytes widened to 8 int32 lanes give both halves of the panel with one mask and one shift;
 *   per group the accumulators hold sum(q * x) and the group's scale is applied once:
 *   y += s * (sum(q x) - 8 sum(x)) + z * sum(x), with sum(x) per group computed once per call.
 *   Rows of x go through in register tiles of 2 (each widened weight feeds both), the panel's
 *   bytes staying in L1 between tiles. From Q4_DEQ_MIN_ROWS rows (a prefill, a decode step of many
 *   sequences) two panels at a time are dequantized once per call into linear.c's fp32 panel and
 *   every row runs through linear.c's register tiles instead (q4_many_rows).
 * int8 (W = q * s, one fp32 scale per output row), row-major [n][k] (the embedding's rows are
 *   looked up in the same matrix): one row of x streams each weight row once (q8_dot1); a few rows
 *   share each 8-float load of x between 4 output rows; from Q8_DEQ_MIN_ROWS rows each block of 4
 *   weight rows is widened once per call and meets every row of x (q8_many_rows). One
 *   horizontal sum per output at the end, times its scale.
 *
 * AVX2 + FMA where the variant is compiled with them (setup.py's avx2 and avx512 builds); otherwise
 * plain C loops with the same arithmetic (pagedkv_quant_linear_simd() says which). Threads:
 * OpenMP over panels (int4) or 4-row blocks (int8), static, so each thread streams one contiguous
 * range. Arguments are checked by the Python wrapper before any pointer is used.
 *
 * Where the CPU has AVX-512 VNNI + VBMI, int4 rows (and int8's under ROWS) multiply x rounded to 16
 * bits as integers (the word products, below); from Q4_AMX_MIN_ROWS rows, where the CPU also has
 * AMX-INT8, int4's integer sums come from the tile unit instead, the same integers (q4_amx_rows).
 *
 * Which arithmetic a row gets (the last argument of the three products, QUANT_ARITH_*): the paths
 * above round their sums differently, so with the row count choosing the path (AUTO) a row's result
 * depends on how many rows share its call. ROWS gives every row the arithmetic it gets alone (the
 * word products, else the row tiles; int8: the one-row products; K-quant: the 4-row kernel), at any
 * row count: a decode step's rows and a speculative verification's rows then come out the same bits
 * whatever else the step holds (worker_svc/model/llama.py says why that matters). PANELS gives every
 * row the many-rows arithmetic (dequantized panels, widened rows, K-quant's rows side by side) at
 * any row count, which a prefill's rows take for the same reason. Where int4 has the AMX tiles
 * (below), every int4 row takes the word products' arithmetic under all three: the tiles beat the
 * dequantized panels at every row count, so there is nothing for the row count to choose.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "linear_panel.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q_SIMD 1
#else
#define Q_SIMD 0
#endif

#define Q4_GROUP 32                  /* inputs per scale/offset group */
#define Q4_PANEL 16                  /* output rows per panel */
#define Q4_CHUNK 256                 /* nibble bytes per (panel, group): 32 inputs x 8 bytes */
#define Q4_SCALES 32                 /* floats per (panel, group): 16 scales, 16 offsets */
#define Q8_ROWS 4                    /* int8 output rows per block */
#define Q8_PREFETCH 4096             /* bytes a one-row int8 product reads ahead */
#define TILE 2                       /* x rows per register tile */
#define PARALLEL_MIN_MACS 65536      /* below this many multiply-adds a parallel region costs more */
#define WIDE_ROWS 4                  /* int8 weight rows widened at a time by q8_many_rows */
#define Q8_DEQ_MIN_ROWS 4            /* from this many rows int8 weight rows are widened first */
#define Q4_DEQ_MIN_ROWS 8            /* from this many rows int4 panels are dequantized first */
#define Q4_PREFETCH 4096             /* nibble bytes read ahead by the row tiles (16 groups) */
#define Q4_WIDE_MIN_ROWS 4           /* from this many rows the row tiles read nibbles widened once */

#define QUANT_ARITH_AUTO 0   /* by the row count: each path where it is fastest */
#define QUANT_ARITH_ROWS 1   /* every row as it would be alone, at any row count */
#define QUANT_ARITH_PANELS 2 /* every row as in a many-row call, at any row count */

int pagedkv_quant_linear_simd(void) { return Q_SIMD; }

/* xs[r * groups + g] = sum of x[r, 32g .. 32g + 32). */
static void group_sums(int64_t m, int64_t groups, const float *x, int64_t x_stride, float *xs) {
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * x_stride + g * Q4_GROUP;
            float s = 0.0f;
            for (int i = 0; i < Q4_GROUP; i++) s += xg[i];
            xs[r * groups + g] = s;
        }
    }
}

/* One scratch buffer of `floats` floats per thread, 32-byte aligned (many-rows paths below); NULL
 * when out of memory. thread_scratch() is the calling thread's own one, inside the parallel region. */
static int64_t scratch_stride(int64_t floats) { return floats > 0 ? (floats + 7) / 8 * 8 : 8; }

static float *scratch_per_thread(int nt, int64_t floats) {
    return aligned_alloc(32, (size_t)nt * (size_t)scratch_stride(floats) * sizeof(float));
}

static inline float *thread_scratch(float *scratch, int64_t floats) {
#ifdef _OPENMP
    return scratch + (int64_t)omp_get_thread_num() * scratch_stride(floats);
#else
    (void)floats;
    return scratch;
#endif
}

/* ---- x rounded to 16 bits per int4 group --------------------------------------------------------
 *
 * The int4 product multiplies x as x^: each Q4_GROUP inputs of a row rounded to q * d, with
 * d = max|x| / 32767 and q = x * (32767 / max|x|) rounded to nearest-even (an all-zero group stays
 * zero), an error of at most 1/65534 of the group's largest |x| per input. Why: with x in 16-bit
 * integers a one-row product is word multiply-adds (q4_words_panel: 128 weights in four
 * instructions) where fp32 widens every nibble to a float (16 a step), which left the one-row
 * kernel compute-bound at about the memory's rate, even with its weights already in cache
 * (docs/kernels.md has the figures). 16 bits and not the K-quant kernel's 8: 8-bit x cost SmolLM2's
 * Q4_1 file 1.1% of perplexity and changed its answers (docs/kernels.md). Every path of
 * pagedkv_q4_linear (the word products, the fp32 row tiles, the dequantized panels of many rows,
 * the plain C loops), and of pagedkv_q8_linear, multiplies the same x^, so a row's result does not depend on which path its
 * batch took, beyond fp32 rounding. A NaN or infinity in a group makes its d NaN, and so every
 * output of its row, as an fp32 product's would be. */
#define Q4_XTOP 32767.0f

/* max|x| over n inputs, and *bad: 0, or NaN when an input is NaN or infinite (x * 0), so that a
 * scale built from them is NaN and so is every output of the row, as an fp32 product's would be.
 * The AVX2 path needs n a multiple of 8. Shared by both roundings of x (16 bits per 32 inputs
 * here, 8 bits per 256 for K-quant blocks below). */
static float abs_max(const float *x, int n, float *bad) {
    float amax = 0.0f, nf_sum = 0.0f;
#if Q_SIMD
    if (n % 8 == 0) {
        __m256 mx = _mm256_setzero_ps(), nf = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
            nf = _mm256_add_ps(nf, _mm256_mul_ps(v, _mm256_setzero_ps()));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        __m128 n4 = _mm_add_ps(_mm256_castps256_ps128(nf), _mm256_extractf128_ps(nf, 1));
        n4 = _mm_add_ps(n4, _mm_movehl_ps(n4, n4));
        *bad = _mm_cvtss_f32(_mm_add_ss(n4, _mm_movehdup_ps(n4)));
        return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    }
#endif
    for (int i = 0; i < n; i++) {
        const float a = x[i] < 0 ? -x[i] : x[i];
        if (a > amax) amax = a;
        nf_sum += x[i] * 0.0f;
    }
    *bad = nf_sum;
    return amax;
}

/* len (1..Q4_GROUP) inputs rounded to q; returns their d. The same integers on every build
 * (cvtps and lrintf both round to nearest-even under the default rounding mode). */
static float round_group(const float *x, int len, int16_t *q) {
    float bad;
    const float amax = abs_max(x, len, &bad);
    const float iscale = amax > 0.0f && bad == 0.0f ? Q4_XTOP / amax : 0.0f;
    int i = 0;
#if Q_SIMD
    const __m256 is = _mm256_set1_ps(iscale);
    for (; i + 16 <= len; i += 16) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), is));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), is));
        /* packs works within 128-bit halves: a0-3 b0-3 a4-7 b4-7, put back in order */
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + i), w);
    }
#endif
    for (; i < len; i++) q[i] = (int16_t)lrintf(x[i] * iscale);
    return amax / Q4_XTOP + bad;
}

/* x^ of m rows as fp32 into xh (dense rows of k): what the fp32 paths multiply. A last group
 * shorter than 32 (int8 rows of other widths) is rounded over the inputs left. */
static void round_rows(int64_t m, int64_t k, const float *x, int64_t x_stride, float *xh) {
    int16_t q[Q4_GROUP];
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g0 = 0; g0 < k; g0 += Q4_GROUP) {
            const int len = (int)(k - g0 < Q4_GROUP ? k - g0 : Q4_GROUP);
            const float d = round_group(x + r * x_stride + g0, len, q);
            for (int i = 0; i < len; i++) xh[r * k + g0 + i] = (float)q[i] * d;
        }
    }
}

/* ---- int4: rows x one panel (all groups) --------------------------------------------------------- */

#if Q_SIMD
static inline void q4_widen(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

/* y += s * (acc - 8 xsum) + z * xsum for one group's 16 outputs. */
static inline void q4_apply(const float *sz, __m256 acc_lo, __m256 acc_hi, float xsum, __m256 *y_lo, __m256 *y_hi) {
    const __m256 xv = _mm256_set1_ps(xsum), eight = _mm256_set1_ps(8.0f);
    const __m256 t_lo = _mm256_fnmadd_ps(eight, xv, acc_lo), t_hi = _mm256_fnmadd_ps(eight, xv, acc_hi);
    *y_lo = _mm256_fmadd_ps(_mm256_loadu_ps(sz), t_lo, *y_lo);
    *y_hi = _mm256_fmadd_ps(_mm256_loadu_ps(sz + 8), t_hi, *y_hi);
    *y_lo = _mm256_fmadd_ps(_mm256_loadu_ps(sz + 16), xv, *y_lo);
    *y_hi = _mm256_fmadd_ps(_mm256_loadu_ps(sz + 24), xv, *y_hi);
}

static inline void q4_store(__m256 lo, __m256 hi, float *y, int cols) {
    float out[Q4_PANEL] __attribute__((aligned(32)));
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
    memcpy(y, out, (size_t)cols * sizeof(float));
}

/* The bytes Q4_PREFETCH ahead of a group and their scales, into L1: a one-row call streams a few
 * hundred KiB a thread, too short for the hardware prefetcher to reach full speed (docs/kernels.md
 * has the figures; 2 and 8 KiB ahead did no better than 4). Past the
 * matrix's end a prefetch is a no-op (it never faults). */
static inline void q4_prefetch(const uint8_t *c, const float *sz) {
    for (int i = 0; i < Q4_CHUNK; i += 64) _mm_prefetch((const char *)(c + Q4_PREFETCH + i), _MM_HINT_T0);
    _mm_prefetch((const char *)(sz + Q4_PREFETCH / 8), _MM_HINT_T0);
    _mm_prefetch((const char *)(sz + Q4_PREFETCH / 8 + 16), _MM_HINT_T0);
}

/* One row: two accumulator pairs (even and odd inputs) so the multiply-adds do not wait on each other. */
static void q4_tile1(int64_t groups, const float *x, const float *xs, const uint8_t *w, const float *sz, float *y,
                     int cols) {
    __m256 y_lo = _mm256_setzero_ps(), y_hi = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        q4_prefetch(w + g * Q4_CHUNK, sz + g * Q4_SCALES);
        const uint8_t *c = w + g * Q4_CHUNK;
        const float *xg = x + g * Q4_GROUP;
        __m256 a_lo = _mm256_setzero_ps(), a_hi = _mm256_setzero_ps();
        __m256 b_lo = _mm256_setzero_ps(), b_hi = _mm256_setzero_ps();
        for (int kk = 0; kk < Q4_GROUP; kk += 2) {
            __m256 w0_lo, w0_hi, w1_lo, w1_hi;
            q4_widen(c + kk * 8, &w0_lo, &w0_hi);
            q4_widen(c + kk * 8 + 8, &w1_lo, &w1_hi);
            const __m256 x0 = _mm256_broadcast_ss(xg + kk), x1 = _mm256_broadcast_ss(xg + kk + 1);
            a_lo = _mm256_fmadd_ps(w0_lo, x0, a_lo);
            a_hi = _mm256_fmadd_ps(w0_hi, x0, a_hi);
            b_lo = _mm256_fmadd_ps(w1_lo, x1, b_lo);
            b_hi = _mm256_fmadd_ps(w1_hi, x1, b_hi);
        }
        q4_apply(sz + g * Q4_SCALES, _mm256_add_ps(a_lo, b_lo), _mm256_add_ps(a_hi, b_hi), xs[g], &y_lo, &y_hi);
    }
    q4_store(y_lo, y_hi, y, cols);
}

/* Two rows share each widened input; each row's sums are q4_tile1's (even and odd inputs apart, added
 * at the group's end), so a row's result is the same whether it went through a pair or alone. */
static void q4_tile2(int64_t groups, const float *x, int64_t x_stride, const float *xs, const uint8_t *w,
                     const float *sz, float *y, int64_t y_stride, int cols) {
    __m256 y0_lo = _mm256_setzero_ps(), y0_hi = _mm256_setzero_ps();
    __m256 y1_lo = _mm256_setzero_ps(), y1_hi = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        q4_prefetch(w + g * Q4_CHUNK, sz + g * Q4_SCALES);
        const uint8_t *c = w + g * Q4_CHUNK;
        const float *x0g = x + g * Q4_GROUP, *x1g = x + x_stride + g * Q4_GROUP;
        __m256 a0_lo = _mm256_setzero_ps(), a0_hi = _mm256_setzero_ps(), b0_lo = _mm256_setzero_ps();
        __m256 b0_hi = _mm256_setzero_ps(), a1_lo = _mm256_setzero_ps(), a1_hi = _mm256_setzero_ps();
        __m256 b1_lo = _mm256_setzero_ps(), b1_hi = _mm256_setzero_ps();
        for (int kk = 0; kk < Q4_GROUP; kk += 2) {
            __m256 w_lo, w_hi;
            q4_widen(c + kk * 8, &w_lo, &w_hi);
            __m256 x0 = _mm256_broadcast_ss(x0g + kk), x1 = _mm256_broadcast_ss(x1g + kk);
            a0_lo = _mm256_fmadd_ps(w_lo, x0, a0_lo);
            a0_hi = _mm256_fmadd_ps(w_hi, x0, a0_hi);
            a1_lo = _mm256_fmadd_ps(w_lo, x1, a1_lo);
            a1_hi = _mm256_fmadd_ps(w_hi, x1, a1_hi);
            q4_widen(c + kk * 8 + 8, &w_lo, &w_hi);
            x0 = _mm256_broadcast_ss(x0g + kk + 1), x1 = _mm256_broadcast_ss(x1g + kk + 1);
            b0_lo = _mm256_fmadd_ps(w_lo, x0, b0_lo);
            b0_hi = _mm256_fmadd_ps(w_hi, x0, b0_hi);
            b1_lo = _mm256_fmadd_ps(w_lo, x1, b1_lo);
            b1_hi = _mm256_fmadd_ps(w_hi, x1, b1_hi);
        }
        q4_apply(sz + g * Q4_SCALES, _mm256_add_ps(a0_lo, b0_lo), _mm256_add_ps(a0_hi, b0_hi), xs[g], &y0_lo, &y0_hi);
        q4_apply(sz + g * Q4_SCALES, _mm256_add_ps(a1_lo, b1_lo), _mm256_add_ps(a1_hi, b1_hi), xs[groups + g], &y1_lo,
                 &y1_hi);
    }
    q4_store(y0_lo, y0_hi, y, cols);
    q4_store(y1_lo, y1_hi, y + y_stride, cols);
}

static void q4_rows_by_panel(int64_t m, int64_t groups, const float *x, int64_t x_stride, const float *xs,
                             const uint8_t *w, const float *sz, float *y, int64_t y_stride, int cols) {
    int64_t r = 0;
    for (; r + TILE <= m; r += TILE)
        q4_tile2(groups, x + r * x_stride, x_stride, xs + r * groups, w, sz, y + r * y_stride, y_stride, cols);
    if (r < m) q4_tile1(groups, x + r * x_stride, xs + r * groups, w, sz, y + r * y_stride, cols);
}

/* Many rows (a prefill, or a decode step of many sequences). Widening nibbles costs more
 * instructions than the multiply-adds they feed, and the row tiles above widen every weight once per
 * 2 rows, with 4 accumulators where the multiply-add's latency wants 10 or more. Here two panels
 * (32 output rows) are dequantized once per call into linear.c's fp32 panel layout,
 * wf[kk * 32 + j] = (q - 8) s_j + z_j computed as q s_j + (z_j - 8 s_j), and every row of x goes
 * through linear.c's register tiles (AVX2: 3 rows x 32 columns, 12 accumulators), the same inner
 * loop as an fp32 weight's. The panel (k x 128 bytes: 72 KiB at k = 576) stays in L2 while the
 * rows stream past it; dequantizing is then a few percent of the work from 8 rows on. Whole
 * 16-row panels only: the caller takes a last partial one through q4_rows_by_panel. */
static inline void q4_dequantize_group(const uint8_t *c, const float *sz, float *restrict wf) {
    const __m256 eight = _mm256_set1_ps(8.0f);
    const __m256 s_lo = _mm256_loadu_ps(sz), s_hi = _mm256_loadu_ps(sz + 8);
    const __m256 b_lo = _mm256_fnmadd_ps(eight, s_lo, _mm256_loadu_ps(sz + 16));
    const __m256 b_hi = _mm256_fnmadd_ps(eight, s_hi, _mm256_loadu_ps(sz + 24));
    for (int kk = 0; kk < Q4_GROUP; kk++) {
        __m256 lo, hi;
        q4_widen(c + kk * 8, &lo, &hi);
        _mm256_storeu_ps(wf + kk * LINEAR_PANEL, _mm256_fmadd_ps(lo, s_lo, b_lo));
        _mm256_storeu_ps(wf + kk * LINEAR_PANEL + 8, _mm256_fmadd_ps(hi, s_hi, b_hi));
    }
}

/* 16-row panel p of the int4 matrix into columns [half * 16, half * 16 + 16) of wf. */
static void q4_dequantize_panel(int64_t groups, const uint8_t *qweight, const float *qscale, int64_t p, int half,
                                float *wf) {
    for (int64_t g = 0; g < groups; g++)
        q4_dequantize_group(qweight + (p * groups + g) * Q4_CHUNK, qscale + (p * groups + g) * Q4_SCALES,
                            wf + g * Q4_GROUP * LINEAR_PANEL + half * Q4_PANEL);
}

static int q4_many_rows(int64_t m, int64_t panels, int64_t groups, const float *x, int64_t x_stride,
                        const uint8_t *qweight, const float *qscale, float *y, int64_t y_stride, int num_threads) {
    const int64_t k = groups * Q4_GROUP, pairs = (panels + 1) / 2;
    const int nt = num_threads > 0 ? num_threads : 1;
    float *scratch = scratch_per_thread(nt, k * LINEAR_PANEL);
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nt)
    {
        float *wf = thread_scratch(scratch, k * LINEAR_PANEL);
        #pragma omp for schedule(static)
        for (int64_t pp = 0; pp < pairs; pp++) {
            const int64_t p = 2 * pp;
            const int two = p + 1 < panels;
            q4_dequantize_panel(groups, qweight, qscale, p, 0, wf);
            if (two) {
                q4_dequantize_panel(groups, qweight, qscale, p + 1, 1, wf);
            } else {
                for (int64_t kk = 0; kk < k; kk++) memset(wf + kk * LINEAR_PANEL + Q4_PANEL, 0, Q4_PANEL * sizeof(float));
            }
            pagedkv_linear_panel(m, k, x, x_stride, wf, NULL, y + p * Q4_PANEL, y_stride, two ? 2 * Q4_PANEL : Q4_PANEL);
        }
    }
    free(scratch);
    return 0;
}

/* Many rows, each with q4_tile1's arithmetic (QUANT_ARITH_ROWS where the word products are not
 * there). The row tiles above widen every nibble once per 2 rows; here a panel's nibbles are widened
 * once per call into floats (exact: 0..15), wq[(g * 32 + kk) * 16 + j], and tiles of Q4_WIDE_TILE
 * rows read them, each row's even and odd inputs summed apart as in q4_tile1 (4 accumulators a row,
 * 12 of AVX2's 16 registers), its y kept in memory between groups (stored and loaded exactly). */
#if defined(__AVX512F__)
/* The same per lane in 16-float vectors (a panel's 16 outputs in one): each lane's multiply-adds and
 * q4_apply's steps are the 8-float code's, so the bits are too; 6 rows a tile in 32 registers. */
#define Q4_WIDE_TILE 6
static inline __attribute__((always_inline)) void q4_wide_tile(const int nr, int64_t groups, const float *x,
                                                               int64_t x_stride, const float *xs, const float *wq,
                                                               const float *sz, float *y, int64_t y_stride, int cols) {
    const __m512 eight = _mm512_set1_ps(8.0f);
    __m512 yv[Q4_WIDE_TILE];
    for (int r = 0; r < nr; r++) yv[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const float *wg = wq + g * Q4_GROUP * Q4_PANEL;
        __m512 a[Q4_WIDE_TILE], b[Q4_WIDE_TILE];
        for (int r = 0; r < nr; r++) a[r] = b[r] = _mm512_setzero_ps();
        for (int kk = 0; kk < Q4_GROUP; kk += 2) {
            const __m512 w0 = _mm512_loadu_ps(wg + kk * Q4_PANEL), w1 = _mm512_loadu_ps(wg + (kk + 1) * Q4_PANEL);
            for (int r = 0; r < nr; r++) {
                const float *xr = x + r * x_stride + g * Q4_GROUP + kk;
                a[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xr[0]), a[r]);
                b[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xr[1]), b[r]);
            }
        }
        const __m512 s = _mm512_loadu_ps(sz + g * Q4_SCALES), z = _mm512_loadu_ps(sz + g * Q4_SCALES + Q4_PANEL);
        for (int r = 0; r < nr; r++) {
            const __m512 xv = _mm512_set1_ps(xs[r * groups + g]);
            const __m512 t = _mm512_fnmadd_ps(eight, xv, _mm512_add_ps(a[r], b[r]));
            yv[r] = _mm512_fmadd_ps(s, t, yv[r]);
            yv[r] = _mm512_fmadd_ps(z, xv, yv[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_mask_storeu_ps(y + r * y_stride, (__mmask16)((1u << cols) - 1u), yv[r]);
}
#else
#define Q4_WIDE_TILE 3
static inline __attribute__((always_inline)) void q4_wide_tile(const int nr, int64_t groups, const float *x,
                                                               int64_t x_stride, const float *xs, const float *wq,
                                                               const float *sz, float *y, int64_t y_stride, int cols) {
    float yb[Q4_WIDE_TILE][Q4_PANEL] __attribute__((aligned(32)));
    for (int r = 0; r < nr; r++) memset(yb[r], 0, sizeof yb[r]);
    for (int64_t g = 0; g < groups; g++) {
        const float *wg = wq + g * Q4_GROUP * Q4_PANEL;
        __m256 a_lo[Q4_WIDE_TILE], a_hi[Q4_WIDE_TILE], b_lo[Q4_WIDE_TILE], b_hi[Q4_WIDE_TILE];
        for (int r = 0; r < nr; r++) a_lo[r] = a_hi[r] = b_lo[r] = b_hi[r] = _mm256_setzero_ps();
        for (int kk = 0; kk < Q4_GROUP; kk += 2) {
            const __m256 w0_lo = _mm256_load_ps(wg + kk * Q4_PANEL), w0_hi = _mm256_load_ps(wg + kk * Q4_PANEL + 8);
            for (int r = 0; r < nr; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + g * Q4_GROUP + kk);
                a_lo[r] = _mm256_fmadd_ps(w0_lo, xv, a_lo[r]);
                a_hi[r] = _mm256_fmadd_ps(w0_hi, xv, a_hi[r]);
            }
            const __m256 w1_lo = _mm256_load_ps(wg + (kk + 1) * Q4_PANEL);
            const __m256 w1_hi = _mm256_load_ps(wg + (kk + 1) * Q4_PANEL + 8);
            for (int r = 0; r < nr; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + g * Q4_GROUP + kk + 1);
                b_lo[r] = _mm256_fmadd_ps(w1_lo, xv, b_lo[r]);
                b_hi[r] = _mm256_fmadd_ps(w1_hi, xv, b_hi[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            __m256 y_lo = _mm256_load_ps(yb[r]), y_hi = _mm256_load_ps(yb[r] + 8);
            q4_apply(sz + g * Q4_SCALES, _mm256_add_ps(a_lo[r], b_lo[r]), _mm256_add_ps(a_hi[r], b_hi[r]),
                     xs[r * groups + g], &y_lo, &y_hi);
            _mm256_store_ps(yb[r], y_lo);
            _mm256_store_ps(yb[r] + 8, y_hi);
        }
    }
    for (int r = 0; r < nr; r++) memcpy(y + r * y_stride, yb[r], (size_t)cols * sizeof(float));
}
#endif

static int q4_rows_wide(int64_t m, int64_t n, int64_t groups, const float *x, int64_t x_stride, const float *xs,
                        const uint8_t *qweight, const float *qscale, float *y, int64_t y_stride, int num_threads) {
    const int64_t panels = (n + Q4_PANEL - 1) / Q4_PANEL, k = groups * Q4_GROUP;
    const int nt = num_threads > 0 ? num_threads : 1;
    float *scratch = scratch_per_thread(nt, k * Q4_PANEL);
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nt)
    {
        float *wq = thread_scratch(scratch, k * Q4_PANEL);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int cols = (int)(n - p * Q4_PANEL < Q4_PANEL ? n - p * Q4_PANEL : Q4_PANEL);
            const uint8_t *w = qweight + p * groups * Q4_CHUNK;
            for (int64_t kk = 0; kk < k; kk++) {
                __m256 lo, hi;
                q4_widen(w + kk * 8, &lo, &hi);
                _mm256_store_ps(wq + kk * Q4_PANEL, lo);
                _mm256_store_ps(wq + kk * Q4_PANEL + 8, hi);
            }
            const float *sz = qscale + p * groups * Q4_SCALES;
            for (int64_t r = 0; r < m; r += Q4_WIDE_TILE) {
                const float *xr = x + r * x_stride;
                float *yr = y + r * y_stride + p * Q4_PANEL;
                const float *xsr = xs + r * groups;
                switch (m - r < Q4_WIDE_TILE ? m - r : Q4_WIDE_TILE) {
                case 1: q4_wide_tile(1, groups, xr, x_stride, xsr, wq, sz, yr, y_stride, cols); break;
                case 2: q4_wide_tile(2, groups, xr, x_stride, xsr, wq, sz, yr, y_stride, cols); break;
#if Q4_WIDE_TILE > 3
                case 3: q4_wide_tile(3, groups, xr, x_stride, xsr, wq, sz, yr, y_stride, cols); break;
                case 4: q4_wide_tile(4, groups, xr, x_stride, xsr, wq, sz, yr, y_stride, cols); break;
                case 5: q4_wide_tile(5, groups, xr, x_stride, xsr, wq, sz, yr, y_stride, cols); break;
#endif
                default: q4_wide_tile(Q4_WIDE_TILE, groups, xr, x_stride, xsr, wq, sz, yr, y_stride, cols); break;
                }
            }
        }
    }
    free(scratch);
    return 0;
}
#else
static void q4_rows_by_panel(int64_t m, int64_t groups, const float *x, int64_t x_stride, const float *xs,
                             const uint8_t *w, const float *sz, float *y, int64_t y_stride, int cols) {
    for (int64_t r = 0; r < m; r++) {
        for (int j = 0; j < cols; j++) {
            float acc_y = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *c = w + g * Q4_CHUNK;
                const float *xg = x + r * x_stride + g * Q4_GROUP, *s = sz + g * Q4_SCALES;
                const float xsum = xs[r * groups + g];
                float acc = 0.0f;
                for (int kk = 0; kk < Q4_GROUP; kk++) {
                    const uint8_t b = c[kk * 8 + (j & 7)];
                    acc += (float)(j < 8 ? b & 15 : b >> 4) * xg[kk];
                }
                acc_y += s[j] * (acc - 8.0f * xsum) + s[Q4_PANEL + j] * xsum;
            }
            y[r * y_stride + j] = acc_y;
        }
    }
}
#endif

/* ---- int4 x 16-bit x: word multiply-adds (AVX-512 VNNI + VBMI, checked at run time) ---------------
 *
 * A group's 256 nibble bytes are four 64-byte vectors of 8 inputs x 8 bytes. One byte permute
 * (vpermb) lays each vector out as 16 dwords, dword 8h + j holding inputs e = 4h..4h+3 of byte
 * column j (row j in the low nibbles, row j + 8 in the high ones). Read as 16-bit words, a mask
 * gives inputs e0 and e2 of row j in each dword, a shift by 8 and a mask e1 and e3, a shift by 4
 * and a mask e0 and e2 of row j + 8, a shift by 12 e1 and e3: vpdpwssd multiplies each pair by the
 * matching pair of rounded inputs and adds, 32 products an instruction into one int32 per row and
 * half. Per group, the halves h = 0, 1 are added (16 sums, one per row), and the group's scales
 * apply once: y += s * (d * sum(q x_q) - 8 * xsum) + z * xsum, xsum = d * sum(x_q) (the sum of the
 * group's x^). A group's sums stay under 2^24 (15 * 32767 * 32), exact in the int32 lanes and in
 * their conversion to fp32. */
#if Q_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && (defined(__GNUC__) || defined(__clang__))
#define Q4_WORDS 1
#define Q4_WORDS_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi")))
#define Q4_XV (2 * Q4_CHUNK) /* bytes of rounded x a group takes in the word layout */
#define Q4_WORDS_TILE 4       /* x rows that share each permuted weight vector */
#define Q4_WORDS_BLOCK 64     /* x rows whose prepared words meet the panels together */

static int q4_words_state = -1; /* -1: not asked yet; 0 off; 1 on */

static int q4_words_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}

/* Row r of x in the layout q4_words_panel reads: per group and 8 inputs b, two vectors of 16
 * dwords, dword 8h + j of the first holding rounded inputs (8b + 4h, 8b + 4h + 2) and of the second
 * (8b + 4h + 1, 8b + 4h + 3) (the same for every j); then per group d and the sum of its x^. */
static void q4_words_prepare(int64_t groups, const float *x, int16_t *xv, float *d, float *xsum) {
    int16_t q[Q4_GROUP];
    for (int64_t g = 0; g < groups; g++) {
        d[g] = round_group(x + g * Q4_GROUP, Q4_GROUP, q);
        int isum = 0;
        for (int i = 0; i < Q4_GROUP; i++) isum += q[i];
        xsum[g] = d[g] * (float)isum;
        int16_t *out = xv + g * (Q4_XV / 2);
        for (int b = 0; b < 4; b++) {
            for (int t = 0; t < 16; t++) {
                const int e = 8 * b + 4 * (t >> 3);
                int16_t *first = out + 64 * b + 2 * t, *second = first + 32;
                first[0] = q[e], first[1] = q[e + 2];
                second[0] = q[e + 1], second[1] = q[e + 3];
            }
        }
    }
}

/* Rows nr (1..Q4_WORDS_TILE, a constant at each call site) of x times one panel: each permuted weight
 * vector meets every row of the tile. A row's integer sums are exact and its fp32 steps are the
 * same whatever the tile holds, so its result does not depend on the other rows. */
Q4_WORDS_TARGET static inline __attribute__((always_inline)) void q4_words_tile(
        const int nr, int64_t groups, const int16_t *xv, const float *d, const float *xsum, const __m512i perm,
        const uint8_t *w, const float *sz, float *y, int64_t y_stride, int cols, int prefetch) {
    const __m512i low = _mm512_set1_epi16(15);
    const __m512 eight = _mm512_set1_ps(8.0f);
    __m512 acc[Q4_WORDS_TILE];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (prefetch) q4_prefetch(w + g * Q4_CHUNK, sz + g * Q4_SCALES);
        const uint8_t *c = w + g * Q4_CHUNK;
        __m512i lo[Q4_WORDS_TILE], hi[Q4_WORDS_TILE];
        for (int r = 0; r < nr; r++) lo[r] = hi[r] = _mm512_setzero_si512();
        for (int b = 0; b < 4; b++) {
            const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(c + 64 * b));
            const __m512i w0 = _mm512_and_si512(v, low), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 8), low);
            const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low), w3 = _mm512_srli_epi16(v, 12);
            for (int r = 0; r < nr; r++) {
                const int16_t *xg = xv + (r * groups + g) * (Q4_XV / 2) + 64 * b;
                const __m512i x02 = _mm512_loadu_si512(xg), x13 = _mm512_loadu_si512(xg + 32);
                lo[r] = _mm512_dpwssd_epi32(lo[r], w0, x02);
                lo[r] = _mm512_dpwssd_epi32(lo[r], w1, x13);
                hi[r] = _mm512_dpwssd_epi32(hi[r], w2, x02);
                hi[r] = _mm512_dpwssd_epi32(hi[r], w3, x13);
            }
        }
        const __m512 s = _mm512_loadu_ps(sz + g * Q4_SCALES), z = _mm512_loadu_ps(sz + g * Q4_SCALES + Q4_PANEL);
        for (int r = 0; r < nr; r++) {
            const __m512i isum = _mm512_add_epi32(_mm512_shuffle_i64x2(lo[r], hi[r], 0x44),
                                                  _mm512_shuffle_i64x2(lo[r], hi[r], 0xEE));
            const __m512 xs = _mm512_set1_ps(xsum[r * groups + g]);
            const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d[r * groups + g]),
                                             _mm512_mul_ps(eight, xs));
            acc[r] = _mm512_fmadd_ps(s, t, acc[r]);
            acc[r] = _mm512_fmadd_ps(z, xs, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_mask_storeu_ps(y + r * y_stride, (__mmask16)((1u << cols) - 1u), acc[r]);
}

/* m rows (prepared: xv, d, xsum as q4_words_prepare lays them out) times one panel, Q4_WORDS_TILE
 * rows at a time; the first tile prefetches the panel's bytes ahead (the others find them in cache). */
Q4_WORDS_TARGET static void q4_words_panel(int64_t m, int64_t groups, const int16_t *xv, const float *d,
                                           const float *xsum, const uint8_t *order, const uint8_t *w,
                                           const float *sz, float *y, int64_t y_stride, int cols) {
    const __m512i perm = _mm512_loadu_si512(order);
    for (int64_t r = 0; r < m; r += Q4_WORDS_TILE) {
        const int64_t xo = r * groups;
        const int pf = r == 0;
        float *yr = y + r * y_stride;
        switch (m - r < Q4_WORDS_TILE ? m - r : Q4_WORDS_TILE) {
        case 1: q4_words_tile(1, groups, xv + xo * (Q4_XV / 2), d + xo, xsum + xo, perm, w, sz, yr, y_stride, cols, pf); break;
        case 2: q4_words_tile(2, groups, xv + xo * (Q4_XV / 2), d + xo, xsum + xo, perm, w, sz, yr, y_stride, cols, pf); break;
        case 3: q4_words_tile(3, groups, xv + xo * (Q4_XV / 2), d + xo, xsum + xo, perm, w, sz, yr, y_stride, cols, pf); break;
        default: q4_words_tile(Q4_WORDS_TILE, groups, xv + xo * (Q4_XV / 2), d + xo, xsum + xo, perm, w, sz, yr, y_stride, cols, pf); break;
        }
    }
}

/* Any number of rows: x's rows prepared once (in parallel when there are many), then for each block
 * of Q4_WORDS_BLOCK rows the panels shared out statically over the threads (the block's prepared
 * rows, 512 bytes per 32 inputs, stay in cache while the panels stream past them). */
static int q4_words_rows(int64_t m, int64_t n, int64_t groups, const float *x, int64_t x_stride,
                         const uint8_t *qweight, const float *qscale, float *y, int64_t y_stride, int num_threads) {
    const int64_t panels = (n + Q4_PANEL - 1) / Q4_PANEL, k = groups * Q4_GROUP;
    int16_t *xv = aligned_alloc(64, (size_t)(m * groups * Q4_XV));
    float *d = malloc((size_t)(2 * m * groups) * sizeof(float));
    if (!xv || !d) {
        free(xv);
        free(d);
        return -1;
    }
    uint8_t order[64]; /* vpermb's table: destination byte 4t + e, t = 8h + j <- input 4h + e, column j */
    for (int p = 0; p < 64; p++) order[p] = (uint8_t)((4 * (p >> 5) + (p & 3)) * 8 + ((p >> 2) & 7));
    #pragma omp parallel num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            q4_words_prepare(groups, x + r * x_stride, xv + r * groups * (Q4_XV / 2), d + r * groups,
                             d + (m + r) * groups);
        for (int64_t r0 = 0; r0 < m; r0 += Q4_WORDS_BLOCK) {
            const int64_t rows = m - r0 < Q4_WORDS_BLOCK ? m - r0 : Q4_WORDS_BLOCK;
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                const int cols = (int)(n - p * Q4_PANEL < Q4_PANEL ? n - p * Q4_PANEL : Q4_PANEL);
                q4_words_panel(rows, groups, xv + r0 * groups * (Q4_XV / 2), d + r0 * groups, d + (m + r0) * groups,
                               order, qweight + p * groups * Q4_CHUNK, qscale + p * groups * Q4_SCALES,
                               y + r0 * y_stride + p * Q4_PANEL, y_stride, cols);
            }
        }
    }
    free(xv);
    free(d);
    return 0;
}
#endif

/* ---- int4 x 16-bit x on AMX tiles (a few rows and more, where the CPU has AMX-INT8) --------------
 *
 * The word products' integers, multiplied by the tile unit: per (panel, group) a block of int32
 * sums over the group's 32 inputs, one row per row of x (up to Q4_AMX_ROWS rows a tile), one column
 * per output of the panel. The tiles multiply bytes, so each rounded input q is split into
 * q = 256 * hi + lo (hi signed, lo 0..255) and the sums come from two tile products:
 * sum(w q) = 256 * sum(w hi) + sum(w lo), each part under 2^17, so both and their combination are
 * exact int32 sums equal to q4_words_tile's (the order of an integer sum does not change it). The
 * fp32 steps per row and group are q4_words_tile's, in its order, so every row gets the bits of its
 * one-row call. Why: q4_words_tile spends 16 multiply-adds and a dozen other vector instructions
 * per row, group and panel, so each extra row of a speculative verification cost most of a one-row
 * step; the tile unit does a row's share of a group's products in a fraction of that, leaving the
 * vector unit the unpacking of the weights (once per group for all rows) and each row's fp32 steps.
 * Below Q4_AMX_MIN_ROWS rows the word products stay: the tile products and their stores cost about
 * the same per group whatever the row count, more than the word products' few rows (one row, a
 * plain decode step, is bound by the weights' bytes either way). The weights are unpacked per group
 * into the tile layout (row i of 8 holds inputs 4i..4i+3 of each of the 16 outputs, 4 bytes an
 * output) in a buffer the tile load reads back from L1. */
#if defined(Q4_WORDS) && defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define Q4_AMX 1
#define Q4_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,amx-tile,amx-int8")))
#define Q4_AMX_ROWS 16    /* x rows per tile product (the tiles' most) */
#define Q4_AMX_MIN_ROWS 4 /* from this many rows the tiles multiply (fewer keep the word products) */
#define Q4_AMX_BATCH 8    /* groups per pass of q4_amx_panel */

/* Tile registers: 0 and 7 a group's unpacked weights, 1 and 2 the rows' high and low bytes of x,
 * 3, 4 and 5, 6 their products with the weights. Written out with a memory clobber (the compiler must not move the
 * buffers' stores and loads across them). */
#define AMX_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((long)(stride)) : "memory")
#define AMX_STORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"((long)(stride)) : "memory")
#define AMX_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define AMX_DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define AMX_DPBUUD(c, a, b) __asm__ volatile("tdpbuud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

static int q4_amx_state = -1; /* -1: not asked yet; 0 off; 1 on */

/* AMX-TILE and AMX-INT8 in CPUID, the tile state enabled by the OS (XCR0 bits 17 and 18), and this
 * process allowed to use it (Linux asks each process to request the tile data state once). */
static int q4_amx_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* The tiles for a block of `rows` rows of x (ldtilecfg's 64-byte layout, palette 1). */
Q4_AMX_TARGET static void q4_amx_configure(int rows) {
    _Alignas(64) uint8_t cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    const uint16_t colsb[8] = {64, Q4_GROUP, Q4_GROUP, 64, 64, 64, 64, 64};
    const uint8_t r8 = (uint8_t)rows, trows[8] = {Q4_GROUP / 4, r8, r8, r8, r8, r8, r8, Q4_GROUP / 4};
    for (int t = 0; t < 8; t++) {
        memcpy(cfg + 16 + 2 * t, &colsb[t], 2);
        cfg[48 + t] = trows[t];
    }
    __asm__ volatile("ldtilecfg (%0)" ::"r"(cfg) : "memory");
}

Q4_AMX_TARGET static void q4_amx_release(void) { __asm__ volatile("tilerelease" ::: "memory"); }

/* Row r of x for the tiles: per group its rounded inputs' high bytes (signed) and low bytes, then
 * per group d, the sum of its x^ and 8 times that (q4_words_prepare's values: the same rounding and
 * the same integer sum; 8 * xsum is exact, as q4_words_tile's product of the two). */
static void q4_amx_prepare(int64_t groups, const float *x, int8_t *xh, uint8_t *xl, float *d, float *xsum,
                           float *xsum8) {
    int16_t q[Q4_GROUP];
    for (int64_t g = 0; g < groups; g++) {
        d[g] = round_group(x + g * Q4_GROUP, Q4_GROUP, q);
        int isum = 0;
        for (int i = 0; i < Q4_GROUP; i++) {
            isum += q[i];
            xh[g * Q4_GROUP + i] = (int8_t)(q[i] >> 8);
            xl[g * Q4_GROUP + i] = (uint8_t)(q[i] & 255);
        }
        xsum[g] = d[g] * (float)isum;
        xsum8[g] = 8.0f * xsum[g];
    }
}

/* `rows` (1..Q4_AMX_ROWS, the tiles configured for them) rows of x times one panel. xh, xl: the
 * block's first row, rows k bytes apart; d, xs, xs8: its first row's, rows `groups` apart; tab: the
 * two byte permutes that lay a 64-byte chunk's nibbles out as two rows of the weight tile.
 * Q4_AMX_BATCH groups at a time in three passes (unpack the weights, the tile products, the fp32
 * steps) rather than one group through all three: a tile load of bytes just stored, and a vector
 * load of products just stored from a tile, wait for the stores to complete, and group by group
 * those waits added up to more than all the arithmetic. Consecutive groups take alternate product
 * tiles (3, 4 and 5, 6) and weight tiles (0 and 7), and a group's products are stored after the
 * next group's are started, so the tile unit need not wait for one store before the next product. */
Q4_AMX_TARGET static void q4_amx_panel(int rows, int64_t groups, const int8_t *xh, const uint8_t *xl,
                                       const float *d, const float *xs, const float *xs8, const __m512i tab[2],
                                       const uint8_t *w, const float *sz, float *y, int64_t y_stride, int cols) {
    const int64_t k = groups * Q4_GROUP;
    _Alignas(64) uint8_t wt[Q4_AMX_BATCH][Q4_GROUP / 4 * 64];             /* the groups' weight tiles */
    _Alignas(64) int32_t prod[Q4_AMX_BATCH][2][Q4_AMX_ROWS][Q4_PANEL]; /* their products with x's bytes */
    _Alignas(64) float acc[Q4_AMX_ROWS][Q4_PANEL];
    const __m512i low = _mm512_set1_epi8(15);
    for (int r = 0; r < rows; r++) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    for (int64_t g0 = 0; g0 < groups; g0 += Q4_AMX_BATCH) {
        const int nb = (int)(groups - g0 < Q4_AMX_BATCH ? groups - g0 : Q4_AMX_BATCH);
        for (int i = 0; i < nb; i++) {
            const int64_t g = g0 + i;
            q4_prefetch(w + g * Q4_CHUNK, sz + g * Q4_SCALES);
            const uint8_t *c = w + g * Q4_CHUNK;
            for (int b = 0; b < 4; b++) { /* inputs 8b..8b+7: tile rows 2b (the first 4) and 2b + 1 */
                const __m512i v = _mm512_loadu_si512(c + 64 * b);
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                _mm512_store_si512(wt[i] + 128 * b, _mm512_permutex2var_epi8(lo, tab[0], hi));
                _mm512_store_si512(wt[i] + 128 * b + 64, _mm512_permutex2var_epi8(lo, tab[1], hi));
            }
        }
        for (int i = 0; i < nb; i++) { /* group i's products, then group i - 1's stored */
            const int64_t g = g0 + i;
            AMX_LOAD(1, xh + g * Q4_GROUP, k);
            AMX_LOAD(2, xl + g * Q4_GROUP, k);
            if (i & 1) {
                AMX_LOAD(7, wt[i], 64);
                AMX_ZERO(5);
                AMX_ZERO(6);
                AMX_DPBSUD(5, 1, 7);
                AMX_DPBUUD(6, 2, 7);
                AMX_STORE(3, prod[i - 1][0], 64);
                AMX_STORE(4, prod[i - 1][1], 64);
            } else {
                AMX_LOAD(0, wt[i], 64);
                AMX_ZERO(3);
                AMX_ZERO(4);
                AMX_DPBSUD(3, 1, 0);
                AMX_DPBUUD(4, 2, 0);
                if (i) {
                    AMX_STORE(5, prod[i - 1][0], 64);
                    AMX_STORE(6, prod[i - 1][1], 64);
                }
            }
        }
        if (nb & 1) {
            AMX_STORE(3, prod[nb - 1][0], 64);
            AMX_STORE(4, prod[nb - 1][1], 64);
        } else {
            AMX_STORE(5, prod[nb - 1][0], 64);
            AMX_STORE(6, prod[nb - 1][1], 64);
        }
        for (int i = 0; i < nb; i++) {
            const int64_t g = g0 + i;
            const __m512 s = _mm512_loadu_ps(sz + g * Q4_SCALES), z = _mm512_loadu_ps(sz + g * Q4_SCALES + Q4_PANEL);
            for (int r = 0; r < rows; r++) {
                const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(prod[i][0][r]), 8),
                                                      _mm512_load_si512(prod[i][1][r]));
                const __m512 xsum = _mm512_set1_ps(xs[r * groups + g]);
                const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d[r * groups + g]),
                                                 _mm512_set1_ps(xs8[r * groups + g]));
                __m512 a = _mm512_load_ps(acc[r]);
                a = _mm512_fmadd_ps(s, t, a);
                a = _mm512_fmadd_ps(z, xsum, a);
                _mm512_store_ps(acc[r], a);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_mask_storeu_ps(y + r * y_stride, (__mmask16)((1u << cols) - 1u), _mm512_load_ps(acc[r]));
}

/* Any number of rows (from Q4_AMX_MIN_ROWS): x's rows prepared once (in parallel), then for each
 * block of Q4_AMX_ROWS rows the panels shared out statically over the threads, each thread
 * configuring its tiles for the block. */
static int q4_amx_rows(int64_t m, int64_t n, int64_t groups, const float *x, int64_t x_stride,
                       const uint8_t *qweight, const float *qscale, float *y, int64_t y_stride, int num_threads) {
    const int64_t panels = (n + Q4_PANEL - 1) / Q4_PANEL, k = groups * Q4_GROUP;
    const size_t xbytes = (size_t)((m * k + 63) / 64 * 64);
    int8_t *xh = aligned_alloc(64, xbytes);
    uint8_t *xl = aligned_alloc(64, xbytes);
    float *f = malloc((size_t)(3 * m * groups) * sizeof(float));
    if (!xh || !xl || !f) {
        free(xh);
        free(xl);
        free(f);
        return -1;
    }
    float *d = f, *xs = f + m * groups, *xs8 = f + 2 * m * groups;
    /* vpermt2b's tables: tile row 2b + h, byte 4o + i (output o, input 4h + i of the chunk) <- chunk
     * byte 8(4h + i) + (o mod 8), its low nibble (o < 8, from the first source) or high (the second) */
    _Alignas(64) uint8_t order[2][64];
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 64; p++) {
            const int o = p >> 2, i = p & 3;
            order[h][p] = (uint8_t)((o >= 8 ? 64 : 0) + 8 * (4 * h + i) + (o & 7));
        }
    #pragma omp parallel num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            q4_amx_prepare(groups, x + r * x_stride, xh + r * k, xl + r * k, d + r * groups, xs + r * groups,
                           xs8 + r * groups);
        const __m512i tab[2] = {_mm512_load_si512(order[0]), _mm512_load_si512(order[1])};
        for (int64_t r0 = 0; r0 < m; r0 += Q4_AMX_ROWS) {
            const int rows = (int)(m - r0 < Q4_AMX_ROWS ? m - r0 : Q4_AMX_ROWS);
            q4_amx_configure(rows);
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                const int cols = (int)(n - p * Q4_PANEL < Q4_PANEL ? n - p * Q4_PANEL : Q4_PANEL);
                q4_amx_panel(rows, groups, xh + r0 * k, xl + r0 * k, d + r0 * groups, xs + r0 * groups,
                             xs8 + r0 * groups, tab, qweight + p * groups * Q4_CHUNK,
                             qscale + p * groups * Q4_SCALES, y + r0 * y_stride + p * Q4_PANEL, y_stride, cols);
            }
        }
        q4_amx_release();
    }
    free(xh);
    free(xl);
    free(f);
    return 0;
}
#endif

/* Whether one- to few-row int4 products and one-row int8 ones take the word multiply-adds: want 0
 * turns them off, 1 on where the CPU has them, -1 only asks. Returns the state after (0 or 1;
 * always 0 in a build without AVX-512). Tests and benchmarks compare the two paths in one process. */
int pagedkv_quant_words(int want) {
#ifdef Q4_WORDS
    if (q4_words_state < 0 || want >= 0) q4_words_state = want != 0 && q4_words_supported();
    return q4_words_state;
#else
    (void)want;
    return 0;
#endif
}

/* Whether int4 products multiply on the AMX tiles from Q4_AMX_MIN_ROWS rows, every int4 row then
 * taking the word products' arithmetic (a prefill's too): want 0 turns them off (the word products'
 * own row tiles, and the dequantized panels for PANELS, then), 1 on where the CPU and the OS have
 * them, -1 only asks. Returns the state after (0 or 1; always 0 in a build without them).
 * Tests compare the two paths in one process. */
int pagedkv_quant_amx(int want) {
#ifdef Q4_AMX
    if (q4_amx_state < 0 || want >= 0) q4_amx_state = want != 0 && q4_amx_supported();
    return q4_amx_state;
#else
    (void)want;
    return 0;
#endif
}

/* m rows x the int4 matrix (n outputs of n_pad = 16 * panels, k = 32 * groups inputs), each row by
 * the arithmetic `arith` says (QUANT_ARITH_*, at the top of this file). */
int pagedkv_q4_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const uint8_t *qweight,
                      const float *qscale, float *y, int64_t y_stride, int num_threads, int arith) {
    const int64_t groups = k / Q4_GROUP, panels = (n + Q4_PANEL - 1) / Q4_PANEL;
    int64_t first = 0; /* panels done by q4_many_rows */
    const int many = arith == QUANT_ARITH_PANELS || (arith == QUANT_ARITH_AUTO && m >= Q4_DEQ_MIN_ROWS);
#ifdef Q4_WORDS
    if (pagedkv_quant_words(-1)) {
#ifdef Q4_AMX
        /* With the tiles, every row gets the word products' arithmetic whatever `arith` says: a
         * prefill's rows (PANELS) run faster on them than on the dequantized panels at every row
         * count, and a prompt's positions then come out as decoding computes them. */
        if (pagedkv_quant_amx(-1))
            return m >= Q4_AMX_MIN_ROWS
                       ? q4_amx_rows(m, n, groups, x, x_stride, qweight, qscale, y, y_stride, num_threads)
                       : q4_words_rows(m, n, groups, x, x_stride, qweight, qscale, y, y_stride, num_threads);
#endif
        if (!many) return q4_words_rows(m, n, groups, x, x_stride, qweight, qscale, y, y_stride, num_threads);
    }
#endif
    float *xh = malloc((size_t)(m * k > 0 ? m * k : 1) * sizeof(float)); /* x^ (see round_group) */
    float *xs = malloc((size_t)(m * groups > 0 ? m * groups : 1) * sizeof(float));
    int rc = 0;
    if (!xh || !xs) {
        rc = -1;
        goto done;
    }
    round_rows(m, k, x, x_stride, xh);
    x = xh;
    x_stride = k;
#if Q_SIMD
    if (many) {
        first = n / Q4_PANEL;
        if (q4_many_rows(m, first, groups, x, x_stride, qweight, qscale, y, y_stride,
                         m * n * k >= PARALLEL_MIN_MACS ? num_threads : 1)) {
            rc = -1;
            goto done;
        }
        if (first == panels) goto done;
    }
#else
    (void)many;
#endif
    group_sums(m, groups, x, x_stride, xs);
#if Q_SIMD
    if (!many && m >= Q4_WIDE_MIN_ROWS) { /* the row tiles' arithmetic, each nibble widened once */
        rc = q4_rows_wide(m, n, groups, x, x_stride, xs, qweight, qscale, y, y_stride,
                          m * n * k >= PARALLEL_MIN_MACS ? num_threads : 1);
        goto done;
    }
#endif
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t p = first; p < panels; p++) {
        const int cols = (int)(n - p * Q4_PANEL < Q4_PANEL ? n - p * Q4_PANEL : Q4_PANEL);
        q4_rows_by_panel(m, groups, x, x_stride, xs, qweight + p * groups * Q4_CHUNK, qscale + p * groups * Q4_SCALES,
                         y + p * Q4_PANEL, y_stride, cols);
    }
done:
    free(xh);
    free(xs);
    return rc;
}

/* ---- int8 rows: 4 output rows share each load of x ----------------------------------------------- */

#if Q_SIMD
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 q8_widen(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

#ifdef Q4_WORDS
/* One x row (rounded: xq, d per group of 32) times one int8 weight row, read front to back once:
 * per group its 32 weights widened to 16 bits (vpmovsxbw) and multiplied pairwise with the
 * rounded inputs (vpmaddwd: 16 int32 sums of 2 products), then into fp32 times the group's d. The
 * same one-stream order as q8_dot1 (which says why one row at a time). */
Q4_WORDS_TARGET static float q8_words_dot(int64_t groups, const int16_t *xq, const float *d, const int8_t *w) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (!(g & 1)) _mm_prefetch((const char *)(w + g * Q4_GROUP + Q8_PREFETCH), _MM_HINT_T0);
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + g * Q4_GROUP)));
        const __m512i dot = _mm512_madd_epi16(wv, _mm512_loadu_si512(xq + g * Q4_GROUP));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d[g]), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static int q8_words_row(int64_t n, int64_t k, const float *x, const int8_t *qweight, int64_t w_stride,
                        const float *scale, float *y, int num_threads) {
    const int64_t groups = k / Q4_GROUP;
    int16_t *xq = aligned_alloc(64, (size_t)(groups * Q4_GROUP * 2 + 64) / 64 * 64);
    float *d = malloc((size_t)(groups > 0 ? groups : 1) * sizeof(float));
    if (!xq || !d) {
        free(xq);
        free(d);
        return -1;
    }
    for (int64_t g = 0; g < groups; g++) d[g] = round_group(x + g * Q4_GROUP, Q4_GROUP, xq + g * Q4_GROUP);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= PARALLEL_MIN_MACS)
    for (int64_t j = 0; j < n; j++) y[j] = q8_words_dot(groups, xq, d, qweight + j * w_stride) * scale[j];
    free(xq);
    free(d);
    return 0;
}

/* xr (1..3) x rows times wr (1..Q8_ROWS) weight rows (constants at each call site), each pair by
 * q8_words_dot's arithmetic (its sums in the same order): a block of weight rows widened once per group
 * meets a tile of x rows, and a row's result does not depend on the other rows of the call. */
Q4_WORDS_TARGET static inline __attribute__((always_inline)) void q8_words_tile(
        const int xr, const int wr, int64_t groups, const int16_t *xq, const float *d, const int8_t *w,
        int64_t w_stride, const float *scale, float *y, int64_t y_stride) {
    __m512 acc[3][Q8_ROWS];
    for (int r = 0; r < xr; r++)
        for (int j = 0; j < wr; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i wv[Q8_ROWS];
        for (int j = 0; j < wr; j++)
            wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + j * w_stride + g * Q4_GROUP)));
        for (int r = 0; r < xr; r++) {
            const __m512i xv = _mm512_loadu_si512(xq + (r * groups + g) * Q4_GROUP);
            const __m512 dv = _mm512_set1_ps(d[r * groups + g]);
            for (int j = 0; j < wr; j++)
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(wv[j], xv)), dv, acc[r][j]);
        }
    }
    for (int r = 0; r < xr; r++)
        for (int j = 0; j < wr; j++) y[r * y_stride + j] = _mm512_reduce_add_ps(acc[r][j]) * scale[j];
}

/* x rows r0 .. r0 + xr (xr 1..3) times the weight rows of a block of wr (1..Q8_ROWS). */
Q4_WORDS_TARGET static void q8_words_block(int xr, int wr, int64_t groups, const int16_t *xq, const float *d,
                                           const int8_t *w, int64_t w_stride, const float *scale, float *y,
                                           int64_t y_stride) {
#define Q8_WORDS_TILE(XR)                                                                                     \
    switch (wr) {                                                                                             \
    case 1: q8_words_tile(XR, 1, groups, xq, d, w, w_stride, scale, y, y_stride); break;                     \
    case 2: q8_words_tile(XR, 2, groups, xq, d, w, w_stride, scale, y, y_stride); break;                     \
    case 3: q8_words_tile(XR, 3, groups, xq, d, w, w_stride, scale, y, y_stride); break;                     \
    default: q8_words_tile(XR, Q8_ROWS, groups, xq, d, w, w_stride, scale, y, y_stride); break;              \
    }
    switch (xr) {
    case 1: Q8_WORDS_TILE(1) break;
    case 2: Q8_WORDS_TILE(2) break;
    default: Q8_WORDS_TILE(3) break;
    }
#undef Q8_WORDS_TILE
}

/* Any number of x rows, each by q8_words_dot's arithmetic: the rows rounded once, then blocks of
 * Q8_ROWS weight rows shared out statically over the threads, each block's rows read once per tile
 * of 3 x rows (from cache after the first). */
static int q8_words_rows(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const int8_t *qweight,
                         int64_t w_stride, const float *scale, float *y, int64_t y_stride, int num_threads) {
    const int64_t groups = k / Q4_GROUP, blocks = (n + Q8_ROWS - 1) / Q8_ROWS;
    int16_t *xq = aligned_alloc(64, (size_t)(m * groups * Q4_GROUP * 2 + 64) / 64 * 64);
    float *d = malloc((size_t)(m * groups > 0 ? m * groups : 1) * sizeof(float));
    if (!xq || !d) {
        free(xq);
        free(d);
        return -1;
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++)
            d[r * groups + g] = round_group(x + r * x_stride + g * Q4_GROUP, Q4_GROUP, xq + (r * groups + g) * Q4_GROUP);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * Q8_ROWS;
        const int wr = (int)(n - n0 < Q8_ROWS ? n - n0 : Q8_ROWS);
        if (b + 1 < blocks) /* the next block's rows arrive while these meet every row of x */
            for (int j = 0; j < Q8_ROWS && n0 + Q8_ROWS + j < n; j++)
                for (int64_t i = 0; i < k; i += 64) __builtin_prefetch(qweight + (n0 + Q8_ROWS + j) * w_stride + i, 0, 2);
        for (int64_t r = 0; r < m; r += 3) {
            const int xr = (int)(m - r < 3 ? m - r : 3);
            q8_words_block(xr, wr, groups, xq + r * groups * Q4_GROUP, d + r * groups, qweight + n0 * w_stride,
                           w_stride, scale + n0, y + r * y_stride + n0, y_stride);
        }
    }
    free(xq);
    free(d);
    return 0;
}
#endif

/* One x row (or two: x1 may be NULL) times rows w[0..4) of the block (rows past `rows` repeat row 0
 * and are not stored). */
static void q8_block(int64_t k, const float *x0, const float *x1, const int8_t *w, int64_t w_stride, const float *scale,
                     int rows, float *y0, float *y1) {
    const int8_t *wr[Q8_ROWS];
    for (int i = 0; i < Q8_ROWS; i++) wr[i] = w + (i < rows ? i : 0) * w_stride;
    float s0[Q8_ROWS] = {0}, s1[Q8_ROWS] = {0};
    int64_t kk = 0;
#if Q_SIMD
    __m256 a[Q8_ROWS], b[Q8_ROWS];
    for (int i = 0; i < Q8_ROWS; i++) a[i] = b[i] = _mm256_setzero_ps();
    if (x1) {
        for (; kk + 8 <= k; kk += 8) {
            const __m256 xv0 = _mm256_loadu_ps(x0 + kk), xv1 = _mm256_loadu_ps(x1 + kk);
            for (int i = 0; i < Q8_ROWS; i++) {
                const __m256 wv = q8_widen(wr[i] + kk);
                a[i] = _mm256_fmadd_ps(wv, xv0, a[i]);
                b[i] = _mm256_fmadd_ps(wv, xv1, b[i]);
            }
        }
    } else {
        for (; kk + 8 <= k; kk += 8) {
            const __m256 xv0 = _mm256_loadu_ps(x0 + kk);
            for (int i = 0; i < Q8_ROWS; i++) a[i] = _mm256_fmadd_ps(q8_widen(wr[i] + kk), xv0, a[i]);
        }
    }
    for (int i = 0; i < Q8_ROWS; i++) {
        s0[i] = hsum(a[i]);
        s1[i] = hsum(b[i]);
    }
#endif
    for (; kk < k; kk++) {
        for (int i = 0; i < Q8_ROWS; i++) {
            s0[i] += (float)wr[i][kk] * x0[kk];
            if (x1) s1[i] += (float)wr[i][kk] * x1[kk];
        }
    }
    for (int i = 0; i < rows; i++) {
        y0[i] = s0[i] * scale[i];
        if (x1) y1[i] = s1[i] * scale[i];
    }
}

/* q8_dot1's inputs past its vectors, one at a time (shared with q8_rows_wide, so both round alike). */
static inline float q8_dot_tail(int64_t kk, int64_t k, const float *x, const int8_t *w, float s) {
    for (; kk < k; kk++) s += (float)w[kk] * x[kk];
    return s;
}

/* One x row times one weight row, the row read front to back once. Why a path of its own: a decode
 * step's output layer is one x row against the whole vocabulary (SmolLM2: 49,152 rows of 576), and
 * there the 4-row blocks above, which share x loads between weight rows, read four interleaved
 * streams and ran well below the rate of one sequential stream with four accumulators
 * (docs/kernels.md has the figures). */
static inline float q8_dot1(int64_t k, const float *x, const int8_t *w) {
    float s = 0.0f;
    int64_t kk = 0;
#if Q_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; kk + 32 <= k; kk += 32) {
        _mm_prefetch((const char *)(w + kk + Q8_PREFETCH), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(q8_widen(w + kk), _mm256_loadu_ps(x + kk), a0);
        a1 = _mm256_fmadd_ps(q8_widen(w + kk + 8), _mm256_loadu_ps(x + kk + 8), a1);
        a2 = _mm256_fmadd_ps(q8_widen(w + kk + 16), _mm256_loadu_ps(x + kk + 16), a2);
        a3 = _mm256_fmadd_ps(q8_widen(w + kk + 24), _mm256_loadu_ps(x + kk + 24), a3);
    }
    for (; kk + 8 <= k; kk += 8) a0 = _mm256_fmadd_ps(q8_widen(w + kk), _mm256_loadu_ps(x + kk), a0);
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    return q8_dot_tail(kk, k, x, w, s);
}

/* ---- int8, many rows: weight rows widened to fp32 once per call -----------------------------------
 *
 * Why: the blocks above widen every weight once per 2 rows of x, and their 8 accumulators leave the
 * multiply-add's latency exposed: at a decode step of many sequences they ran slower than the fp32
 * kernel on the same matrix dequantized (docs/kernels.md). Here each block of 4 weight rows is widened
 * to fp32 once per call (4 x k floats, in L1) and every row of x meets it in tiles of 3 rows x 4
 * weight rows: 12 accumulators, 7 loads per 12 multiply-adds, the balance of linear.c's fp32 tiles.
 * The same arithmetic as the blocks, sum(x q) * s. Threads take the weight-row blocks statically.
 * Every variant takes this path (the plain C build with plain loops), so which arithmetic a row
 * count gets does not depend on the CPU. */

/* y[r][j] = sum(x[r] * wf[j]) * scale[j] for xr (<= 3) rows of x and wr (<= 4) widened weight rows
 * wf[j] (32-byte aligned, row stride wf_stride); rows past xr / wr repeat the first and are not
 * stored. */
static inline void q8_wide_tile(int64_t k, const float *x, int64_t x_stride, int xr, const float *wf,
                                int64_t wf_stride, int wr, const float *scale, float *y, int64_t y_stride) {
    const float *xp[3], *wp[WIDE_ROWS];
    for (int r = 0; r < 3; r++) xp[r] = x + (r < xr ? r : 0) * x_stride;
    for (int j = 0; j < WIDE_ROWS; j++) wp[j] = wf + (j < wr ? j : 0) * wf_stride;
    float part[3][WIDE_ROWS] = {{0}};
    int64_t kk = 0;
#if Q_SIMD
    __m256 acc[3][WIDE_ROWS];
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < WIDE_ROWS; j++) acc[r][j] = _mm256_setzero_ps();
    for (; kk + 8 <= k; kk += 8) {
        const __m256 w0 = _mm256_load_ps(wp[0] + kk), w1 = _mm256_load_ps(wp[1] + kk);
        const __m256 w2 = _mm256_load_ps(wp[2] + kk), w3 = _mm256_load_ps(wp[3] + kk);
        for (int r = 0; r < 3; r++) {
            const __m256 xv = _mm256_loadu_ps(xp[r] + kk);
            acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(w2, xv, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(w3, xv, acc[r][3]);
        }
    }
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < WIDE_ROWS; j++) part[r][j] = hsum(acc[r][j]);
#endif
    for (int r = 0; r < xr; r++) {
        for (int j = 0; j < wr; j++) {
            float sum = part[r][j];
            for (int64_t t = kk; t < k; t++) sum += wp[j][t] * xp[r][t];
            y[r * y_stride + j] = sum * scale[j];
        }
    }
}

static int q8_many_rows(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const int8_t *qweight,
                        int64_t w_stride, const float *scale, float *y, int64_t y_stride, int num_threads) {
    const int64_t blocks = (n + WIDE_ROWS - 1) / WIDE_ROWS, k8 = (k + 7) / 8 * 8;
    const int nt = num_threads > 0 ? num_threads : 1;
    float *scratch = scratch_per_thread(nt, WIDE_ROWS * k8);
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nt)
    {
        float *wf = thread_scratch(scratch, WIDE_ROWS * k8);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * WIDE_ROWS;
            const int rows = (int)(n - n0 < WIDE_ROWS ? n - n0 : WIDE_ROWS);
            for (int j = 0; j < rows; j++) {
                const int8_t *wr = qweight + (n0 + j) * w_stride;
                float *out = wf + j * k8;
                int64_t kk = 0;
#if Q_SIMD
                for (; kk + 8 <= k; kk += 8) _mm256_store_ps(out + kk, q8_widen(wr + kk));
#endif
                for (; kk < k; kk++) out[kk] = (float)wr[kk];
            }
            if (b + 1 < blocks) { /* the next block's rows arrive while these meet every row of x */
                const char *next = (const char *)(qweight + (n0 + WIDE_ROWS) * w_stride);
                const int64_t bytes = (n - n0 - WIDE_ROWS < WIDE_ROWS ? n - n0 - WIDE_ROWS : WIDE_ROWS) * w_stride;
                for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(next + i, 0, 2);
            }
            for (int64_t r = 0; r < m; r += 3) {
                const int xr = (int)(m - r < 3 ? m - r : 3);
                q8_wide_tile(k, x + r * x_stride, x_stride, xr, wf, k8, rows, scale + n0, y + r * y_stride + n0,
                             y_stride);
            }
        }
    }
    free(scratch);
    return 0;
}

#if Q_SIMD
/* Many rows, each with q8_dot1's arithmetic (QUANT_ARITH_ROWS where the word products are not there):
 * each block of Q8_ROWS weight rows widened to fp32 once per call (as q8_many_rows does), then tiles
 * of xr rows of x by wr of the block's rows (constants at each call site), each pair of rows with
 * q8_dot1's four accumulators and order. q8_dot1's accumulators take their own x and weight vectors,
 * so a tile shares loads only between its rows: 2 x 2 where the build has 32 vector registers
 * (AVX-512), 1 x 2 where it has 16 (AVX2), every accumulator in a register of its own. */
#if defined(__AVX512F__)
#define Q8_WIDE_X 2
#else
#define Q8_WIDE_X 1
#endif
static inline __attribute__((always_inline)) void q8_wide_dot(const int xr, const int wr, int64_t k, const float *x,
                                                              int64_t x_stride, const float *wf, int64_t wf_stride,
                                                              const int8_t *w, int64_t w_stride, const float *scale,
                                                              float *y, int64_t y_stride) {
    __m256 a0[Q8_WIDE_X][2], a1[Q8_WIDE_X][2], a2[Q8_WIDE_X][2], a3[Q8_WIDE_X][2];
    for (int r = 0; r < xr; r++)
        for (int j = 0; j < wr; j++) a0[r][j] = a1[r][j] = a2[r][j] = a3[r][j] = _mm256_setzero_ps();
    int64_t kk = 0;
    for (; kk + 32 <= k; kk += 32) {
        __m256 w0[2], w1[2], w2[2], w3[2];
        for (int j = 0; j < wr; j++) {
            const float *wj = wf + j * wf_stride + kk;
            w0[j] = _mm256_load_ps(wj), w1[j] = _mm256_load_ps(wj + 8);
            w2[j] = _mm256_load_ps(wj + 16), w3[j] = _mm256_load_ps(wj + 24);
        }
        for (int r = 0; r < xr; r++) {
            const float *xp = x + r * x_stride + kk;
            const __m256 x0 = _mm256_loadu_ps(xp), x1 = _mm256_loadu_ps(xp + 8);
            const __m256 x2 = _mm256_loadu_ps(xp + 16), x3 = _mm256_loadu_ps(xp + 24);
            for (int j = 0; j < wr; j++) {
                a0[r][j] = _mm256_fmadd_ps(w0[j], x0, a0[r][j]);
                a1[r][j] = _mm256_fmadd_ps(w1[j], x1, a1[r][j]);
                a2[r][j] = _mm256_fmadd_ps(w2[j], x2, a2[r][j]);
                a3[r][j] = _mm256_fmadd_ps(w3[j], x3, a3[r][j]);
            }
        }
    }
    const int64_t k32 = kk;
    for (int r = 0; r < xr; r++) {
        const float *xp = x + r * x_stride;
        for (int j = 0; j < wr; j++) {
            const float *wj = wf + j * wf_stride;
            for (kk = k32; kk + 8 <= k; kk += 8)
                a0[r][j] = _mm256_fmadd_ps(_mm256_load_ps(wj + kk), _mm256_loadu_ps(xp + kk), a0[r][j]);
            const float s = hsum(_mm256_add_ps(_mm256_add_ps(a0[r][j], a1[r][j]), _mm256_add_ps(a2[r][j], a3[r][j])));
            y[r * y_stride + j] = q8_dot_tail(kk, k, xp, w + j * w_stride, s) * scale[j];
        }
    }
}

static int q8_rows_wide(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const int8_t *qweight,
                        int64_t w_stride, const float *scale, float *y, int64_t y_stride, int num_threads) {
    const int64_t blocks = (n + WIDE_ROWS - 1) / WIDE_ROWS, k8 = (k + 7) / 8 * 8;
    const int nt = num_threads > 0 ? num_threads : 1;
    float *scratch = scratch_per_thread(nt, WIDE_ROWS * k8);
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nt)
    {
        float *wf = thread_scratch(scratch, WIDE_ROWS * k8);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * WIDE_ROWS;
            const int rows = (int)(n - n0 < WIDE_ROWS ? n - n0 : WIDE_ROWS);
            for (int j = 0; j < rows; j++) {
                const int8_t *wr = qweight + (n0 + j) * w_stride;
                float *out = wf + j * k8;
                int64_t kk = 0;
                for (; kk + 8 <= k; kk += 8) _mm256_store_ps(out + kk, q8_widen(wr + kk));
                for (; kk < k; kk++) out[kk] = (float)wr[kk];
            }
            for (int64_t r = 0; r < m; r += Q8_WIDE_X) {
                const float *xr = x + r * x_stride;
                float *yr = y + r * y_stride + n0;
                const int two_x = Q8_WIDE_X > 1 && r + 1 < m;
                for (int j = 0; j < rows; j += 2) {
                    const int8_t *wj = qweight + (n0 + j) * w_stride;
                    const float *wfj = wf + j * k8;
                    if (j + 1 < rows && two_x)
                        q8_wide_dot(Q8_WIDE_X, 2, k, xr, x_stride, wfj, k8, wj, w_stride, scale + n0 + j, yr + j, y_stride);
                    else if (j + 1 < rows)
                        q8_wide_dot(1, 2, k, xr, x_stride, wfj, k8, wj, w_stride, scale + n0 + j, yr + j, y_stride);
                    else if (two_x)
                        q8_wide_dot(Q8_WIDE_X, 1, k, xr, x_stride, wfj, k8, wj, w_stride, scale + n0 + j, yr + j, y_stride);
                    else
                        q8_wide_dot(1, 1, k, xr, x_stride, wfj, k8, wj, w_stride, scale + n0 + j, yr + j, y_stride);
                }
            }
        }
    }
    free(scratch);
    return 0;
}
#endif

int pagedkv_q8_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const int8_t *qweight,
                      int64_t w_stride, const float *scale, float *y, int64_t y_stride, int num_threads, int arith) {
    const int alone = arith == QUANT_ARITH_ROWS || (arith == QUANT_ARITH_AUTO && m == 1);
#ifdef Q4_WORDS
    if (alone && k % Q4_GROUP == 0 && pagedkv_quant_words(-1))
        return m == 1 ? q8_words_row(n, k, x, qweight, w_stride, scale, y, num_threads)
                      : q8_words_rows(m, n, k, x, x_stride, qweight, w_stride, scale, y, y_stride, num_threads);
#endif
    float *xh = malloc((size_t)(m * k > 0 ? m * k : 1) * sizeof(float)); /* x^ (see round_group) */
    if (!xh) return -1;
    round_rows(m, k, x, x_stride, xh);
    x = xh;
    x_stride = k;
    int rc = 0;
    if (alone && m == 1) {
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= PARALLEL_MIN_MACS)
        for (int64_t j = 0; j < n; j++) y[j] = q8_dot1(k, x, qweight + j * w_stride) * scale[j];
    } else if (alone) { /* each row as one row alone (q8_dot1's arithmetic) */
#if Q_SIMD
        rc = q8_rows_wide(m, n, k, x, x_stride, qweight, w_stride, scale, y, y_stride,
                          m * n * k >= PARALLEL_MIN_MACS ? num_threads : 1);
#else
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
        for (int64_t j = 0; j < n; j++)
            for (int64_t r = 0; r < m; r++) y[r * y_stride + j] = q8_dot1(k, x + r * x_stride, qweight + j * w_stride) * scale[j];
#endif
    } else if (arith == QUANT_ARITH_PANELS || m >= Q8_DEQ_MIN_ROWS) {
        rc = q8_many_rows(m, n, k, x, x_stride, qweight, w_stride, scale, y, y_stride,
                          m * n * k >= PARALLEL_MIN_MACS ? num_threads : 1);
    } else {
        const int64_t blocks = (n + Q8_ROWS - 1) / Q8_ROWS;
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * Q8_ROWS;
            const int rows = (int)(n - n0 < Q8_ROWS ? n - n0 : Q8_ROWS);
            int64_t r = 0;
            for (; r + TILE <= m; r += TILE) {
                q8_block(k, x + r * x_stride, x + (r + 1) * x_stride, qweight + n0 * w_stride, w_stride, scale + n0,
                         rows, y + r * y_stride + n0, y + (r + 1) * y_stride + n0);
            }
            if (r < m)
                q8_block(k, x + r * x_stride, NULL, qweight + n0 * w_stride, w_stride, scale + n0, rows,
                         y + r * y_stride + n0, NULL);
        }
    }
    free(xh);
    return rc;
}

/* ---- GGUF K-quant blocks (Q4_K, Q6_K) held as the file holds them ---------------------------------
 *
 * W's rows are the file's 256-weight super-blocks, row after row, in row segments of one GGML type
 * each (a fused matrix may join Q4_K and Q6_K parts): segs[2 s] is segment s's type (12: Q4_K,
 * 14: Q6_K), segs[2 s + 1] its row count. The block layouts (GGML's, little-endian):
 *   Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-scales sc[8] and minimums mn[8],
 *     128 bytes of nibbles. Weight i of sub-block j (32 each) is d * sc[j] * q - dmin * mn[j]; the
 *     nibbles of sub-blocks 2c and 2c + 1 share bytes 32c .. 32c + 31 (low, high nibble).
 *   Q6_K, 210 bytes: 128 bytes of low nibbles ql, 64 bytes of high 2-bit pairs qh, 16 int8 scales,
 *     fp16 d. Weight 128 h + 32 c + i (h < 2, c < 4, i < 32) is d * sc[(128 h + 32 c + i) / 16] *
 *     (q - 32), q = nibble (c >> 1) of ql[64 h + 32 (c & 1) + i] | ((qh[32 h + i] >> 2c) & 3) << 4.
 * x's rows are rounded to 8-bit integers first (below), so the products are integer ones; each
 * weight row is read once, as stored, and its unpacked bytes meet up to four rows of x (2-5 rows
 * four at a time, the row's bytes staying in L1 between them; from KQ_T_MIN_ROWS rows x's rows go
 * side by side instead, kq_many_rows below).
 */

#define KQ_BLOCK 256
#define KQ_Q4_K 12
#define KQ_Q6_K 14

static int64_t kq_block_bytes(int32_t type) { return type == KQ_Q4_K ? 144 : type == KQ_Q6_K ? 210 : 0; }

static inline float kq_half(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112) << 23) | (man << 13);
    } else {
        const float f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, exact */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void q4k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* One super-block's 256 weights in fp32, each rounded as the gguf package computes it
 * ((d * sc) * q - dmin * mn, no fused multiply-add), so a row lookup is exact. */
__attribute__((optimize("fp-contract=off"))) static void kq_dequant_block(int32_t type, const uint8_t *b, float *out) {
    if (type == KQ_Q4_K) {
        const float d = kq_half(b), dmin = kq_half(b + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(b + 4, sc, mn);
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++) {
            const float d0 = d * (float)sc[2 * c], m0 = dmin * (float)mn[2 * c];
            const float d1 = d * (float)sc[2 * c + 1], m1 = dmin * (float)mn[2 * c + 1];
            for (int i = 0; i < 32; i++) {
                const float lo = d0 * (float)(qs[32 * c + i] & 15), hi = d1 * (float)(qs[32 * c + i] >> 4);
                out[64 * c + i] = lo - m0;
                out[64 * c + 32 + i] = hi - m1;
            }
        }
    } else {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = kq_half(b + 208);
        for (int h = 0; h < 2; h++) {
            for (int c = 0; c < 4; c++) {
                for (int i = 0; i < 32; i++) {
                    const int idx = 128 * h + 32 * c + i;
                    const uint8_t l = ql[64 * h + 32 * (c & 1) + i];
                    const int q = ((c >> 1) ? l >> 4 : l & 15) | (((qh[32 * h + i] >> (2 * c)) & 3) << 4);
                    out[idx] = (d * (float)sc[idx / 16]) * (float)(q - 32);
                }
            }
        }
    }
}

/* Where each row's blocks start: row r lies in the segment s with first[s] <= r < first[s + 1]. */
typedef struct {
    int64_t nsegs, blocks;
    const int32_t *segs;
    const uint8_t *w;
} KQMatrix;

static inline const uint8_t *kq_row(const KQMatrix *mat, int64_t r, int32_t *type) {
    const uint8_t *p = mat->w;
    int64_t first = 0;
    for (int64_t s = 0; s < mat->nsegs; s++) {
        const int32_t t = mat->segs[2 * s];
        const int64_t rows = mat->segs[2 * s + 1], row_bytes = mat->blocks * kq_block_bytes(t);
        if (r < first + rows) {
            *type = t;
            return p + (r - first) * row_bytes;
        }
        p += rows * row_bytes;
        first += rows;
    }
    *type = 0;
    return NULL;
}

#if Q_SIMD
/* The Q4_K sub-scales and minimums, 8 bytes each, from the 12 packed bytes, four at a time. */
static inline void q4k_scales_x4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a, b, c, v;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    v = a & 0x3f3f3f3fu;
    memcpy(sc, &v, 4);
    v = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
    memcpy(sc + 4, &v, 4);
    v = b & 0x3f3f3f3fu;
    memcpy(mn, &v, 4);
    v = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
    memcpy(mn + 4, &v, 4);
}

static inline float kq_half_simd(const uint8_t *p) {
#ifdef __F16C__
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
#else
    return kq_half(p);
#endif
}

#endif

/* ---- x rows as 8-bit integers: the K-quant products in integer arithmetic -------------------------
 *
 * Each 256 inputs of an x row become one KQ8Block: q = round(x * 127 / max|x|) in int8, the scale
 * d = max|x| / 127, and the sums of q over each 16 inputs (Q4_K's minimums and Q6_K's offset of 32
 * act on those sums). A super-block's product is then integers all the way down: AVX2's
 * unsigned-by-signed byte multiply (maddubs) takes 32 weights a time where an fp32 product widens 8
 * to floats (which left the one-row kernel compute-bound, well above its memory floor:
 * docs/kernels.md), and only the
 * block's two scales are applied in floating point. The cost is one rounding
 * of x per 256 inputs (a relative error of at most 1/254 of the block's largest |x| per input, the
 * same trade llama.cpp makes for its own K-quant products; docs/kernels.md measures what it does to
 * perplexity). Rounding is nearest-even in both variants (cvtps and lrintf under the default
 * rounding mode), so the AVX2 and plain C paths quantize x to the same integers.
 */

typedef struct {
    int8_t q[KQ_BLOCK];
    int16_t sum16[KQ_BLOCK / 16]; /* q summed over each 16 inputs (Q6_K's groups) */
    int16_t sum32[KQ_BLOCK / 32]; /* and each 32 (Q4_K's sub-blocks) */
    float d;
} KQ8Block;

#define KQ_ROWS 4 /* x rows that share each unpacked weight vector */
/* A few rows of x (a decode step) read each weight row once, a few KiB, and the loads of its
 * nibbles waited on memory (perf: the hottest instructions of kq_dot_q8 were the loads). The row
 * this many rows ahead is prefetched into L2 while a row is multiplied, a share of its lines per
 * super-block: the whole row at its start into L1 stalled in the prefetch loop, on the line-fill
 * buffers, and into L2 (at once or spread over the super-blocks) did better; 1, 2 and 4 rows ahead
 * did alike (docs/kernels.md has the figures). */
#define KQ_PREFETCH_ROWS 2

/* The row to prefetch while this one is multiplied (row NULL: none), in 64-byte lines. */
typedef struct {
    const uint8_t *row;
    int64_t lines;
} KQAhead;

/* Super-block bi of `blocks`: its share of the lines ahead. */
static inline void kq_ahead_block(KQAhead ahead, int64_t bi, int64_t blocks) {
    if (!ahead.row) return;
    for (int64_t l = ahead.lines * bi / blocks; l < ahead.lines * (bi + 1) / blocks; l++)
        __builtin_prefetch(ahead.row + 64 * l, 0, 2);
}

static void kq8_quantize_row(int64_t blocks, const float *x, KQ8Block *out) {
    for (int64_t bi = 0; bi < blocks; bi++) {
        const float *xb = x + bi * KQ_BLOCK;
        KQ8Block *o = out + bi;
        float bad;
        const float amax = abs_max(xb, KQ_BLOCK, &bad);
        const float iscale = amax > 0.0f && bad == 0.0f ? 127.0f / amax : 0.0f;
        o->d = amax / 127.0f + bad;
#if Q_SIMD
        const __m256 is = _mm256_set1_ps(iscale);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int i = 0; i < KQ_BLOCK; i += 32) {
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), is));
            const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), is));
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), is));
            const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), is));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
            _mm256_storeu_si256((__m256i *)(o->q + i), _mm256_permutevar8x32_epi32(bytes, order));
        }
#else
        for (int i = 0; i < KQ_BLOCK; i++) o->q[i] = (int8_t)lrintf(xb[i] * iscale);
#endif
        for (int g = 0; g < KQ_BLOCK / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += o->q[16 * g + i];
            o->sum16[g] = (int16_t)s;
        }
        for (int j = 0; j < KQ_BLOCK / 32; j++) o->sum32[j] = (int16_t)(o->sum16[2 * j] + o->sum16[2 * j + 1]);
    }
}

#if Q_SIMD
static inline float hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One Q4_K row times nr (1..4) quantized x rows: acc[r]. Per super-block and row, the sub-scaled
 * integer sums go to fp32 lanes once (times d * dx) and the minimums, mn[j] * sum32[j] in four
 * int32 lanes, once (times dmin * dx); one horizontal sum per row at the end. */
static inline __attribute__((always_inline)) void q4k_dot_q8(int64_t blocks, const uint8_t *w,
                                                             const KQ8Block *const xr[KQ_ROWS], int nr,
                                                             float acc[KQ_ROWS], KQAhead ahead) {
    const __m256i low = _mm256_set1_epi8(15);
    __m256 ys[KQ_ROWS];
    __m128 ms[KQ_ROWS];
    for (int r = 0; r < KQ_ROWS; r++) {
        ys[r] = _mm256_setzero_ps();
        ms[r] = _mm_setzero_ps();
    }
    for (int64_t bi = 0; bi < blocks; bi++) {
        kq_ahead_block(ahead, bi, blocks);
        const uint8_t *b = w + bi * 144, *qs = b + 16;
        const float d = kq_half_simd(b), dmin = kq_half_simd(b + 2);
        uint8_t sc[8], mn[8];
        q4k_scales_x4(b + 4, sc, mn);
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
        /* the 8 sub-scales as 16-bit words, in both 128-bit halves; per c, one shuffle each spreads
         * sc[2c] and sc[2c + 1] over all 16 words */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        __m256i s[KQ_ROWS];
        for (int r = 0; r < KQ_ROWS; r++) s[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i s_lo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((int16_t)(0x0100 + 0x0404 * c)));
            const __m256i s_hi = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((int16_t)(0x0302 + 0x0404 * c)));
            for (int r = 0; r < nr; r++) {
                const int8_t *xq = xr[r][bi].q + 64 * c;
                const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq));
                const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32)));
                s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo), _mm256_madd_epi16(p_hi, s_hi)));
            }
        }
        for (int r = 0; r < nr; r++) {
            const KQ8Block *xb = xr[r] + bi;
            ys[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(s[r]), ys[r]);
            const __m128i mins = _mm_madd_epi16(mn16, _mm_loadu_si128((const __m128i *)xb->sum32));
            ms[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * xb->d), _mm_cvtepi32_ps(mins), ms[r]);
        }
    }
    for (int r = 0; r < nr; r++) acc[r] = hsum(ys[r]) - hsum128(ms[r]);
}

/* Q6_K super-block b's 128 weights of half h as bytes 0..63 in input order: q[c] holds inputs
 * 128h + 32c .. 128h + 32c + 31 (low 4 bits from ql, high 2 from qh). */
static inline void q6k_half(const uint8_t *b, int h, __m256i q[4]) {
    const __m256i low = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3);
    const __m256i A = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
    const __m256i B = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
    const __m256i H = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_slli_epi16(_mm256_and_si256(H, pair), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(B, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), pair), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), pair), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), pair), 4));
}

/* One Q6_K row times nr (1..4) quantized x rows: acc[r]. The 6-bit weights go in unsigned (0..63,
 * so the byte products cannot saturate) and the offset of 32 comes off in the integers, through
 * the group sums of x. */
static inline __attribute__((always_inline)) void q6k_dot_q8(int64_t blocks, const uint8_t *w,
                                                             const KQ8Block *const xr[KQ_ROWS], int nr,
                                                             float acc[KQ_ROWS], KQAhead ahead) {
    __m256 ys[KQ_ROWS];
    for (int r = 0; r < KQ_ROWS; r++) ys[r] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < blocks; bi++) {
        kq_ahead_block(ahead, bi, blocks);
        const uint8_t *b = w + bi * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = kq_half_simd(b + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i s[KQ_ROWS];
        for (int r = 0; r < nr; r++)
            s[r] = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)xr[r][bi].sum16)), 5);
        for (int r = 0; r < nr; r++) s[r] = _mm256_sub_epi32(_mm256_setzero_si256(), s[r]);
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6k_half(b, h, q);
            for (int c = 0; c < 4; c++) {
                const int g = 8 * h + 2 * c; /* bytes 0..15 are group g, 16..31 group g + 1 */
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                for (int r = 0; r < nr; r++) {
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr[r][bi].q + 128 * h + 32 * c));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], xq), scv));
                }
            }
        }
        for (int r = 0; r < nr; r++) ys[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xr[r][bi].d), _mm256_cvtepi32_ps(s[r]), ys[r]);
    }
    for (int r = 0; r < nr; r++) acc[r] = hsum(ys[r]);
}
#else
/* Q4_K's minimums: sum over its 8 sub-blocks of mn[j] * (sum of q over sub-block j). */
static inline int32_t q4k_min_dot(const uint8_t mn[8], const KQ8Block *x) {
    int32_t s = 0;
    for (int j = 0; j < 8; j++) s += (int32_t)mn[j] * x->sum32[j];
    return s;
}

/* Q6_K's offset: sum over its 16 groups of sc[g] * (sum of q over group g). */
static inline int32_t q6k_offset_dot(const int8_t sc[16], const KQ8Block *x) {
    int32_t s = 0;
    for (int g = 0; g < 16; g++) s += (int32_t)sc[g] * x->sum16[g];
    return s;
}

/* One super-block's contribution in floating point, from its exact integer sums. */
static inline float kq8_combine(float acc, float d, float dm, float dx, int32_t isum, int32_t imin) {
    return acc + ((d * dx) * (float)isum - (dm * dx) * (float)imin);
}

/* The plain C products: the same integers (the floating-point sums in another order). */
static inline __attribute__((always_inline)) void q4k_dot_q8(int64_t blocks, const uint8_t *w, const KQ8Block *const xr[KQ_ROWS], int nr, float acc[KQ_ROWS], KQAhead ahead) {
    for (int64_t bi = 0; bi < blocks; bi++) {
        kq_ahead_block(ahead, bi, blocks);
        const uint8_t *b = w + bi * 144, *qs = b + 16;
        const float d = kq_half(b), dmin = kq_half(b + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(b + 4, sc, mn);
        for (int r = 0; r < nr; r++) {
            const int8_t *xq = xr[r][bi].q;
            int32_t s = 0;
            for (int c = 0; c < 4; c++) {
                int32_t lo = 0, hi = 0;
                for (int i = 0; i < 32; i++) {
                    lo += (qs[32 * c + i] & 15) * xq[64 * c + i];
                    hi += (qs[32 * c + i] >> 4) * xq[64 * c + 32 + i];
                }
                s += sc[2 * c] * lo + sc[2 * c + 1] * hi;
            }
            acc[r] = kq8_combine(acc[r], d, dmin, xr[r][bi].d, s, q4k_min_dot(mn, xr[r] + bi));
        }
    }
}

static inline __attribute__((always_inline)) void q6k_dot_q8(int64_t blocks, const uint8_t *w, const KQ8Block *const xr[KQ_ROWS], int nr, float acc[KQ_ROWS], KQAhead ahead) {
    for (int64_t bi = 0; bi < blocks; bi++) {
        kq_ahead_block(ahead, bi, blocks);
        const uint8_t *b = w + bi * 210, *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = kq_half(b + 208);
        for (int r = 0; r < nr; r++) {
            const int8_t *xq = xr[r][bi].q;
            int32_t s = 0;
            for (int g = 0; g < 16; g++) {
                int32_t t = 0;
                for (int i = 16 * g; i < 16 * g + 16; i++) {
                    const int h = i / 128, c = (i % 128) / 32, j = i % 32;
                    const uint8_t l = ql[64 * h + 32 * (c & 1) + j];
                    const int q = ((c >> 1) ? l >> 4 : l & 15) | (((qh[32 * h + j] >> (2 * c)) & 3) << 4);
                    t += q * xq[i];
                }
                s += sc[g] * t;
            }
            acc[r] = kq8_combine(acc[r], d, 0.0f, xr[r][bi].d, s - 32 * q6k_offset_dot(sc, xr[r] + bi), 0);
        }
    }
}
#endif

/* The row count as a constant in each call, so the compiler keeps each row's sums in registers. */
static void kq_dot_q8(int32_t type, int64_t blocks, const uint8_t *w, const KQ8Block *const xr[KQ_ROWS], int nr,
                      float acc[KQ_ROWS], KQAhead ahead) {
#define KQ_DOT(N) \
    (type == KQ_Q4_K ? q4k_dot_q8(blocks, w, xr, N, acc, ahead) : q6k_dot_q8(blocks, w, xr, N, acc, ahead))
    switch (nr) {
    case 1: KQ_DOT(1); break;
    case 2: KQ_DOT(2); break;
    case 3: KQ_DOT(3); break;
    default: KQ_DOT(KQ_ROWS); break;
    }
#undef KQ_DOT
}

#if Q_SIMD
/* ---- K-quant at many rows: x rows side by side, each weight broadcast -----------------------------
 *
 * From KQ_T_MIN_ROWS rows of x the product runs the other way round: x's quantized rows are laid
 * eight side by side (KQ8T: 4 bytes of each of 8 rows per 256-bit vector, lane r = row r), and
 * each 4 unpacked weight bytes are broadcast to all lanes. One maddubs then makes 32 products for
 * 8 rows of x at once and needs no horizontal sum. Its 16-bit pair sums stay in 16 bits for a
 * whole sub-block before one madd applies the sub-block's scale (Q4_K: 8 broadcasts of 4 weights
 * of 0..15 times 127 is at most 30,480; Q6_K's 0..63 allow 2), so a product costs about one
 * maddubs and one 16-bit add per 32 multiply-adds where the row-by-row kernel above spends a
 * maddubs, a madd and an add. Each thread unpacks KQ_T_ROWS weight rows at a time into bytes (its
 * L1 scratch) and runs them against every 8-row group of x; the integers are the same as the
 * row-by-row kernel's, only the floating-point sums differ in order.
 */
#define KQ_T_ROWS 4      /* weight rows unpacked together, each broadcast against the same x vector */
#define KQ_T_MIN_ROWS 6  /* from this many rows of x (at 4 the 4-row kernel above is faster) */

typedef struct {
    int32_t q[KQ_BLOCK / 4][8]; /* 4 quantized inputs of each of 8 rows */
    int32_t s16[8][8];          /* sum16 pairs (2p, 2p + 1) of each row, as two int16 */
    int32_t s32[4][8];          /* sum32 pairs */
    float d[8];                 /* each row's scale (0 for a row past m) */
} KQ8T;

typedef struct {
    float d, dm;       /* the block's scale d; Q4_K's dmin */
    int16_t sc[16];    /* Q4_K: 8 sub-block scales; Q6_K: 16 group scales */
    int16_t mn[8];     /* Q4_K: 8 sub-block minimums */
} KQMeta;

/* One super-block row of x groups g (8 rows from r0) as KQ8T; rows past m are zeros. */
static void kq8_transpose(int64_t m, int64_t blocks, const KQ8Block *xq, int64_t r0, int64_t bi, KQ8T *out) {
    for (int r = 0; r < 8; r++) {
        if (r0 + r < m) {
            const KQ8Block *b = xq + (r0 + r) * blocks + bi;
            for (int u = 0; u < KQ_BLOCK / 4; u++) memcpy(&out->q[u][r], b->q + 4 * u, 4);
            for (int p = 0; p < 8; p++) memcpy(&out->s16[p][r], b->sum16 + 2 * p, 4);
            for (int p = 0; p < 4; p++) memcpy(&out->s32[p][r], b->sum32 + 2 * p, 4);
            out->d[r] = b->d;
        } else {
            for (int u = 0; u < KQ_BLOCK / 4; u++) out->q[u][r] = 0;
            for (int p = 0; p < 8; p++) out->s16[p][r] = 0;
            for (int p = 0; p < 4; p++) out->s32[p][r] = 0;
            out->d[r] = 0.0f;
        }
    }
}

/* One weight row's super-blocks as bytes in input order (wq, 256 per block) and their scales. */
static void kq_unpack_row(int32_t type, int64_t blocks, const uint8_t *row, uint8_t *wq, KQMeta *meta) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t bi = 0; bi < blocks; bi++) {
        uint8_t *o = wq + bi * KQ_BLOCK;
        KQMeta *mt = meta + bi;
        if (type == KQ_Q4_K) {
            const uint8_t *b = row + bi * 144, *qs = b + 16;
            uint8_t sc[8], mn[8];
            mt->d = kq_half_simd(b);
            mt->dm = kq_half_simd(b + 2);
            q4k_scales_x4(b + 4, sc, mn);
            for (int j = 0; j < 8; j++) {
                mt->sc[j] = sc[j];
                mt->mn[j] = mn[j];
            }
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                _mm256_store_si256((__m256i *)(o + 64 * c), _mm256_and_si256(v, low));
                _mm256_store_si256((__m256i *)(o + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
        } else {
            const uint8_t *b = row + bi * 210;
            const int8_t *sc = (const int8_t *)(b + 192);
            mt->d = kq_half_simd(b + 208);
            mt->dm = 0.0f;
            for (int g = 0; g < 16; g++) mt->sc[g] = sc[g];
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                q6k_half(b, h, q);
                for (int c = 0; c < 4; c++) _mm256_store_si256((__m256i *)(o + 128 * h + 32 * c), q[c]);
            }
        }
    }
}

static inline __m256i kq_bcast4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Per lane r: sum over p < pairs of coef[2p] * x_r[2p] + coef[2p + 1] * x_r[2p + 1], xs[p] holding
 * each row's pair of 16-bit sums (Q4_K's minimums against sum32, Q6_K's scales against sum16). */
static inline __m256i kq_pair_dot(const int16_t *coef, const int32_t (*xs)[8], int pairs) {
    __m256i s = _mm256_setzero_si256();
    for (int p = 0; p < pairs; p++) {
        int32_t c;
        memcpy(&c, coef + 2 * p, 4);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_set1_epi32(c), _mm256_load_si256((const __m256i *)xs[p])));
    }
    return s;
}

/* KQ_T_ROWS unpacked weight rows of one type times one KQ8T group of x: out[w][r]. */
static inline __attribute__((always_inline)) void kq_tile(int32_t type, int64_t blocks, const uint8_t *wq,
                                                          const KQMeta *meta, const KQ8T *xt, __m256 ys[KQ_T_ROWS]) {
    for (int w = 0; w < KQ_T_ROWS; w++) ys[w] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < blocks; bi++) {
        const KQ8T *xb = xt + bi;
        __m256i acc[KQ_T_ROWS], off[KQ_T_ROWS];
        for (int w = 0; w < KQ_T_ROWS; w++) acc[w] = _mm256_setzero_si256();
        if (type == KQ_Q4_K) {
            for (int s = 0; s < 8; s++) {
                __m256i a16[KQ_T_ROWS];
                for (int w = 0; w < KQ_T_ROWS; w++) a16[w] = _mm256_setzero_si256();
                for (int u = 0; u < 8; u++) {
                    const __m256i xv = _mm256_load_si256((const __m256i *)xb->q[8 * s + u]);
                    for (int w = 0; w < KQ_T_ROWS; w++) {
                        const __m256i wv = kq_bcast4(wq + (w * blocks + bi) * KQ_BLOCK + 32 * s + 4 * u);
                        a16[w] = _mm256_add_epi16(a16[w], _mm256_maddubs_epi16(wv, xv));
                        /* the sums in this order: GCC otherwise regroups the 8 adds into a tree whose
                         * 32 partial products spill to the stack, which is slower (docs/kernels.md) */
                        __asm__("" : "+x"(a16[w]));
                    }
                }
                for (int w = 0; w < KQ_T_ROWS; w++)
                    acc[w] = _mm256_add_epi32(acc[w], _mm256_madd_epi16(a16[w], _mm256_set1_epi16(meta[w * blocks + bi].sc[s])));
            }
            for (int w = 0; w < KQ_T_ROWS; w++) off[w] = kq_pair_dot(meta[w * blocks + bi].mn, xb->s32, 4);
        } else {
            for (int h = 0; h < 32; h++) { /* 8 inputs (2 broadcasts) per half group */
                __m256i a16[KQ_T_ROWS];
                const __m256i x0 = _mm256_load_si256((const __m256i *)xb->q[2 * h]);
                const __m256i x1 = _mm256_load_si256((const __m256i *)xb->q[2 * h + 1]);
                for (int w = 0; w < KQ_T_ROWS; w++) {
                    const uint8_t *p = wq + (w * blocks + bi) * KQ_BLOCK + 8 * h;
                    a16[w] = _mm256_add_epi16(_mm256_maddubs_epi16(kq_bcast4(p), x0), _mm256_maddubs_epi16(kq_bcast4(p + 4), x1));
                    acc[w] = _mm256_add_epi32(acc[w], _mm256_madd_epi16(a16[w], _mm256_set1_epi16(meta[w * blocks + bi].sc[h / 2])));
                }
            }
            for (int w = 0; w < KQ_T_ROWS; w++) {
                off[w] = kq_pair_dot(meta[w * blocks + bi].sc, xb->s16, 8);
                acc[w] = _mm256_sub_epi32(acc[w], _mm256_slli_epi32(off[w], 5));
            }
        }
        const __m256 xd = _mm256_load_ps(xb->d);
        for (int w = 0; w < KQ_T_ROWS; w++) {
            const KQMeta *mt = meta + w * blocks + bi;
            ys[w] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(mt->d), xd), _mm256_cvtepi32_ps(acc[w]), ys[w]);
            if (type == KQ_Q4_K)
                ys[w] = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_set1_ps(mt->dm), xd), _mm256_cvtepi32_ps(off[w]), ys[w]);
        }
    }
}

/* The many-rows product: x quantized (xq, m rows of blocks), then laid 8 rows side by side; the
 * weight rows go to the threads KQ_T_ROWS at a time, never a tile across two segments (a short
 * tile repeats its last row and stores only its own). -1 when out of memory. */
static int kq_many_rows(int64_t m, int64_t n, const KQMatrix *mat, const KQ8Block *xq, float *y, int64_t y_stride,
                        int num_threads) {
    const int64_t blocks = mat->blocks, groups = (m + 7) / 8;
    const int nt = num_threads > 0 ? num_threads : 1;
    /* tiles: per segment, ceil(rows / KQ_T_ROWS) */
    int64_t tiles = 0;
    for (int64_t s = 0; s < mat->nsegs; s++) tiles += (mat->segs[2 * s + 1] + KQ_T_ROWS - 1) / KQ_T_ROWS;
    KQ8T *xt = aligned_alloc(32, (size_t)(groups * blocks > 0 ? groups * blocks : 1) * sizeof(KQ8T));
    const int64_t wbytes = KQ_T_ROWS * blocks * KQ_BLOCK, per_thread = wbytes + KQ_T_ROWS * blocks * (int64_t)sizeof(KQMeta);
    float *scratch = scratch_per_thread(nt, (per_thread + 3) / 4);
    if (!xt || !scratch) {
        free(xt);
        free(scratch);
        return -1;
    }
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < groups * blocks; i++) kq8_transpose(m, blocks, xq, (i / blocks) * 8, i % blocks, xt + i);
        uint8_t *wq = (uint8_t *)thread_scratch(scratch, (per_thread + 3) / 4);
        KQMeta *meta = (KQMeta *)(wq + wbytes);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            /* the tile's segment, first row and row count */
            int64_t seg = 0, first = 0, tt = t, j0 = 0;
            for (; seg < mat->nsegs; seg++) {
                const int64_t rows = mat->segs[2 * seg + 1], st = (rows + KQ_T_ROWS - 1) / KQ_T_ROWS;
                if (tt < st) {
                    j0 = first + tt * KQ_T_ROWS;
                    break;
                }
                tt -= st;
                first += rows;
            }
            const int64_t seg_end = first + mat->segs[2 * seg + 1];
            const int nr = (int)(seg_end - j0 < KQ_T_ROWS ? seg_end - j0 : KQ_T_ROWS);
            int32_t type = 0;
            for (int w = 0; w < KQ_T_ROWS; w++) {
                const uint8_t *row = kq_row(mat, j0 + (w < nr ? w : nr - 1), &type);
                kq_unpack_row(type, blocks, row, wq + w * blocks * KQ_BLOCK, meta + w * blocks);
            }
            /* the next tile's rows (they start where this tile's end, in this segment or the next)
             * arrive while these meet every row of x */
            for (int w = 0; w < KQ_T_ROWS && j0 + nr + w < n; w++) {
                int32_t next_type = 0;
                const uint8_t *row = kq_row(mat, j0 + nr + w, &next_type);
                for (int64_t i = 0; i < blocks * kq_block_bytes(next_type); i += 64) __builtin_prefetch(row + i, 0, 2);
            }
            for (int64_t g = 0; g < groups; g++) {
                __m256 ys[KQ_T_ROWS];
                if (type == KQ_Q4_K)
                    kq_tile(KQ_Q4_K, blocks, wq, meta, xt + g * blocks, ys);
                else
                    kq_tile(KQ_Q6_K, blocks, wq, meta, xt + g * blocks, ys);
                float out[KQ_T_ROWS][8];
                for (int w = 0; w < KQ_T_ROWS; w++) _mm256_storeu_ps(out[w], ys[w]);
                const int rows = (int)(m - 8 * g < 8 ? m - 8 * g : 8);
                for (int r = 0; r < rows; r++)
                    for (int w = 0; w < nr; w++) y[(8 * g + r) * y_stride + j0 + w] = out[w][r];
            }
        }
    }
    free(xt);
    free(scratch);
    return 0;
}
#endif

/* m rows of x times the K-quant matrix W [n, k] (segs: nsegs (type, rows) pairs summing to n): x's
 * rows quantized to KQ8Blocks once, then each weight row, unpacked once per super-block, meets up to
 * KQ_ROWS of them (or, from KQ_T_MIN_ROWS rows with AVX2, kq_many_rows). */
int pagedkv_kq_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const uint8_t *w,
                      const int32_t *segs, int64_t nsegs, float *y, int64_t y_stride, int num_threads, int arith) {
    const KQMatrix mat = {nsegs, k / KQ_BLOCK, segs, w};
    const int par = m * n * k >= PARALLEL_MIN_MACS;
    KQ8Block *xq = malloc((size_t)(m * mat.blocks > 0 ? m * mat.blocks : 1) * sizeof(KQ8Block));
    if (!xq) return -1;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (par && m > 1)
    for (int64_t r = 0; r < m; r++) kq8_quantize_row(mat.blocks, x + r * x_stride, xq + r * mat.blocks);
#if Q_SIMD
    if (arith == QUANT_ARITH_PANELS || (arith == QUANT_ARITH_AUTO && m >= KQ_T_MIN_ROWS)) {
        const int status = kq_many_rows(m, n, &mat, xq, y, y_stride, num_threads);
        free(xq);
        return status;
    }
#else
    (void)arith;
#endif
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (par)
    for (int64_t j = 0; j < n; j++) {
        int32_t type, ahead_type = 0;
        const uint8_t *row = kq_row(&mat, j, &type);
        /* the row KQ_PREFETCH_ROWS ahead, for the first pass over x's rows only */
        KQAhead ahead = {NULL, 0};
        if (j + KQ_PREFETCH_ROWS < n) {
            ahead.row = kq_row(&mat, j + KQ_PREFETCH_ROWS, &ahead_type);
            ahead.lines = (mat.blocks * kq_block_bytes(ahead_type) + 63) / 64;
        }
        for (int64_t r0 = 0; r0 < m; r0 += KQ_ROWS) {
            const int nr = (int)(m - r0 < KQ_ROWS ? m - r0 : KQ_ROWS);
            const KQ8Block *xr[KQ_ROWS];
            float acc[KQ_ROWS] = {0};
            for (int r = 0; r < KQ_ROWS; r++) xr[r] = xq + (r0 + (r < nr ? r : 0)) * mat.blocks;
            kq_dot_q8(type, mat.blocks, row, xr, nr, acc, ahead);
            ahead.row = NULL;
            for (int r = 0; r < nr; r++) y[(r0 + r) * y_stride + j] = acc[r];
        }
    }
    free(xq);
    return 0;
}

/* out[i, :] = row ids[i] of W in fp32, as the gguf package dequantizes it (an embedding lookup). */
void pagedkv_kq_rows(int64_t count, const int64_t *ids, int64_t k, const uint8_t *w, const int32_t *segs, int64_t nsegs,
                     float *out, int64_t out_stride) {
    const KQMatrix mat = {nsegs, k / KQ_BLOCK, segs, w};
    for (int64_t i = 0; i < count; i++) {
        int32_t type;
        const uint8_t *row = kq_row(&mat, ids[i], &type);
        const int64_t bb = kq_block_bytes(type);
        for (int64_t bi = 0; bi < mat.blocks; bi++) kq_dequant_block(type, row + bi * bb, out + i * out_stride + bi * KQ_BLOCK);
    }
}
