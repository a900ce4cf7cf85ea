/* y = x @ W^T for fp32 rows x on CPU, with W held as integers: int4 groups, int8 rows, or GGUF's
 * Q4_K / Q6_K super-blocks as the file holds them (kernels/quant_linear.py owns the formats;
 * kernels/cpu_quant_linear.py calls these; the K-quant part is at the end of this file).
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
 * One x row (decode): each sub-block's integers are multiplied into fp32 accumulators and its scale
 * applied once (Q4_K's minimums through x's per-32 sums), so the bytes are read once, as stored.
 * Four or more rows (prefill): a panel of 16 output rows is dequantized once into fp32 (per thread,
 * 16 x k floats, row by row) and the rows of x go through it in register tiles of 4 x rows by 2
 * weight rows.
 */

#define KQ_BLOCK 256
#define KQ_Q4_K 12
#define KQ_Q6_K 14
#define KQ_PANEL 16
#define KQ_TILE 4

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
static inline __m256 kq_widen(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

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

/* One Q4_K row times one x row; xs holds x's per-32 sums. */
static float q4k_dot(int64_t blocks, const uint8_t *w, const float *x, const float *xs) {
    __m256 y0 = _mm256_setzero_ps(), y1 = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(15);
    float dsc[8] __attribute__((aligned(32)));
    for (int64_t bi = 0; bi < blocks; bi++) {
        const uint8_t *b = w + bi * 144, *qs = b + 16;
        const float *xb = x + bi * KQ_BLOCK;
        uint8_t sc[8], mn[8];
        q4k_scales_x4(b + 4, sc, mn);
        _mm256_store_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(kq_half_simd(b)), kq_widen(sc)));
        mins = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kq_half_simd(b + 2)), kq_widen(mn)),
                               _mm256_loadu_ps(xs + bi * 8), mins);
        for (int c = 0; c < 4; c++) {
            __m256 a = _mm256_setzero_ps(), h = _mm256_setzero_ps();
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 32 * c + 8 * t)));
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), _mm256_loadu_ps(xb + 64 * c + 8 * t), a);
                h = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), _mm256_loadu_ps(xb + 64 * c + 32 + 8 * t), h);
            }
            y0 = _mm256_fmadd_ps(_mm256_broadcast_ss(dsc + 2 * c), a, y0);
            y1 = _mm256_fmadd_ps(_mm256_broadcast_ss(dsc + 2 * c + 1), h, y1);
        }
    }
    return hsum(_mm256_add_ps(y0, y1)) - hsum(mins);
}

/* One Q6_K row times one x row. */
static float q6k_dot(int64_t blocks, const uint8_t *w, const float *x) {
    __m256 y0 = _mm256_setzero_ps(), y1 = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(15), top = _mm256_set1_epi32(0x30), bias = _mm256_set1_epi32(32);
    for (int64_t bi = 0; bi < blocks; bi++) {
        const uint8_t *b = w + bi * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = kq_half_simd(b + 208);
        const float *xb = x + bi * KQ_BLOCK;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            const float *xh = xb + 128 * h;
            for (int i0 = 0; i0 < 32; i0 += 16) {
                __m256 acc[4];
                for (int c = 0; c < 4; c++) acc[c] = _mm256_setzero_ps();
                for (int i = i0; i < i0 + 16; i += 8) {
                    const __m256i A = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + i)));
                    const __m256i B = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 32 + i)));
                    const __m256i H = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + i)));
                    __m256i q[4];
                    q[0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_and_si256(_mm256_slli_epi32(H, 4), top));
                    q[1] = _mm256_or_si256(_mm256_and_si256(B, low), _mm256_and_si256(_mm256_slli_epi32(H, 2), top));
                    q[2] = _mm256_or_si256(_mm256_srli_epi32(A, 4), _mm256_and_si256(H, top));
                    q[3] = _mm256_or_si256(_mm256_srli_epi32(B, 4), _mm256_and_si256(_mm256_srli_epi32(H, 2), top));
                    for (int c = 0; c < 4; c++)
                        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[c], bias)), _mm256_loadu_ps(xh + 32 * c + i),
                                                 acc[c]);
                }
                for (int c = 0; c < 4; c++) {
                    const __m256 s = _mm256_set1_ps(d * (float)sc[8 * h + 2 * c + i0 / 16]);
                    if (c & 1)
                        y1 = _mm256_fmadd_ps(s, acc[c], y1);
                    else
                        y0 = _mm256_fmadd_ps(s, acc[c], y0);
                }
            }
        }
    }
    return hsum(_mm256_add_ps(y0, y1));
}

/* One row's super-blocks dequantized into out[k] (fused multiply-subtract: within an fp32 rounding
 * of kq_dequant_block's values), for the panel path. */
static void kq_dequant_row(int32_t type, int64_t blocks, const uint8_t *w, float *out) {
    const __m256i low = _mm256_set1_epi32(15), top = _mm256_set1_epi32(0x30), bias = _mm256_set1_epi32(32);
    float dsc[8] __attribute__((aligned(32))), dmn[8] __attribute__((aligned(32)));
    for (int64_t bi = 0; bi < blocks; bi++) {
        float *o = out + bi * KQ_BLOCK;
        if (type == KQ_Q4_K) {
            const uint8_t *b = w + bi * 144, *qs = b + 16;
            uint8_t sc[8], mn[8];
            q4k_scales_x4(b + 4, sc, mn);
            _mm256_store_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(kq_half_simd(b)), kq_widen(sc)));
            _mm256_store_ps(dmn, _mm256_mul_ps(_mm256_set1_ps(kq_half_simd(b + 2)), kq_widen(mn)));
            for (int c = 0; c < 4; c++) {
                const __m256 s0 = _mm256_broadcast_ss(dsc + 2 * c), s1 = _mm256_broadcast_ss(dsc + 2 * c + 1);
                const __m256 m0 = _mm256_broadcast_ss(dmn + 2 * c), m1 = _mm256_broadcast_ss(dmn + 2 * c + 1);
                for (int t = 0; t < 4; t++) {
                    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 32 * c + 8 * t)));
                    _mm256_storeu_ps(o + 64 * c + 8 * t, _mm256_fmsub_ps(s0, _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), m0));
                    _mm256_storeu_ps(o + 64 * c + 32 + 8 * t, _mm256_fmsub_ps(s1, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), m1));
                }
            }
        } else {
            const uint8_t *b = w + bi * 210;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = kq_half_simd(b + 208);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                for (int i = 0; i < 32; i += 8) {
                    const __m256i A = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + i)));
                    const __m256i B = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 32 + i)));
                    const __m256i H = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + i)));
                    __m256i q[4];
                    q[0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_and_si256(_mm256_slli_epi32(H, 4), top));
                    q[1] = _mm256_or_si256(_mm256_and_si256(B, low), _mm256_and_si256(_mm256_slli_epi32(H, 2), top));
                    q[2] = _mm256_or_si256(_mm256_srli_epi32(A, 4), _mm256_and_si256(H, top));
                    q[3] = _mm256_or_si256(_mm256_srli_epi32(B, 4), _mm256_and_si256(_mm256_srli_epi32(H, 2), top));
                    for (int c = 0; c < 4; c++) {
                        const int idx = 128 * h + 32 * c + i;
                        const __m256 s = _mm256_set1_ps(d * (float)sc[idx / 16]);
                        _mm256_storeu_ps(o + idx, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[c], bias))));
                    }
                }
            }
        }
    }
}

/* Rows xr[0..4) of x times two dequantized weight rows w0, w1 (k floats each): out[i][j]. */
static void kq_tile(int64_t k, const float *const xr[KQ_TILE], const float *w0, const float *w1, float out[KQ_TILE][2]) {
    __m256 a[KQ_TILE][2];
    for (int i = 0; i < KQ_TILE; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + kk), v1 = _mm256_loadu_ps(w1 + kk);
        for (int i = 0; i < KQ_TILE; i++) {
            const __m256 xv = _mm256_loadu_ps(xr[i] + kk);
            a[i][0] = _mm256_fmadd_ps(v0, xv, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(v1, xv, a[i][1]);
        }
    }
    for (int i = 0; i < KQ_TILE; i++) {
        out[i][0] = hsum(a[i][0]);
        out[i][1] = hsum(a[i][1]);
    }
}
#else
static void kq_dequant_row(int32_t type, int64_t blocks, const uint8_t *w, float *out) {
    const int64_t bb = kq_block_bytes(type);
    for (int64_t bi = 0; bi < blocks; bi++) kq_dequant_block(type, w + bi * bb, out + bi * KQ_BLOCK);
}

static void kq_tile(int64_t k, const float *const xr[KQ_TILE], const float *w0, const float *w1, float out[KQ_TILE][2]) {
    for (int i = 0; i < KQ_TILE; i++) {
        float s0 = 0.0f, s1 = 0.0f;
        for (int64_t kk = 0; kk < k; kk++) {
            s0 += w0[kk] * xr[i][kk];
            s1 += w1[kk] * xr[i][kk];
        }
        out[i][0] = s0;
        out[i][1] = s1;
    }
}
#endif

#if !Q_SIMD
/* One output row times one x row, the super-blocks dequantized one at a time (the plain C path). */
static float kq_dot_plain(int32_t type, int64_t blocks, const uint8_t *w, const float *x) {
    float tmp[KQ_BLOCK], acc = 0.0f;
    const int64_t bb = kq_block_bytes(type);
    for (int64_t bi = 0; bi < blocks; bi++) {
        kq_dequant_block(type, w + bi * bb, tmp);
        float s = 0.0f;
        for (int i = 0; i < KQ_BLOCK; i++) s += tmp[i] * x[bi * KQ_BLOCK + i];
        acc += s;
    }
    return acc;
}
#endif

static float kq_dot(int32_t type, int64_t blocks, const uint8_t *w, const float *x, const float *xs) {
#if Q_SIMD
    if (type == KQ_Q4_K) return q4k_dot(blocks, w, x, xs);
    return q6k_dot(blocks, w, x);
#else
    (void)xs;
    return kq_dot_plain(type, blocks, w, x);
#endif
}

/* m rows of x times the K-quant matrix W [n, k] (segs: nsegs (type, rows) pairs summing to n). */
int pagedkv_kq_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const uint8_t *w,
                      const int32_t *segs, int64_t nsegs, float *y, int64_t y_stride, int num_threads) {
    const KQMatrix mat = {nsegs, k / KQ_BLOCK, segs, w};
    const int par = m * n * k >= PARALLEL_MIN_MACS;
    if (m < KQ_TILE) {
        const int64_t groups = k / Q4_GROUP;
        float *xs = malloc((size_t)(m * groups > 0 ? m * groups : 1) * sizeof(float));
        if (!xs) return -1;
        group_sums(m, groups, x, x_stride, xs);
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (par)
        for (int64_t j = 0; j < n; j++) {
            int32_t type;
            const uint8_t *row = kq_row(&mat, j, &type);
            for (int64_t r = 0; r < m; r++) y[r * y_stride + j] = kq_dot(type, mat.blocks, row, x + r * x_stride, xs + r * groups);
        }
        free(xs);
        return 0;
    }
    const int64_t panels = (n + KQ_PANEL - 1) / KQ_PANEL;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (par)
    {
        float *panel = aligned_alloc(32, (size_t)k * KQ_PANEL * sizeof(float));
        if (!panel) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!panel) continue;
            const int cols = (int)(n - p * KQ_PANEL < KQ_PANEL ? n - p * KQ_PANEL : KQ_PANEL);
            for (int j = 0; j < cols; j++) {
                int32_t type;
                const uint8_t *row = kq_row(&mat, p * KQ_PANEL + j, &type);
                kq_dequant_row(type, mat.blocks, row, panel + (int64_t)j * k);
            }
            for (int64_t r = 0; r < m; r += KQ_TILE) {
                const float *xr[KQ_TILE];
                for (int i = 0; i < KQ_TILE; i++) xr[i] = x + (r + i < m ? r + i : m - 1) * x_stride;
                for (int j = 0; j < cols; j += 2) {
                    float out[KQ_TILE][2];
                    const float *w0 = panel + (int64_t)j * k, *w1 = j + 1 < cols ? w0 + k : w0;
                    kq_tile(k, xr, w0, w1, out);
                    for (int i = 0; i < KQ_TILE && r + i < m; i++) {
                        float *yr = y + (r + i) * y_stride + p * KQ_PANEL + j;
                        yr[0] = out[i][0];
                        if (j + 1 < cols) yr[1] = out[i][1];
                    }
                }
            }
        }
        free(panel);
    }
    return failed ? -1 : 0;
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
