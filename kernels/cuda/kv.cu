// Paged-KV kernels of the CUDA executor: writing a step's rows into their cache rows, and
// packing a request's blocks into one contiguous buffer (and scattering one back) for the
// handoff — the same layout as kvflow_kernels::kv::PagedKvCache::export_blocks: by layer, then
// block, then row. The cache holds f32, or bf16 where `kv_bf16` (kernels/src/cuda/kv.rs); a packed
// buffer always holds f32 (the handoff's and the offload tier's format), widened from bf16 and
// rounded back. Compiled at run time by NVRTC (kernels/src/cuda/sources.rs).

// cache[write_rows[r], :] = src[r * src_stride + (0 .. width)]
extern "C" __global__ void write_cache_rows(void* cache, int kv_bf16, const float* src, const u32* write_rows,
                                            int width, long long src_stride) {
    int r = blockIdx.x;
    size_t d = (size_t)write_rows[r] * width;
    const float* s = src + (size_t)r * src_stride;
    for (int i = threadIdx.x; i < width; i += blockDim.x) kv_store(cache, d + i, s[i], kv_bf16);
}

// Copies `bytes` bytes (an even count), 16 at a time when both ends allow it.
__device__ __forceinline__ void copy_bytes(void* dst, const void* src, size_t bytes) {
    if (bytes % 16 == 0 && ((size_t)dst % 16) == 0 && ((size_t)src % 16) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        for (size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = s[i];
    } else {
        u16* d = (u16*)dst;
        const u16* s = (const u16*)src;
        for (size_t i = threadIdx.x; i < bytes / 2; i += blockDim.x) d[i] = s[i];
    }
}

// Where layer l's part of a packed buffer of n blocks starts (floats): layers are packed in order.
__device__ __forceinline__ size_t packed_at(const int* widths, int l, int n, int block_size) {
    size_t at = 0;
    for (int j = 0; j < l; j++) at += (size_t)n * block_size * widths[j];
    return at;
}

// Gathers blocks `blocks[0 .. n)` of every layer into `packed`: one thread block per (block,
// layer). Layer l's cache starts at layers[l], with rows of widths[l] values.
extern "C" __global__ void pack_blocks(float* packed, const u64* layers, const int* widths, const u32* blocks, int n,
                                       int block_size, int kv_bf16) {
    int i = blockIdx.x, l = blockIdx.y;
    size_t chunk = (size_t)block_size * widths[l], at = (size_t)blocks[i] * chunk;
    float* dst = packed + packed_at(widths, l, n, block_size) + (size_t)i * chunk;
    if (kv_bf16)
        for (size_t j = threadIdx.x; j < chunk; j += blockDim.x) dst[j] = kv_load((const void*)layers[l], at + j, 1);
    else
        copy_bytes(dst, (const float*)layers[l] + at, chunk * 4);
}

// The inverse of pack_blocks: scatters `packed` into blocks `blocks[0 .. n)` of every layer.
extern "C" __global__ void unpack_blocks(const float* packed, const u64* layers, const int* widths, const u32* blocks,
                                         int n, int block_size, int kv_bf16) {
    int i = blockIdx.x, l = blockIdx.y;
    size_t chunk = (size_t)block_size * widths[l], at = (size_t)blocks[i] * chunk;
    const float* src = packed + packed_at(widths, l, n, block_size) + (size_t)i * chunk;
    if (kv_bf16)
        for (size_t j = threadIdx.x; j < chunk; j += blockDim.x) kv_store((void*)layers[l], at + j, src[j], 1);
    else
        copy_bytes((float*)layers[l] + at, src, chunk * 4);
}

// Copies blocks `from[i]` of one cache into blocks `to[i]` of another of the same geometry and
// dtype (`value_bytes` 4 or 2; an in-place handoff between two pools on one GPU: device to device,
// no staging).
extern "C" __global__ void copy_blocks(const u64* to_layers, const u64* from_layers, const int* widths, const u32* to,
                                       const u32* from, int block_size, int value_bytes) {
    int i = blockIdx.x, l = blockIdx.y;
    size_t chunk = (size_t)block_size * widths[l] * value_bytes;
    copy_bytes((char*)to_layers[l] + (size_t)to[i] * chunk, (const char*)from_layers[l] + (size_t)from[i] * chunk,
               chunk);
}
