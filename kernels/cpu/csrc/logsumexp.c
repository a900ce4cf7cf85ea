/* Row-wise log-sum-exp of fp32 logits, for the log-probability of every sampled token, and each
 * row's argmax, for the greedy token, from the same passes.
 *
 * Why: a decode step's logits are [sequences, vocabulary] (48 x 32,000 at the vs_vllm workload),
 * and torch.logsumexp on CPU runs a max pass, a subtract, an exp pass and a sum as separate
 * loops over a temporary. Here each row is two passes over the row (max, then the vectorised
 * exp-sum) with no temporary, rows spread over OpenMP threads (docs/kernels.md has both times).
 * The max pass goes chunk by chunk and keeps the first chunk holding the row's maximum, so the
 * argmax costs one more look at that chunk instead of a pass of its own (torch's argmax is a
 * scalar loop on CPU; worker_svc/model/sampling.py's chunked argmax_rows is a third pass).
 *
 * Same result as torch.logsumexp up to fp32 rounding; a row holding +inf gives +inf, a row of
 * -inf gives -inf, a NaN anywhere gives NaN (as torch does). The argmax is torch.argmax's: the
 * first index of the maximum, the first NaN in a row holding one, 0 for a row of -inf.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "fastexp.h"

#define ARGMAX_CHUNK 256 /* columns whose maximum is taken in one vectorised loop */

void pagedkv_logsumexp_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride, float *out,
                                  int64_t *argmax, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t i = 0; i < rows; i++) {
        const float *row = x + i * row_stride;
        float m = -INFINITY;
        int64_t best = 0; /* start of the first chunk holding m */
        int nan = 0;
        for (int64_t c = 0; c < cols; c += ARGMAX_CHUNK) {
            const int64_t end = c + ARGMAX_CHUNK < cols ? c + ARGMAX_CHUNK : cols;
            float cm = -INFINITY;
            #pragma omp simd reduction(max:cm) reduction(|:nan)
            for (int64_t j = c; j < end; j++) { cm = row[j] > cm ? row[j] : cm; nan |= row[j] != row[j]; }
            if (cm > m) { m = cm; best = c; }
        }
        if (nan) {
            out[i] = NAN;
            if (argmax) {
                int64_t j = 0;
                while (row[j] == row[j]) j++;
                argmax[i] = j;
            }
            continue;
        }
        if (argmax) {
            int64_t j = best;
            while (row[j] != m) j++; /* m is in [best, best + chunk) */
            argmax[i] = j;
        }
        if (isinf(m)) { out[i] = m; continue; }  /* +inf, or a row of -inf */
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < cols; j++) sum += exp_nonpos(row[j] - m);
        out[i] = m + logf(sum);
    }
}
