/* tree.c: what a server needs around a draft tree: its attention mask and
 * positions, and compacting the KV cache onto the accepted path. */
#include <stdlib.h>
#include <string.h>

#include "../common/params.h"
#include "specfast.h"

SF_API sf_status sf_tree_mask(const int32_t *parents, const int32_t *num_draft,
                              int64_t batch, int64_t max_draft, uint8_t *mask,
                              uint32_t *bits, int32_t *positions, sf_error *err) {
    if (err) err->index = -1;
    if (!num_draft || batch < 0 || max_draft < 0 || max_draft > SF_MAX_DRAFT ||
        SF_MISALIGNED(parents) || SF_MISALIGNED(num_draft) || SF_MISALIGNED(bits) ||
        SF_MISALIGNED(positions))
        return SF_ERR_ARGUMENT;
    const int64_t width = max_draft + 1, words = (width + 31) / 32;
    int64_t node0 = 0;
    for (int64_t b = 0; b < batch; b++) {
        /* Each value is read once, checked and used: another thread may write
         * the caller's arrays during the call. */
        const int32_t n = num_draft[b];
        if (n < 0 || n > max_draft) {
            if (err) err->index = b;
            return SF_ERR_SHAPE;
        }
        uint8_t *m = mask ? mask + b * width * width : NULL;
        uint32_t *w = bits ? bits + b * width * words : NULL;
        int32_t *pos = positions ? positions + b * width : NULL;
        if (m) memset(m, 0, (size_t)(width * width));
        if (w) memset(w, 0, (size_t)(width * words) * 4);
        for (int64_t t = 0; t <= n; t++) {
            /* Token t (node t - 1) has its parent's ancestors plus itself:
             * parents come first, so their rows are complete. */
            const int64_t p = t == 0 ? -2 : parents ? parents[node0 + t - 1] : t - 2;
            if (t > 0 && (p < -1 || p >= t - 1)) {
                if (err) err->index = b;
                return SF_ERR_PARENT;
            }
            const int64_t parent = p + 1;
            if (m) {
                if (parent >= 0) memcpy(m + t * width, m + parent * width, (size_t)width);
                m[t * width + t] = 1;
            }
            if (w) {
                if (parent >= 0) memcpy(w + t * words, w + parent * words, (size_t)words * 4);
                w[t * words + t / 32] |= 1u << (t % 32);
            }
            if (pos) pos[t] = parent < 0 ? 0 : pos[parent] + 1;
        }
        /* Padding attends to itself only: a row of no keys would give an
         * attention kernel NaN there, and it would spread through the next
         * layer's values (0 weight times NaN) to every row. */
        for (int64_t t = n + 1; t < width; t++) {
            if (m) m[t * width + t] = 1;
            if (w) w[t * words + t / 32] |= 1u << (t % 32);
            if (pos) pos[t] = -1;
        }
        node0 += n;
    }
    return SF_OK;
}

SF_API sf_status sf_kv_compact(const sf_kv_cache *c, const int32_t *nodes,
                               const int32_t *num_accepted, int64_t max_draft,
                               const int64_t *root_slot, sf_error *err) {
    if (err) err->index = -1;
    if (!c || !c->data || !num_accepted || !root_slot || max_draft < 0 ||
        (max_draft > 0 && !nodes) || c->n_outer < 0 || c->batch < 0 ||
        c->n_inner < 0 || c->seq_len < 0 || c->row_bytes < 0 || SF_MISALIGNED(nodes) ||
        SF_MISALIGNED(num_accepted) || SF_MISALIGNED(root_slot))
        return SF_ERR_ARGUMENT;
    /* A stride-0 axis aliases its entries: moves would overwrite each other
     * (an empty cache, which moves nothing, may have any strides). */
    const int empty = !c->n_outer || !c->batch || !c->n_inner || !c->seq_len || !c->row_bytes;
    if (!empty && ((c->n_outer > 1 && !c->outer_stride) || (c->batch > 1 && !c->batch_stride) ||
        (c->n_inner > 1 && !c->inner_stride) || (c->seq_len > 1 && !c->seq_stride)))
        return SF_ERR_ARGUMENT;
    /* The requests' paths, copied (another thread may write the caller's
     * arrays during the call) and all checked before anything moves. */
    if (c->batch > SF_MAX_BATCH || max_draft > SF_MAX_DRAFT) return SF_ERR_SHAPE;
    int64_t *roots = malloc((size_t)c->batch * 8 + (size_t)(c->batch * (max_draft + 1)) * 4 + 8);
    if (!roots) return SF_ERR_NO_MEMORY;
    int32_t *n_at = (int32_t *)(roots + c->batch), *paths = n_at + c->batch;
    for (int64_t b = 0; b < c->batch; b++) {
        const int32_t n = n_at[b] = num_accepted[b];
        const int64_t root = roots[b] = root_slot[b];
        int32_t *path = paths + b * max_draft;
        int bad = n < 0 || n > max_draft || root < 0 || (n > 0 && root >= c->seq_len);
        /* root + 1 + path < seq_len, written so that nothing overflows */
        for (int32_t k = 0; k < n && !bad; k++) {
            path[k] = nodes[b * max_draft + k];
            bad = path[k] < k || (k > 0 && path[k] <= path[k - 1]) ||
                  path[k] >= c->seq_len - 1 - root;
        }
        if (bad) {
            free(roots);
            if (err) err->index = b;
            return SF_ERR_SHAPE;
        }
    }
    char *base = c->data;
    for (int64_t b = 0; b < c->batch; b++) {
        const int32_t *path = paths + b * max_draft;
        const int64_t root = roots[b];
        for (int32_t k = 0; k < n_at[b]; k++) {
            if (path[k] == k) continue; /* already in place */
            const int64_t src = root + 1 + path[k], dst = root + 1 + k;
            for (int64_t o = 0; o < c->n_outer; o++)
                for (int64_t i = 0; i < c->n_inner; i++) {
                    char *row = base + o * c->outer_stride + b * c->batch_stride +
                                i * c->inner_stride;
                    memmove(row + dst * c->seq_stride, row + src * c->seq_stride,
                            (size_t)c->row_bytes);
                }
        }
    }
    free(roots);
    return SF_OK;
}
