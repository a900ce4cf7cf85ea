/* The float vector the attention kernels (paged_decode.c, paged_prefill.c) compute in: one register
 * of the build's widest unit, VW floats (AVX-512 16, AVX2 8, SSE 4), so tiles sized in vectors keep
 * every accumulator in a register. A 16-float type compiled for AVX2 is split into pairs of
 * registers, and tiles written for AVX-512's 32 registers then spill to the stack on every
 * multiply-add (docs/kernels.md). linear.c keeps its own tile table (its baseline build uses
 * 8-float vectors by measurement). */
#ifndef PAGEDKV_VECTOR_WIDTH_H
#define PAGEDKV_VECTOR_WIDTH_H
#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4))); /* unaligned loads and stores */

#endif
