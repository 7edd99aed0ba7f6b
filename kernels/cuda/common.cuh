// What every kernel source shares: kernels/src/cuda/sources.rs puts this before each source it gives
// NVRTC (one module per source), and the CPU emulation puts it once before them all (one
// translation unit), so nothing here is defined twice and no source repeats it.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Dynamic shared memory (the CPU emulation defines it otherwise).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif

// NVRTC has no <math.h>: infinity by its bits.
#define KV_INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (sm_90 and later): a kernel the host launches with it
// (kernels/src/cuda/gpu.rs, PDL_KERNELS, when the PDL tuning constant is set) may start while the
// kernel before it on the stream still runs. griddep_wait() returns once that kernel has completed
// and its writes are visible: before it, such a kernel only reads what no kernel writes (weights)
// and writes nothing. griddep_launch_dependents() lets the next such kernel start. Both are
// no-ops for a kernel launched the ordinary way (and on older GPUs, and emulated).
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The rows of sequence s: [row_at[s], row_at[s + 1]) (the last one ends at `rows`).
__device__ __forceinline__ int seq_end(const u32* row_at, int s, int seqs, int rows) {
    return s + 1 < seqs ? (int)row_at[s + 1] : rows;
}

// Sum of a warp's values, reduced down to lane 0 in a fixed order and given to every lane.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

// The inputs of one fma chain of a product (model.cu's `linear`, bf16.cu's `linear_bf16`): an
// element sums its chunks' chains in order.
#define LINEAR_CHUNK 256

// The bf16 bits of f (round to nearest even; a NaN stays a NaN), and a bf16 as a float.
__device__ __forceinline__ u32 bf16_bits(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float bf16_float(u32 bits) { return __uint_as_float(bits << 16); }

// Element i of an array of f32 or bf16 (weights), as a float.
__device__ __forceinline__ float load_float(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load_float(const u16* p, size_t i) { return bf16_float(p[i]); }

// The KV cache holds f32, or bf16 where `bf16` (the executor's dtype, kernels/src/cuda/kv.rs):
// element i of it read as a float, and v written into it (rounded to nearest even in bf16).
__device__ __forceinline__ float kv_load(const void* cache, size_t i, int bf16) {
    return bf16 ? load_float((const u16*)cache, i) : load_float((const float*)cache, i);
}
__device__ __forceinline__ void kv_store(void* cache, size_t i, float v, int bf16) {
    if (bf16)
        ((u16*)cache)[i] = (u16)bf16_bits(v);
    else
        ((float*)cache)[i] = v;
}

#ifndef KVFLOW_EMULATE
// 16 bytes from global memory to shared memory without the registers (zeros where !full); the
// copies issued since the last commit form a group, and cp_async_wait<N> waits until at most N
// of this thread's groups are still in flight (PTX ISA, "cp.async").
// The copies and ldmatrix carry no "memory" clobber, so that the compiler may move ordinary loads
// (a cache table's entries, addresses) across them; volatile asm keeps its order among itself,
// and the wait (which has the clobber) and __syncthreads order them against plain accesses.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full) {
    unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(full ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 × 8 matrices of 16-bit values from shared memory, one warp: lanes 8i .. 8i + 7 give the
// rows of matrix i (16 bytes each), and lane t gets in r[i] row t / 4, values 2(t % 4) and
// 2(t % 4) + 1 of matrix i — an mma fragment (PTX ISA, "ldmatrix").
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* row) {
    unsigned at = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
// The same, transposed: lane t gets in r[i] column t / 4's values at rows 2(t % 4) and 2(t % 4) + 1.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* row) {
    unsigned at = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// D += A · B for one warp: A 16 × 16 bf16 (row-major fragments), B 16 × 8 bf16 (column-major),
// D 16 × 8 f32 (PTX ISA, "Matrix fragments for mma.m16n8k16"); every lane of the warp takes part.
__device__ __forceinline__ void mma_bf16_16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
