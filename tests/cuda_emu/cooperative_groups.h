/* tests/cuda_emu: the cluster part of cooperative groups (see cuda_runtime.h). */
#ifndef SF_CUDA_EMU_COOPERATIVE_GROUPS_H
#define SF_CUDA_EMU_COOPERATIVE_GROUPS_H

#include "cuda_runtime.h"

namespace cooperative_groups {

struct cluster_group {
    void sync(const char *file = __builtin_FILE(), int line = __builtin_LINE()) const {
        sf_emu::Cluster &c = *sf_emu::cur_block->cluster;
        const unsigned par = sf_emu::self().clusters++ & 1;
        sf_emu::tsan_arrive(&c.hb[par]);
        sf_emu::wait(sf_emu::AT_CLUSTER, file, line);
        sf_emu::tsan_leave(&c.hb[par]);
    }

    unsigned block_rank() const { return sf_emu::cur_block->rank; }

    unsigned num_blocks() const { return sf_emu::cur_block->cluster->size; }

    /* p, a __shared__ variable of this block, in block `rank` of the cluster:
     * the same offset in that block's thread-local storage. */
    template <class T>
    T *map_shared_rank(T *p, unsigned rank) const {
        sf_emu::Block &b = *sf_emu::cur_block;
        sf_emu::Cluster &c = *b.cluster;
        if (rank >= c.size || c.done[rank].load()) {
            b.launch->fail(sf_emu::where() + "map_shared_rank to block rank " +
                           std::to_string(rank) + ", which is not running");
            return p;
        }
        return (T *)((char *)p - &sf_emu::anchor + c.anchor[rank]);
    }
};

inline cluster_group this_cluster() { return cluster_group(); }

} /* namespace cooperative_groups */

#endif
