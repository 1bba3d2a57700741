/*
 * tests/cuda_emu/race_check.cc: the CUDA kernels on random batches under
 * ThreadSanitizer (tests/test_cuda_emu.py builds it with the emulated kernels
 * and -fsanitize=thread). The emulator tells ThreadSanitizer what orders the
 * threads of a launch (barriers, and nothing else), so two threads touching
 * the same memory between barriers, one writing, is a reported race: the
 * check compute-sanitizer's racecheck makes on a GPU, here for shared and
 * global memory alike. Every method, dtype and draft kind; chains and trees;
 * vocabularies that give clusters of 1, 3 and 8 blocks (the arguments, when
 * given). Exit 0 when every launch succeeded (ThreadSanitizer exits non-zero
 * on a report). `race_check control` launches a kernel with a race instead:
 * the proof that one is reported.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <vector>

#include "kernels.cu" /* one translation unit: the emulator defines its state */

/* Thread 0 writes what the others read, with no barrier between. */
__global__ void racy(int *out) {
    __shared__ int s;
    if (threadIdx.x == 0) s = 1;
    out[threadIdx.x] = s;
}

static int control() {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(64);
    std::vector<int> out(64);
    const cudaError_t e = cudaLaunchKernelEx(&cfg, racy, out.data());
    printf("control launched: %s\n", cudaGetErrorString(e));
    return e != cudaSuccess;
}

static std::mt19937_64 rng(7);

static double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); }
static int64_t below(int64_t n) { return (int64_t)(rng() % (uint64_t)n); }

static uint16_t to16(float x, int dtype) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if (dtype == SF_BF16) return (uint16_t)(u >> 16);
    /* float16 of values in (-8, 8): normal numbers, truncated */
    const uint32_t sign = (u >> 16) & 0x8000u, e = (u >> 23) & 255u, m = u & 0x7FFFFFu;
    if (e < 113) return (uint16_t)sign;
    return (uint16_t)(sign | ((e - 112) << 10) | (m >> 13));
}

static int failures = 0;

static void expect(sf_status st, const int32_t *status, int64_t n, const char *what) {
    int bad = st != SF_OK;
    for (int64_t i = 0; i < n; i++) bad |= status[i] != 0;
    if (bad) {
        fprintf(stderr, "%s: status %d, %s\n", what, (int)st,
                sf_cuda_error_string(sf_cuda_last_error()));
        failures++;
    }
}

static void one_batch(int64_t vocab, int dtype, int method, int kind, bool tree) {
    const int64_t batch = 1 + below(5), k = 4;
    std::vector<int32_t> nd(batch), tokens, parents;
    for (auto &v : nd) {
        v = (int32_t)below(5);
        for (int32_t i = 0; i < v; i++) {
            parents.push_back(tree ? (int32_t)below(i + 1) - 1 : i - 1);
            tokens.push_back((int32_t)below(vocab < 3 ? vocab : 3));  /* often the argmax */
        }
    }
    const int64_t n = (int64_t)tokens.size(), rows = n + batch;
    std::vector<float> x((size_t)(rows * vocab));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t v = 0; v < vocab; v++)
            x[(size_t)(r * vocab + v)] = v < 3 ? 3.0f - (float)v : (float)(uniform() * 6 - 4);
    std::vector<uint16_t> x16(x.size());
    for (size_t i = 0; i < x.size(); i++) x16[i] = to16(x[i], dtype);
    std::vector<float> dense, sp;
    std::vector<int32_t> ids;
    if (kind == SF_DRAFT_DENSE) {
        dense.assign((size_t)(n * vocab), 1.0f / (float)vocab);
    } else if (kind == SF_DRAFT_SPARSE) {
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < k; j++) {
                ids.push_back(j == 0 ? tokens[(size_t)i] : (int32_t)((tokens[(size_t)i] + j) % vocab));
                sp.push_back(1.0f / (float)k);
            }
    }
    std::vector<float> temperature(batch), top_p(batch), min_p(batch);
    std::vector<int32_t> top_k(batch);
    std::vector<uint64_t> seed(batch);
    std::vector<int64_t> position(batch);
    for (int64_t b = 0; b < batch; b++) {
        const float ts[] = {0.0f, 0.7f, 1.0f};
        const int32_t ks[] = {0, 0, 5};
        const float ps[] = {1.0f, 0.9f};
        temperature[(size_t)b] = ts[below(3)];
        top_k[(size_t)b] = ks[below(3)];
        top_p[(size_t)b] = ps[below(2)];
        min_p[(size_t)b] = below(3) == 0 ? 0.05f : 0.0f;
        seed[(size_t)b] = rng();
        position[(size_t)b] = (int64_t)below(1 << 20);
    }
    sf_logits l = {dtype == SF_F32 ? (const void *)x.data() : (const void *)x16.data(),
                   (sf_dtype)dtype, rows, vocab, vocab};
    sf_draft d = {};
    d.tokens = tokens.data();
    d.n = n;
    d.num_draft = nd.data();
    d.batch = batch;
    d.parents = tree ? parents.data() : NULL;
    d.kind = (sf_draft_kind)kind;
    d.dense = dense.data();
    d.sparse_ids = ids.data();
    d.sparse_probs = sp.data();
    d.sparse_k = k;
    sf_cuda_params p = {};
    p.temperature = temperature.data(); p.n_temperature = batch;
    p.top_k = top_k.data(); p.n_top_k = batch;
    p.top_p = top_p.data(); p.n_top_p = batch;
    p.min_p = min_p.data(); p.n_min_p = batch;
    p.seed = seed.data(); p.n_seed = batch;
    p.position = position.data(); p.n_position = batch;
    const int64_t width = 5;
    std::vector<int32_t> out_tok((size_t)(batch * width)), acc((size_t)batch),
        nodes((size_t)(batch * 4)), status((size_t)batch);
    sf_verify_out o = {out_tok.data(), acc.data(), nodes.data(), 4};
    const int64_t need = sf_cuda_verify_workspace(&l, &d, (sf_method)method);
    void *ws = need ? aligned_alloc(16, (size_t)(need + 15) / 16 * 16) : NULL;
    char what[128];
    snprintf(what, sizeof what, "verify V=%lld dtype %d method %d kind %d %s", (long long)vocab,
             dtype, method, kind, tree ? "tree" : "chain");
    expect(sf_cuda_verify(&l, &d, &p, (sf_method)method, &o, status.data(), ws, need, NULL),
           status.data(), batch, what);
    free(ws);
    if (kind == SF_DRAFT_NONE && !tree) {
        /* sample and probs over the same rows */
        sf_cuda_params q = p;
        q.n_temperature = q.n_top_k = q.n_top_p = q.n_min_p = q.n_seed = q.n_position = 1;
        std::vector<int32_t> tok((size_t)rows), st((size_t)rows);
        snprintf(what, sizeof what, "sample V=%lld dtype %d method %d", (long long)vocab, dtype,
                 method);
        expect(sf_cuda_sample(&l, &q, (sf_method)method, tok.data(), st.data(), NULL), st.data(),
               rows, what);
        std::vector<float> pr((size_t)(rows * vocab));
        snprintf(what, sizeof what, "probs V=%lld dtype %d", (long long)vocab, dtype);
        expect(sf_cuda_probs(&l, &q, pr.data(), st.data(), NULL), st.data(), rows, what);
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "control")) return control();
    std::vector<int64_t> vocabs = {7, 1000, 4099, 17000};
    if (argc > 1) vocabs.clear();
    for (int i = 1; i < argc; i++) vocabs.push_back(atoll(argv[i]));
    for (int64_t vocab : vocabs)
        for (int dtype = 0; dtype < 3; dtype++)
            for (int method = 0; method < 2; method++)
                for (int kind = 0; kind < 3; kind++)
                    for (int tree = 0; tree < 2; tree++)
                        /* clusters of 8 blocks in float32 only: a minute saved */
                        if (!(kind == SF_DRAFT_SPARSE && vocab < 4) &&
                            !(vocab > 10000 && dtype != SF_F32))
                            one_batch(vocab, dtype, method, kind, tree);
    printf("%d launches failed\n", failures);
    return failures ? 1 : 0;
}
