/* A decode step's decoder layers in one call: the same kernels the model calls one by one from
 * Python (layer_ops.c, linear.c, quant_linear.c, paged_decode.c), chained here in the same order on
 * the same arguments, so the results are the same to the bit.
 *
 * Why: a decode step of a deep, narrow model is mostly calls, not arithmetic. SmolLM2-135M's step
 * makes nine kernel calls a layer over 30 layers; from Python each costs its argument checks, a
 * tensor allocation and a ctypes crossing, which at one sequence add up to more than reading the
 * step's weights (docs/kernels.md, "A decode step in one call", has the figures). Chained in C the
 * step pays one crossing (kernels/cpu/decode_layers.py decides when it applies and fills these
 * structs; the Python path stays the reference and the path of every other step).
 *
 * Per layer, as worker_svc/model/llama.py's forward (LayerArgs.norms = 2): x += delta (the previous
 * layer's output, none before the first) and RMSNorm; the fused QKV projection; RoPE with the K/V
 * write into the layer's cache (Qwen3: each q and k head RMS-normalised first); paged decode
 * attention; the output projection; x += it and RMSNorm; the fused gate/up projection;
 * SiLU-and-multiply; the down projection into delta.
 *
 * Gemma 3's layer (worker_svc/model/gemma3.py's forward, norms = 4): x += delta and RMSNorm; QKV;
 * per-head q/k RMSNorm, RoPE (the local or the global table, LayerArgs.rope) and the K/V write;
 * attention within the layer's window; the output projection and its RMSNorm (no residual); x += that
 * and RMSNorm; gate/up; gelu_tanh-and-multiply; down and its RMSNorm into delta.
 *
 * Each layer writes its K/V and reads its attention through one TableArgs: a KV-cache group's slots,
 * block tables and lengths (worker_svc/model/kv_layout.py: window layers may have their own) under
 * the layer's window, and its place in the cache's first dimension (LayerArgs.cache_slot). The
 * caller adds the last delta.
 */
#include <stdint.h>
#include <stdlib.h>

#include "decode_args.h"

/* The chained kernels (their own files). */
void pagedkv_rms_norm_f32(int64_t n, int64_t h, float *x, int64_t x_stride, const float *delta, int64_t delta_stride,
                          const float *weight, float *out, int64_t out_stride, float eps, int num_threads);
void pagedkv_silu_mul_f32(int64_t n, int64_t inter, const float *gate_up, int64_t gu_stride, float *out,
                          int64_t out_stride, int num_threads);
void pagedkv_gelu_tanh_mul_f32(int64_t n, int64_t inter, const float *gate_up, int64_t gu_stride, float *out,
                               int64_t out_stride, int num_threads);
void pagedkv_rope_store_f32(int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t D, const float *qkv,
                            int64_t qkv_stride, const float *cos, const float *sin, int64_t cs_stride, float *q,
                            float *key_cache, float *value_cache, int64_t block_size, int64_t c_block_stride,
                            int64_t c_slot_stride, int64_t c_head_stride, const int64_t *slots,
                            const float *q_norm, const float *k_norm, float eps, int num_threads);
void pagedkv_linear_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const float *packed,
                        const float *bias, float *y, int64_t y_stride, int num_threads);
int pagedkv_q4_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const uint8_t *qweight,
                      const float *qscale, float *y, int64_t y_stride, int num_threads, int arith);
int pagedkv_q8_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const int8_t *qweight,
                      int64_t w_stride, const float *scale, float *y, int64_t y_stride, int num_threads, int arith);
int pagedkv_kq_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride, const uint8_t *w,
                      const int32_t *segs, int64_t nsegs, float *y, int64_t y_stride, int num_threads, int arith);

/* quant_linear.c's QUANT_ARITH_ROWS: every row of a decode step as it would be alone, so a sequence's
 * tokens do not depend on how many others share its steps. */
#define ARITH_ROWS 1

enum { LIN_F32 = 1, LIN_Q4 = 2, LIN_Q8 = 3, LIN_KQ = 4 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {      /* one linear layer: its kernel and weight arguments (cpu_decode_layers._Linear) */
    int64_t kind;     /* LIN_* */
    int64_t n, k;     /* out_features, in_features */
    const void *w;    /* packed fp32 panels / int4 nibbles / int8 rows / K-quant bytes */
    const void *aux;  /* int4 scales / int8 row scales / K-quant segment table; unused for fp32 */
    int64_t aux_int;  /* int8 row stride / K-quant segment count */
    const float *bias; /* or NULL: for fp32 the kernel adds it, for integers it is added after */
} LinearArgs;

typedef struct {   /* where a layer's new K/V go and what its attention reads: one KV-cache group's
                    * step under one window (cpu_decode_layers._Tables) */
    const int64_t *slots;                   /* [num_tokens] cache slots of the new K/V */
    const int32_t *block_tables, *seq_lens; /* [num_tokens, bt_stride], [num_tokens] */
    int64_t bt_stride;
    int64_t window;                         /* sliding window; 0: full attention */
} TableArgs;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm;             /* per-head q/k RMSNorm before RoPE, or NULL */
    const float *pre_ffn_norm, *post_ffn_norm; /* norms = 4 only */
    int64_t norms;      /* 2: Llama's layer; 4: Gemma 3's */
    int64_t act;        /* ACT_* */
    int64_t rope;       /* which of ChainArgs' cos/sin tables */
    int64_t tables;     /* which of ChainArgs' TableArgs */
    int64_t cache_slot; /* the layer's index in the cache's first dimension */
    LinearArgs qkv, o, gate_up, down;
} LayerArgs;

typedef struct {
    int64_t num_layers, num_tokens, hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps;
    int num_threads;
    const float *cos[2], *sin[2]; /* each [num_tokens, head_dim], row stride cs_stride */
    int64_t cs_stride;
    const TableArgs *tables;
    float *kv_base;         /* the all-layers cache [slots, 2, blocks, block_size, kv_heads, head_dim] */
    int64_t layer_stride, kv_stride; /* elements from one cache slot to the next, and from K to V */
    DecodeArgs attn;        /* the attention kernel's shapes and strides (num_seqs = num_tokens); each
                             * layer's bt_stride and window come from its TableArgs */
} ChainArgs;

/* The structs' sizes, for kernels/cpu/decode_layers.py to check its mirrors against (a stale build
 * would otherwise read misplaced fields). */
void pagedkv_decode_layers_sizes(int64_t *out) {
    out[0] = (int64_t)sizeof(LinearArgs);
    out[1] = (int64_t)sizeof(TableArgs);
    out[2] = (int64_t)sizeof(LayerArgs);
    out[3] = (int64_t)sizeof(ChainArgs);
}

static int linear(const LinearArgs *l, int64_t m, const float *x, float *y, int nt) {
    int rc;
    switch (l->kind) {
    case LIN_F32:
        pagedkv_linear_f32(m, l->n, l->k, x, l->k, (const float *)l->w, l->bias, y, l->n, nt);
        return 0;
    case LIN_Q4:
        rc = pagedkv_q4_linear(m, l->n, l->k, x, l->k, (const uint8_t *)l->w, (const float *)l->aux, y, l->n, nt,
                               ARITH_ROWS);
        break;
    case LIN_Q8:
        rc = pagedkv_q8_linear(m, l->n, l->k, x, l->k, (const int8_t *)l->w, l->aux_int, (const float *)l->aux, y,
                               l->n, nt, ARITH_ROWS);
        break;
    case LIN_KQ:
        rc = pagedkv_kq_linear(m, l->n, l->k, x, l->k, (const uint8_t *)l->w, (const int32_t *)l->aux, l->aux_int, y,
                               l->n, nt, ARITH_ROWS);
        break;
    default:
        return -3;
    }
    if (rc == 0 && l->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < l->n; j++) y[r * l->n + j] += l->bias[j];
    return rc;
}

/* x [num_tokens, hidden] is the residual stream (updated in place), delta [num_tokens, hidden] gets
 * the last layer's output. Returns 0, -1 when a kernel could not allocate its scratch, -2 when the
 * attention kernel refused its indices, -3 for an unknown linear kind, activation or norm count; on
 * an error x and the caches are part-way through the step (the caller fails the step, as a failing
 * per-op call would). */
int pagedkv_decode_layers_f32(const ChainArgs *a, const LayerArgs *layers, float *x, float *delta) {
    const int64_t n = a->num_tokens, h = a->hidden, hd = a->num_heads * a->head_dim;
    const int64_t qkv_w = (a->num_heads + 2 * a->num_kv_heads) * a->head_dim;
    const int nt = a->num_threads;
    const size_t floats = (size_t)n * (size_t)(h + qkv_w + 2 * hd + 2 * h + 3 * a->inter);
    float *scratch = malloc((floats > 0 ? floats : 1) * sizeof(float));
    if (!scratch) return -1;
    float *normed = scratch, *qkv = normed + n * h, *q = qkv + n * qkv_w, *attn = q + n * hd, *o = attn + n * hd;
    float *post = o + n * h, *gate_up = post + n * h, *act = gate_up + n * 2 * a->inter;
    int rc = 0;
    for (int64_t li = 0; li < a->num_layers && rc == 0; li++) {
        const LayerArgs *L = layers + li;
        const TableArgs *T = a->tables + L->tables;
        const int gemma = L->norms == 4;
        if ((L->norms != 2 && !gemma) || (L->act != ACT_SILU && L->act != ACT_GELU_TANH)) {
            rc = -3;
            break;
        }
        float *kc = a->kv_base + L->cache_slot * a->layer_stride, *vc = kc + a->kv_stride;
        DecodeArgs attn_args = a->attn;
        attn_args.bt_stride = T->bt_stride;
        attn_args.window = T->window;
        pagedkv_rms_norm_f32(n, h, x, h, li ? delta : NULL, li ? h : 0, L->input_norm, normed, h, a->eps, nt);
        if ((rc = linear(&L->qkv, n, normed, qkv, nt)) != 0) break;
        pagedkv_rope_store_f32(n, a->num_heads, a->num_kv_heads, a->head_dim, qkv, qkv_w, a->cos[L->rope],
                               a->sin[L->rope], a->cs_stride, q, kc, vc, a->attn.block_size, a->attn.c_block_stride,
                               a->attn.c_slot_stride, a->attn.c_head_stride, T->slots, L->q_norm, L->k_norm, a->eps,
                               nt);
        if ((rc = pagedkv_decode_f32(&attn_args, q, kc, vc, T->block_tables, T->seq_lens, attn)) != 0) break;
        if ((rc = linear(&L->o, n, attn, o, nt)) != 0) break;
        if (gemma) { /* post = RMSNorm(o); x += post and RMSNorm */
            pagedkv_rms_norm_f32(n, h, o, h, NULL, 0, L->post_norm, post, h, a->eps, nt);
            pagedkv_rms_norm_f32(n, h, x, h, post, h, L->pre_ffn_norm, normed, h, a->eps, nt);
        } else { /* x += o and RMSNorm */
            pagedkv_rms_norm_f32(n, h, x, h, o, h, L->post_norm, normed, h, a->eps, nt);
        }
        if ((rc = linear(&L->gate_up, n, normed, gate_up, nt)) != 0) break;
        if (L->act == ACT_GELU_TANH)
            pagedkv_gelu_tanh_mul_f32(n, a->inter, gate_up, 2 * a->inter, act, a->inter, nt);
        else
            pagedkv_silu_mul_f32(n, a->inter, gate_up, 2 * a->inter, act, a->inter, nt);
        if (gemma) { /* delta = RMSNorm(down) */
            if ((rc = linear(&L->down, n, act, o, nt)) != 0) break;
            pagedkv_rms_norm_f32(n, h, o, h, NULL, 0, L->post_ffn_norm, delta, h, a->eps, nt);
        } else {
            rc = linear(&L->down, n, act, delta, nt);
        }
    }
    free(scratch);
    return rc;
}
