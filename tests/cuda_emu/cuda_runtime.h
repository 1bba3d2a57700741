/*
 * tests/cuda_emu: a CPU emulator of the CUDA that csrc/cuda/kernels.cu uses,
 * so that the kernels' decisions are compared with the CPU backend's on
 * machines without a GPU (tests/test_cuda.py, built by tests/cuda_emu.py).
 *
 * kernels.cu is compiled as C++ with this folder first on the include path:
 * <cuda_runtime.h>, <cooperative_groups.h> and <cuda_pipeline_primitives.h>
 * resolve here, and the result is a libspecfast_cuda.so whose "device
 * pointers" are host pointers.
 *
 * Model
 * - Each block runs on an OS thread of its own, its threads as fibers (small
 *   stacks switched by sf_emu_switch below) that run one at a time, each until
 *   it waits at a barrier or a shuffle or returns. __shared__ is thread_local:
 *   every block has its own shared memory, as on the GPU. The blocks of a
 *   cluster run at once; map_shared_rank finds a variable of another block at
 *   the same offset in that block's thread-local storage.
 * - __syncthreads waits for every thread of the block that has not returned;
 *   a shuffle waits for all 32 lanes of its warp (the full mask only);
 *   cluster.sync() waits for every block of the cluster that has not
 *   returned. Threads stuck at different barriers (a shuffle under
 *   divergence, a barrier in a branch) fail the launch with a message rather
 *   than hang, and so do reads of an exited block's shared memory, a cluster
 *   that does not divide the grid, and dynamic shared memory past 48 KB
 *   without cudaFuncAttributeMaxDynamicSharedMemorySize.
 * - Between barriers the threads run in thread order, or as
 *   SPECFAST_CUDA_EMU_ORDER says: "reverse", or a number, the seed of a new
 *   random order each time. A result that changes with the order is a race
 *   between threads that the barriers do not order.
 * - Devices: SPECFAST_CUDA_EMU_DEVICE picks what cudaGetDevice returns. 0
 *   (the default) is sm_90-like: clusters of up to 8 blocks, 227 KB of shared
 *   memory a block may opt in to. 1 launches no clusters and grants 99 KB (an
 *   sm_86 / sm_89 GPU, or a MIG or vGPU setup without clusters). 2 launches
 *   clusters but grants 64 KB, less than any GPU does, so that the host's
 *   fallbacks show without the static shared memory's size (unknown here).
 *   3 launches clusters of at most 2 blocks (a MIG slice of few SMs). 4
 *   launches clusters but runs the kernels from code built for sm_80 (an
 *   sm_80 build's PTX compiled by the driver for a Hopper GPU), which has
 *   no cluster paths: a cluster launch there would combine nothing.
 *   A launch past a device's limits fails.
 * - A launch runs to its end before cudaLaunchKernelEx returns; streams are
 *   ignored. A block's shared memory, static and dynamic, starts filled with
 *   0xFF bytes (a NaN as float): the GPU's is uninitialised too.
 * - Arithmetic: IEEE float and double, no fused multiply-add (the build
 *   passes -ffp-contract=off; the GPU build -fmad=false), so the _rn
 *   intrinsics are the plain operators.
 * What it cannot show: speed; memory visibility (every write is seen at
 * once, so a missing __ldcg or fence passes); the static shared memory's
 * size (unknown here, so the 48 KB limit counts the dynamic part alone).
 * Races that the threads' order hides are for ThreadSanitizer (race_check.cc).
 */
#ifndef SF_CUDA_EMU_RUNTIME_H
#define SF_CUDA_EMU_RUNTIME_H

#if !defined(__x86_64__)
#error "tests/cuda_emu switches fiber stacks with x86-64 code"
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreReadsBegin(const char *file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char *file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char *file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char *file, int line);
#endif

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

/* shared.h's device branch: the _rn intrinsics and __umul64hi below. */
#define __CUDA_ARCH__ 900

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ thread_local /* at block scope thread_local implies static */

/* ---- types ---- */

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorLaunchFailure = 719,
};
typedef void *cudaStream_t;

enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
enum { cudaSharedmemCarveoutMaxShared = 100 };
struct cudaFuncAttributes { size_t sharedSizeBytes; int maxThreadsPerBlock, ptxVersion; };

enum cudaDeviceAttr {
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrClusterLaunch = 120,
};

enum cudaLaunchAttributeID { cudaLaunchAttributeClusterDimension = 4 };
union cudaLaunchAttributeValue {
    struct { unsigned x, y, z; } clusterDim;
    char pad[64];
};
struct cudaLaunchAttribute {
    cudaLaunchAttributeID id;
    cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
    dim3 gridDim, blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned numAttrs;
};

/* ---- the emulator ---- */

extern "C" void sf_emu_switch(void **save_sp, void *to_sp);
extern "C" void sf_emu_start(void);

/* Saves the callee-saved registers on the current stack, stores its pointer
 * in *save_sp and resumes the stack to_sp (System V x86-64). A new fiber's
 * stack "returns" into sf_emu_start, which calls r13(r12). */
__asm__(R"(
    .text
    .globl sf_emu_switch
    .hidden sf_emu_switch
    .type sf_emu_switch, @function
sf_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size sf_emu_switch, .-sf_emu_switch
    .globl sf_emu_start
    .hidden sf_emu_start
    .type sf_emu_start, @function
sf_emu_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size sf_emu_start, .-sf_emu_start
)");

thread_local uint3 blockIdx, blockDim, gridDim;

/* The launch's dynamic shared memory (block.cuh declares it extern). */
#define SF_EMU_SHARED_MAX (227 * 1024)
thread_local __attribute__((aligned(16))) uint64_t sf_cu_dynamic[SF_EMU_SHARED_MAX / 8];

namespace sf_emu {

enum { RUN, AT_WARP, AT_BLOCK, AT_CLUSTER, DONE };
constexpr size_t STACK = 64 * 1024; /* the kernels use a few KB; a guard page below */

struct Fiber {
    void *sp;
    uint3 tid;
    int state;
    unsigned shuffles, barriers, clusters; /* how many this thread has passed */
    const char *file;            /* where it waits */
    int line;
    char *lo;                    /* its stack: [lo, lo + STACK) */
    void *fake;                  /* AddressSanitizer's state while it waits */
    void *tsan;                  /* ThreadSanitizer's fiber */
    bool started;
};

struct Launch;

/* The blocks of one cluster, each on its own OS thread. */
struct Cluster {
    Launch *launch;
    unsigned first, size; /* blocks first .. first + size - 1 */
    std::mutex m;
    std::condition_variable cv;
    unsigned arrived = 0, live, gen = 0, registered = 0;
    char *anchor[8] = {};
    std::atomic<bool> done[8] = {};
    bool failed = false;
    char hb[2]; /* ThreadSanitizer: cluster.sync() orders what comes before it */
};

struct Launch {
    dim3 grid, block;
    size_t dynamic;
    uint64_t order; /* 0: thread order, 1: reversed, else the seed of random orders */
    const std::function<void()> *body;
    std::mutex m;
    std::string error;
    std::atomic<bool> failed{false};

    void fail(const std::string &why) {
        std::lock_guard<std::mutex> hold(m);
        if (error.empty()) error = why;
        failed = true;
    }
};

struct Block {
    Launch *launch;
    Cluster *cluster;
    unsigned rank;
    std::vector<Fiber> fibers;
    void *sched_sp;
    void *sched_tsan;
    char hb[2]; /* ThreadSanitizer: __syncthreads orders what comes before it */
    char hb_end; /* and the block's end orders all it did before what follows */
    const void *sched_lo; /* the OS thread's stack, for AddressSanitizer */
    size_t sched_size;
    uint64_t slots[32][2][32]; /* per warp, per shuffle parity, per lane */
    int orv[2];
    unsigned bar_gen;
};

/* A variable in this module's thread-local storage: others are found at
 * their offset from it in another thread. */
thread_local char anchor;
thread_local Block *cur_block;
thread_local Fiber *cur_fiber;

/* Under AddressSanitizer every switch of stacks is announced to it, so that
 * it checks each fiber's stack as a stack (the hardening stage builds the
 * emulator with -fsanitize=address: kernels' out-of-bounds reads fail). */
#if defined(__SANITIZE_ADDRESS__)
inline void asan_leave(void **fake, const void *to_lo, size_t to_size) {
    __sanitizer_start_switch_fiber(fake, to_lo, to_size);
}
inline void asan_enter(void *fake, const void **from_lo, size_t *from_size) {
    __sanitizer_finish_switch_fiber(fake, from_lo, from_size);
}
#else
inline void asan_leave(void **, const void *, size_t) {}
inline void asan_enter(void *, const void **, size_t *) {}
#endif

/* Under ThreadSanitizer each CUDA thread is a fiber of its own: switching
 * orders nothing (but the launch before every thread's start, which is in
 * the first round, and every thread's end before the block's), barriers order
 * everything before them before everything after them, and the scheduler's
 * own bookkeeping is not watched.
 * Two threads touching the same memory between two barriers, one of them
 * writing (not atomically), is then a reported race. A barrier's parity
 * picks its token, so threads that left one barrier are not ordered by
 * those still leaving it. */
#if defined(__SANITIZE_THREAD__)
inline void tsan_switch(void *to, bool sync) {
    __tsan_switch_to_fiber(to, sync ? 0 : __tsan_switch_to_fiber_no_sync);
}
inline void tsan_arrive(void *token) { __tsan_release(token); }
inline void tsan_leave(void *token) { __tsan_acquire(token); }
/* Fibers are kept for the next block: creating one costs about a millisecond. */
inline std::mutex tsan_pool_lock;
inline std::vector<void *> tsan_pool;
inline void *tsan_fiber_new() {
    std::lock_guard<std::mutex> hold(tsan_pool_lock);
    if (tsan_pool.empty()) return __tsan_create_fiber(0);
    void *f = tsan_pool.back();
    tsan_pool.pop_back();
    return f;
}
inline void tsan_fiber_free(void *f) {
    std::lock_guard<std::mutex> hold(tsan_pool_lock);
    tsan_pool.push_back(f);
}
inline void *tsan_current() { return __tsan_get_current_fiber(); }
inline void tsan_unwatched(bool on) {
    if (on) {
        AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
        AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    } else {
        AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
        AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    }
}
#else
inline void tsan_switch(void *, bool) {}
inline void tsan_arrive(void *) {}
inline void tsan_leave(void *) {}
inline void *tsan_fiber_new() { return NULL; }
inline void tsan_fiber_free(void *) {}
inline void *tsan_current() { return NULL; }
inline void tsan_unwatched(bool) {}
#endif

/* Back to the scheduler, until the thread is released. */
inline void wait(int state, const char *file, int line) {
    Fiber *f = cur_fiber;
    Block *b = cur_block;
    f->state = state;
    f->file = file;
    f->line = line;
    asan_leave(state == DONE ? NULL : &f->fake, b->sched_lo, b->sched_size);
    if (state == DONE) tsan_arrive(&b->hb_end);
    tsan_switch(b->sched_tsan, false);
    sf_emu_switch(&f->sp, b->sched_sp);
    asan_enter(f->fake, NULL, NULL);
}

extern "C" inline void sf_emu_fiber_main(Fiber *) {
    Block *b = cur_block;
    asan_enter(NULL, &b->sched_lo, &b->sched_size);
    (*b->launch->body)();
    wait(DONE, "", 0);
}

/* Called on a block's OS thread, whose blockIdx is the block's. */
inline std::string where() {
    return "block " + std::to_string(blockIdx.x) + ": ";
}

/* Where threads [t0, t1) wait, e.g. "threads 0-31 at a shuffle (block.cuh:152)". */
inline std::string describe(const Block &b, size_t t0, size_t t1) {
    static const char *names[] = {"running", "a shuffle", "__syncthreads", "cluster.sync",
                                  "returned"};
    std::string s;
    for (size_t t = t0; t < t1;) {
        const Fiber &f = b.fibers[t];
        size_t u = t + 1;
        while (u < t1 && b.fibers[u].state == f.state &&
               (f.state == DONE || (b.fibers[u].line == f.line && !strcmp(b.fibers[u].file, f.file))))
            u++;
        s += (s.empty() ? "" : ", ") + std::string("threads ") + std::to_string(t) + "-" +
             std::to_string(u - 1) + " at " + names[f.state];
        if (f.state != DONE) {
            const char *base = strrchr(f.file, '/');
            s += std::string(" (") + (base ? base + 1 : f.file) + ":" + std::to_string(f.line) + ")";
        }
        t = u;
    }
    return s;
}

/* Whether the threads [t0, t1) that wait in `state` all wait at one place,
 * having passed as many barriers and shuffles: barriers or shuffles in
 * divergent code are undefined on the GPU. */
inline bool one_site(Block &b, size_t t0, size_t t1, int state) {
    const Fiber *first = NULL;
    for (size_t t = t0; t < t1; t++) {
        const Fiber &f = b.fibers[t];
        if (f.state != state) continue;
        if (!first) first = &f;
        else if (f.line != first->line || strcmp(f.file, first->file) ||
                 f.barriers != first->barriers || f.shuffles != first->shuffles ||
                 f.clusters != first->clusters) {
            b.launch->fail(where() + "threads wait at different places: " + describe(b, t0, t1));
            return false;
        }
    }
    return true;
}

/* Waits until every live block of the cluster has arrived; false when the
 * launch failed meanwhile. */
inline bool cluster_barrier(Cluster &c) {
    std::unique_lock<std::mutex> lk(c.m);
    if (c.failed) return false;
    const unsigned gen = c.gen;
    if (++c.arrived == c.live) {
        c.arrived = 0;
        c.gen++;
        c.cv.notify_all();
        return true;
    }
    c.cv.wait(lk, [&] { return c.gen != gen || c.failed; });
    return c.gen != gen;
}

/* Runs the threads until every one has returned: each until it waits, then
 * releases the warps whose 32 lanes all wait at a shuffle, else the block
 * when all its live threads wait at __syncthreads, else the cluster when they
 * wait at cluster.sync. False when the launch fails. */
inline bool schedule(Block &b) {
    const size_t n = b.fibers.size();
    std::vector<size_t> order(n);
    for (size_t t = 0; t < n; t++) order[t] = b.launch->order == 1 ? n - 1 - t : t;
    uint64_t rnd = b.launch->order * 0x9E3779B97F4A7C15ull ^ blockIdx.x;
    for (;;) {
        if (b.launch->order > 1) {
            for (size_t t = n - 1; t > 0; t--) { /* Fisher-Yates on xorshift64 */
                rnd ^= rnd << 13, rnd ^= rnd >> 7, rnd ^= rnd << 17;
                std::swap(order[t], order[rnd % (t + 1)]);
            }
        }
        for (size_t t : order) {
            Fiber &f = b.fibers[t];
            if (f.state != RUN) continue;
            cur_fiber = &f;
            void *fake = NULL;
            asan_leave(&fake, f.lo, STACK);
            tsan_switch(f.tsan, !f.started);
            f.started = true;
            sf_emu_switch(&b.sched_sp, f.sp);
            asan_enter(fake, NULL, NULL);
        }
        if (b.launch->failed) return false;
        size_t count[DONE + 1] = {};
        bool released = false;
        for (size_t l0 = 0; l0 < n; l0 += 32) {
            const size_t l1 = l0 + 32 < n ? l0 + 32 : n;
            size_t at_warp = 0;
            for (size_t l = l0; l < l1; l++) {
                count[b.fibers[l].state]++;
                at_warp += b.fibers[l].state == AT_WARP;
            }
            if (at_warp == l1 - l0) {
                if (!one_site(b, l0, l1, AT_WARP)) return false;
                for (size_t l = l0; l < l1; l++) b.fibers[l].state = RUN;
                released = true;
            }
        }
        if (released) continue;
        if (count[DONE] == n) return true;
        const int state = count[AT_BLOCK] + count[DONE] == n     ? AT_BLOCK
                          : count[AT_CLUSTER] + count[DONE] == n ? AT_CLUSTER
                                                                 : RUN;
        if (state == RUN) {
            b.launch->fail(where() + "threads wait at different barriers: " + describe(b, 0, n));
            return false;
        }
        if (!one_site(b, 0, n, state)) return false;
        if (state == AT_BLOCK) {
            b.orv[(b.bar_gen + 1) & 1] = 0;
            b.bar_gen++;
        } else if (!cluster_barrier(*b.cluster)) {
            return false;
        }
        for (Fiber &f : b.fibers)
            if (f.state == state) f.state = RUN;
    }
}

/* This module's thread-local storage in the calling thread: every __shared__
 * variable, the emulator's own few too. */
inline std::pair<char *, size_t> tls_block() {
    std::pair<char *, size_t> r(NULL, 0);
    dl_iterate_phdr([](struct dl_phdr_info *info, size_t, void *out) {
        for (int i = 0; i < info->dlpi_phnum; i++) {
            const ElfW(Phdr) &ph = info->dlpi_phdr[i];
            char *tls = (char *)info->dlpi_tls_data;
            if (ph.p_type == PT_TLS && tls && tls <= &anchor && &anchor < tls + ph.p_memsz) {
                *(std::pair<char *, size_t> *)out = {tls, ph.p_memsz};
                return 1;
            }
        }
        return 0;
    }, &r);
    return r;
}

/* A block's shared memory starts as 0xFF bytes (a NaN as float, -1 as an
 * integer), as uninitialised as the GPU's: a read before the block's own
 * write shows. Under AddressSanitizer the dynamic shared memory past the
 * launch's size is poisoned. */
inline void fresh_shared(size_t dynamic) {
    const std::pair<char *, size_t> tls = tls_block();
    char *dyn = (char *)sf_cu_dynamic, *end = tls.first + tls.second;
    if (tls.first && tls.first <= dyn && dyn + sizeof sf_cu_dynamic <= end) {
        memset(tls.first, 0xFF, (size_t)(dyn - tls.first));
        memset(dyn + sizeof sf_cu_dynamic, 0xFF, (size_t)(end - dyn - sizeof sf_cu_dynamic));
    }
    memset(dyn, 0xFF, dynamic);
#if defined(__SANITIZE_ADDRESS__)
    __asan_poison_memory_region((char *)sf_cu_dynamic + dynamic, sizeof sf_cu_dynamic - dynamic);
#else
    (void)dynamic;
#endif
}

inline void fail_cluster(Cluster &c) {
    std::lock_guard<std::mutex> hold(c.m);
    c.failed = true;
    c.cv.notify_all();
}

inline void run_block(Cluster &c, unsigned rank) {
    Launch &L = *c.launch;
    fresh_shared(L.dynamic); /* first: the emulator's own variables are set below */
    Block b;
    b.launch = &L;
    b.cluster = &c;
    b.rank = rank;
    blockIdx = {c.first + rank, 0, 0};
    blockDim = {L.block.x, 1, 1};
    gridDim = {L.grid.x, 1, 1};
    b.sched_lo = NULL;
    b.sched_size = 0;
    b.orv[0] = b.orv[1] = 0;
    b.bar_gen = 0;
    {
        /* Every block's storage is known before any thread runs. */
        std::unique_lock<std::mutex> lk(c.m);
        c.anchor[rank] = &anchor;
        c.registered++;
        c.cv.notify_all();
        c.cv.wait(lk, [&] { return c.registered == c.size; });
    }
    const size_t n = L.block.x, page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t each = STACK + page;
    char *mem = (char *)mmap(NULL, n * each, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    bool ok = mem != MAP_FAILED;
    if (!ok) L.fail(where() + "cannot map the threads' stacks");
    if (ok) {
        b.fibers.resize(n);
        for (size_t t = 0; t < n; t++) {
            char *lo = mem + t * each;
            mprotect(lo, page, PROT_NONE); /* a stack overflow faults */
            uintptr_t top = ((uintptr_t)(lo + each)) & ~(uintptr_t)15;
            void **sp = (void **)(top - 72);
            /* popped into r15, r14, r13, r12, rbx, rbp, then the return address */
            sp[0] = NULL;
            sp[1] = NULL;
            sp[2] = (void *)&sf_emu_fiber_main;
            sp[3] = &b.fibers[t];
            sp[4] = NULL;
            sp[5] = NULL;
            sp[6] = (void *)&sf_emu_start;
            Fiber &f = b.fibers[t];
            f.sp = sp;
            f.tid = {(unsigned)t, 0, 0};
            f.state = RUN;
            f.shuffles = f.barriers = f.clusters = 0;
            f.lo = lo + page;
            f.fake = NULL;
            f.tsan = tsan_fiber_new();
            f.started = false;
        }
        cur_block = &b;
        b.sched_tsan = tsan_current();
        tsan_unwatched(true);
        ok = schedule(b);
        cur_block = NULL;
        cur_fiber = NULL;
        tsan_unwatched(false);
        tsan_leave(&b.hb_end);
        for (Fiber &f : b.fibers)
            if (f.state == DONE) tsan_fiber_free(f.tsan); /* an abandoned one is left */
    }
    if (!ok) fail_cluster(c);
    {
        /* Others may still read this block's shared memory until they end. */
        std::unique_lock<std::mutex> lk(c.m);
        c.done[rank] = true;
        c.live--;
        if (c.live > 0 && c.arrived == c.live) {
            c.arrived = 0;
            c.gen++;
        }
        c.cv.notify_all();
        c.cv.wait(lk, [&] { return c.live == 0; }); /* failed ones too: all return */
    }
#if defined(__SANITIZE_ADDRESS__)
    /* Frames of threads that never returned (each ends in a switch, a failed
     * one mid-way) leave poisoned stack; the next mapping may get it. */
    __asan_unpoison_memory_region(sf_cu_dynamic, sizeof sf_cu_dynamic);
    if (mem != MAP_FAILED) __asan_unpoison_memory_region(mem, n * each);
#endif
    if (mem != MAP_FAILED) munmap(mem, n * each);
}

/* The emulated devices (the header's comment): clusters, opt-in shared memory. */
struct Device { bool clusters; int shared_optin; unsigned max_cluster; int ptx; };
inline const Device devices[] = {
    {true, SF_EMU_SHARED_MAX, 8, 90}, {false, 99 * 1024, 1, 90}, {true, 64 * 1024, 8, 90},
    {true, SF_EMU_SHARED_MAX, 2, 90}, {true, SF_EMU_SHARED_MAX, 8, 80}};
enum { DEVICES = sizeof devices / sizeof devices[0] };

inline int current_device() {
    const char *env = getenv("SPECFAST_CUDA_EMU_DEVICE");
    const int d = env ? atoi(env) : 0;
    return d >= 0 && d < DEVICES ? d : 0;
}

/* Kernels the host granted more than 48 KB of dynamic shared memory, per
 * device. */
inline std::mutex grants_lock;
inline std::vector<std::pair<std::pair<int, const void *>, int>> grants;

inline thread_local std::string last_error;

inline cudaError_t launch(const cudaLaunchConfig_t &cfg, const void *kernel,
                          const std::function<void()> &body) {
    unsigned csize = 1;
    for (unsigned i = 0; i < cfg.numAttrs; i++)
        if (cfg.attrs[i].id == cudaLaunchAttributeClusterDimension)
            csize = cfg.attrs[i].val.clusterDim.x;
    const Device &dev = devices[current_device()];
    int granted = 48 * 1024;
    {
        std::lock_guard<std::mutex> hold(grants_lock);
        for (auto &g : grants)
            if (g.first == std::make_pair(current_device(), kernel)) granted = g.second;
    }
    std::string bad;
    if (cfg.gridDim.y != 1 || cfg.gridDim.z != 1 || cfg.blockDim.y != 1 || cfg.blockDim.z != 1)
        bad = "only 1-D grids and blocks are emulated";
    else if (cfg.blockDim.x < 1 || cfg.blockDim.x > 1024)
        bad = "blockDim.x must be in [1, 1024]";
    else if (cfg.gridDim.x < 1)
        bad = "an empty grid";
    else if (csize < 1 || csize > 8 || cfg.gridDim.x % csize)
        bad = "cluster size " + std::to_string(csize) + " does not divide the grid (or is past 8)";
    else if (csize > 1 && !dev.clusters)
        bad = "a cluster on a device that launches none";
    else if (csize > 1 && dev.ptx < 90)
        bad = "a cluster launch of code built for sm_" + std::to_string(dev.ptx) +
              ", which has no cluster paths";
    else if (csize > dev.max_cluster)
        bad = "a cluster of " + std::to_string(csize) + " blocks, the device runs " +
              std::to_string(dev.max_cluster);
    else if (cfg.dynamicSmemBytes > (size_t)granted ||
             cfg.dynamicSmemBytes > (size_t)dev.shared_optin)
        bad = std::to_string(cfg.dynamicSmemBytes) + " bytes of dynamic shared memory, " +
              std::to_string(granted) + " granted";
    if (!bad.empty()) {
        last_error = "emulated launch refused: " + bad;
        return cudaErrorInvalidConfiguration;
    }
    Launch L;
    const char *order = getenv("SPECFAST_CUDA_EMU_ORDER");
    L.order = !order || !strcmp(order, "forward") ? 0 : !strcmp(order, "reverse") ? 1
              : strtoull(order, NULL, 10) | 2;
    L.grid = cfg.gridDim;
    L.block = cfg.blockDim;
    L.dynamic = cfg.dynamicSmemBytes;
    L.body = &body;
    const unsigned clusters = cfg.gridDim.x / csize;
    std::atomic<unsigned> next{0};
    unsigned hw = std::thread::hardware_concurrency();
    unsigned workers = hw ? hw : 1;
    if (workers > clusters) workers = clusters;
    /* Each worker takes whole clusters, one OS thread per block. */
    auto work = [&] {
        for (unsigned k; (k = next++) < clusters && !L.failed;) {
            Cluster c;
            c.launch = &L;
            c.first = k * csize;
            c.size = csize;
            c.live = csize;
            /* Fresh OS threads: fresh thread-local (shared) memory. */
            std::vector<std::thread> blocks;
            for (unsigned r = 0; r < csize; r++) blocks.emplace_back(run_block, std::ref(c), r);
            for (auto &t : blocks) t.join();
        }
    };
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < workers; w++) pool.emplace_back(work);
    work();
    for (auto &t : pool) t.join();
    if (L.failed) {
        last_error = "emulated kernel failed: " + L.error;
        return cudaErrorLaunchFailure;
    }
    return cudaSuccess;
}

inline Fiber &self() { return *cur_fiber; }

template <class T>
inline T shuffle(const char *file, int line, unsigned mask, T v, int lane_of(int lane, int arg),
                 int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
    Block &b = *cur_block;
    Fiber &f = self();
    if (mask != 0xFFFFFFFFu || width != 32 || b.fibers.size() % 32) {
        b.launch->fail(where() + "only full-warp shuffles are emulated");
        return v;
    }
    const unsigned warp = f.tid.x >> 5, lane = f.tid.x & 31, par = f.shuffles++ & 1;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    __atomic_store_n(&b.slots[warp][par][lane], bits, __ATOMIC_RELAXED);
    wait(AT_WARP, file, line);
    const int src = lane_of((int)lane, arg); /* outside the warp: the lane's own value */
    bits = __atomic_load_n(&b.slots[warp][par][src >= 0 && src < 32 ? src : (int)lane],
                           __ATOMIC_RELAXED);
    T r;
    memcpy(&r, &bits, sizeof(T));
    return r;
}

inline int xor_lane(int lane, int m) { return lane ^ m; }

} /* namespace sf_emu */

/* ---- device functions ---- */

/* A block's threads share its OS thread: its index and sizes are thread-local
 * variables, the thread's index is the running fiber's. */
#define threadIdx (sf_emu::cur_fiber->tid)

namespace sf_emu {

inline void syncthreads(const char *file, int line) {
    Block &b = *cur_block;
    self().barriers++;
    const unsigned par = b.bar_gen & 1;
    tsan_arrive(&b.hb[par]);
    wait(AT_BLOCK, file, line);
    tsan_leave(&b.hb[par]);
}

inline int syncthreads_or(int v, const char *file, int line) {
    Block &b = *cur_block;
    self().barriers++;
    const unsigned par = b.bar_gen & 1;
    if (v) __atomic_store_n(&b.orv[par], 1, __ATOMIC_RELAXED);
    tsan_arrive(&b.hb[par]);
    wait(AT_BLOCK, file, line);
    tsan_leave(&b.hb[par]);
    return __atomic_load_n(&b.orv[par], __ATOMIC_RELAXED);
}

template <class T>
inline T shfl_xor(const char *file, int line, unsigned mask, T v, int lane_mask, int width = 32) {
    return shuffle(file, line, mask, v, xor_lane, lane_mask, width);
}

template <class T>
inline T shfl_up(const char *file, int line, unsigned mask, T v, unsigned delta, int width = 32) {
    T up = shuffle(file, line, mask, v, [](int lane, int d) { return lane >= d ? lane - d : lane; },
                   (int)delta, width);
    return (cur_fiber->tid.x & 31) >= delta ? up : v;
}

} /* namespace sf_emu */

/* Macros, so that each barrier and shuffle knows the line it stands on. */
#define __syncthreads() sf_emu::syncthreads(__FILE__, __LINE__)
#define __syncthreads_or(v) sf_emu::syncthreads_or((v), __FILE__, __LINE__)
#define __shfl_xor_sync(...) sf_emu::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) sf_emu::shfl_up(__FILE__, __LINE__, __VA_ARGS__)

template <class T>
inline T atomicAdd(T *p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

template <class T>
inline T __ldg(const T *p) { return *p; }
template <class T>
inline T __ldcg(const T *p) { return *p; }

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline uint64_t __umul64hi(uint64_t a, uint64_t b) {
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
}

/* CUDA's integer min / max, and fminf / fmaxf (NaN-ignoring) for floats. */
template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

/* ---- host functions ---- */

inline cudaError_t cudaGetDevice(int *dev) {
    *dev = sf_emu::current_device();
    return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev) {
    if (dev < 0 || dev >= sf_emu::DEVICES) return cudaErrorInvalidValue;
    switch (attr) {
    case cudaDevAttrClusterLaunch: *value = sf_emu::devices[dev].clusters; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
        *value = sf_emu::devices[dev].shared_optin;
        return cudaSuccess;
    }
    return cudaErrorInvalidValue;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

inline const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration:
    case cudaErrorLaunchFailure: return sf_emu::last_error.c_str();
    }
    return "unknown error";
}

inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *fa, const void *) {
    fa->sharedSizeBytes = 0; /* unknown here: only the dynamic part is checked */
    fa->maxThreadsPerBlock = 1024;
    fa->ptxVersion = sf_emu::devices[sf_emu::current_device()].ptx;
    return cudaSuccess;
}

inline cudaError_t cudaFuncSetAttribute(const void *kernel, cudaFuncAttribute attr, int value) {
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        const int dev = sf_emu::current_device();
        if (value < 0 || value > sf_emu::devices[dev].shared_optin) return cudaErrorInvalidValue;
        std::lock_guard<std::mutex> hold(sf_emu::grants_lock);
        for (auto &g : sf_emu::grants)
            if (g.first == std::make_pair(dev, kernel)) { g.second = value; return cudaSuccess; }
        sf_emu::grants.emplace_back(std::make_pair(dev, kernel), value);
    }
    return cudaSuccess;
}

/* Occupancy is not modelled: one block, whatever the shared memory (up to
 * what a block may have), so the kernels take every option the GPU may. */
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, const void *,
                                                                 int, size_t shm) {
    *blocks = shm <= (size_t)sf_emu::devices[sf_emu::current_device()].shared_optin;
    return cudaSuccess;
}

/* The largest cluster the device can run (what the hardware or a MIG slice
 * allows; the configuration is not modelled). */
inline cudaError_t cudaOccupancyMaxPotentialClusterSize(int *size, const void *,
                                                        const cudaLaunchConfig_t *) {
    const sf_emu::Device &dev = sf_emu::devices[sf_emu::current_device()];
    if (!dev.clusters) return cudaErrorInvalidValue;
    *size = (int)dev.max_cluster;
    return cudaSuccess;
}

template <class... P, class... A>
inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t *cfg, void (*kernel)(P...),
                                      A &&...args) {
    const std::tuple<P...> params(std::forward<A>(args)...);
    const std::function<void()> body = [&] { std::apply(kernel, params); };
    return sf_emu::launch(*cfg, (const void *)kernel, body);
}

#endif /* SF_CUDA_EMU_RUNTIME_H */
