/*
 * specfast.h: the public C API of specfast.
 *
 * specfast verifies the draft tokens of speculative decoding against the
 * target model's logits and samples from the target, for a whole ragged batch
 * in one call, exactly: the emitted tokens are distributed as if the target
 * had been sampled alone.
 *
 * Conventions
 * - Every entry point returns an sf_status; SF_OK is 0. Bad input is a status,
 *   never an abort. When `err` is not NULL it receives the index of the
 *   request (or row) at fault, or -1.
 * - Arrays are dense and row-major. Logits rows may be strided: row r starts
 *   at element r * row_stride.
 * - Randomness comes from Philox4x32-10 keyed by the seed and counted by
 *   (absolute position, purpose, index): results do not depend on the batch,
 *   the order of requests, the number of threads or the SIMD level.
 * - The functions are thread safe; calls from many threads share one pool,
 *   one call at a time (each on the whole pool; the others wait, and so does
 *   a fork(), so that the child starts from a consistent pool). A call runs
 *   to its end: signals reach the caller's handlers after it returns.
 *   Index inputs (tokens, counts, parents, sparse ids, parameters) are
 *   checked as they are used, so another thread writing them during a call
 *   gives a status or a result, not a read out of bounds.
 */
#ifndef SPECFAST_H
#define SPECFAST_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SF_VERSION_MAJOR 0
#define SF_VERSION_MINOR 1
#define SF_VERSION_PATCH 0
#define SF_VERSION_NUMBER \
    (SF_VERSION_MAJOR * 10000 + SF_VERSION_MINOR * 100 + SF_VERSION_PATCH)

#if defined(_WIN32)
#define SF_API __declspec(dllexport)
#elif defined(__GNUC__)
#define SF_API __attribute__((visibility("default")))
#else
#define SF_API
#endif

/* Limits. The vocabulary keeps the fixed-point masses inside 64 bits: a row's
 * (at most 2^40 a token) and a dense draft row's (at most 1.001 * 2^40 a token,
 * summed to check it): V * 1.001 < 2^24. */
#define SF_MAX_VOCAB ((1 << 24) - (1 << 15))
#define SF_MAX_BATCH (1 << 20)
#define SF_MAX_DRAFT 1024 /* draft nodes per request */

/* Status codes. The values are pinned: bindings rely on them. */
typedef enum sf_status {
    SF_OK = 0,
    SF_ERR_ARGUMENT = 1,     /* a NULL pointer, one not aligned to its type, a bad size or enum */
    SF_ERR_SHAPE = 2,        /* sizes and counts disagree */
    SF_ERR_PARAM = 3,        /* temperature, top_k, top_p or min_p out of range */
    SF_ERR_LOGITS = 4,       /* a NaN or +inf logit */
    SF_ERR_ALL_MASKED = 5,   /* a row whose logits are all -inf */
    SF_ERR_TOKEN = 6,        /* a draft token outside [0, vocab) */
    SF_ERR_PARENT = 7,       /* a parent index not in [-1, node) */
    SF_ERR_DRAFT_PROBS = 8,  /* draft probabilities negative, non-finite or not summing to 1 */
    SF_ERR_NO_MEMORY = 9,    /* scratch allocation failed */
    SF_ERR_THREADS = 10,     /* the thread pool could not start */
    SF_ERR_UNSUPPORTED = 11  /* a feature not built into this library */
} sf_status;

typedef enum sf_dtype { SF_F32 = 0, SF_F16 = 1, SF_BF16 = 2 } sf_dtype;

typedef enum sf_method {
    SF_REJECTION = 0, /* speculative (recursive) rejection sampling */
    SF_COUPLED = 1    /* Gumbel-max coupling: drafter-invariant output */
} sf_method;

typedef enum sf_draft_kind {
    SF_DRAFT_NONE = 0,   /* deterministic drafts: q is one-hot at the token */
    SF_DRAFT_DENSE = 1,  /* (n, vocab) float32 probabilities per node */
    SF_DRAFT_SPARSE = 2  /* (n, k) ids and float32 probabilities per node */
} sf_draft_kind;

/* Target logits: `rows` rows of `vocab` values of type `dtype`, row r at
 * element offset r * row_stride (row_stride >= vocab). */
typedef struct sf_logits {
    const void *data;
    sf_dtype dtype;
    int64_t rows;
    int64_t vocab;
    int64_t row_stride;
} sf_logits;

/* The largest temperature: above it, logits - max can overflow float for
 * tokens whose weight exp((logit - max) / T) is still representable; up to it
 * such a token weighs exactly 0, as in float64. */
#define SF_MAX_TEMPERATURE 1e30f

/* Sampling parameters, one value per request or one value for all: each
 * pointer addresses `n_*` values and n_* is 1 (broadcast) or the batch size.
 * 0 <= temperature <= SF_MAX_TEMPERATURE (0 is greedy); top_k >= 0 (0 keeps
 * all); 0 < top_p <= 1; 0 <= min_p <= 1. position is the absolute index in
 * the sequence of the token that a request's first row predicts; it keys the
 * random streams. */
typedef struct sf_params {
    const float *temperature; int64_t n_temperature;
    const int32_t *top_k;     int64_t n_top_k;
    const float *top_p;       int64_t n_top_p;
    const float *min_p;       int64_t n_min_p;
    const uint64_t *seed;     int64_t n_seed;
    const int64_t *position;  int64_t n_position;
} sf_params;

/* Draft tokens of a ragged batch. Request b owns num_draft[b] consecutive
 * nodes of `tokens` and num_draft[b] + 1 consecutive logits rows: its row 0 is
 * the logits at the last accepted token, its row 1 + i the logits after node i.
 * parents (n,), when not NULL, gives each node's parent as a local index
 * within its request (-1: a child of row 0); parents precede children. NULL
 * means chains. Siblings are tried in node order.
 * kind selects q, the distribution each node's token was drawn from:
 *   SF_DRAFT_NONE   q is one-hot at the token;
 *   SF_DRAFT_DENSE  dense (n, vocab) float32, row stride vocab;
 *   SF_DRAFT_SPARSE sparse_ids and sparse_probs (n, sparse_k): the token was
 *                   drawn from those ids only; id -1 marks an unused slot
 *                   (its probability must be 0). */
typedef struct sf_draft {
    const int32_t *tokens;    /* (n,) */
    int64_t n;
    const int32_t *num_draft; /* (batch,) */
    int64_t batch;
    const int32_t *parents;   /* (n,) or NULL */
    sf_draft_kind kind;
    const float *dense;       /* (n, vocab) */
    const int32_t *sparse_ids;   /* (n, sparse_k) */
    const float *sparse_probs;   /* (n, sparse_k) */
    int64_t sparse_k;
} sf_draft;

/* Results of sf_verify for `batch` requests, with width = max_draft + 1
 * (max_draft in [0, SF_MAX_DRAFT]):
 *   tokens          (batch, width) int32: accepted draft tokens, then one
 *                   corrected or bonus token, padded with -1;
 *   num_accepted    (batch,) int32;
 *   accepted_nodes  (batch, max_draft) int32: local node indices of the
 *                   accepted nodes in depth order, padded with -1 (may be
 *                   NULL when max_draft is 0). */
typedef struct sf_verify_out {
    int32_t *tokens;
    int32_t *num_accepted;
    int32_t *accepted_nodes;
    int64_t max_draft;
} sf_verify_out;

/* Where an error was found: the request (sf_verify) or row (sf_sample,
 * sf_probs) index, -1 when it concerns the whole call. */
typedef struct sf_error {
    int64_t index;
} sf_error;

/* Verifies every request's draft chain or tree and emits its tokens.
 * `params` holds values for `draft->batch` requests. The target distribution
 * of a row is sf_probs' (temperature, then top_k, top_p, min_p). Returns
 * SF_OK, or the first error found, in this order of checks: the arguments,
 * every request's parameters, every request's draft counts and shapes, every
 * request's tokens, parents and sparse draft probabilities, then the values
 * each row holds as it is read (logits, dense draft probabilities); within a
 * check, the lowest request. */
SF_API sf_status sf_verify(const sf_logits *logits, const sf_draft *draft,
                           const sf_params *params, sf_method method,
                           sf_verify_out *out, sf_error *err);

/* Samples one token per row into `tokens` (rows,) int32. SF_REJECTION draws
 * from the row's distribution by inverse CDF; SF_COUPLED draws the Gumbel-max
 * token that coupled verification uses at the same (seed, position). */
SF_API sf_status sf_sample(const sf_logits *logits, const sf_params *params,
                           sf_method method, int32_t *tokens, sf_error *err);

/* Writes each row's target distribution into `out` (rows, vocab) float32.
 * Only temperature, top_k, top_p and min_p of `params` are read. */
SF_API sf_status sf_probs(const sf_logits *logits, const sf_params *params,
                          float *out, sf_error *err);

/* Tree attention for a ragged batch of draft trees (the layout of sf_draft:
 * request b has num_draft[b] nodes with local `parents`, -1 for a child of the
 * root). A request's tree has num_draft[b] + 1 tokens: the root (the token of
 * its row 0) at index 0 and node i at index 1 + i. With width = max_draft + 1:
 *   mask       (batch, width, width) uint8, or NULL: mask[b][i][j] is 1 when
 *              token j is token i or one of its ancestors, else 0; a padding
 *              token (past the request's) attends to itself only;
 *   bits       (batch, width, words) uint32 with words = (width + 31) / 32, or
 *              NULL: the same, bit j % 32 of word j / 32;
 *   positions  (batch, width) int32, or NULL: each token's depth (root 0),
 *              -1 past the request's tokens.
 * parents NULL means chains. Returns SF_ERR_PARENT for a bad parent. */
SF_API sf_status sf_tree_mask(const int32_t *parents, const int32_t *num_draft,
                              int64_t batch, int64_t max_draft, uint8_t *mask,
                              uint32_t *bits, int32_t *positions, sf_error *err);

/* A KV cache seen as rows of row_bytes contiguous bytes, addressed by
 * data + o * outer_stride + b * batch_stride + i * inner_stride
 *        + s * seq_stride (strides in bytes): o < n_outer (e.g. layers and
 * K/V), b < batch, i < n_inner (e.g. heads), s < seq_len. */
typedef struct sf_kv_cache {
    void *data;
    int64_t n_outer, outer_stride;
    int64_t batch, batch_stride;
    int64_t n_inner, inner_stride;
    int64_t seq_len, seq_stride;
    int64_t row_bytes;
} sf_kv_cache;

/* After tree verification, moves each request's accepted path to where a
 * chain would hold it: slot root_slot[b] + 1 + nodes[b][k] goes to
 * root_slot[b] + 1 + k for k < num_accepted[b], in place. nodes (batch,
 * max_draft) int32 is sf_verify's accepted_nodes; root_slot (batch,) int64 is
 * the slot of each tree's root token (batch <= SF_MAX_BATCH, max_draft <=
 * SF_MAX_DRAFT). Nodes must increase along the path and
 * stay inside the cache (else SF_ERR_SHAPE); an axis of more than one entry
 * with stride 0 aliases its entries (SF_ERR_ARGUMENT). */
SF_API sf_status sf_kv_compact(const sf_kv_cache *cache, const int32_t *nodes,
                               const int32_t *num_accepted, int64_t max_draft,
                               const int64_t *root_slot, sf_error *err);

/* Threads used by the calls: n >= 1 (at most 256), or 0 for one per core of
 * the process (the main thread's affinity, at most its cgroup CPU quota
 * rounded up). SF_ERR_THREADS where they cannot
 * start: the setting before stays; a call runs alone where its pool cannot start. */
SF_API sf_status sf_set_num_threads(int n);
/* The threads the calls run on, the caller's included: the pool's size, 1
 * where its workers could not start (a size that failed is tried again only
 * by sf_set_num_threads). Does not wait for a call in another thread. */
SF_API int sf_get_num_threads(void);

/* The SIMD level in use: "scalar", "avx2" or "avx512". The environment
 * variable SPECFAST_SIMD may lower it before the first call. */
SF_API const char *sf_simd_level(void);

/* SF_VERSION_NUMBER of the library that is loaded. */
SF_API unsigned sf_version(void);

/* A static, human-readable name for a status. */
SF_API const char *sf_status_string(sf_status status);

#ifdef __cplusplus
}
#endif
#endif /* SPECFAST_H */
