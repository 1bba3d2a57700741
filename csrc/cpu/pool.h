/*
 * pool.h: a small persistent thread pool, and the scratch memory each of its
 * workers keeps between calls (so a call allocates nothing once warm).
 */
#ifndef SF_CPU_POOL_H
#define SF_CPU_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "specfast.h"

/* Slots of sf_scratch, each grown on demand by sf_scratch_get. */
enum { SF_SLOT_BLOCKS, SF_SLOT_RESID, SF_SLOT_IDS, SF_SLOT_VALS, SF_SLOT_KEYS,
       SF_SLOT_OVER_ID, SF_SLOT_OVER_W, SF_SLOT_TREE, SF_SLOT_CUT, SF_SLOTS };

typedef struct sf_scratch {
    void *buf[SF_SLOTS];
    size_t cap[SF_SLOTS];
    int64_t upcoming; /* the item this thread runs next, or -1 */
} sf_scratch;

/* A buffer of at least `bytes` in `slot`, or NULL when memory runs out. */
void *sf_scratch_get(sf_scratch *s, int slot, size_t bytes);

/* Runs fn(ctx, item, scratch) for item in [0, n) on the pool; the calling
 * thread works too. One call at a time: concurrent callers wait their turn.
 * fn returns a status; the result is the status of the lowest failing item,
 * whose index goes to *fail_item (or -1). */
typedef sf_status (*sf_task_fn)(void *ctx, int64_t item, sf_scratch *s);
sf_status sf_parallel_for(int64_t n, sf_task_fn fn, void *ctx,
                          int64_t *fail_item);

/* From inside a task of a one-item sf_parallel_for (when the workers are
 * idle): runs fn(ctx, part, NULL-or-worker-scratch) for part in [0, n) on all
 * threads and returns 1; returns 0, doing nothing, anywhere else. */
int sf_parallel_split(int64_t n, sf_task_fn fn, void *ctx);

/* How many threads sf_parallel_split would use now (1: it would not). */
int sf_parallel_width(void);

#endif /* SF_CPU_POOL_H */
