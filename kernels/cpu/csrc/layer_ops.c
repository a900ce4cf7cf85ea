/* The elementwise parts of a decoder layer on CPU, fused: one pass over the rows instead of one torch
 * operator per step of the formula.
 *
 * Why: a decode step of a deep, narrow model (SmolLM2-135M: 30 layers of hidden 576) runs about 25
 * small torch operators per layer around its four GEMMs (RMSNorm alone is eight: to, pow, mean, add,
 * rsqrt, mul, to, mul), each paying dispatch and an output allocation on a few dozen rows. These
 * three functions do the same arithmetic in one call each:
 *
 * - pagedkv_rms_norm_f32: optionally x += delta (the residual add, in place), then
 *   out = weight * (x * 1/sqrt(mean(x^2) + eps)), Llama's RMSNorm.
 * - pagedkv_silu_mul_f32: out = silu(gate) * up over the fused [gate | up] rows.
 * - pagedkv_gelu_tanh_mul_f32: out = gelu_tanh(gate) * up over the fused [gate | up] rows (Gemma 3's
 *   GeGLU, transformers' gelu_pytorch_tanh).
 * - pagedkv_rope_store_f32: rotate-half rotary embedding of the q and k heads of each fused
 *   [q | k | v] row, q written to its own tensor, k and v written straight into the paged cache slot
 *   (a slot of -1 skips the token), so the rotated k is never materialised. Optionally each q and k
 *   head is RMS-normalised first (Qwen3's and Gemma 3's per-head q/k norm: q_norm / k_norm weights of
 *   head_dim values, the RMSNorm formula above; NULL: no norm).
 *
 * The arithmetic is Hugging Face's, operation for operation, with fused multiply-add contraction
 * off in this file, so the results equal the torch composition (worker_svc/model/layer_ops.py) to
 * the bit for the rotary embedding and within fp32 rounding of a sum's order for the norms; silu and
 * gelu_tanh use fastexp.h's polynomial (relative error below 1e-7). fp32 only: other dtypes keep the
 * torch path.
 * Called through ctypes (kernels/cpu/native.py loads the library); rows are split over OpenMP
 * threads when there are enough of them to pay for a parallel region.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fastexp.h"

/* Below this many elements a parallel region costs more than it saves. */
#define PARALLEL_MIN_ELEMS 65536

static inline float silu(float g) {
    /* g / (1 + exp(-g)); exp of a positive argument through exp(-|g|): for g < 0, exp(-g) =
     * 1 / exp(g) with exp(g) <= 1 computed by exp_nonpos, so silu(g) = g e / (1 + e). Both signs
     * as selects, not a branch: a branch in the loop keeps it scalar, a visible share of a decode
     * step (docs/kernels.md), selects let it vectorise, to the same bits. */
    const float e = exp_nonpos(-fabsf(g));
    const float ge = g * e; /* computed for both signs: a select of two values, nothing speculated */
    return (g >= 0.0f ? g : ge) / (1.0f + e);
}

static inline float gelu_tanh(float g) {
    /* 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), torch's approximate="tanh" formula.
     * 1 + tanh(u) = 2 / (1 + exp(-2u)), so this is g * sigmoid(2u), computed as silu is: with
     * e = exp(-2|u|) <= 1, g / (1 + e) for u >= 0 and g e / (1 + e) below. Written through tanh
     * it would cancel (1 + tanh(u) -> 0) for negative g; here every step keeps relative error near
     * fastexp.h's. u has g's sign (the cubic term does not change it). */
    const float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
    const float u = kBeta * (g + kKappa * (g * g * g));
    const float e = exp_nonpos(-2.0f * fabsf(u));
    const float ge = g * e;
    return (u >= 0.0f ? g : ge) / (1.0f + e);
}

void pagedkv_rms_norm_f32(int64_t n, int64_t h, float *x, int64_t x_stride, const float *delta,
                          int64_t delta_stride, const float *weight, float *out, int64_t out_stride, float eps,
                          int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (n * h >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        float *restrict xr = x + i * x_stride;
        if (delta) {
            const float *restrict dr = delta + i * delta_stride;
            #pragma omp simd
            for (int64_t j = 0; j < h; j++) xr[j] = xr[j] + dr[j];
        }
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < h; j++) ss += xr[j] * xr[j];
        const float r = 1.0f / sqrtf(ss / (float)h + eps);
        float *restrict o = out + i * out_stride;
        #pragma omp simd
        for (int64_t j = 0; j < h; j++) o[j] = weight[j] * (xr[j] * r);
    }
}

void pagedkv_silu_mul_f32(int64_t n, int64_t inter, const float *gate_up, int64_t gu_stride, float *out,
                          int64_t out_stride, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (n * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *restrict g = gate_up + i * gu_stride, *restrict u = g + inter;
        float *restrict o = out + i * out_stride;
        #pragma omp simd
        for (int64_t j = 0; j < inter; j++) o[j] = silu(g[j]) * u[j];
    }
}

void pagedkv_gelu_tanh_mul_f32(int64_t n, int64_t inter, const float *gate_up, int64_t gu_stride, float *out,
                               int64_t out_stride, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (n * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *restrict g = gate_up + i * gu_stride, *restrict u = g + inter;
        float *restrict o = out + i * out_stride;
        #pragma omp simd
        for (int64_t j = 0; j < inter; j++) o[j] = gelu_tanh(g[j]) * u[j];
    }
}

/* x * cos + rotate_half(x) * sin for one head of D values (D even). */
static inline void rotate(const float *restrict x, const float *restrict cs, const float *restrict sn,
                          float *restrict y, int64_t D) {
    const int64_t half = D / 2;
    #pragma omp simd
    for (int64_t d = 0; d < half; d++) y[d] = x[d] * cs[d] + (-x[d + half]) * sn[d];
    #pragma omp simd
    for (int64_t d = half; d < D; d++) y[d] = x[d] * cs[d] + x[d - half] * sn[d];
}

/* RMSNorm of one head's D values into y: pagedkv_rms_norm_f32's formula on one row. */
static inline void head_norm(const float *restrict x, const float *restrict w, float eps, float *restrict y,
                             int64_t D) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int64_t d = 0; d < D; d++) ss += x[d] * x[d];
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    #pragma omp simd
    for (int64_t d = 0; d < D; d++) y[d] = w[d] * (x[d] * r);
}

/* One token's row: its q heads into q_out, its k (rotated) and v heads into the cache at base (a
 * slot of -1: none). tmp (D floats) holds a normalised head when a norm weight is given. */
static inline void rope_store_row(int64_t num_heads, int64_t num_kv_heads, int64_t D, const float *row,
                                  const float *cs, const float *sn, float *q_out, float *k_cache, float *v_cache,
                                  int64_t base, int64_t c_head_stride, const float *q_norm, const float *k_norm,
                                  float eps, float *restrict tmp) {
    for (int64_t h = 0; h < num_heads; h++) {
        const float *x = row + h * D;
        if (q_norm) {
            head_norm(x, q_norm, eps, tmp, D);
            x = tmp;
        }
        rotate(x, cs, sn, q_out + h * D, D);
    }
    if (base < 0) return;
    const float *k = row + num_heads * D, *v = k + num_kv_heads * D;
    for (int64_t h = 0; h < num_kv_heads; h++) {
        const float *x = k + h * D;
        if (k_norm) {
            head_norm(x, k_norm, eps, tmp, D);
            x = tmp;
        }
        rotate(x, cs, sn, k_cache + base + h * c_head_stride, D);
        float *restrict vd = v_cache + base + h * c_head_stride;
        for (int64_t d = 0; d < D; d++) vd[d] = v[h * D + d];
    }
}

void pagedkv_rope_store_f32(int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t D, const float *qkv,
                            int64_t qkv_stride, const float *cos, const float *sin, int64_t cs_stride, float *q_out,
                            float *k_cache, float *v_cache, int64_t block_size, int64_t c_block_stride,
                            int64_t c_slot_stride, int64_t c_head_stride, const int64_t *slots,
                            const float *q_norm, const float *k_norm, float eps, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (n * (num_heads + 2 * num_kv_heads) * D >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *row = qkv + i * qkv_stride, *cs = cos + i * cs_stride, *sn = sin + i * cs_stride;
        const int64_t slot = slots[i];
        const int64_t base =
            slot < 0 ? -1 : (slot / block_size) * c_block_stride + (slot % block_size) * c_slot_stride;
        float *q = q_out + i * num_heads * D;
        if (q_norm || k_norm) { /* a head's worth of stack: the caller bounds D (MAX_GROUP_X_HEAD_DIM) */
            float tmp[D > 0 ? D : 1];
            rope_store_row(num_heads, num_kv_heads, D, row, cs, sn, q, k_cache, v_cache, base, c_head_stride,
                           q_norm, k_norm, eps, tmp);
        } else {
            rope_store_row(num_heads, num_kv_heads, D, row, cs, sn, q, k_cache, v_cache, base, c_head_stride,
                           NULL, NULL, eps, NULL);
        }
    }
}
