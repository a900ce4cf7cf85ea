/* y = x @ W^T for fp32 rows x on CPU, with W held as integers: int4 groups or int8 rows
 * (kernels/quant_linear.py owns both formats; kernels/cpu_quant_linear.py calls these).
 *
 * Why: a decode step multiplies a few rows by every weight matrix, so its time is the weight bytes
 * over the memory bandwidth. PyTorch's weight-packed int4 / int8 matmuls read their bytes at about
 * 0.5 GB/s at one row on the AVX2 development host (their vectorised paths are written for
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
 *   bytes staying in L1 between tiles, so many rows (a prefill) cost little more than their
 *   multiply-adds (a dequantize-to-fp32-panel kernel for many rows measured slower and was dropped).
 * int8 (W = q * s, one fp32 scale per output row), row-major [n][k] (the embedding's rows are
 *   looked up in the same matrix): 4 output rows at a time share each 8-float load of x; one
 *   horizontal sum per row at the end, times its scale.
 *
 * AVX2 + FMA where the variant is compiled with them (setup.py's avx2 and avx512 builds); otherwise
 * plain C loops with the same arithmetic (pagedkv_quant_linear_simd() says which). Threads:
 * OpenMP over panels (int4) or 4-row blocks (int8), static, so each thread streams one contiguous
 * range. Arguments are checked by the Python wrapper before any pointer is used.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
#define TILE 2                       /* x rows per register tile */
#define PARALLEL_MIN_MACS 65536      /* below this many multiply-adds a parallel region costs more */

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

/* One row: two accumulator pairs (even and odd inputs) so the multiply-adds do not wait on each other. */
static void q4_tile1(int64_t groups, const float *x, const float *xs, const uint8_t *w, const float *sz, float *y,
                     int cols) {
    __m256 y_lo = _mm256_setzero_ps(), y_hi = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
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

/* Two rows share each widened input. */
static void q4_tile2(int64_t groups, const float *x, int64_t x_stride, const float *xs, const uint8_t *w,
                     const float *sz, float *y, int64_t y_stride, int cols) {
    __m256 y0_lo = _mm256_setzero_ps(), y0_hi = _mm256_setzero_ps();
    __m256 y1_lo = _mm256_setzero_ps(), y1_hi = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *c = w + g * Q4_CHUNK;
        const float *x0g = x + g * Q4_GROUP, *x1g = x + x_stride + g * Q4_GROUP;
        __m256 a_lo = _mm256_setzero_ps(), a_hi = _mm256_setzero_ps();
        __m256 b_lo = _mm256_setzero_ps(), b_hi = _mm256_setzero_ps();
        for (int kk = 0; kk < Q4_GROUP; kk++) {
            __m256 w_lo, w_hi;
            q4_widen(c + kk * 8, &w_lo, &w_hi);
            const __m256 x0 = _mm256_broadcast_ss(x0g + kk), x1 = _mm256_broadcast_ss(x1g + kk);
            a_lo = _mm256_fmadd_ps(w_lo, x0, a_lo);
            a_hi = _mm256_fmadd_ps(w_hi, x0, a_hi);
            b_lo = _mm256_fmadd_ps(w_lo, x1, b_lo);
            b_hi = _mm256_fmadd_ps(w_hi, x1, b_hi);
        }
        q4_apply(sz + g * Q4_SCALES, a_lo, a_hi, xs[g], &y0_lo, &y0_hi);
        q4_apply(sz + g * Q4_SCALES, b_lo, b_hi, xs[groups + g], &y1_lo, &y1_hi);
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

/* m rows x the int4 matrix (n outputs of n_pad = 16 * panels, k = 32 * groups inputs). */
int pagedkv_q4_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const uint8_t *qweight,
                             const float *qscale, float *y, int64_t y_stride, int num_threads) {
    const int64_t groups = k / Q4_GROUP, panels = (n + Q4_PANEL - 1) / Q4_PANEL;
    float *xs = malloc((size_t)(m * groups > 0 ? m * groups : 1) * sizeof(float));
    if (!xs) return -1;
    group_sums(m, groups, x, x_stride, xs);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t p = 0; p < panels; p++) {
        const int cols = (int)(n - p * Q4_PANEL < Q4_PANEL ? n - p * Q4_PANEL : Q4_PANEL);
        q4_rows_by_panel(m, groups, x, x_stride, xs, qweight + p * groups * Q4_CHUNK, qscale + p * groups * Q4_SCALES,
                         y + p * Q4_PANEL, y_stride, cols);
    }
    free(xs);
    return 0;
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

int pagedkv_q8_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const int8_t *qweight,
                              int64_t w_stride, const float *scale, float *y, int64_t y_stride, int num_threads) {
    const int64_t blocks = (n + Q8_ROWS - 1) / Q8_ROWS;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * Q8_ROWS;
        const int rows = (int)(n - n0 < Q8_ROWS ? n - n0 : Q8_ROWS);
        int64_t r = 0;
        for (; r + TILE <= m; r += TILE) {
            q8_block(k, x + r * x_stride, x + (r + 1) * x_stride, qweight + n0 * w_stride, w_stride, scale + n0, rows,
                     y + r * y_stride + n0, y + (r + 1) * y_stride + n0);
        }
        if (r < m)
            q8_block(k, x + r * x_stride, NULL, qweight + n0 * w_stride, w_stride, scale + n0, rows, y + r * y_stride + n0,
                     NULL);
    }
    return 0;
}
