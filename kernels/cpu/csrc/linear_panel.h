/* linear.c's packed fp32 panel, shared with the integer kernels (quant_linear.c) that dequantize a
 * panel of their weights at a time and multiply many rows by it with linear.c's register tiles.
 *
 * A panel is LINEAR_PANEL output columns of W over all k inputs: panel[kk * LINEAR_PANEL + j] =
 * W[j, kk], columns past the matrix's end zero (or anything finite: they are never stored). */
#ifndef PAGEDKV_LINEAR_PANEL_H
#define PAGEDKV_LINEAR_PANEL_H
#include <stdint.h>

#define LINEAR_PANEL 32

/* y[r][0..cols) = x[r] @ panel (+ bias[0..cols) when bias is not NULL) for rows r < m, one thread. */
void pagedkv_linear_panel(int64_t m, int64_t k, const float *x, int64_t x_stride, const float *panel,
                          const float *bias, float *y, int64_t y_stride, int cols);

#endif
