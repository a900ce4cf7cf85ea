/* A plain read of a list of memory spans, in order, each shared out over the threads: the time a
 * weight kernel's bytes take to stream with no arithmetic on them (bench/decode_floor.py compares
 * a decode step with a plain read of the same weight tensors in the same order).
 *
 * Why a kernel of its own: the weight-read floor divides the weight bytes by the rate a sum over a
 * large buffer reads, but a decode step reads about 120 separate tensors of a few hundred KiB, one
 * after another, and a host's last-level cache may hold part of a small model between steps. This
 * reads exactly those tensors, in the step's order, each split statically over the same OpenMP
 * threads as the kernels split theirs, so "step / plain read" says how much more than streaming its
 * own weights a step costs (the kernels' arithmetic, and the work between the matrices).
 *
 * The sum is of 64-bit words (wrapping) plus any tail bytes, returned so that the reads cannot be
 * elided; it is a checksum a test can recompute, not a meaningful value. No software prefetch:
 * the hardware prefetchers follow one sequential stream per thread at the memory's rate.
 */
#include <stdint.h>
#include <string.h>

/* Below 64 KiB a span is read by the calling thread (a norm's weights: the kernels read those alone). */
#define PARALLEL_MIN_WORDS 8192

uint64_t pagedkv_read_spans(int64_t count, const uint8_t *const *ptrs, const int64_t *bytes, int num_threads) {
    uint64_t total = 0;
    for (int64_t s = 0; s < count; s++) {
        const uint8_t *p = ptrs[s];
        const int64_t n = bytes[s], words = n / 8;
        uint64_t sum = 0;
        #pragma omp parallel for schedule(static) reduction(+:sum) num_threads(num_threads > 0 ? num_threads : 1) \
            if (words >= PARALLEL_MIN_WORDS)
        for (int64_t i = 0; i < words; i++) {
            uint64_t w;
            memcpy(&w, p + 8 * i, sizeof w); /* spans need not be 8-byte aligned */
            sum += w;
        }
        for (int64_t i = 8 * words; i < n; i++) sum += p[i];
        total += sum;
    }
    return total;
}
