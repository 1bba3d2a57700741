/*
 * specfast_cuda.h: the C API of libspecfast_cuda.so, the CUDA backend.
 *
 * The same operations as specfast.h (sf_verify, sf_sample, sf_probs) on data
 * that lives on the GPU, with the same decisions: coupled and greedy tokens
 * are bit-identical to the CPU backend's, rejection sampling uses the same
 * Philox streams and the same integer masses (csrc/common/shared.h).
 *
 * Conventions
 * - Every pointer inside the structs (logits, draft arrays, outputs, status,
 *   workspace, parameter arrays) is a DEVICE pointer. The structs themselves
 *   live on the host and are read before the call returns.
 * - One kernel launch per call on `stream` (a cudaStream_t passed as void *;
 *   NULL is the legacy default stream). The call never synchronises, never
 *   allocates and never copies between host and device, so it can be
 *   captured in a CUDA graph.
 * - Errors that need the data (a NaN logit, a bad draft token, a parameter
 *   out of range) cannot be returned without a synchronisation: they are
 *   written per request (per row for sample / probs) to `status` (int32):
 *       status[b] = code | phase << 8
 *   code an sf_status, phase 0 (parameters), 1 (draft checks) or 2 (while
 *   verifying); 0 when the request went through. A failed request has
 *   num_accepted 0 and tokens -1. The host reports the error of the lowest
 *   (phase, request), as the CPU backend does.
 * - The return value covers what the host can see: shapes, NULL pointers,
 *   enums, the workspace size and its 16-byte alignment, sampling parameters
 *   passed by value, and SF_ERR_UNSUPPORTED when the launch fails
 *   (sf_cuda_last_error() then names the CUDA error).
 */
#ifndef SPECFAST_CUDA_H
#define SPECFAST_CUDA_H

#include <stdint.h>

#include "specfast.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sampling parameters. For each parameter: a device array of n_* values (1 or
 * the batch size), or, when the pointer is NULL, the host scalar *_value for
 * every request (no device memory and no copy needed). */
typedef struct sf_cuda_params {
    const float *temperature; int64_t n_temperature; float temperature_value;
    const int32_t *top_k;     int64_t n_top_k;       int32_t top_k_value;
    const float *top_p;       int64_t n_top_p;       float top_p_value;
    const float *min_p;       int64_t n_min_p;       float min_p_value;
    const uint64_t *seed;     int64_t n_seed;        uint64_t seed_value;
    const int64_t *position;  int64_t n_position;    int64_t position_value;
} sf_cuda_params;

/* Bytes of device workspace sf_cuda_verify needs for these shapes on the
 * current device (0 is possible; pass NULL then). Depends on draft->n,
 * draft->batch, draft->kind, draft->sparse_k, whether draft->parents is set,
 * logits->vocab, method, and whether the device launches clusters. */
SF_API int64_t sf_cuda_verify_workspace(const sf_logits *logits, const sf_draft *draft,
                                        sf_method method);

/* sf_verify on the GPU. `out` arrays (batch, max_draft + 1), (batch,),
 * (batch, max_draft) int32; out->max_draft must be >= max(num_draft), as the
 * host knows it without reading num_draft. status (batch,) int32. workspace
 * of at least sf_cuda_verify_workspace() bytes, 16-byte aligned. */
SF_API sf_status sf_cuda_verify(const sf_logits *logits, const sf_draft *draft,
                                const sf_cuda_params *params, sf_method method,
                                sf_verify_out *out, int32_t *status,
                                void *workspace, int64_t workspace_bytes,
                                void *stream);

/* sf_sample on the GPU: tokens (rows,) int32, status (rows,) int32. */
SF_API sf_status sf_cuda_sample(const sf_logits *logits, const sf_cuda_params *params,
                                sf_method method, int32_t *tokens, int32_t *status,
                                void *stream);

/* sf_probs on the GPU: out (rows, vocab) float32, status (rows,) int32. */
SF_API sf_status sf_cuda_probs(const sf_logits *logits, const sf_cuda_params *params,
                               float *out, int32_t *status, void *stream);

/* SF_VERSION_NUMBER this library was built from. */
SF_API unsigned sf_cuda_version(void);

/* The cudaError_t of the last failed launch in this thread (0 if none) and
 * its name. */
SF_API int sf_cuda_last_error(void);
SF_API const char *sf_cuda_error_string(int error);

#ifdef __cplusplus
}
#endif
#endif /* SPECFAST_CUDA_H */
