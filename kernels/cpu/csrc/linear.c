/* y = x @ W^T (+ bias) for fp32 on CPU, with W packed once at load into column panels.
 *
 * Why: on CPU a decode step multiplies a few dozen rows by every weight matrix of the model, so its
 * GEMMs are bound by reading the weights: the time is the weight bytes over the memory bandwidth.
 * oneDNN's prepacked linear reads a decode step's weights well below the rate a plain sum streams
 * them at; this kernel streams the packed panels at the memory's rate for few rows and stays level
 * with oneDNN for many (bench/dense_bench.py measures both, side by side; docs/kernels.md has the
 * figures).
 *
 * Layout: W [n, k] (out, in) is packed as ceil(n / 32) panels of [k][32] floats, zero padded past
 * row n. A panel is read front to back, one 128-byte line pair per k, so the hardware prefetchers
 * see one sequential stream per thread. For each panel and each tile of up to 8 rows of x (AVX-512:
 * 8 rows x 2 vectors of 16 columns; AVX2: 3 rows x 4 vectors of 8), the vector accumulators take
 * x[r, k] (broadcast) times the vectors of W[k]; a tile's panel comes from DRAM once and from cache
 * for the tile's other rows.
 * Each output is one sequential sum over k (fused multiply-add where the variant has it), so the
 * result differs from a BLAS's only by summation order and rounding. The bias is added last, as
 * torch's addmm does.
 *
 * Threads: (panel, 64-row block) work items split statically over OpenMP threads; consecutive items
 * share a panel, so a thread reuses it from its cache. Called through ctypes (kernels/cpu/linear.py
 * checks the arguments first).
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "linear_panel.h"

#define PANEL LINEAR_PANEL /* columns of W per panel */
#define BLOCK_ROWS 64  /* rows of x per work item */
/* Below this many multiply-adds a parallel region costs more than it saves. */
#define PARALLEL_MIN_MACS 65536

/* The register tile follows the vector registers the variant has. AVX-512: 32 registers of 16 floats,
 * a panel row is 2 vectors and 8 rows of x take 16 accumulators. AVX2 (and the baseline build): 16
 * registers of 8 floats, a panel row is 4 vectors, so 3 rows take 12 accumulators and leave room for
 * the broadcast and a weight vector. The AVX-512 tile compiled for AVX2 keeps every accumulator
 * on the stack and runs many times slower than oneDNN (docs/kernels.md). */
#if defined(__AVX512F__)
#define VW 16
#define TILE_ROWS 8
#else
#define VW 8
#define TILE_ROWS 3
#endif
#define NV (PANEL / VW) /* vectors per panel row */

typedef float vecw __attribute__((vector_size(VW * sizeof(float))));

int64_t pagedkv_linear_packed_numel(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * k * PANEL; }

void pagedkv_linear_pack_f32(int64_t n, int64_t k, const float *w, int64_t w_stride, float *out, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float *restrict o = out + p * k * PANEL;
        for (int64_t kk = 0; kk < k; kk++) {
            for (int j = 0; j < PANEL; j++) {
                const int64_t row = p * PANEL + j;
                o[kk * PANEL + j] = row < n ? w[row * w_stride + kk] : 0.0f;
            }
        }
    }
}

/* rows x[0..ROWS) times one panel into y[0..ROWS)[0..cols). One function per ROWS (the macro below),
 * so each has exactly ROWS x NV accumulators and the compiler keeps them all in registers (with a
 * shared maximum-size array it spilled the smaller tiles' accumulators to the stack:
 * docs/kernels.md). */
#define DEFINE_TILE(ROWS)                                                                                 \
    static void tile_##ROWS(int64_t k, const float *restrict x, int64_t x_stride, const float *restrict panel, \
                            const float *restrict bias, float *restrict y, int64_t y_stride, int cols,         \
                            const char *pf, int64_t pf_lines) {                                              \
        vecw acc[ROWS][NV];                                                                                \
        int64_t pf_due = 0;                                                                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                          \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = (vecw){0};                  \
        }                                                                                                  \
        for (int64_t kk = 0; kk < k; kk++) {                                                               \
            /* pf_lines lines of the next panel spread over the k steps (into L2: a panel outgrows L1) */ \
            for (pf_due += pf_lines; pf_due >= k; pf_due -= k, pf += 64) __builtin_prefetch(pf, 0, 2);   \
            vecw w[NV];                                                                                    \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                        \
                memcpy(&w[v], panel + kk * PANEL + v * VW, sizeof w[v]);                                   \
            }                                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                      \
                const float xv = x[r * x_stride + kk];                                                     \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] += xv * w[v];              \
            }                                                                                              \
        }                                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                          \
            float out[PANEL] __attribute__((aligned(64)));                                                 \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                        \
                memcpy(out + v * VW, &acc[r][v], sizeof acc[r][v]);                                        \
            }                                                                                              \
            if (bias) {                                                                                    \
                for (int j = 0; j < cols; j++) out[j] += bias[j];                                          \
            }                                                                                              \
            memcpy(y + r * y_stride, out, (size_t)cols * sizeof(float));                                   \
        }                                                                                                  \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)

typedef void (*tile_fn)(int64_t, const float *, int64_t, const float *, const float *, float *, int64_t, int,
                        const char *, int64_t);
static const tile_fn TILES[8 + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

/* m rows of x times one panel: tiles of TILE_ROWS rows, then one tile of the rest. `next` (or NULL):
 * the panel this thread takes next, prefetched into L2 a share per tile while the tiles compute. A
 * panel (k x 128 bytes, 72 KiB at k = 576) comes from DRAM in the first tile that reads it, and from
 * cache in the others: without the prefetch the first tile waits on memory and the others leave it
 * idle, where with it the next panel arrives during this one's arithmetic. */
static void rows_by_panel(int64_t m, int64_t k, const float *x, int64_t x_stride, const float *panel,
                          const float *bias, float *y, int64_t y_stride, int cols, const float *next) {
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS, lines = next ? k * PANEL * 4 / 64 : 0;
    for (int64_t r0 = 0, t = 0; r0 < m; r0 += TILE_ROWS, t++) {
        const int64_t rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
        const int64_t l0 = lines * t / tiles, l1 = lines * (t + 1) / tiles;
        TILES[rows](k, x + r0 * x_stride, x_stride, panel, bias, y + r0 * y_stride, y_stride, cols,
                    next ? (const char *)next + l0 * 64 : NULL, l1 - l0);
    }
}

void pagedkv_linear_panel(int64_t m, int64_t k, const float *x, int64_t x_stride, const float *panel,
                          const float *bias, float *y, int64_t y_stride, int cols) {
    rows_by_panel(m, k, x, x_stride, panel, bias, y, y_stride, cols, NULL);
}

void pagedkv_linear_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const float *packed,
                        const float *bias, float *y, int64_t y_stride, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t item = 0; item < panels * blocks; item++) {
        const int64_t p = item / blocks, b = item % blocks;
        const int64_t r0 = b * BLOCK_ROWS, rows = m - r0 < BLOCK_ROWS ? m - r0 : BLOCK_ROWS;
        const int cols = (int)(n - p * PANEL < PANEL ? n - p * PANEL : PANEL);
        /* the next item's panel when it is another one (the last item's "next" is past this
         * thread's range or the matrix: a prefetch never faults, and the pointer is not read) */
        const float *next = b == blocks - 1 && p + 1 < panels ? packed + (p + 1) * k * PANEL : NULL;
        rows_by_panel(rows, k, x + r0 * x_stride, x_stride, packed + p * k * PANEL, bias ? bias + p * PANEL : NULL,
                      y + r0 * y_stride + p * PANEL, y_stride, cols, next);
    }
}
