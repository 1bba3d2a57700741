/*
 * fuzz_tree.c: a libFuzzer harness over sf_tree_mask and sf_kv_compact.
 *
 * sf_tree_mask: ragged batches of trees or chains (parents valid or not,
 * max_draft too small, outputs NULL or not). On SF_OK, for every request and
 * every pair of its tokens, mask[b][i][j] == 1 exactly when j is i or an
 * ancestor of i; the bit-packed mask says the same; positions are depths and
 * -1 past the request's tokens.
 * sf_kv_compact: a cache of random geometry (strides with gaps, outer and
 * inner dims), accepted paths that increase (or not), root slots inside (or
 * not), now and then an axis with stride 0 (must be refused). On SF_OK the
 * cache equals a plain sequential reference of the moves and nothing outside
 * the rows it names changed (ASan checks every access against the exact
 * allocation); a refused call moves nothing.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specfast.h"

typedef struct reader {
    const uint8_t *p;
    size_t n, i;
} reader;
static uint8_t u8(reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }

#define FAIL(...) do { fprintf(stderr, "\nspecfast fuzz_tree: " __VA_ARGS__); \
                       fputc('\n', stderr); abort(); } while (0)

static void *xcalloc(size_t n, size_t s) {
    void *p = calloc(n ? n : 1, s ? s : 1);
    if (!p) abort();
    return p;
}

static void check_status(sf_status st, const sf_error *err, int64_t batch, int valid) {
    if (valid && st != SF_OK) FAIL("a valid call failed: %d (%s)", (int)st, sf_status_string(st));
    if (st == SF_ERR_NO_MEMORY || st == SF_ERR_THREADS || (int)st < 0 ||
        (int)st > SF_ERR_UNSUPPORTED)
        FAIL("status %d", (int)st);
    if (err->index < -1 || err->index >= (batch > 0 ? batch : 1))
        FAIL("err.index %lld", (long long)err->index);
}

static void run_mask(reader *r) {
    int64_t batch = u8(r) % 6;
    int32_t *nd = xcalloc((size_t)batch, 4);
    int64_t n = 0, max_nd = 0;
    int valid = 1;
    for (int64_t b = 0; b < batch; b++) {
        uint8_t c = u8(r);
        nd[b] = c % 40;
        if (c == 0xFF) { nd[b] = -1; valid = 0; }
        if (nd[b] > 0) n += nd[b];
        if (nd[b] > max_nd) max_nd = nd[b];
    }
    uint8_t pm = u8(r) % 4;
    int32_t *par = pm ? xcalloc((size_t)n, 4) : NULL;
    int64_t *node0 = xcalloc((size_t)batch + 1, 8);
    for (int64_t b = 0, off = 0; b < batch; b++) {
        node0[b] = off;
        for (int32_t i = 0; i < nd[b]; i++) {
            int32_t p = pm == 1 ? (int32_t)(u8(r) % (uint32_t)(i + 1)) - 1 : pm == 2 ? -1 : i - 1;
            if (pm == 3 && u8(r) == 0xFF) { p = (u8(r) & 1) ? i : -2; valid = 0; }
            if (par) par[off + i] = p;
        }
        if (nd[b] > 0) off += nd[b];
    }
    uint8_t oc = u8(r);
    int64_t max_draft = max_nd + oc % 3;
    if (oc == 0xFF && max_nd > 0) { max_draft = max_nd - 1; valid = 0; }
    const int64_t w = max_draft + 1, words = (w + 31) / 32;
    uint8_t *mask = (oc & 0x40) ? NULL : xcalloc((size_t)(batch * w * w), 1);
    uint32_t *bits = (oc & 0x20) ? NULL : xcalloc((size_t)(batch * w * words), 4);
    int32_t *pos = (oc & 0x10) ? NULL : xcalloc((size_t)(batch * w), 4);
    sf_error err = {-5};
    sf_status st = sf_tree_mask(par, nd, batch, max_draft, mask, bits, pos, &err);
    check_status(st, &err, batch, valid);
    if (st == SF_OK) {
        int32_t *depth = xcalloc((size_t)w, 4), *pp = xcalloc((size_t)w, 4);
        for (int64_t b = 0; b < batch; b++) {
            const int64_t t = nd[b] + 1; /* tokens: root + nodes */
            pp[0] = -1;
            depth[0] = 0;
            for (int64_t i = 1; i < t; i++) {
                int32_t p = par ? par[node0[b] + i - 1] : (int32_t)i - 2;
                pp[i] = p + 1;
                depth[i] = depth[p + 1] + 1;
            }
            for (int64_t i = 0; i < w; i++) {
                if (pos && pos[b * w + i] != (i < t ? depth[i] : -1))
                    FAIL("request %lld: position[%lld] = %d", (long long)b, (long long)i,
                         pos[b * w + i]);
                if (i >= t) continue;
                for (int64_t j = 0; j < w; j++) {
                    int anc = 0;
                    for (int64_t a = i; a >= 0; a = pp[a]) anc |= a == j;
                    int m = mask ? mask[(b * w + i) * w + j] : anc;
                    int bit = bits ? (int)((bits[(b * w + i) * words + j / 32] >> (j % 32)) & 1)
                                   : anc;
                    if (j < t && (m != anc || bit != anc))
                        FAIL("request %lld: mask[%lld][%lld] = %d / bit %d, want %d",
                             (long long)b, (long long)i, (long long)j, m, bit, anc);
                    if (j >= t && (m || bit))
                        FAIL("request %lld: mask past the tokens at [%lld][%lld]", (long long)b,
                             (long long)i, (long long)j);
                }
            }
        }
        free(depth);
        free(pp);
    }
    free(mask);
    free(bits);
    free(pos);
    free(par);
    free(node0);
    free(nd);
}

static void run_kv(reader *r) {
    const int64_t batch = u8(r) % 5, n_outer = 1 + u8(r) % 3, n_inner = 1 + u8(r) % 3;
    const int64_t seq = 1 + u8(r) % 24, row_bytes = 1 + u8(r) % 20;
    const int64_t gap = u8(r) % 3; /* padding between rows */
    /* layout: outer, batch, seq, inner (seq-major within a request), or inner first */
    const int inner_first = u8(r) & 1;
    int64_t rs = row_bytes + gap, inner_stride, seq_stride;
    if (inner_first) { seq_stride = rs; inner_stride = seq * rs; }
    else { inner_stride = rs; seq_stride = n_inner * rs; }
    const int64_t batch_stride = seq * n_inner * rs, outer_stride = batch * batch_stride;
    const size_t bytes = (size_t)(n_outer * outer_stride);
    uint8_t *data = xcalloc(bytes, 1), *ref = xcalloc(bytes, 1);
    for (size_t i = 0; i < bytes; i++) data[i] = ref[i] = (uint8_t)(i * 131u + 7u);
    uint8_t oc = u8(r);
    const int64_t max_draft = oc % 8;
    int32_t *nodes = xcalloc((size_t)(batch * (max_draft ? max_draft : 1)), 4);
    int32_t *nacc = xcalloc((size_t)batch, 4);
    int64_t *root = xcalloc((size_t)batch, 8);
    int valid = 1;
    for (int64_t b = 0; b < batch; b++) {
        int32_t na = max_draft ? (int32_t)(u8(r) % (uint32_t)(max_draft + 1)) : 0;
        nacc[b] = na;
        root[b] = u8(r) % (uint32_t)seq;
        int32_t cur = -1;
        for (int64_t k = 0; k < max_draft; k++) {
            if (k < na) {
                cur += 1 + u8(r) % 3; /* increasing node indices */
                nodes[b * max_draft + k] = cur;
            } else {
                nodes[b * max_draft + k] = -1;
            }
        }
        if (na && root[b] + 1 + cur >= seq) valid = 0; /* runs off the cache */
        uint8_t bad = u8(r);
        if (bad == 0xFF && na > 1) { nodes[b * max_draft + 1] = nodes[b * max_draft]; valid = 0; }
        if (bad == 0xFE) { root[b] = -1 - (bad & 1); valid = 0; }
        if (bad == 0xFD) { nacc[b] = (int32_t)max_draft + 1; valid = 0; }
        if (bad == 0xFC) { /* root + 1 + node wraps past INT64_MAX */
            root[b] = INT64_MAX - u8(r) % 4;
            if (na) valid = 0;
        }
    }
    sf_kv_cache c = {data, n_outer, outer_stride, batch, batch_stride, n_inner, inner_stride,
                     seq, seq_stride, row_bytes};
    /* An axis with stride 0 (an expanded view) aliases its entries: refused,
     * unless the cache is empty (batch 0: the only axis here that can be). */
    const uint8_t alias = batch ? u8(r) % 16 : 0;
    int aliased = 0;
    if (alias == 1 && n_outer > 1) c.outer_stride = 0, aliased = 1;
    if (alias == 2 && batch > 1) c.batch_stride = 0, aliased = 1;
    if (alias == 3 && n_inner > 1) c.inner_stride = 0, aliased = 1;
    if (alias == 4 && seq > 1) c.seq_stride = 0, aliased = 1;
    sf_error err = {-5};
    sf_status st = sf_kv_compact(&c, nodes, nacc, max_draft, root, &err);
    check_status(st, &err, batch, valid && !aliased);
    if (aliased && st == SF_OK) FAIL("a cache with a stride-0 axis was accepted");
    if (st != SF_OK && memcmp(data, ref, bytes)) FAIL("a refused call moved entries");
    if (st == SF_OK) {
        for (int64_t b = 0; b < batch; b++)
            for (int64_t k = 0; k < nacc[b]; k++) {
                int64_t src = root[b] + 1 + nodes[b * max_draft + k], dst = root[b] + 1 + k;
                for (int64_t o = 0; o < n_outer; o++)
                    for (int64_t i = 0; i < n_inner; i++) {
                        uint8_t *base = ref + o * outer_stride + b * batch_stride + i * inner_stride;
                        memmove(base + dst * seq_stride, base + src * seq_stride,
                                (size_t)row_bytes);
                    }
            }
        if (memcmp(data, ref, bytes))
            FAIL("the compacted cache differs from the reference");
    }
    free(data);
    free(ref);
    free(nodes);
    free(nacc);
    free(root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size, 0};
    if (u8(&r) & 1) run_kv(&r);
    else run_mask(&r);
    return 0;
}
