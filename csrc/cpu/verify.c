/* verify.c: sf_verify on the CPU: chains and trees, one request per task. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../common/params.h"
#include "../common/shared.h"
#include "dist.h"
#include "rowmath.h"

typedef struct verify_ctx {
    const sf_logits *logits;
    const sf_draft *draft;
    const sf_params *params;
    sf_method method;
    sf_verify_out *out;
    const int64_t *node_off; /* first node of each request; rows: + b */
    const sf_kernels *k;
} verify_ctx;

/* q(x) of a node: 1 for deterministic drafts, else read from its row. */
static float draft_prob(const sf_draft *d, int64_t node, int32_t x, int64_t vocab) {
    if (d->kind == SF_DRAFT_DENSE) return d->dense[node * vocab + x];
    if (d->kind == SF_DRAFT_SPARSE) {
        for (int64_t i = 0; i < d->sparse_k; i++)
            if (d->sparse_ids[node * d->sparse_k + i] == x)
                return d->sparse_probs[node * d->sparse_k + i];
        return 0.0f;
    }
    return 1.0f;
}

static sf_status verify_one(void *arg, int64_t b, sf_scratch *s) {
    const verify_ctx *c = arg;
    const sf_draft *dr = c->draft;
    const int64_t vocab = c->logits->vocab, width = c->out->max_draft + 1;
    const int64_t node0 = c->node_off[b], row0 = node0 + b;
    const int32_t nd = dr->num_draft[b];
    const int32_t *tok = dr->tokens + node0;
    int32_t *out_tok = c->out->tokens + b * width;
    int32_t *out_nodes = c->out->accepted_nodes
                             ? c->out->accepted_nodes + b * c->out->max_draft : NULL;
    for (int64_t i = 0; i < width; i++) out_tok[i] = -1;
    if (out_nodes)
        for (int64_t i = 0; i < c->out->max_draft; i++) out_nodes[i] = -1;
    sf_rowparams p;
    if (sf_params_load(c->params, b, &p) != SF_OK) return SF_ERR_PARAM;

    /* first[n + 1]: first child of node n (-1 = the root); next[n]: sibling. */
    int32_t *first = sf_scratch_get(s, SF_SLOT_TREE, (size_t)(2 * nd + 1) * 4);
    if (!first) return SF_ERR_NO_MEMORY;
    int32_t *next = first + nd + 1;
    for (int32_t i = 0; i <= nd; i++) first[i] = -1;
    for (int32_t i = nd - 1; i >= 0; i--) {
        int32_t parent = dr->parents ? dr->parents[node0 + i] : i - 1;
        next[i] = first[parent + 1];
        first[parent + 1] = i;
    }

    sf_dist d;
    const int64_t k_over = dr->kind == SF_DRAFT_SPARSE ? dr->sparse_k : 1;
    d.over_id = sf_scratch_get(s, SF_SLOT_OVER_ID, (size_t)(nd * k_over + 1) * 4);
    d.over_w = sf_scratch_get(s, SF_SLOT_OVER_W, (size_t)(nd * k_over + 1) * 8);
    if (!d.over_id || !d.over_w) return SF_ERR_NO_MEMORY;
    /* Residual buffers: only a rejected sibling with later siblings forms
     * its residual whole into them (a last one's is drawn by tries). */
    int siblings = 0;
    for (int32_t i = 0; i < nd && !siblings; i++) siblings = next[i] >= 0;
    d.resid[0] = d.resid[1] = NULL;
    if (c->method == SF_REJECTION && dr->kind == SF_DRAFT_DENSE && siblings) {
        float *r = sf_scratch_get(s, SF_SLOT_RESID, (size_t)vocab * 8);
        if (!r) return SF_ERR_NO_MEMORY;
        d.resid[0] = r;
        d.resid[1] = r + vocab;
    }

    /* What this thread reads after this request: the next request's first
     * row. The passes that end a request prefetch it. */
    const int64_t es = sf_dtype_size(c->logits->dtype);
    const sf_ahead upcoming = {
        s->upcoming >= 0 ? sf_row_ptr(c->logits, c->node_off[s->upcoming] + s->upcoming)
                         : NULL, es};

    int32_t cur = -1, depth = 0;
    for (;;) {
        const void *row = sf_row_ptr(c->logits, row0 + cur + 1);
        /* The first child's row is next if it is accepted. */
        const sf_ahead child = {
            first[cur + 1] >= 0 ? sf_row_ptr(c->logits, row0 + first[cur + 1] + 1) : NULL, es};
        /* What the row's first passes fetch: the child's row, or at a leaf
         * the next request's. */
        const sf_ahead ahead = child.data ? child : upcoming;
        /* Deeper rows' positions wrap modulo 2^64, as the Philox counter. */
        const int64_t pos = (int64_t)((uint64_t)p.position + (uint64_t)depth);
        int32_t accepted = -1, emit = -1;
        sf_status st;
        if (p.temperature == 0.0f || c->method == SF_COUPLED) {
            /* The target's token is fixed: accept the first child equal to it. */
            if (p.temperature == 0.0f) {
                st = sf_row_greedy(c->k, row, c->logits->dtype, vocab, &emit);
            } else {
                st = sf_dist_prepare(&d, c->k, s, row, c->logits->dtype, vocab, &p, 0,
                                     ahead, INFINITY, NULL);
                /* The noise pass computes more than it reads: it fetches the
                 * rest meanwhile. */
                d.row.next = ahead;
                d.row.also = child.data ? upcoming : (sf_ahead){NULL, 0};
                if (st == SF_OK) emit = sf_dist_coupled(&d, c->k, p.seed, pos);
            }
            if (st != SF_OK) return st;
            for (int32_t ch = first[cur + 1]; ch >= 0; ch = next[ch])
                if (tok[ch] == emit) { accepted = ch; break; }
        } else {
            /* The mass is formed only when needed: most accepted first
             * children are accepted from a bound on it. The max pass reads
             * the child's row ahead until the max shows that u q(x) >=
             * e^((l(x) - max) / T) >= p(x): a sure rejection, which reads
             * that row never. The same pass bounds the mass from the first
             * child's logit, which then decides most acceptances. */
            float until = INFINITY;
            sf_ref_bound rb = {0.0f, 0.0, NAN};
            if (first[cur + 1] >= 0) {
                const int32_t x = tok[first[cur + 1]];
                const float qx = draft_prob(dr, node0 + first[cur + 1], x, vocab);
                const double u = sf_uniform_open0(sf_philox(p.seed, pos, SF_PURPOSE_ACCEPT, 0));
                rb.ref = sf_load(row, c->logits->dtype, x);
                until = qx > 0.0f ? (float)(rb.ref - p.temperature * log(u * qx)) : -INFINITY;
                rb.uq = u * (double)qx;
            }
            st = sf_dist_prepare(&d, c->k, s, row, c->logits->dtype, vocab, &p, 0, ahead,
                                 until, first[cur + 1] >= 0 ? &rb : NULL);
            if (st != SF_OK) return st;
            int have_mass = 0;
            uint32_t j = 0;
            for (int32_t ch = first[cur + 1]; ch >= 0; ch = next[ch], j++) {
                const int64_t node = node0 + ch;
                const int32_t x = tok[ch];
                float qx = draft_prob(dr, node, x, vocab);
                if (!sf_prob_ok(qx)) return SF_ERR_DRAFT_PROBS;
                double u = sf_uniform_open0(sf_philox(p.seed, pos, SF_PURPOSE_ACCEPT, j));
                if (!have_mass) {
                    /* Only the first child comes here: a rejection forms the mass. */
                    const int sure =
                        qx > 0.0f && (isnan(rb.sum)
                                          ? sf_dist_bound_accepts(&d, c->k, u * (double)qx, x, child)
                                          : sf_dist_ref_accepts(&d, u * (double)qx, x, rb.sum));
                    if (sure) {
                        accepted = ch;
                        break;
                    }
                    /* The bound could not accept, so the draft is most likely
                     * rejected: what comes next is its q row (dense, when
                     * later siblings need the residual formed whole) or the
                     * next request. */
                    const int resid_whole = dr->kind == SF_DRAFT_DENSE && next[ch] >= 0;
                    const sf_ahead q_row = {resid_whole ? dr->dense + node * vocab : NULL, 4};
                    st = sf_dist_mass(&d, c->k, s, q_row.data ? q_row : upcoming, resid_whole);
                    if (st != SF_OK) return st;
                    have_mass = 1;
                }
                if (qx > 0.0f && u * (double)qx < sf_dist_prob(&d, x)) {
                    accepted = ch;
                    break;
                }
                if (dr->kind == SF_DRAFT_DENSE) {
                    const float *q = dr->dense + node * vocab;
                    if (next[ch] < 0) {
                        /* The last sibling: its residual is drawn by tries,
                         * and formed only when none keeps a token. */
                        st = sf_dist_resid_tries(&d, c->k, q, p.seed, pos, &emit);
                        if (st != SF_OK) return st;
                        if (emit >= 0) break;
                    }
                    /* What comes next: the q row of a sibling that forms
                     * its residual whole, or the next request. */
                    const int32_t sib = next[ch];
                    const sf_ahead after = sib >= 0 && next[sib] >= 0
                        ? (sf_ahead){dr->dense + (node0 + sib) * vocab, 4} : upcoming;
                    st = sf_dist_reject_dense(&d, c->k, q, sib >= 0, after);
                    if (st != SF_OK) return st;
                } else if (dr->kind == SF_DRAFT_SPARSE) {
                    sf_dist_reject_sparse(&d, dr->sparse_ids + node * dr->sparse_k,
                                          dr->sparse_probs + node * dr->sparse_k,
                                          dr->sparse_k);
                } else {
                    const float one = 1.0f;
                    sf_dist_reject_sparse(&d, &x, &one, 1);
                }
            }
            if (accepted < 0 && emit < 0) {
                if (!have_mass) { /* a leaf: the bonus token */
                    st = sf_dist_mass(&d, c->k, s, upcoming, 0);
                    if (st != SF_OK) return st;
                }
                emit = sf_dist_draw(&d, c->k, p.seed, pos, first[cur + 1] >= 0);
            }
        }
        if (accepted < 0) {
            out_tok[depth] = emit;
            break;
        }
        out_tok[depth] = tok[accepted];
        if (out_nodes) out_nodes[depth] = accepted;
        depth++;
        cur = accepted;
    }
    c->out->num_accepted[b] = depth;
    return SF_OK;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Whether ids (n, -1 = unused) repeat one: pairwise for small n, else sorted
 * in `scratch` (n ints). */
static int has_duplicate(const int32_t *ids, int64_t n, int32_t *scratch) {
    if (n <= 32) {
        for (int64_t a = 1; a < n; a++)
            for (int64_t z = 0; z < a; z++)
                if (ids[a] >= 0 && ids[z] == ids[a]) return 1;
        return 0;
    }
    memcpy(scratch, ids, (size_t)n * sizeof *ids);
    qsort(scratch, (size_t)n, sizeof *scratch, cmp_i32);
    for (int64_t a = 1; a < n; a++)
        if (scratch[a] >= 0 && scratch[a] == scratch[a - 1]) return 1;
    return 0;
}

static int32_t *copy_words(int32_t *dst, const void *src, int64_t count) {
    if (count > 0) memcpy(dst, src, (size_t)count * 4); /* src may be NULL when 0 */
    return dst;
}

/* Copies of the caller's index arrays (num_draft, tokens, parents, sparse
 * ids and probabilities) into one buffer (*mem, freed by the caller), to
 * which d then points: what is checked is then what the requests read, even
 * where another thread writes the caller's arrays during the call (Python
 * releases the GIL: a token changed after its check indexed past the row). */
static sf_status copy_draft(sf_draft *d, void **mem) {
    const int64_t n = d->n, k = d->kind == SF_DRAFT_SPARSE ? d->sparse_k : 0;
    const int64_t fixed = d->batch + n + (d->parents ? n : 0);
    if (n > 0 && k > (INT64_MAX / 4 - fixed) / 2 / n) return SF_ERR_SHAPE;
    int32_t *m = malloc((size_t)(fixed + 2 * n * k + 1) * 4);
    if (!m) return SF_ERR_NO_MEMORY;
    *mem = m;
    d->num_draft = copy_words(m, d->num_draft, d->batch);
    m += d->batch;
    d->tokens = copy_words(m, d->tokens, n);
    m += n;
    if (d->parents) {
        d->parents = copy_words(m, d->parents, n);
        m += n;
    }
    if (k > 0) {
        d->sparse_ids = copy_words(m, d->sparse_ids, n * k);
        m += n * k;
        d->sparse_probs = (const float *)copy_words(m, d->sparse_probs, n * k);
    }
    return SF_OK;
}

/* Checks everything that is cheap to check before any row is read, on a copy
 * of the index arrays (copy_draft) that d points to after an SF_OK. */
static sf_status check_draft(sf_draft *d, const sf_logits *l, int64_t *node_off,
                             int64_t max_draft, int64_t *index, int32_t *scratch,
                             void **mem) {
    *index = -1;
    if (d->batch < 0 || d->batch > SF_MAX_BATCH || d->n < 0 ||
        d->n > d->batch * SF_MAX_DRAFT)
        return SF_ERR_SHAPE;
    if ((d->n > 0 && !d->tokens) || (d->batch > 0 && !d->num_draft))
        return SF_ERR_ARGUMENT;
    if (d->kind != SF_DRAFT_NONE && d->kind != SF_DRAFT_DENSE &&
        d->kind != SF_DRAFT_SPARSE)
        return SF_ERR_ARGUMENT;
    if (d->kind == SF_DRAFT_DENSE && d->n > 0 && !d->dense) return SF_ERR_ARGUMENT;
    if (d->kind == SF_DRAFT_SPARSE &&
        (d->sparse_k < 1 || (d->n > 0 && (!d->sparse_ids || !d->sparse_probs))))
        return SF_ERR_ARGUMENT;
    sf_status st = copy_draft(d, mem);
    if (st != SF_OK) return st;
    int64_t nodes = 0;
    for (int64_t b = 0; b < d->batch; b++) {
        int32_t nd = d->num_draft[b];
        if (nd < 0 || nd > SF_MAX_DRAFT || nd > max_draft) { *index = b; return SF_ERR_SHAPE; }
        node_off[b] = nodes;
        nodes += nd;
    }
    if (nodes != d->n || nodes + d->batch != l->rows) return SF_ERR_SHAPE;
    for (int64_t b = 0; b < d->batch; b++) {
        const int64_t n0 = node_off[b];
        *index = b;
        for (int64_t i = 0; i < d->num_draft[b]; i++) {
            if (d->tokens[n0 + i] < 0 || d->tokens[n0 + i] >= l->vocab) return SF_ERR_TOKEN;
            if (d->parents && (d->parents[n0 + i] < -1 || d->parents[n0 + i] >= i))
                return SF_ERR_PARENT;
            if (d->kind != SF_DRAFT_SPARSE) continue;
            const int32_t *ids = d->sparse_ids + (n0 + i) * d->sparse_k;
            const float *pr = d->sparse_probs + (n0 + i) * d->sparse_k;
            double sum = 0.0;
            for (int64_t a = 0; a < d->sparse_k; a++) {
                if (ids[a] < -1 || ids[a] >= l->vocab || !sf_prob_ok(pr[a]) ||
                    (ids[a] == -1 && pr[a] != 0.0f))
                    return SF_ERR_DRAFT_PROBS;
                sum += pr[a];
            }
            if (!(fabs(sum - 1.0) <= 1e-3) || has_duplicate(ids, d->sparse_k, scratch))
                return SF_ERR_DRAFT_PROBS;
        }
    }
    *index = -1;
    return SF_OK;
}

SF_API sf_status sf_verify(const sf_logits *logits, const sf_draft *draft,
                           const sf_params *params, sf_method method,
                           sf_verify_out *out, sf_error *err) {
    int64_t index = -1;
    sf_status st = sf_logits_check(logits);
    if (st == SF_OK && (!draft || !out || !out->tokens || !out->num_accepted ||
                        out->max_draft < 0 || out->max_draft > SF_MAX_DRAFT ||
                        (out->max_draft > 0 && !out->accepted_nodes) ||
                        sf_verify_misaligned(draft, out)))
        st = SF_ERR_ARGUMENT;
    if (st == SF_OK && method != SF_REJECTION && method != SF_COUPLED)
        st = SF_ERR_ARGUMENT;
    /* Before the parameters are read once per request. */
    if (st == SF_OK && (draft->batch < 0 || draft->batch > SF_MAX_BATCH)) st = SF_ERR_SHAPE;
    if (st == SF_OK) st = sf_params_check(params, draft->batch, &index);
    int64_t *node_off = NULL;
    void *copies = NULL;
    sf_draft dr;
    if (st == SF_OK) {
        dr = *draft;
        node_off = malloc((size_t)(dr.batch > 0 ? dr.batch : 1) * sizeof *node_off);
        int32_t *ids = dr.kind == SF_DRAFT_SPARSE && dr.sparse_k > 32
                           ? malloc((size_t)dr.sparse_k * sizeof *ids) : NULL;
        st = !node_off || (dr.kind == SF_DRAFT_SPARSE && dr.sparse_k > 32 && !ids)
                 ? SF_ERR_NO_MEMORY
                 : check_draft(&dr, logits, node_off, out->max_draft, &index, ids, &copies);
        free(ids);
    }
    if (st == SF_OK) {
        verify_ctx c = {logits, &dr, params, method, out, node_off, sf_cpu_kernels()};
        st = sf_parallel_for(dr.batch, verify_one, &c, &index);
    }
    free(copies);
    free(node_off);
    if (err) err->index = index;
    return st;
}
