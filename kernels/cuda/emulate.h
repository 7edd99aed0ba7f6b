// Runs the kernels of kernels/cuda/*.cu on the CPU, for checks on machines without a GPU
// (kernels/src/cuda/emulate.rs compiles this header, the sources and a table of launchers with the
// host C++ compiler). The semantics are CUDA's: a grid of blocks, run one block at a time; a
// block's threads are fibers on one OS thread, switched at __syncthreads (every thread of the
// block) and at warp operations (every thread of the warp); __shared__ memory is one copy per
// kernel, shared by the running block. Arithmetic is the host's (libm's expf, cosf; fmaf), so
// the bits differ from a GPU's in the last places; the order of every reduction is the kernel's.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#if !defined(__x86_64__)
#error "the CPU emulation of the CUDA kernels switches fibers in x86-64 assembly"
#endif

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define DYNAMIC_SHARED(type, name) type* name = (type*)kvflow_dynamic_shared

struct uint3 { unsigned x, y, z; };
#define KVFLOW_EMULATE 1

struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

static uint3 threadIdx, blockIdx, blockDim, gridDim;
static void* kvflow_dynamic_shared;
// A misuse the emulation catches in a kernel (reported by the launch): a misaligned cp.async or
// ldmatrix address.
static const char* kvflow_fault;

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float __int_as_float(int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
static inline float __uint_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::isfinite;
// CUDA's rounded single operations (the host compiler here neither contracts nor fuses them).
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __longlong_as_double(long long bits) { double d; std::memcpy(&d, &bits, 8); return d; }
using std::floor;
using std::fma;

// ---- fibers ----
asm(R"(
.text
.p2align 4
kvflow_switch:
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
)");
extern "C" void kvflow_switch(void** save_sp, void* load_sp) __asm__("kvflow_switch");

enum FiberState { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, FINISHED };

struct Fiber {
    void* sp;
    char* stack;
    FiberState state;
};

static const size_t STACK_BYTES = 128 * 1024;
static const int MAX_THREADS = 1024;
static Fiber fibers[MAX_THREADS];
static int block_threads;
static int current;
static void* scheduler_sp;
static void (*current_kernel)(void**);
static void** current_args;
// A warp's exchanges (shuffles, ballots, mma and ldmatrix fragments) go through slots of two
// phases: a lane flips its phase at each exchange, so a lane already at the next exchange writes
// the other phase while slower lanes still read this one, and one warp barrier an exchange is
// enough (a lane two exchanges on has passed the barrier every lane reached after reading).
static float warp_slots[MAX_THREADS / 32][2][32];
static int exchange_phase[MAX_THREADS];

// Counts kept as fibers arrive, so the scheduler never scans for a released barrier.
static int finished, at_block_barrier;
static int warp_waiting[MAX_THREADS / 32], warp_finished[MAX_THREADS / 32];

static int lanes_of_warp(int warp) { return min(32, block_threads - warp * 32); }

static void fiber_entry() {
    current_kernel(current_args);
    fibers[current].state = FINISHED;
    finished++;
    warp_finished[current / 32]++;
    kvflow_switch(&fibers[current].sp, scheduler_sp);
    std::abort();  // a finished fiber is never resumed
}

// Parks this fiber at a barrier and runs the next runnable lane of its warp, straight from fiber
// to fiber (the scheduler's round over the warp would run it next anyway: one switch, not two),
// or returns to the scheduler after the warp's last lane.
static void yield_at(FiberState state) {
    int from = current, warp = from / 32;
    fibers[from].state = state;
    if (state == AT_BLOCK_BARRIER) at_block_barrier++;
    if (state == AT_WARP_BARRIER) warp_waiting[warp]++;
    for (int t = from + 1; t < warp * 32 + lanes_of_warp(warp); t++)
        if (fibers[t].state == RUNNABLE) {
            current = t;
            threadIdx = {(unsigned)t, 0, 0};
            kvflow_switch(&fibers[from].sp, fibers[t].sp);
            return;
        }
    kvflow_switch(&fibers[from].sp, scheduler_sp);
}

static void __syncthreads() { yield_at(AT_BLOCK_BARRIER); }
static void __syncwarp(unsigned = 0xffffffffu) { yield_at(AT_WARP_BARRIER); }

// This lane's phase for its next exchange (flipped).
static int next_phase() { return exchange_phase[current] ^= 1; }

// Every lane's v, after the warp barrier.
static const float* exchange(float v) {
    int warp = current / 32, lane = current % 32, phase = next_phase();
    warp_slots[warp][phase][lane] = v;
    __syncwarp();
    return warp_slots[warp][phase];
}

static float __shfl_down_sync(unsigned, float v, int offset) {
    const float* lanes = exchange(v);
    int src = current % 32 + offset;
    return src < lanes_of_warp(current / 32) ? lanes[src] : v;
}

static float __shfl_sync(unsigned, float v, int src) {
    const float* lanes = exchange(v);
    return src < lanes_of_warp(current / 32) ? lanes[src] : v;
}

static float __shfl_xor_sync(unsigned, float v, int mask) {
    const float* lanes = exchange(v);
    int src = current % 32 ^ mask;
    return src < lanes_of_warp(current / 32) ? lanes[src] : v;
}

static unsigned __ballot_sync(unsigned, bool pred) {
    const float* lanes = exchange(pred ? 1.0f : 0.0f);
    unsigned mask = 0;
    for (int l = 0; l < lanes_of_warp(current / 32); l++)
        if (lanes[l] != 0.0f) mask |= 1u << l;
    return mask;
}

static int __popc(unsigned v) { return __builtin_popcount(v); }

// mma.sync m16n8k16 (bf16 in, f32 accumulate) for one warp, from the lanes' fragments (PTX ISA,
// "Matrix fragments for mma.m16n8k16"): each output adds its 16 products in k order, one fma each.
// A GPU's tensor cores add them their own way: the emulation keeps the fragments' layout, not the
// hardware's bits.
static unsigned mma_slots[MAX_THREADS / 32][2][32][6];
static void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    int warp = current / 32, lane = current % 32, phase = next_phase();
    for (int i = 0; i < 4; i++) mma_slots[warp][phase][lane][i] = a[i];
    mma_slots[warp][phase][lane][4] = b[0];
    mma_slots[warp][phase][lane][5] = b[1];
    __syncwarp();
    auto half = [&](int holder, int reg, int k) {
        unsigned v = mma_slots[warp][phase][holder][reg];
        return __uint_as_float(((k & 1) ? v >> 16 : v & 0xffffu) << 16);
    };
    auto A = [&](int row, int k) { return half((row % 8) * 4 + (k % 8) / 2, (row >= 8) + 2 * (k >= 8), k); };
    auto B = [&](int k, int col) { return half(col * 4 + (k % 8) / 2, 4 + (k >= 8), k); };
    int gid = lane / 4, tig = lane % 4;
    float out[4];
    for (int c = 0; c < 4; c++) {
        int row = gid + 8 * (c / 2), col = 2 * tig + c % 2;
        float s = d[c];
        for (int k = 0; k < 16; k++) s = std::fmaf(A(row, k), B(k, col), s);
        out[c] = s;
    }
    for (int c = 0; c < 4; c++) d[c] = out[c];
}

// ldmatrix .x4: lane 8i + j gives row j of matrix i; lane t gets row t / 4's 32 bits at 4(t % 4).
static const unsigned char* ldmatrix_slots[MAX_THREADS / 32][2][32];
// Every lane's row address, after the warp barrier.
static const unsigned char* const* ldmatrix_rows(const void* row) {
    int warp = current / 32, lane = current % 32, phase = next_phase();
    if ((uintptr_t)row % 16 != 0) kvflow_fault = "ldmatrix with a row not 16-byte aligned";
    ldmatrix_slots[warp][phase][lane] = (const unsigned char*)row;
    __syncwarp();
    return ldmatrix_slots[warp][phase];
}
static void ldmatrix_x4(unsigned* r, const void* row) {
    const unsigned char* const* rows = ldmatrix_rows(row);
    int lane = current % 32;
    for (int i = 0; i < 4; i++) std::memcpy(&r[i], rows[8 * i + lane / 4] + 4 * (lane % 4), 4);
}

// ldmatrix .x4.trans: lane t gets column t / 4 of rows 2(t % 4) and 2(t % 4) + 1 of matrix i.
static void ldmatrix_x4_trans(unsigned* r, const void* row) {
    const unsigned char* const* rows = ldmatrix_rows(row);
    int lane = current % 32;
    for (int i = 0; i < 4; i++) {
        unsigned short lo, hi;
        std::memcpy(&lo, rows[8 * i + 2 * (lane % 4)] + 2 * (lane / 4), 2);
        std::memcpy(&hi, rows[8 * i + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
        r[i] = lo | ((unsigned)hi << 16);
    }
}

// One block runs at a time: atomics and fences need nothing more.
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = old + v;
    return old;
}
static inline void __threadfence() {}
static inline float __ldcg(const float* p) { return *p; }

// cp.async as a GPU may run it: a copy lands only when its thread waits for its group (later
// groups may stay in flight), and until then its destination holds a NaN pattern — so a stage
// read before its wait and barrier, or overwritten while another warp reads it, changes the bits.
struct PendingCopy {
    void* dst;
    const void* src;
    bool full;
    int group;
};
static std::vector<PendingCopy> pending_copies[MAX_THREADS];
static int copy_groups[MAX_THREADS];
static inline void cp_async16(void* smem, const void* gmem, bool full) {
    if (((uintptr_t)smem | (uintptr_t)gmem) % 16 != 0) kvflow_fault = "cp.async with an address not 16-byte aligned";
    std::memset(smem, 0xff, 16);
    pending_copies[current].push_back({smem, gmem, full, copy_groups[current]});
}
static inline void cp_async_commit() { copy_groups[current]++; }
template <int N>
static inline void cp_async_wait() {
    std::vector<PendingCopy>& pending = pending_copies[current];
    size_t kept = 0;
    for (PendingCopy& c : pending) {
        if (c.group < copy_groups[current] - N) {
            if (c.full) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        } else {
            pending[kept++] = c;
        }
    }
    pending.resize(kept);
}

// Each fiber's stack top sits at its own offset in the cache (t * 192 bytes, wrapping at 64 KiB):
// tops 128 KiB apart would all fall in one cache set, and every switch would miss L1 and L2.
static const size_t STACK_STAGGER = 64 * 1024;
static void start_fiber(int t) {
    pending_copies[t].clear();
    copy_groups[t] = 0;
    exchange_phase[t] = 0;
    Fiber& f = fibers[t];
    if (!f.stack) f.stack = (char*)std::malloc(STACK_BYTES + STACK_STAGGER);
    uintptr_t top = ((uintptr_t)(f.stack + STACK_BYTES + (size_t)t * 192 % STACK_STAGGER)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;                    // fiber_entry's return address (it never returns)
    *--sp = (void*)&fiber_entry;        // where the first switch returns to
    for (int i = 0; i < 6; i++) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
    f.sp = sp;
    f.state = RUNNABLE;
}

// Runs fiber t until it reaches a barrier or its end.
static void resume(int t) {
    current = t;
    threadIdx = {(unsigned)t, 0, 0};
    kvflow_switch(&scheduler_sp, fibers[t].sp);
}

// Runs one block to the end; returns 0, or 1 when its threads deadlock at a barrier.
static int run_block() {
    int warps = (block_threads + 31) / 32;
    finished = at_block_barrier = 0;
    for (int w = 0; w < warps; w++) warp_waiting[w] = warp_finished[w] = 0;
    for (int t = 0; t < block_threads; t++) start_fiber(t);
    while (finished < block_threads) {
        bool progress = false;
        for (int w = 0; w < warps; w++) {
            int lo = w * 32, hi = lo + lanes_of_warp(w);
            // run the warp's lanes; release its warp barrier whenever all its live lanes are there
            for (;;) {
                bool ran = false;
                for (int t = lo; t < hi; t++)
                    if (fibers[t].state == RUNNABLE) { resume(t); ran = true; }
                progress |= ran;
                if (warp_waiting[w] > 0 && warp_waiting[w] + warp_finished[w] == hi - lo) {
                    for (int t = lo; t < hi; t++)
                        if (fibers[t].state == AT_WARP_BARRIER) fibers[t].state = RUNNABLE;
                    warp_waiting[w] = 0;
                    continue;
                }
                break;
            }
        }
        if (at_block_barrier > 0 && at_block_barrier + finished == block_threads) {
            for (int t = 0; t < block_threads; t++)
                if (fibers[t].state == AT_BLOCK_BARRIER) fibers[t].state = RUNNABLE;
            at_block_barrier = 0;
            continue;
        }
        if (!progress) return 1;
    }
    return 0;
}

struct KernelEntry {
    const char* name;
    void (*launch)(void**);
};

// This library's statics serve one launch at a time (emulate.rs holds a copy per launch, and
// loads one copy per core so that launches from different threads run at once).
static std::mutex launch_lock;

// Runs kernel `name` over the grid; writes why into `err` and returns non-zero on failure.
static int emulate_launch(const KernelEntry* table, const char* name, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned smem, void** args, char* err, int err_len) {
    std::lock_guard<std::mutex> guard(launch_lock);
    const KernelEntry* k = nullptr;
    for (const KernelEntry* e = table; e->name; e++)
        if (std::strcmp(e->name, name) == 0) k = e;
    if (!k) { std::snprintf(err, err_len, "no kernel %s", name); return 1; }
    if (bx == 0 || bx > (unsigned)MAX_THREADS) { std::snprintf(err, err_len, "%s: %u threads a block", name, bx); return 1; }
    std::vector<char> shared(smem + 16);
    kvflow_dynamic_shared = shared.data();
    current_kernel = k->launch;
    current_args = args;
    block_threads = (int)bx;
    blockDim = {bx, 1, 1};
    gridDim = {gx, gy, gz};
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                blockIdx = {x, y, z};
                kvflow_fault = nullptr;
                if (run_block()) {
                    std::snprintf(err, err_len, "%s: block (%u, %u, %u) deadlocked at a barrier", name, x, y, z);
                    return 1;
                }
                if (kvflow_fault) {
                    std::snprintf(err, err_len, "%s: block (%u, %u, %u): %s", name, x, y, z, kvflow_fault);
                    return 1;
                }
            }
    return 0;
}
