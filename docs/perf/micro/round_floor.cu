// The fixed costs a 1-token device round is made of, measured alone on one GPU (issue 20):
//   chain  - the gap between dependent kernels of one stream inside a CUDA graph (1 block each,
//            and 24 blocks each with afdep's last-block ticket: a system fence, an atomic);
//   hand   - one cross-stream flag handoff between two resident kernels (a release store seen
//            by a spinning acquire load with a 64 ns sleep, as afdep_wait_ge; system and GPU
//            scope);
//   serial - one thread's dependent global-memory operations (what a one-thread control path,
//            such as a status all-gather or a loop of flag waits, is made of): a pointer chase
//            of relaxed volatile loads, of ld.acquire.sys loads, and a store + system fence;
//   icache - one thread's straight-line code of N instructions between two stamps, in a chain
//            of four dependent kernels in a graph (A, A again, B, B again: A and B the same
//            length but different code): the first run of a code on an SM against the second,
//            i.e. what fetching a kernel's instructions into a cold SM costs (its code in L2);
//   skew   - the device-side start spread of four ranks' graphs launched after a host spin
//            barrier by four threads of one process (as `afdep exchange --graph` with emulated
//            ranks), by one thread back to back, and as one joint graph of four branches.
// Every number is a median over REPS iterations, in µs, from %globaltimer stamps on the device.
// Build and run (CUDA 12+/13, Hopper): nvcc -O3 -std=c++17 -arch=sm_90 -o rf round_floor.cu
// -lpthread && ./rf. A measurement tool, not part of afdep; nothing in afdep calls it.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,             \
                         cudaGetErrorString(e_));                                      \
            std::exit(2);                                                              \
        }                                                                              \
    } while (0)

typedef unsigned long long u64;
typedef unsigned int u32;
static const int REPS = 50;

__device__ __forceinline__ u64 now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ u32 ld_acq_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_acq_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_rel_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_rel_gpu(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// chain: stamp the entry of kernel i (thread 0 of block 0)
__global__ void k_stamp(u64* t, int i) {
    if (threadIdx.x == 0 && blockIdx.x == 0) t[i] = now();
}
// chain with afdep's ticket: every block fences at system scope and takes a ticket; the last
// block stamps and resets
__global__ void k_ticket(u64* t, int i, u32* ticket, int sys) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (sys) __threadfence_system(); else __threadfence();
        if (atomicAdd(ticket, 1u) == gridDim.x - 1) {
            *(volatile u32*)ticket = 0u;
            t[i] = now();
        }
    }
}
// hand: a and b ping-pong n times through flags fa (b waits on it) and fb
__global__ void k_ping(u32* mine, u32* other, int n, int first, int sys, u64* t) {
    if (threadIdx.x != 0) return;
    if (first) t[0] = now();
    for (int i = 1; i <= n; i++) {
        if (first) {
            sys ? st_rel_sys(other, i) : st_rel_gpu(other, i);
            while ((sys ? ld_acq_sys(mine) : ld_acq_gpu(mine)) < (u32)i) __nanosleep(64);
        } else {
            while ((sys ? ld_acq_sys(mine) : ld_acq_gpu(mine)) < (u32)i) __nanosleep(64);
            sys ? st_rel_sys(other, i) : st_rel_gpu(other, i);
        }
    }
    if (first) t[1] = now();
}

// serial: thread 0 chases n pointers (mode 0: volatile loads, 1: ld.acquire.sys), or (mode 2)
// stores then fences at system scope n times; t[0], t[1] around it, next[] the chase's links
__global__ void k_serial(u32* next, int n, int mode, u64* t) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u32 j = 0;
    const u64 t0 = now();
    for (int i = 0; i < n; i++) {
        if (mode == 0) j = *(volatile u32*)(next + j);
        else if (mode == 1) j = ld_acq_sys(next + j);
        else { next[4096 + (i & 63)] = i; __threadfence_system(); }
    }
    const u64 t1 = now();
    t[0] = t0;
    t[1] = t1;
    t[2] = j;
}

// icache: N multiply-adds over 8 registers (each reads another register, so ptxas can fold
// none), straight-line; TAG makes two instantiations of one length different code. Stamps
// t[2 i] before and t[2 i + 1] after the body; the registers' xor goes to t[64 + i].
template <int N, int TAG>
__global__ void k_code(u64* t, int i, u32 seed) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u32 x[8];
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] = seed + (u32)(j * 7 + TAG);
    const u64 t0 = now();
#pragma unroll
    for (int j = 0; j < N; j++) x[j & 7] = x[j & 7] * (3u + 2u * TAG) + x[(j + 3) & 7];
    const u64 t1 = now();
    t[2 * i] = t0;
    t[2 * i + 1] = t1;
    t[64 + i] = x[0] ^ x[1] ^ x[2] ^ x[3] ^ x[4] ^ x[5] ^ x[6] ^ x[7];
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    t[96 + i] = sm;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static cudaGraphExec_t capture(cudaStream_t s, void (*body)(cudaStream_t)) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    body(s);
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t e;
    CK(cudaGraphInstantiate(&e, g, 0));
    return e;
}

static u64* g_t;   // device stamps
static u32* g_tk;  // device ticket
static int g_k, g_blocks, g_sys;

static void chain_stamp(cudaStream_t s) {
    for (int i = 0; i < g_k; i++) k_stamp<<<1, 256, 0, s>>>(g_t, i);
}
static void chain_ticket(cudaStream_t s) {
    for (int i = 0; i < g_k; i++) k_ticket<<<g_blocks, 256, 0, s>>>(g_t, i, g_tk, g_sys);
}

static void run_chain(const char* name, void (*body)(cudaStream_t), cudaStream_t s) {
    cudaGraphExec_t e = capture(s, body);
    std::vector<double> gap, span;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<u64> h(g_k);
    for (int r = 0; r < REPS + 5; r++) {
        CK(cudaEventRecord(a, s));
        CK(cudaGraphLaunch(e, s));
        CK(cudaEventRecord(b, s));
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(h.data(), g_t, g_k * 8, cudaMemcpyDeviceToHost));
        if (r < 5) continue;
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        span.push_back(ms * 1e3);
        gap.push_back((h[g_k - 1] - h[0]) / 1e3 / (g_k - 1));
    }
    std::printf("chain %-28s kernels %d: per dependent kernel %.2f us, graph span %.2f us\n", name,
                g_k, median(gap), median(span));
    CK(cudaGraphExecDestroy(e));
}

static void run_hand(int sys, int n) {
    u32 *f;
    CK(cudaMalloc(&f, 256));
    CK(cudaMemset(f, 0, 256));
    cudaStream_t s1, s2;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    std::vector<double> one;
    for (int r = 0; r < 11; r++) {
        CK(cudaMemset(f, 0, 256));
        CK(cudaDeviceSynchronize());
        k_ping<<<1, 32, 0, s2>>>(f + 32, f, n, 0, sys, g_t);
        k_ping<<<1, 32, 0, s1>>>(f, f + 32, n, 1, sys, g_t);
        CK(cudaDeviceSynchronize());
        u64 h[2];
        CK(cudaMemcpy(h, g_t, 16, cudaMemcpyDeviceToHost));
        if (r) one.push_back((h[1] - h[0]) / 1e3 / (2.0 * n));
    }
    std::printf("hand  %s scope: one handoff %.3f us (median of 10 runs of %d round trips)\n",
                sys ? "sys" : "gpu", median(one), n);
    CK(cudaFree(f));
}

static void run_serial(int mode, int n) {
    u32* next;
    CK(cudaMalloc(&next, (4096 + 64) * 4));
    std::vector<u32> h(4096);
    for (int i = 0; i < 4096; i++) h[i] = (u32)((i * 1031 + 17) % 4096);  // a long cycle
    CK(cudaMemcpy(next, h.data(), 4096 * 4, cudaMemcpyHostToDevice));
    std::vector<double> v;
    for (int r = 0; r < 11; r++) {
        k_serial<<<1, 32>>>(next, n, mode, g_t);
        CK(cudaDeviceSynchronize());
        u64 t[2];
        CK(cudaMemcpy(t, g_t, 16, cudaMemcpyDeviceToHost));
        if (r) v.push_back((t[1] - t[0]) / 1e3 / n);
    }
    const char* what[] = {"volatile load chase", "ld.acquire.sys chase", "store + fence.sys"};
    std::printf("serial %-22s one op %.3f us (median of 10 runs of %d)\n", what[mode], median(v), n);
    CK(cudaFree(next));
}

template <int N>
static void icache_chain(cudaStream_t s) {
    k_code<N, 0><<<1, 32, 0, s>>>(g_t, 0, 1u);
    k_code<N, 0><<<1, 32, 0, s>>>(g_t, 1, 2u);
    k_code<N, 1><<<1, 32, 0, s>>>(g_t, 2, 3u);
    k_code<N, 1><<<1, 32, 0, s>>>(g_t, 3, 4u);
}

template <int N>
static void run_icache(cudaStream_t s) {
    cudaGraphExec_t e = capture(s, icache_chain<N>);
    std::vector<double> first, second, other, gap;
    u64 h[100];
    for (int r = 0; r < REPS + 5; r++) {
        CK(cudaGraphLaunch(e, s));
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(h, g_t, sizeof h, cudaMemcpyDeviceToHost));
        if (r < 5) continue;
        first.push_back((h[1] - h[0]) / 1e3);
        first.push_back((h[5] - h[4]) / 1e3);
        // the second run of a code: on the SM of its first run, or on another one
        (h[97] == h[96] ? second : other).push_back((h[3] - h[2]) / 1e3);
        (h[99] == h[98] ? second : other).push_back((h[7] - h[6]) / 1e3);
        gap.push_back((h[4] - h[3]) / 1e3);
    }
    std::printf("icache %5d instructions (%3d KiB of code): body first run %.2f us, second run on "
                "the same SM %.2f us (%zu of %zu), on another SM %.2f us; gap to the next kernel "
                "%.2f us\n",
                N, N * 16 / 1024, median(first), second.empty() ? -1.0 : median(second),
                second.size(), second.size() + other.size(), other.empty() ? -1.0 : median(other),
                median(gap));
    CK(cudaGraphExecDestroy(e));
}

// skew: four ranks' graphs (each: RK kernels, the first stamps its start into t[rank])
static int g_rank, g_rk;
static void rank_graph(cudaStream_t s) {
    k_stamp<<<1, 32, 0, s>>>(g_t, g_rank);
    for (int i = 1; i < g_rk; i++) k_stamp<<<1, 32, 0, s>>>(g_t, 8 + g_rank);
}

static void run_skew(int rk) {
    const int W = 4;
    g_rk = rk;
    std::vector<cudaStream_t> st(W);
    std::vector<cudaGraphExec_t> ex(W);
    std::vector<cudaEvent_t> ev(W);
    for (int w = 0; w < W; w++) {
        CK(cudaStreamCreateWithFlags(&st[w], cudaStreamNonBlocking));
        CK(cudaEventCreate(&ev[w]));
        g_rank = w;
        ex[w] = capture(st[w], rank_graph);
    }
    // joint graph: the four rank graphs as child nodes of one graph
    cudaGraph_t joint;
    CK(cudaGraphCreate(&joint, 0));
    for (int w = 0; w < W; w++) {
        cudaGraph_t g;
        g_rank = w;
        CK(cudaStreamBeginCapture(st[w], cudaStreamCaptureModeThreadLocal));
        rank_graph(st[w]);
        CK(cudaStreamEndCapture(st[w], &g));
        cudaGraphNode_t n;
        CK(cudaGraphAddChildGraphNode(&n, joint, nullptr, 0, g));
    }
    cudaGraphExec_t jex;
    CK(cudaGraphInstantiate(&jex, joint, 0));
    auto spread = [&]() {
        u64 h[W];
        CK(cudaMemcpy(h, g_t, W * 8, cudaMemcpyDeviceToHost));
        u64 lo = *std::min_element(h, h + W), hi = *std::max_element(h, h + W);
        return (hi - lo) / 1e3;
    };
    // (a) four threads, spin barrier, event + launch each
    std::vector<double> a;
    for (int r = 0; r < REPS + 5; r++) {
        std::atomic<int> arrived{0};
        std::vector<std::thread> th;
        for (int w = 0; w < W; w++)
            th.emplace_back([&, w]() {
                CK(cudaSetDevice(0));
                arrived.fetch_add(1);
                while (arrived.load() < W) {
                }
                CK(cudaEventRecord(ev[w], st[w]));
                CK(cudaGraphLaunch(ex[w], st[w]));
            });
        for (auto& t : th) t.join();
        CK(cudaDeviceSynchronize());
        if (r >= 5) a.push_back(spread());
    }
    // (b) one thread, back to back
    std::vector<double> b;
    for (int r = 0; r < REPS + 5; r++) {
        for (int w = 0; w < W; w++) {
            CK(cudaEventRecord(ev[w], st[w]));
            CK(cudaGraphLaunch(ex[w], st[w]));
        }
        CK(cudaDeviceSynchronize());
        if (r >= 5) b.push_back(spread());
    }
    // (c) the joint graph
    std::vector<double> c;
    for (int r = 0; r < REPS + 5; r++) {
        CK(cudaGraphLaunch(jex, st[0]));
        CK(cudaDeviceSynchronize());
        if (r >= 5) c.push_back(spread());
    }
    std::printf("skew  %d-kernel rank graphs: start spread four threads %.2f us, one thread %.2f us, "
                "joint graph %.2f us (max %.2f / %.2f / %.2f)\n",
                rk, median(a), median(b), median(c), *std::max_element(a.begin(), a.end()),
                *std::max_element(b.begin(), b.end()), *std::max_element(c.begin(), c.end()));
    for (int w = 0; w < W; w++) CK(cudaGraphExecDestroy(ex[w]));
    CK(cudaGraphExecDestroy(jex));
}

int main() {
    CK(cudaSetDevice(0));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    std::printf("device %s, %d SMs\n", p.name, p.multiProcessorCount);
    CK(cudaMalloc(&g_t, 4096));
    CK(cudaMalloc(&g_tk, 64));
    CK(cudaMemset(g_tk, 0, 64));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    g_k = 8;
    run_chain("1 block", chain_stamp, s);
    g_blocks = 24;
    g_sys = 1;
    run_chain("24 blocks, ticket, sys fence", chain_ticket, s);
    g_sys = 0;
    run_chain("24 blocks, ticket, gpu fence", chain_ticket, s);
    g_blocks = 1;
    g_sys = 1;
    run_chain("1 block, ticket, sys fence", chain_ticket, s);
    run_hand(1, 1000);
    run_hand(0, 1000);
    run_serial(0, 256);
    run_serial(1, 256);
    run_serial(2, 256);
    run_icache<256>(s);
    run_icache<1024>(s);
    run_icache<2048>(s);
    run_icache<4096>(s);
    run_skew(1);
    run_skew(8);
    return 0;
}
