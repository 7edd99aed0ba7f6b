// Paged-KV kernels of the CUDA executor: writing a step's rows into their cache rows, and
// packing a request's blocks into one contiguous buffer (and scattering one back) for the
// handoff — the same layout as kvflow_kernels::kv::PagedKvCache::export_blocks: by layer, then
// block, then row. Compiled at run time by NVRTC (kernels/src/cuda/gpu.rs).

// cache[write_rows[r], :] = src[r * src_stride + (0 .. width)]
extern "C" __global__ void write_cache_rows(float* cache, const float* src, const u32* write_rows, int width,
                                            long long src_stride) {
    int r = blockIdx.x;
    float* d = cache + (size_t)write_rows[r] * width;
    const float* s = src + (size_t)r * src_stride;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}

// Copies `floats` floats, 16 bytes at a time when both ends allow it.
__device__ __forceinline__ void copy_chunk(float* dst, const float* src, size_t floats) {
    if (floats % 4 == 0 && ((size_t)dst % 16) == 0 && ((size_t)src % 16) == 0) {
        float4* d = (float4*)dst;
        const float4* s = (const float4*)src;
        for (size_t i = threadIdx.x; i < floats / 4; i += blockDim.x) d[i] = s[i];
    } else {
        for (size_t i = threadIdx.x; i < floats; i += blockDim.x) dst[i] = src[i];
    }
}

// Where layer l's part of a packed buffer of n blocks starts (floats): layers are packed in order.
__device__ __forceinline__ size_t packed_at(const int* widths, int l, int n, int block_size) {
    size_t at = 0;
    for (int j = 0; j < l; j++) at += (size_t)n * block_size * widths[j];
    return at;
}

// Gathers blocks `blocks[0 .. n)` of every layer into `packed`: one thread block per (block,
// layer). Layer l's cache starts at layers[l], with rows of widths[l] floats.
extern "C" __global__ void pack_blocks(float* packed, const u64* layers, const int* widths, const u32* blocks, int n,
                                       int block_size) {
    int i = blockIdx.x, l = blockIdx.y;
    size_t chunk = (size_t)block_size * widths[l];
    const float* src = (const float*)layers[l] + (size_t)blocks[i] * chunk;
    copy_chunk(packed + packed_at(widths, l, n, block_size) + (size_t)i * chunk, src, chunk);
}

// The inverse of pack_blocks: scatters `packed` into blocks `blocks[0 .. n)` of every layer.
extern "C" __global__ void unpack_blocks(const float* packed, const u64* layers, const int* widths, const u32* blocks,
                                         int n, int block_size) {
    int i = blockIdx.x, l = blockIdx.y;
    size_t chunk = (size_t)block_size * widths[l];
    float* dst = (float*)layers[l] + (size_t)blocks[i] * chunk;
    copy_chunk(dst, packed + packed_at(widths, l, n, block_size) + (size_t)i * chunk, chunk);
}

// Copies blocks `from[i]` of one cache into blocks `to[i]` of another of the same geometry
// (an in-place handoff between two pools on one GPU: device to device, no staging).
extern "C" __global__ void copy_blocks(const u64* to_layers, const u64* from_layers, const int* widths, const u32* to,
                                       const u32* from, int block_size) {
    int i = blockIdx.x, l = blockIdx.y;
    size_t chunk = (size_t)block_size * widths[l];
    copy_chunk((float*)to_layers[l] + (size_t)to[i] * chunk, (const float*)from_layers[l] + (size_t)from[i] * chunk,
               chunk);
}
