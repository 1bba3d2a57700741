"""The C declarations of ``specfast.h`` that cffi needs (ABI mode).

Kept in step with ``csrc/include/specfast.h``; ``tests/test_cdef.py`` parses
the real header and fails when the two disagree.
"""

CDEF = """
typedef enum sf_status {
    SF_OK = 0,
    SF_ERR_ARGUMENT = 1,
    SF_ERR_SHAPE = 2,
    SF_ERR_PARAM = 3,
    SF_ERR_LOGITS = 4,
    SF_ERR_ALL_MASKED = 5,
    SF_ERR_TOKEN = 6,
    SF_ERR_PARENT = 7,
    SF_ERR_DRAFT_PROBS = 8,
    SF_ERR_NO_MEMORY = 9,
    SF_ERR_THREADS = 10,
    SF_ERR_UNSUPPORTED = 11
} sf_status;

typedef enum sf_dtype { SF_F32 = 0, SF_F16 = 1, SF_BF16 = 2 } sf_dtype;

typedef enum sf_method {
    SF_REJECTION = 0,
    SF_COUPLED = 1
} sf_method;

typedef enum sf_draft_kind {
    SF_DRAFT_NONE = 0,
    SF_DRAFT_DENSE = 1,
    SF_DRAFT_SPARSE = 2
} sf_draft_kind;

typedef struct sf_logits {
    const void *data;
    sf_dtype dtype;
    int64_t rows;
    int64_t vocab;
    int64_t row_stride;
} sf_logits;

typedef struct sf_params {
    const float *temperature; int64_t n_temperature;
    const int32_t *top_k;     int64_t n_top_k;
    const float *top_p;       int64_t n_top_p;
    const float *min_p;       int64_t n_min_p;
    const uint64_t *seed;     int64_t n_seed;
    const int64_t *position;  int64_t n_position;
} sf_params;

typedef struct sf_draft {
    const int32_t *tokens;
    int64_t n;
    const int32_t *num_draft;
    int64_t batch;
    const int32_t *parents;
    sf_draft_kind kind;
    const float *dense;
    const int32_t *sparse_ids;
    const float *sparse_probs;
    int64_t sparse_k;
} sf_draft;

typedef struct sf_verify_out {
    int32_t *tokens;
    int32_t *num_accepted;
    int32_t *accepted_nodes;
    int64_t max_draft;
} sf_verify_out;

typedef struct sf_error {
    int64_t index;
} sf_error;

sf_status sf_verify(const sf_logits *logits, const sf_draft *draft,
                    const sf_params *params, sf_method method,
                    sf_verify_out *out, sf_error *err);
sf_status sf_sample(const sf_logits *logits, const sf_params *params,
                    sf_method method, int32_t *tokens, sf_error *err);
sf_status sf_probs(const sf_logits *logits, const sf_params *params,
                   float *out, sf_error *err);
sf_status sf_tree_mask(const int32_t *parents, const int32_t *num_draft,
                       int64_t batch, int64_t max_draft, uint8_t *mask,
                       uint32_t *bits, int32_t *positions, sf_error *err);

typedef struct sf_kv_cache {
    void *data;
    int64_t n_outer, outer_stride;
    int64_t batch, batch_stride;
    int64_t n_inner, inner_stride;
    int64_t seq_len, seq_stride;
    int64_t row_bytes;
} sf_kv_cache;

sf_status sf_kv_compact(const sf_kv_cache *cache, const int32_t *nodes,
                        const int32_t *num_accepted, int64_t max_draft,
                        const int64_t *root_slot, sf_error *err);
sf_status sf_set_num_threads(int n);
int sf_get_num_threads(void);
const char *sf_simd_level(void);
unsigned sf_version(void);
const char *sf_status_string(sf_status status);
"""
