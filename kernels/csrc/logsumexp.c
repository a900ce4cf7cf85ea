/* Row-wise log-sum-exp of fp32 logits, for the log-probability of every sampled token.
 *
 * Why: a decode step's logits are [sequences, vocabulary] (48 x 32,000 at the vs_vllm workload),
 * and torch.logsumexp on CPU runs a max pass, a subtract, an exp pass and a sum as separate
 * loops over a temporary: 0.89 ms of a 25 ms step. Here each row is two passes over the row
 * (max, then the vectorised exp-sum) with no temporary, rows spread over OpenMP threads: 0.47 ms.
 * Same result as torch.logsumexp up to fp32 rounding; a row holding +inf gives +inf, a row of
 * -inf gives -inf, a NaN anywhere gives NaN (as torch does).
 */
#include <math.h>
#include <stdint.h>

#include "fastexp.h"

void pagedkv_logsumexp_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride, float *out,
                           int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t i = 0; i < rows; i++) {
        const float *row = x + i * row_stride;
        float m = -INFINITY;
        int nan = 0;
        #pragma omp simd reduction(max:m) reduction(|:nan)
        for (int64_t j = 0; j < cols; j++) { m = row[j] > m ? row[j] : m; nan |= row[j] != row[j]; }
        if (nan) { out[i] = NAN; continue; }
        if (isinf(m)) { out[i] = m; continue; }  /* +inf, or a row of -inf */
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < cols; j++) sum += exp_nonpos(row[j] - m);
        out[i] = m + logf(sum);
    }
}
