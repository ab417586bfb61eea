/* The CPU expert executor's job (cpu_experts.c runs it; copy_service.c fills one per CPU list it serves), and the
 * signature of its entry point, for C callers that reach it through a function pointer. */
#ifndef EDGEMOE_CPU_EXPERTS_JOB_H
#define EDGEMOE_CPU_EXPERTS_JOB_H
#include <stdint.h>

/* One layer's pairs (edgemoe.offload.cpu_experts.Job mirrors it). A C caller fills one per call; the pool keeps no
 * pointer into it after `edgemoe_cpu_experts_run` returns. */
typedef struct {
  const float *x;              /* [tokens, hidden] fp32, contiguous */
  int64_t tokens;              /* rows of x: token ids must be below */
  const uint8_t *bank;         /* expert e's row at bank + e * row_stride: gate_up [2 inter rows], then down */
  int64_t experts;             /* rows of the bank: expert ids must be below */
  int64_t row_stride;          /* bytes */
  int64_t down_offset;         /* bytes from a row's start to its down weights */
  int32_t gate_up_format;      /* a GGML type id (cpu_experts_kernels.h's formats) */
  int32_t down_format;
  int32_t act;                 /* 0 SiLU, 1 tanh GELU, 2 gpt-oss's clamped SwiGLU (cpu_experts.c's ACT_*) */
  int32_t reserved;
  int64_t hidden, inter;
  int64_t pairs;
  const int64_t *token_ids;    /* [pairs]: the pair's row of x */
  const int64_t *expert_ids;   /* [pairs]: the pair's expert */
  float *out;                  /* [pairs, hidden] fp32, contiguous: each pair's unweighted output */
  const float *gate_up_bias;   /* [experts, 2 inter] fp32 or NULL: expert biases (gpt-oss), added before act */
  const float *down_bias;      /* [experts, hidden] fp32 or NULL (both or neither) */
} edgemoe_cpu_job;

/* edgemoe_cpu_experts_run: 0, or an error code (edgemoe.offload.cpu_experts.ERRORS) */
typedef int (*edgemoe_cpu_run_fn)(void *pool, const edgemoe_cpu_job *job);

#endif
