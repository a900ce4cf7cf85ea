/* The decode attention kernel's arguments (csrc/paged_decode.c), shared with the decode chain
 * (csrc/decode_layers.c) that calls it; kernels/cpu/native.py mirrors the struct (_DecodeArgs, its
 * size checked at load). */
#ifndef PAGEDKV_DECODE_ARGS_H
#define PAGEDKV_DECODE_ARGS_H
#include <stdint.h>

typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    int64_t q_seq_stride, q_head_stride;                   /* query [num_seqs, num_heads, head_dim] */
    int64_t o_seq_stride, o_head_stride;                   /* out, same shape */
    int64_t c_block_stride, c_slot_stride, c_head_stride;  /* each cache [blocks, block_size, kv_heads, head_dim] */
    int64_t bt_stride;                                     /* block_tables [num_seqs, max_blocks] int32 */
    float scale;
    int num_threads;
    int generic_only;  /* 1: skip the specialised copies (for measuring them against the generic one) */
    int64_t window;    /* sliding window: a query at position p sees keys p - window + 1 .. p; 0: all */
} DecodeArgs;

int pagedkv_decode_f32(const DecodeArgs *a, const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *block_tables, const int32_t *seq_lens, float *out);

#endif
