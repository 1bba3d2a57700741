/*
 * params.h: reading and checking sf_params, shared by the backends' host code.
 */
#ifndef SF_PARAMS_H
#define SF_PARAMS_H

#include <math.h>

#include "shared.h"
#include "specfast.h"

typedef struct sf_rowparams {
    float temperature; /* 0 = greedy */
    int32_t top_k;
    float top_p, min_p;
    uint64_t seed;
    int64_t position;
} sf_rowparams;

/* A typed pointer whose address is not a multiple of its type's size: C
 * forbids reading through it, and on a GPU such a read faults and loses the
 * context. NULL passes (what may be NULL is checked where it is used). */
#define SF_MISALIGNED(p) (((uintptr_t)(p) & (sizeof *(p) - 1)) != 0)

/* Whether any of the parameter arrays of p is misaligned: an sf_params or a
 * CUDA backend's sf_cuda_params, whose arrays have the same names. */
#define SF_PARAMS_MISALIGNED(p)                                               \
    (SF_MISALIGNED((p)->temperature) || SF_MISALIGNED((p)->top_k) ||          \
     SF_MISALIGNED((p)->top_p) || SF_MISALIGNED((p)->min_p) ||                \
     SF_MISALIGNED((p)->seed) || SF_MISALIGNED((p)->position))

#define SF_PICK(p, field, b) ((p)->field[(p)->n_##field == 1 ? 0 : (b)])

static inline void sf_params_get(const sf_params *p, int64_t b, sf_rowparams *r) {
    r->temperature = SF_PICK(p, temperature, b);
    r->top_k = SF_PICK(p, top_k, b);
    r->top_p = SF_PICK(p, top_p, b);
    r->min_p = SF_PICK(p, min_p, b);
    r->seed = SF_PICK(p, seed, b);
    r->position = SF_PICK(p, position, b);
}

/* Request b's parameters, checked again as they are read: sf_params_check
 * saw the caller's arrays, which another thread may write during the call. */
static inline sf_status sf_params_load(const sf_params *p, int64_t b, sf_rowparams *r) {
    sf_params_get(p, b, r);
    return sf_params_ok(r->temperature, r->top_k, r->top_p, r->min_p) ? SF_OK
                                                                       : SF_ERR_PARAM;
}

/* Checks the shape of `p` for `batch` requests and every value; on a bad
 * value sets *index to the request, or leaves it -1 where the value is one
 * for all. No request, no value read. */
static inline sf_status sf_params_check(const sf_params *p, int64_t batch,
                                        int64_t *index) {
    *index = -1;
    if (!p || !p->temperature || !p->top_k || !p->top_p || !p->min_p ||
        !p->seed || !p->position)
        return SF_ERR_ARGUMENT;
    if (SF_PARAMS_MISALIGNED(p)) return SF_ERR_ARGUMENT;
    const int64_t n[6] = {p->n_temperature, p->n_top_k, p->n_top_p,
                          p->n_min_p, p->n_seed, p->n_position};
    for (int i = 0; i < 6; i++)
        if (n[i] != 1 && n[i] != batch) return SF_ERR_SHAPE;
    /* The values given once, with valid values standing in for the arrays. */
    if (batch > 0 && !sf_params_ok(p->n_temperature == 1 ? p->temperature[0] : 1.0f,
                      p->n_top_k == 1 ? p->top_k[0] : 0, p->n_top_p == 1 ? p->top_p[0] : 1.0f,
                      p->n_min_p == 1 ? p->min_p[0] : 0.0f))
        return SF_ERR_PARAM;
    for (int64_t b = 0; b < batch; b++) {
        sf_rowparams r;
        sf_params_get(p, b, &r);
        if (!sf_params_ok(r.temperature, r.top_k, r.top_p, r.min_p)) {
            *index = b;
            return SF_ERR_PARAM;
        }
    }
    return SF_OK;
}

static inline int sf_dtype_size(sf_dtype d) { return d == SF_F32 ? 4 : 2; }

static inline sf_status sf_logits_check(const sf_logits *l) {
    if (!l || (!l->data && l->rows > 0)) return SF_ERR_ARGUMENT;
    if (l->dtype != SF_F32 && l->dtype != SF_F16 && l->dtype != SF_BF16)
        return SF_ERR_ARGUMENT;
    if ((uintptr_t)l->data % (uintptr_t)sf_dtype_size(l->dtype)) return SF_ERR_ARGUMENT;
    if (l->vocab < 1 || l->vocab > SF_MAX_VOCAB || l->rows < 0 ||
        l->row_stride < l->vocab)
        return SF_ERR_SHAPE;
    /* Row offsets in bytes must not wrap (they read before the buffer). */
    if (l->rows > 1 && l->row_stride > INT64_MAX / 4 / l->rows) return SF_ERR_SHAPE;
    return SF_OK;
}

/* Whether any of the draft's or the verify results' arrays is misaligned. */
static inline int sf_verify_misaligned(const sf_draft *d, const sf_verify_out *o) {
    return SF_MISALIGNED(d->tokens) || SF_MISALIGNED(d->num_draft) ||
           SF_MISALIGNED(d->parents) || SF_MISALIGNED(d->dense) ||
           SF_MISALIGNED(d->sparse_ids) || SF_MISALIGNED(d->sparse_probs) ||
           SF_MISALIGNED(o->tokens) || SF_MISALIGNED(o->num_accepted) ||
           SF_MISALIGNED(o->accepted_nodes);
}

#endif /* SF_PARAMS_H */
