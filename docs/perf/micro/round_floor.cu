// The fixed costs a 1-token device round is made of, measured alone on one GPU (issue 20):
//   chain  - the gap between dependent kernels of one stream inside a CUDA graph (1 block each,
//            and 24 blocks each with afdep's last-block ticket: a system fence, an atomic);
//   hand   - one cross-stream flag handoff between two resident kernels (a release store seen
//            by a spinning acquire load with a 64 ns sleep, as afdep_wait_ge; system and GPU
//            scope);
//   serial - one thread's dependent global-memory operations (what a one-thread control path,
//            such as a status all-gather or a loop of flag waits, is made of): a pointer chase
//            of relaxed volatile loads, of ld.acquire.sys loads, and a store + system fence;
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
    run_skew(1);
    run_skew(8);
    return 0;
}
