// The model kernels of the CUDA executor, compiled at run time by NVRTC (kernels/src/cuda/sources.rs).
//
// Batch invariance (DESIGN §6): every value a row gets is reduced in an order fixed by the row's
// own sizes (hidden width, head width, context length) and never by how many rows share the
// launch or which tile a row falls in. No split-K, no atomics in any sum (bf16.cu's split
// counts its blocks' arrivals to pick the one that adds a tile's chunks, in order). The host
// picks a `linear` tile by the launch's shape, batch included, only because every tile gives an
// element the same chain; kernels whose orders differ (`linear_narrow`) are picked by the layer's sizes alone. So a
// prompt's logits are bit-identical alone and in a batch of 64, which is what `--verify` relies on.

// Where a fed token comes from: a literal id, or (high bit set) the slot of the sampled-token ring
// that an earlier step's sampling wrote (deferred output, DESIGN §4: the host never waits for it).
#define FROM_RING 0x80000000u

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out[r, :] = table[token(r), :]
extern "C" __global__ void embed_rows(float* out, const float* table, const u32* tokens, const u32* ring,
                                      int hidden, int vocab) {
    int r = blockIdx.x;
    u32 t = tokens[r];
    if (t & FROM_RING) t = ring[t & ~FROM_RING];
    if (t >= (u32)vocab) t = 0;  // a placeholder the host already failed (never read past the table)
    const float* src = table + (size_t)t * hidden;
    float* dst = out + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// The MTP layer's input before its norms: row r is [table[token(r), :], hidden[r, :]] (2 * hidden
// floats), the token read as embed_rows reads it.
extern "C" __global__ void join_embedded(float* out, const float* table, const u32* tokens, const u32* ring,
                                         const float* hidden_rows, int hidden, int vocab) {
    int r = blockIdx.x;
    u32 t = tokens[r];
    if (t & FROM_RING) t = ring[t & ~FROM_RING];
    if (t >= (u32)vocab) t = 0;  // a placeholder the host already failed (never read past the table)
    const float* e = table + (size_t)t * hidden;
    const float* h = hidden_rows + (size_t)r * hidden;
    float* dst = out + (size_t)r * 2 * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = e[i];
        dst[hidden + i] = h[i];
    }
}

// RMSNorm of `rows` vectors of `dim` floats, in place or not: vector j sits at
// (j / per_row) * row_stride + offset + (j % per_row) * dim. Thread t sums squares of
// t, t + blockDim, ... in order; a fixed shared-memory tree adds the partial sums. With
// `out_bf16`, vector j is also written rounded to bf16 at out_bf16[j · dim ..] (a bf16 product's
// input, so that it needs no `round_rows_bf16` of its own).
extern "C" __global__ void rms_norm(float* out, const float* in, const float* weight, int dim, int per_row,
                                    long long row_stride, int offset, float eps, u16* out_bf16) {
    griddep_wait();
    DYNAMIC_SHARED(float, partial);
    int j = blockIdx.x;
    size_t base = (size_t)(j / per_row) * row_stride + offset + (size_t)(j % per_row) * dim;
    const float* x = in + base;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s = fmaf(x[i], x[i], s);
    partial[threadIdx.x] = s;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (threadIdx.x < step) partial[threadIdx.x] += partial[threadIdx.x + step];
        __syncthreads();
    }
    float inv = 1.0f / sqrtf(partial[0] / (float)dim + eps);
    float* y = out + base;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = weight[i] * (x[i] * inv);
        y[i] = v;
        if (out_bf16) out_bf16[(size_t)j * dim + i] = (u16)bf16_bits(v);
    }
}

// Rotary embedding of `heads` heads per row, head h of row r at r * row_stride + offset +
// h * head_stride; rotates its first 2 * half values. neox: pairs (i, i + half). interleaved
// (DeepSeek): pairs (2i, 2i + 1), written back de-interleaved as transformers does. One block
// per (row, head), one thread per frequency; cos and sin carry the attention scaling.
__device__ __forceinline__ void rope_head(float* head, int position, const float* inv_freq, int half, float scaling,
                                          int interleaved) {
    int i = threadIdx.x;
    float a = 0.0f, b = 0.0f, c = 0.0f, s = 0.0f;
    if (i < half) {
        float angle = (float)position * inv_freq[i];
        c = cosf(angle) * scaling;
        s = sinf(angle) * scaling;
        if (interleaved) { a = head[2 * i]; b = head[2 * i + 1]; }
        else { a = head[i]; b = head[i + half]; }
    }
    __syncthreads();
    if (i < half) {
        head[i] = a * c - b * s;
        head[i + half] = b * c + a * s;
    }
}

extern "C" __global__ void rope(float* x, const int* positions, const float* inv_freq, int half, float scaling,
                                int interleaved, long long row_stride, int offset, int head_stride) {
    int r = blockIdx.x, h = blockIdx.y;
    rope_head(x + (size_t)r * row_stride + offset + (size_t)h * head_stride, positions[r], inv_freq, half, scaling,
              interleaved);
}

// The same over two tensors in one launch (a layer's queries and keys): blocks (r, h < heads)
// take x's head h, the others y's head h − heads. With a cache, a y head's block then writes the
// whole rotated head (d values) and its value head (d values, v_from after it in y) into row
// write_rows[r] of the cache (rows of cache_width; value heads from v_to), as write_cache_rows
// would: the rows' keys and values in the cache without a launch of their own.
extern "C" __global__ void rope_pair(float* x, long long x_stride, int x_offset, int heads, float* y,
                                     long long y_stride, int y_offset, const int* positions, const float* inv_freq,
                                     int half, float scaling, int interleaved, int head_stride, void* cache,
                                     int kv_bf16, const u32* write_rows, int cache_width, int d, int v_from,
                                     int v_to) {
    int r = blockIdx.x, h = blockIdx.y;
    float* head = h < heads ? x + (size_t)r * x_stride + x_offset + (size_t)h * head_stride
                            : y + (size_t)r * y_stride + y_offset + (size_t)(h - heads) * head_stride;
    rope_head(head, positions[r], inv_freq, half, scaling, interleaved);
    if (!cache || h < heads) return;
    __syncthreads();  // the rotated values, written by other threads
    size_t row = (size_t)write_rows[r] * cache_width + (size_t)(h - heads) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        kv_store(cache, row + i, head[i], kv_bf16);
        kv_store(cache, row + v_to + i, head[v_from + i], kv_bf16);
    }
}

// y[z][m, n] = (accumulate ? y : 0) + (Σ_c chain_c + bias[n]): k in chunks of LINEAR_CHUNK,
// each chunk one fused multiply-add chain over its k in order (from 0), the chunks' chains added
// in order (from 0). A block of 16 × 16 threads computes a 16T × 16T tile, T × T elements per
// thread (T = 4, 2 or 1: `linear`, `linear_t2`, `linear_t1`), or one chunk of a 64 × 64 tile
// whose chains `linear_chunks_sum` then adds (`linear_split`: skinny products whose tiles alone
// would leave SMs idle). An element's value depends on its row of x and of W only — never on M,
// on the kernel or on where the row falls in a tile — so the host may pick the kernel by the
// launch's shape, batch included, and every choice gives the same bits.
// z batches independent products (MLA's per-head absorptions).
#define BK 16
template <int T>
__device__ __forceinline__ void linear_tile(float* y, const float* x, const float* w, const float* bias, int M, int N,
                                            int K, long long x_stride, long long y_stride, long long x_batch,
                                            long long w_batch, long long y_batch, int accumulate, int z, int k_lo,
                                            int k_hi, float* chunk_out) {
    constexpr int TILE = 16 * T;
    // two k-tiles in shared memory: the next one is fetched from global memory into registers
    // while this one is multiplied, then stored into the other buffer
    __shared__ float As[2][BK][TILE + 4];
    __shared__ float Bs[2][BK][TILE + 4];
    x += (size_t)z * x_batch;
    w += (size_t)z * w_batch;
    y += (size_t)z * y_batch;
    int m0 = blockIdx.y * TILE, n0 = blockIdx.x * TILE;
    int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[T][T], total[T][T];
    for (int i = 0; i < T; i++)
        for (int j = 0; j < T; j++) acc[i][j] = total[i][j] = 0.0f;
    float xa[T], wb[T];
    // this thread's share of k-tile k0: T values of x and T of W (zero past the edges)
    auto fetch = [&](int k0) {
        for (int q = 0; q < T; q++) {
            int idx = tid + 256 * q, rr = idx / BK, kk = idx % BK;
            int m = m0 + rr, n = n0 + rr, k = k0 + kk;
            xa[q] = (m < M && k < k_hi) ? x[(size_t)m * x_stride + k] : 0.0f;
            wb[q] = (n < N && k < k_hi) ? w[(size_t)n * K + k] : 0.0f;
        }
    };
    auto store = [&](int buf) {
        for (int q = 0; q < T; q++) {
            int idx = tid + 256 * q, rr = idx / BK, kk = idx % BK;
            As[buf][kk][rr] = xa[q];
            Bs[buf][kk][rr] = wb[q];
        }
    };
    fetch(k_lo);
    store(0);
    __syncthreads();
    int buf = 0;
    for (int k0 = k_lo; k0 < k_hi; k0 += BK) {
        if (k0 > k_lo && (k0 - k_lo) % LINEAR_CHUNK == 0)
            for (int i = 0; i < T; i++)
                for (int j = 0; j < T; j++) {
                    total[i][j] += acc[i][j];
                    acc[i][j] = 0.0f;
                }
        bool more = k0 + BK < k_hi;
        if (more) fetch(k0 + BK);
        int kmax = min(BK, k_hi - k0);
        if (kmax == BK) {
#pragma unroll
            for (int kk = 0; kk < BK; kk++) {
                float a[T], b[T];
                for (int i = 0; i < T; i++) a[i] = As[buf][kk][ty + 16 * i];
                for (int j = 0; j < T; j++) b[j] = Bs[buf][kk][tx + 16 * j];
                for (int i = 0; i < T; i++)
                    for (int j = 0; j < T; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
        } else {
            for (int kk = 0; kk < kmax; kk++) {
                float a[T], b[T];
                for (int i = 0; i < T; i++) a[i] = As[buf][kk][ty + 16 * i];
                for (int j = 0; j < T; j++) b[j] = Bs[buf][kk][tx + 16 * j];
                for (int i = 0; i < T; i++)
                    for (int j = 0; j < T; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
        }
        if (more) store(buf ^ 1);
        __syncthreads();
        buf ^= 1;
    }
    for (int i = 0; i < T; i++) {
        int m = m0 + ty + 16 * i;
        if (m >= M) continue;
        for (int j = 0; j < T; j++) {
            int n = n0 + tx + 16 * j;
            if (n >= N) continue;
            if (chunk_out) {
                chunk_out[(size_t)m * N + n] = acc[i][j];
                continue;
            }
            float v = total[i][j] + acc[i][j];
            if (bias) v += bias[n];
            float* dst = y + (size_t)m * y_stride + n;
            *dst = accumulate ? *dst + v : v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) linear(float* y, const float* x, const float* w, const float* bias,
                                  int M, int N, int K, long long x_stride, long long y_stride,
                                  long long x_batch, long long w_batch, long long y_batch, int accumulate) {
    linear_tile<4>(y, x, w, bias, M, N, K, x_stride, y_stride, x_batch, w_batch, y_batch, accumulate, blockIdx.z, 0, K,
                   nullptr);
}

extern "C" __global__ void __launch_bounds__(256) linear_t2(float* y, const float* x, const float* w, const float* bias,
                                  int M, int N, int K, long long x_stride, long long y_stride,
                                  long long x_batch, long long w_batch, long long y_batch, int accumulate) {
    linear_tile<2>(y, x, w, bias, M, N, K, x_stride, y_stride, x_batch, w_batch, y_batch, accumulate, blockIdx.z, 0, K,
                   nullptr);
}

extern "C" __global__ void __launch_bounds__(256) linear_t1(float* y, const float* x, const float* w, const float* bias,
                                  int M, int N, int K, long long x_stride, long long y_stride,
                                  long long x_batch, long long w_batch, long long y_batch, int accumulate) {
    linear_tile<1>(y, x, w, bias, M, N, K, x_stride, y_stride, x_batch, w_batch, y_batch, accumulate, blockIdx.z, 0, K,
                   nullptr);
}

// One chunk's chains of a 64 × 64 tile: blockIdx.z = product · chunks + chunk; the chains go to
// partial[(product · chunks + chunk) · M · N + m · N + n].
extern "C" __global__ void __launch_bounds__(256) linear_split(float* partial, const float* x, const float* w, int M,
                                  int N, int K, long long x_stride, long long x_batch, long long w_batch, int chunks) {
    int z = blockIdx.z / chunks, c = blockIdx.z % chunks;
    int k_lo = c * LINEAR_CHUNK, k_hi = min(K, k_lo + LINEAR_CHUNK);
    linear_tile<4>(nullptr, x, w, nullptr, M, N, K, x_stride, 0, x_batch, w_batch, 0, 0, z, k_lo, k_hi,
                   partial + (size_t)blockIdx.z * M * N);
}

// y[z][m, n] = (accumulate ? y : 0) + (Σ_c partial[z][c][m, n] + bias[n]), chunks in order.
extern "C" __global__ void linear_chunks_sum(float* y, const float* partial, const float* bias, int M, int N,
                                             int chunks, long long y_stride, long long y_batch, int accumulate) {
    griddep_wait();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int z = blockIdx.y;
    if (i >= (size_t)M * N) return;
    int m = i / N, n = i % N;
    const float* p = partial + (size_t)z * chunks * M * N + i;
    float v = 0.0f;
#pragma unroll 8
    for (int c = 0; c < chunks; c++) v += p[(size_t)c * M * N];  // (the loads of 8 chunks in flight)
    if (bias) v += bias[n];
    float* dst = y + (size_t)z * y_batch + (size_t)m * y_stride + n;
    *dst = accumulate ? *dst + v : v;
}

// The same product for narrow outputs over long inputs (N ≤ 256 and K ≥ 512: low-rank
// projections, routers), whose long chains the tiles would run on too few blocks: one warp per
// element, lanes taking k = lane, lane + 32, … in order, then a fixed warp sum. The host picks
// this kernel by N and K alone (product.rs, `linear_plan`), so a layer's elements are summed
// the same way in every step, whatever its batch.
extern "C" __global__ void linear_narrow(float* y, const float* x, const float* w, const float* bias, int M, int N,
                                         int K, long long x_stride, long long y_stride, long long x_batch,
                                         long long w_batch, long long y_batch, int accumulate) {
    int m = blockIdx.x, n = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N || m >= M) return;
    int z = blockIdx.z;
    const float* xr = x + (size_t)z * x_batch + (size_t)m * x_stride;
    const float* wr = w + (size_t)z * w_batch + (size_t)n * K;
    float s = 0.0f;
    for (int k = lane; k < K; k += 32) s = fmaf(xr[k], wr[k], s);
    s = warp_sum(s);
    if (lane == 0) {
        float v = s;
        if (bias) v += bias[n];
        float* dst = y + (size_t)z * y_batch + (size_t)m * y_stride + n;
        *dst = accumulate ? *dst + v : v;
    }
}


// The routed pairs grouped by expert: order[offsets[e] .. offsets[e + 1]] are the pairs routed to
// expert e, ascending. One block; warp w counts, then lists, experts w, w + warps, …: its lanes
// read 32 pairs at a time and place theirs by a ballot (ascending, whatever the warp count). Then
// the work of the expert products: each expert's pairs cut into items of up to per_item, listed
// as work[0] = items, work[1 + 2i] = item i's expert, work[2 + 2i] = its first pair in `order`
// (so a heavily routed expert spreads over many blocks instead of holding up the launch).
extern "C" __global__ void group_pairs(int* order, int* offsets, int* work, const int* experts, int pairs,
                                       int n_experts, int per_item) {
    DYNAMIC_SHARED(int, counts);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int e = warp; e < n_experts; e += warps) {
        int c = 0;
        for (int p0 = 0; p0 < pairs; p0 += 32) {
            int p = p0 + lane;
            c += __popc(__ballot_sync(0xffffffffu, p < pairs && experts[p] == e));
        }
        if (lane == 0) counts[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0;
        for (int e = 0; e < n_experts; e++) {
            offsets[e] = at;
            at += counts[e];
        }
        offsets[n_experts] = at;
        int items = 0;
        for (int e = 0; e < n_experts; e++)
            for (int c = offsets[e]; c < offsets[e + 1]; c += per_item) {
                work[1 + 2 * items] = e;
                work[2 + 2 * items] = c;
                items++;
            }
        work[0] = items;
    }
    __syncthreads();
    for (int e = warp; e < n_experts; e += warps) {
        int at = offsets[e];
        for (int p0 = 0; p0 < pairs; p0 += 32) {
            int p = p0 + lane;
            bool mine = p < pairs && experts[p] == e;
            unsigned mask = __ballot_sync(0xffffffffu, mine);
            if (mine) order[at + __popc(mask & ((1u << lane) - 1u))] = p;
            at += __popc(mask);
        }
    }
}

// Four consecutive weights as floats: f32, or bf16 (W's rows then 8-byte aligned).
__device__ __forceinline__ float4 weights4(const float* w, int k4) { return ((const float4*)w)[k4]; }
__device__ __forceinline__ float4 weights4(const u16* w, int k4) {
    uint2 v = ((const uint2*)w)[k4];
    return make_float4(bf16_float(v.x & 0xffffu), bf16_float(v.x >> 16), bf16_float(v.y & 0xffffu),
                       bf16_float(v.y >> 16));
}

// Routed expert products, expert by expert: y[p, n] = Σ_k x[p / x_per, k] · W[e][n, k] for the
// pairs p routed to expert e (`group_pairs`), W in f32 (`expert_linear`) or bf16
// (`expert_linear_bf16`, each weight widened to f32; x stays f32). Block (work item, n / 32): 8
// warps of OUTPUTS_PER_WARP outputs each, over the item's pairs (up to per_item of one expert's)
// in chunks of PAIRS_PER_PASS, so a lane's
// loads of x serve four outputs and its loads of W eight pairs. A pair's value is its own: each
// lane takes its k in order (four consecutive ones at a time, 4·lane + 128·i + j, when K is a
// multiple of 4; else lane + 32·i), then a fixed warp sum, whichever pairs and outputs share the
// warp.
#define PAIRS_PER_PASS 8
#define OUTPUTS_PER_WARP 4
template <class W>
__device__ __forceinline__ void expert_products(float* y, const float* x, const W* w, const int* order,
                                                const int* offsets, const int* work, int per_item, int N, int K,
                                                int x_per) {
    int item = blockIdx.x, lane = threadIdx.x % 32;
    int n0 = (blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32) * OUTPUTS_PER_WARP;
    if (item >= work[0] || n0 >= N) return;
    int e = work[1 + 2 * item];
    int outputs = min(OUTPUTS_PER_WARP, N - n0);
    const W* wr[OUTPUTS_PER_WARP];
    for (int j = 0; j < OUTPUTS_PER_WARP; j++) wr[j] = w + ((size_t)e * N + n0 + min(j, outputs - 1)) * K;
    int first = work[2 + 2 * item], end = min(first + per_item, offsets[e + 1]);
    for (int c0 = first; c0 < end; c0 += PAIRS_PER_PASS) {
        int count = min(PAIRS_PER_PASS, end - c0);
        float s[PAIRS_PER_PASS][OUTPUTS_PER_WARP];
        const float* xr[PAIRS_PER_PASS];
        for (int c = 0; c < PAIRS_PER_PASS; c++) {
            for (int j = 0; j < OUTPUTS_PER_WARP; j++) s[c][j] = 0.0f;
            xr[c] = x + (size_t)(order[c0 + min(c, count - 1)] / x_per) * K;
        }
        if (K % 4 == 0) {
            // rows are 16-byte aligned (8-byte in bf16) when K is a multiple of 4
            for (int k4 = lane; k4 < K / 4; k4 += 32) {
                float4 wv[OUTPUTS_PER_WARP];
                for (int j = 0; j < OUTPUTS_PER_WARP; j++) wv[j] = weights4(wr[j], k4);
                for (int c = 0; c < PAIRS_PER_PASS; c++) {
                    float4 xv = ((const float4*)xr[c])[k4];
                    for (int j = 0; j < OUTPUTS_PER_WARP; j++) {
                        s[c][j] = fmaf(xv.x, wv[j].x, s[c][j]);
                        s[c][j] = fmaf(xv.y, wv[j].y, s[c][j]);
                        s[c][j] = fmaf(xv.z, wv[j].z, s[c][j]);
                        s[c][j] = fmaf(xv.w, wv[j].w, s[c][j]);
                    }
                }
            }
        } else {
            for (int k = lane; k < K; k += 32) {
                for (int c = 0; c < PAIRS_PER_PASS; c++) {
                    float xv = xr[c][k];
                    for (int j = 0; j < OUTPUTS_PER_WARP; j++) s[c][j] = fmaf(xv, load_float(wr[j], k), s[c][j]);
                }
            }
        }
        for (int c = 0; c < PAIRS_PER_PASS; c++)
            for (int j = 0; j < OUTPUTS_PER_WARP; j++) {
                float v = warp_sum(s[c][j]);
                if (lane == 0 && c < count && j < outputs) y[(size_t)order[c0 + c] * N + n0 + j] = v;
            }
    }
}

extern "C" __global__ void expert_linear(float* y, const float* x, const float* w, const int* order,
                                         const int* offsets, const int* work, int per_item, int N, int K,
                                         int x_per) {
    expert_products(y, x, w, order, offsets, work, per_item, N, K, x_per);
}

extern "C" __global__ void expert_linear_bf16(float* y, const float* x, const u16* w, const int* order,
                                              const int* offsets, const int* work, int per_item, int N, int K,
                                              int x_per) {
    expert_products(y, x, w, order, offsets, work, per_item, N, K, x_per);
}

// act[r, i] = silu(gu[r, i]) · gu[r, inter + i]; with `act_bf16`, also rounded to bf16 there (the
// down product's input, as rms_norm's out_bf16).
extern "C" __global__ void swiglu(float* act, const float* gu, int rows, int inter, u16* act_bf16) {
    griddep_wait();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * inter) return;
    size_t r = i / inter, c = i % inter;
    float v = silu(gu[r * 2 * inter + c]) * gu[r * 2 * inter + inter + c];
    act[i] = v;
    if (act_bf16) act_bf16[i] = (u16)bf16_bits(v);
}

#define KEYS_AT_ONCE 4
#define HEADS_PER_WARP 2
#define STAGED_KEYS 8
#define STAGE_LOADS 8
#define KEY_SPLIT 64        // a row's keys in parts of 64 (rows.rs: KEY_SPLIT)
#define MAX_QK_PER_LANE 24  // head widths up to 768 for scores
#define MAX_V_PER_LANE 16   // and 512 for values (parts/attention.rs checks both)
// Causal attention over the paged cache, read through the block tables, in two kernels (split
// keys, as flash-decoding does). Row r is at position positions[r] of sequence seqs[r], whose
// blocks start at tables[table_at[seq]]; it sees positions max(0, p + 1 − window) ..= p (window 0:
// all), or, where `selected` is given and counts[r] ≥ 0 (DeepSeek-V3.2's indexer,
// kernels/cuda/indexer.cu), the counts[r] positions at selected[r * selected_stride ..], ascending.
//
// The cache holds f32, or bf16 where kv_bf16 (widened as it is staged).
// paged_attention, block (row r0 + i, kv head g, head part; key part s): HEADS_PER_WARP of g's
// query heads per warp (blockDim / 32 warps: parts/attention.rs picks them from the group's size), over
// keys s·KEY_SPLIT .. (s + 1)·KEY_SPLIT of the row's list, staged in shared memory STAGED_KEYS
// at a time and shared by every warp (an MLA row's 16 heads read each latent key once). Lane l
// holds q and the output at d = l, l + 32, … of each of its warp's heads; a key's score is the
// lane's fma chain over its d in order, then a fixed warp sum; KEYS_AT_ONCE scores at a time
// fold into the head's running max m, sum l and output. A part writes [m, l, output] per head to
// `parts` (m = −∞ when it has no keys). attention_merge then adds a row's parts in order. Every
// order is fixed by the row and the head alone (its key list cut at fixed counts), whatever the
// batch, the grid, the warps and the launch slice.
extern "C" __global__ void __launch_bounds__(256, 2) paged_attention(float* parts, const float* q, const void* cache, int kv_bf16, const u32* tables,
                                           const u32* table_at, const int* positions, const int* seqs, int r0,
                                           int rows, int q_heads, int kv_heads, int qk_dim, int v_dim, int k_offset,
                                           int v_offset, int row_width, int block_size, int window, float scale,
                                           long long q_stride, const int* selected, const int* counts,
                                           int selected_stride) {
    DYNAMIC_SHARED(float, staged);  // STAGED_KEYS × [k (qk_dim) | v (v_dim)]
    __shared__ size_t key_row[STAGED_KEYS];
    int warps = blockDim.x / 32, per_block = warps * HEADS_PER_WARP;
    int group = q_heads / kv_heads, head_parts = (group + per_block - 1) / per_block;
    int i = blockIdx.x / (kv_heads * head_parts), g = blockIdx.x / head_parts % kv_heads;
    int part = blockIdx.x % head_parts, split = blockIdx.y, splits = gridDim.y;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int r = r0 + i;
    if (r >= rows) return;
    // the warp's first head within the group; a warp past the group's last head only stages
    int first = part * per_block + warp * HEADS_PER_WARP;
    int heads_here = max(0, min(HEADS_PER_WARP, group - first));
    float qr[HEADS_PER_WARP][MAX_QK_PER_LANE], acc[HEADS_PER_WARP][MAX_V_PER_LANE];
    float m[HEADS_PER_WARP], l[HEADS_PER_WARP];
#pragma unroll
    for (int c = 0; c < HEADS_PER_WARP; c++) {
        const float* qh = q + (size_t)r * q_stride + (size_t)(g * group + first + c) * qk_dim;
#pragma unroll
        for (int j = 0; j < MAX_QK_PER_LANE; j++) {
            int d = lane + 32 * j;
            qr[c][j] = c < heads_here && d < qk_dim ? qh[d] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < MAX_V_PER_LANE; j++) acc[c][j] = 0.0f;
        m[c] = -KV_INFINITY;
        l[c] = 0.0f;
    }
    int p = positions[r];
    const u32* table = tables + table_at[seqs[r]];
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    int picked = selected ? counts[r] : -1;
    const int* keys = picked >= 0 ? selected + (size_t)r * selected_stride : nullptr;
    int n_keys = picked >= 0 ? picked : p + 1 - lo;
    int key0 = split * KEY_SPLIT, end = min(n_keys, key0 + KEY_SPLIT);
    int width = qk_dim + v_dim;
    size_t k_base = k_offset + (size_t)g * qk_dim, v_base = v_offset + (size_t)g * v_dim;
    for (int s0 = key0; s0 < end; s0 += STAGED_KEYS) {
        int count = min(STAGED_KEYS, end - s0);
        __syncthreads();  // every warp is done with the previous stage
        if (threadIdx.x < count) {
            int pos = keys ? keys[s0 + threadIdx.x] : lo + s0 + threadIdx.x;
            key_row[threadIdx.x] = ((size_t)table[pos / block_size] * block_size + pos % block_size) * row_width;
        }
        __syncthreads();
        // STAGE_LOADS loads in flight per thread before any is stored; element e = u·width + d
        // is walked without a division (d steps by blockDim, wrapping into the next key)
        int u = 0, d = threadIdx.x;
        while (d >= width && u < count) { d -= width; u++; }
        for (int e0 = threadIdx.x; e0 < count * width; e0 += STAGE_LOADS * blockDim.x) {
            float v[STAGE_LOADS];
            int at[STAGE_LOADS];
#pragma unroll
            for (int j = 0; j < STAGE_LOADS; j++) {
                bool in = u < count;
                at[j] = in ? u * width + d : -1;
                v[j] = in ? kv_load(cache, key_row[u] + (d < qk_dim ? k_base + d : v_base + d - qk_dim), kv_bf16)
                          : 0.0f;
                d += blockDim.x;
                while (d >= width && u < count) { d -= width; u++; }
            }
#pragma unroll
            for (int j = 0; j < STAGE_LOADS; j++)
                if (at[j] >= 0) staged[at[j]] = v[j];
        }
        __syncthreads();
        if (heads_here == 0) continue;
        for (int i0 = 0; i0 < count; i0 += KEYS_AT_ONCE) {
            int keys_now = min(KEYS_AT_ONCE, count - i0);
            const float* key[KEYS_AT_ONCE];
#pragma unroll
            for (int k = 0; k < KEYS_AT_ONCE; k++) key[k] = staged + (i0 + min(k, keys_now - 1)) * width;
            float sc[HEADS_PER_WARP][KEYS_AT_ONCE];
#pragma unroll
            for (int c = 0; c < HEADS_PER_WARP; c++)
#pragma unroll
                for (int k = 0; k < KEYS_AT_ONCE; k++) sc[c][k] = 0.0f;
#pragma unroll
            for (int j = 0; j < MAX_QK_PER_LANE; j++) {
                int dd = lane + 32 * j;
                if (dd < qk_dim) {
                    float kv[KEYS_AT_ONCE];
#pragma unroll
                    for (int k = 0; k < KEYS_AT_ONCE; k++) kv[k] = key[k][dd];
#pragma unroll
                    for (int c = 0; c < HEADS_PER_WARP; c++)
#pragma unroll
                        for (int k = 0; k < KEYS_AT_ONCE; k++) sc[c][k] = fmaf(qr[c][j], kv[k], sc[c][k]);
                }
            }
            float corr[HEADS_PER_WARP], e[HEADS_PER_WARP][KEYS_AT_ONCE];
#pragma unroll
            for (int c = 0; c < HEADS_PER_WARP; c++) {
                float m_new = m[c];
#pragma unroll
                for (int k = 0; k < KEYS_AT_ONCE; k++) {
                    sc[c][k] = warp_sum(sc[c][k]) * scale;
                    if (k < keys_now) m_new = fmaxf(m_new, sc[c][k]);
                }
                corr[c] = expf(m[c] - m_new);
                l[c] = l[c] * corr[c];
#pragma unroll
                for (int k = 0; k < KEYS_AT_ONCE; k++) {
                    e[c][k] = k < keys_now ? expf(sc[c][k] - m_new) : 0.0f;
                    l[c] += e[c][k];
                }
                m[c] = m_new;
            }
#pragma unroll
            for (int j = 0; j < MAX_V_PER_LANE; j++) {
                int dd = lane + 32 * j;
                if (dd < v_dim) {
                    float vv[KEYS_AT_ONCE];
#pragma unroll
                    for (int k = 0; k < KEYS_AT_ONCE; k++) vv[k] = key[k][qk_dim + dd];
#pragma unroll
                    for (int c = 0; c < HEADS_PER_WARP; c++) {
                        float a = acc[c][j] * corr[c];
#pragma unroll
                        for (int k = 0; k < KEYS_AT_ONCE; k++)
                            if (k < keys_now) a = fmaf(e[c][k], vv[k], a);
                        acc[c][j] = a;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < HEADS_PER_WARP; c++) {
        if (c >= heads_here) break;
        int h = g * group + first + c;
        float* o = parts + (((size_t)i * q_heads + h) * splits + split) * (v_dim + 2);
        if (lane == 0) {
            o[0] = m[c];
            o[1] = l[c];
        }
#pragma unroll
        for (int j = 0; j < MAX_V_PER_LANE; j++) {
            int dd = lane + 32 * j;
            if (dd < v_dim) o[2 + dd] = acc[c][j];
        }
    }
}

// out[r0 + i, h, :] = the row's parts added in order: Σ_s output_s · e^(m_s − M) / Σ_s l_s · e^(m_s − M),
// M the largest m_s (a part without keys weighs 0). Block (i, h), a thread per d.
extern "C" __global__ void attention_merge(float* out, const float* parts, int r0, int q_heads, int v_dim,
                                           int splits) {
    int i = blockIdx.x / q_heads, h = blockIdx.x % q_heads;
    const float* p = parts + ((size_t)i * q_heads + h) * splits * (v_dim + 2);
    float big = -KV_INFINITY;
    for (int s = 0; s < splits; s++) big = fmaxf(big, p[s * (v_dim + 2)]);
    float sum = 0.0f;
    for (int s = 0; s < splits; s++) {
        float m = p[s * (v_dim + 2)];
        if (m > -KV_INFINITY) sum += p[s * (v_dim + 2) + 1] * expf(m - big);
    }
    float* o = out + ((size_t)(r0 + i) * q_heads + h) * v_dim;
    for (int d = threadIdx.x; d < v_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < splits; s++) {
            float m = p[s * (v_dim + 2)];
            if (m > -KV_INFINITY) a = fmaf(p[s * (v_dim + 2) + 2 + d], expf(m - big), a);
        }
        o[d] = a / sum;
    }
}

// dst[r * dst_stride + dst_offset + h * dst_head + i] = src[r * src_stride + src_offset + h * src_head + i]
extern "C" __global__ void copy_heads(float* dst, const float* src, int width, long long dst_stride, int dst_offset,
                                      int dst_head, long long src_stride, int src_offset, int src_head) {
    int r = blockIdx.x, h = blockIdx.y;
    float* d = dst + (size_t)r * dst_stride + dst_offset + (size_t)h * dst_head;
    const float* s = src + (size_t)r * src_stride + src_offset + (size_t)h * src_head;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}

// out[i, :] = src[rows[i], :]
extern "C" __global__ void gather_rows(float* out, const float* src, const int* rows, int width) {
    int i = blockIdx.x;
    const float* s = src + (size_t)rows[i] * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) out[(size_t)i * width + c] = s[c];
}

// MoE routing of one token per block (its first thread; the scores in shared memory, not in a
// per-thread stack that would spill), as kvflow_kernels::models::parts::moe::Routing::route:
// scores (sigmoid or softmax), the correction bias for choosing only, group-limited top-k (ties
// to the lower index), normalised and scaled weights, then the choice in ascending expert order.
// Shared: scores [n], choice [n], group scores [n_group], kept groups [n_group].
#define MAX_TOP_K 32
extern "C" __global__ void route(int* experts_out, float* weights_out, const float* logits, const float* bias,
                                 int tokens, int n, int top_k, int softmax_scoring, int n_group, int topk_group,
                                 int norm_topk, float scaling) {
    DYNAMIC_SHARED(float, scores);
    int t = blockIdx.x;
    if (threadIdx.x != 0 || t >= tokens) return;
    const float* l = logits + (size_t)t * n;
    float *choice = scores + n, *group_score = choice + n, *keep = group_score + max(n_group, 1);
    if (softmax_scoring) {
        float mx = -KV_INFINITY;
        for (int e = 0; e < n; e++) mx = fmaxf(mx, l[e]);
        float sum = 0.0f;
        for (int e = 0; e < n; e++) { scores[e] = expf(l[e] - mx); sum += scores[e]; }
        for (int e = 0; e < n; e++) scores[e] = scores[e] / sum;
    } else {
        for (int e = 0; e < n; e++) scores[e] = sigmoid(l[e]);
    }
    for (int e = 0; e < n; e++) choice[e] = bias ? scores[e] + bias[e] : scores[e];
    if (n_group > 1) {
        int per = n / n_group;
        for (int g = 0; g < n_group; g++) {
            int b1 = -1, b2 = -1;
            for (int i = 0; i < per; i++) {
                float v = choice[g * per + i];
                if (b1 < 0 || v > choice[g * per + b1]) { b2 = b1; b1 = i; }
                else if (b2 < 0 || v > choice[g * per + b2]) { b2 = i; }
            }
            float s = 0.0f;
            s += choice[g * per + b1];
            if (b2 >= 0) s += choice[g * per + b2];
            group_score[g] = s;
        }
        for (int g = 0; g < n_group; g++) keep[g] = 0.0f;
        for (int k = 0; k < topk_group; k++) {
            int best = -1;
            for (int g = 0; g < n_group; g++)
                if (keep[g] == 0.0f && (best < 0 || group_score[g] > group_score[best])) best = g;
            keep[best] = 1.0f;
        }
        for (int g = 0; g < n_group; g++)
            if (keep[g] == 0.0f)
                for (int i = 0; i < per; i++) choice[g * per + i] = -KV_INFINITY;
    }
    int chosen[MAX_TOP_K];
    float w[MAX_TOP_K];
    for (int k = 0; k < top_k; k++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            bool taken = false;
            for (int j = 0; j < k; j++) taken |= chosen[j] == e;
            if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
        }
        chosen[k] = best;
        w[k] = scores[best];
    }
    if (norm_topk) {
        float den = 0.0f;
        for (int k = 0; k < top_k; k++) den += w[k];
        if (!softmax_scoring) den += 1e-20f;
        for (int k = 0; k < top_k; k++) w[k] = w[k] / den;
    }
    for (int k = 0; k < top_k; k++) w[k] = w[k] * scaling;
    // ascending expert order (insertion sort: top_k is small)
    for (int a = 1; a < top_k; a++)
        for (int b = a; b > 0 && chosen[b - 1] > chosen[b]; b--) {
            int e = chosen[b]; chosen[b] = chosen[b - 1]; chosen[b - 1] = e;
            float v = w[b]; w[b] = w[b - 1]; w[b - 1] = v;
        }
    for (int k = 0; k < top_k; k++) {
        experts_out[t * top_k + k] = chosen[k];
        weights_out[t * top_k + k] = w[k];
    }
}

// Qwen3-Next's gated attention: q_proj yields [query (d) | gate (d)] per head. Splits a row's
// first 2·heads·d values of `qkv` (rows of `width`) into q [rows × heads·d] and gate.
extern "C" __global__ void split_query_gate(float* q, float* gate, const float* qkv, int width, int heads, int d) {
    int r = blockIdx.x, n = blockIdx.y;
    const float* src = qkv + (size_t)r * width + (size_t)n * 2 * d;
    size_t dst = (size_t)r * heads * d + (size_t)n * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        q[dst + i] = src[i];
        gate[dst + i] = src[d + i];
    }
}

// x[i] *= sigmoid(gate[i]) (the attention output of a gated layer, before o_proj)
extern "C" __global__ void apply_sigmoid_gate(float* x, const float* gate, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= sigmoid(gate[i]);
}

// h[t, i] += (Σ_k expert_out[t·top_k + k, i] · weight[t·top_k + k]) + shared[t, i], experts in
// ascending order, as the CPU block sums them; with `shared_gate` (Qwen's gated shared expert)
// the shared term is sigmoid(shared_gate[t]) · shared[t, i].
extern "C" __global__ void moe_combine(float* h, const float* expert_out, const float* weights, const float* shared,
                                       const float* shared_gate, int tokens, int top_k, int hidden) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * hidden) return;
    size_t t = i / hidden, c = i % hidden;
    float a = 0.0f;
    for (int k = 0; k < top_k; k++) a += expert_out[(t * top_k + k) * hidden + c] * weights[t * top_k + k];
    if (shared) a += shared_gate ? sigmoid(shared_gate[t]) * shared[i] : shared[i];
    h[i] += a;
}

__device__ __forceinline__ u64 mix(u64 state, u64 value) {
    u64 z = state ^ (value + 0x9E3779B97F4A7C15ull + (state << 6) + (state >> 2));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// What sampling needs of a logits row, every thread of the block getting it: the argmax (first on
// a tie), whether the row is all finite, and kvflow_kernels::hash::logits_row of its bit patterns
// (what --verify compares). The hash: each LOGITS_SEGMENT values hashed by one thread, then thread
// 0 chains the segments' hashes in order, blockDim of them at a time.
#define LOGITS_SEGMENT 256
struct RowSummary {
    int token;
    int finite;
    u64 hash;
};
__device__ RowSummary summarize_row(const float* row, int vocab) {
    __shared__ float best_v[256];
    __shared__ int best_i[256];
    __shared__ int all_finite[256];
    __shared__ u64 segment_hash[256];
    __shared__ RowSummary summary;
    float bv = -KV_INFINITY;
    int bi = -1, finite = 1;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        float v = row[c];
        finite &= isfinite(v) ? 1 : 0;
        if (bi < 0 || v > bv) { bv = v; bi = c; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    all_finite[threadIdx.x] = finite;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (threadIdx.x < step) {
            int o = threadIdx.x + step;
            float v = best_v[o];
            int j = best_i[o];
            if (j >= 0 && (best_i[threadIdx.x] < 0 || v > best_v[threadIdx.x] ||
                           (v == best_v[threadIdx.x] && j < best_i[threadIdx.x]))) {
                best_v[threadIdx.x] = v;
                best_i[threadIdx.x] = j;
            }
            all_finite[threadIdx.x] &= all_finite[o];
        }
        __syncthreads();
    }
    const u32* bits = (const u32*)row;
    int segments = (vocab + LOGITS_SEGMENT - 1) / LOGITS_SEGMENT;
    u64 h = mix(0xcbf29ce484222325ull, (u64)vocab);
    for (int s0 = 0; s0 < segments; s0 += blockDim.x) {
        int s = s0 + threadIdx.x;
        if (s < segments) {
            int c = s * LOGITS_SEGMENT, end = min(vocab, c + LOGITS_SEGMENT);
            u64 sh = 0xcbf29ce484222325ull;
            for (; c + 1 < end; c += 2) sh = mix(sh, ((u64)bits[c] << 32) | (u64)bits[c + 1]);
            if (c < end) sh = mix(sh, (u64)bits[c]);
            segment_hash[threadIdx.x] = sh;
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (int j = 0; j < min((int)blockDim.x, segments - s0); j++) h = mix(h, segment_hash[j]);
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        summary.token = best_i[0];
        summary.finite = all_finite[0];
        summary.hash = h;
    }
    __syncthreads();
    return summary;
}

// Row i's token (0 when the row is not all finite) into the ring at ring_slots[i], and
// results[i] = {token, finite, hash lo, hash hi}. Thread 0 writes.
__device__ void write_sample(u32* results, u32* ring, const int* ring_slots, int i, u32 token, RowSummary s) {
    if (threadIdx.x != 0) return;
    token = s.finite ? token : 0u;
    ring[ring_slots[i]] = token;
    results[4 * i] = token;
    results[4 * i + 1] = (u32)s.finite;
    results[4 * i + 2] = (u32)(s.hash & 0xffffffffull);
    results[4 * i + 3] = (u32)(s.hash >> 32);
}

// Greedy sampling of each logits row, on the device: the argmax.
extern "C" __global__ void sample_greedy(u32* results, u32* ring, const int* ring_slots, const float* logits,
                                         int vocab) {
    int i = blockIdx.x;
    RowSummary s = summarize_row(logits + (size_t)i * vocab, vocab);
    write_sample(results, ring, ring_slots, i, (u32)s.token, s);
}

// ---- seeded draws: the rule and arithmetic of kernels/src/cpu/draw.rs, the same bits ----
// Every double operation is an intrinsic that rounds once (never contracted into an fma) or an
// explicit fma, so the host and the device compute the same bits.

static __device__ const u64 INVERSE_FACTORIALS[14] = {
    0x3ff0000000000000ull, 0x3ff0000000000000ull, 0x3fe0000000000000ull, 0x3fc5555555555555ull,
    0x3fa5555555555555ull, 0x3f81111111111111ull, 0x3f56c16c16c16c17ull, 0x3f2a01a01a01a01aull,
    0x3efa01a01a01a01aull, 0x3ec71de3a556c734ull, 0x3e927e4fb7789f5dull, 0x3e5ae64567f544e4ull,
    0x3e21eed8eff8d898ull, 0x3de6124613a86d0aull};

// kvflow_kernels::cpu::draw::exp_det: e^x for x <= 0 from basic operations alone.
__device__ double exp_det(double x) {
    if (!(x >= -745.0)) return 0.0;
    double k = floor(__dadd_rn(__dmul_rn(x, __longlong_as_double(0x3ff71547652b82fell)), 0.5));
    double r = fma(-k, __longlong_as_double(0x3fe62e42fee00000ll), x);
    r = fma(-k, __longlong_as_double(0x3dea39ef35793c76ll), r);
    double p = __longlong_as_double((long long)INVERSE_FACTORIALS[13]);
    for (int n = 12; n >= 0; n--) p = fma(p, r, __longlong_as_double((long long)INVERSE_FACTORIALS[n]));
    long long e = (long long)k;
    if (e >= -1022) return __dmul_rn(p, __longlong_as_double((e + 1023) << 52));
    return __dmul_rn(__dmul_rn(p, __longlong_as_double((e + 64 + 1023) << 52)),
                     __longlong_as_double((long long)(1023 - 64) << 52));
}

// kvflow_kernels::cpu::draw::rank_key: larger is likelier, ties by the lower id.
__device__ __forceinline__ u64 rank_key(float logit, int id) {
    u32 b = __float_as_uint(logit);
    u32 ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)ordered << 32) | (u64)(0xffffffffu - (u32)id);
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    u64 z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// How many of the row's keys are at least `threshold` (every thread gets it).
__device__ u32 count_from(const float* row, int vocab, u64 threshold) {
    __shared__ u32 counts[256];
    u32 c = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) c += rank_key(row[i], i) >= threshold ? 1u : 0u;
    __syncthreads();
    counts[threadIdx.x] = c;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (threadIdx.x < step) counts[threadIdx.x] += counts[threadIdx.x + step];
        __syncthreads();
    }
    return counts[0];
}

#define MAX_SEGMENTS 2048
// kvflow_kernels::cpu::draw::Weights::tree over the tokens whose key is at least `threshold`,
// token `skip` left out (-1: none): the segments' sums at tree[0..segments), each level of the
// pairwise tree after the one below it. Returns the root (every thread gets it).
__device__ double tree_from(const double* w, const float* row, int vocab, int segment, u64 threshold, int skip,
                           double* tree) {
    int segments = (vocab + segment - 1) / segment;
    __syncthreads();
    for (int j = threadIdx.x; j < segments; j += blockDim.x) {
        double s = 0.0;
        for (int i = j * segment, end = min(vocab, (j + 1) * segment); i < end; i++)
            if (i != skip && rank_key(row[i], i) >= threshold) s = __dadd_rn(s, w[i]);
        tree[j] = s;
    }
    __syncthreads();
    int at = 0, len = segments;
    while (len > 1) {
        int next = (len + 1) / 2;
        for (int j = threadIdx.x; j < next; j += blockDim.x)
            tree[at + len + j] = 2 * j + 1 < len ? __dadd_rn(tree[at + 2 * j], tree[at + 2 * j + 1]) : tree[at + 2 * j];
        __syncthreads();
        at += len;
        len = next;
    }
    return tree[at];
}

// The highest key at least `threshold` of a token other than `skip` (every thread gets it).
__device__ u64 most_likely_except(const float* row, int vocab, u64 threshold, int skip) {
    __shared__ u64 best[256];
    u64 b = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        u64 k = rank_key(row[i], i);
        if (i != skip && k >= threshold && k > b) b = k;
    }
    __syncthreads();
    best[threadIdx.x] = b;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (threadIdx.x < step && best[threadIdx.x + step] > best[threadIdx.x]) best[threadIdx.x] = best[threadIdx.x + step];
        __syncthreads();
    }
    return best[0];
}

// kvflow_kernels::cpu::sampling::SampleKey::uniform
__device__ double uniform_draw(u64 seed, u64 request, u64 position) {
    u64 h = splitmix64(splitmix64(splitmix64(seed) ^ request) ^ position);
    return __ddiv_rn((double)(h >> 11), 9007199254740992.0);
}

// The highest key in [lo, hi] at which `enough` holds (it holds at lo, and fails above some key).
#define HIGHEST_KEY(lo, hi, enough)                         \
    while (lo < hi) {                                       \
        u64 d = hi - lo, mid = lo + (d >> 1) + (d & 1ull);  \
        if (enough) lo = mid; else hi = mid - 1;            \
    }

// Seeded sampling of each logits row (temperature, top-k, top-p), one block of 256 threads a row:
// kvflow_kernels::cpu::sampling::sample's token from the same row, the same bits — or, for a row
// that checks a draft, Sampler::check_draft's (the draft kept with probability p(draft), else a
// token drawn from the rest). draws holds DRAW_WORDS a row: temperature (f32 bits), top_k, top_p
// (f32 bits), seed, request id, position (each u64, low word first), the draft (NO_DRAFT: none);
// temperature 0 or top_k 1 is greedy. weights: vocab doubles a row.
#define DRAW_WORDS 10
#define NO_DRAFT 0xffffffffu
#define ACCEPT_STREAM 0x5EC5A11DD4AF7000ull
extern "C" __global__ void sample_drawn(u32* results, u32* ring, const int* ring_slots, const float* logits,
                                        const u32* draws, double* weights, int vocab) {
    __shared__ double tree[2 * MAX_SEGMENTS];
    int i = blockIdx.x;
    const float* row = logits + (size_t)i * vocab;
    RowSummary s = summarize_row(row, vocab);
    const u32* d = draws + (size_t)i * DRAW_WORDS;
    float temperature = __uint_as_float(d[0]), top_p = __uint_as_float(d[2]);
    u32 top_k = d[1];
    if (!s.finite || !(temperature > 0.0f) || top_k == 1) {
        write_sample(results, ring, ring_slots, i, (u32)s.token, s);
        return;
    }
    double t = (double)temperature, m = __ddiv_rn((double)row[s.token], t);
    double* w = weights + (size_t)i * vocab;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) w[c] = exp_det(__dsub_rn(__ddiv_rn((double)row[c], t), m));
    int segment = max(64, (vocab + MAX_SEGMENTS - 1) / MAX_SEGMENTS);
    u64 most = rank_key(row[s.token], s.token), from = 0;
    if (top_k > 0 && top_k < (u32)vocab) {
        u64 hi = most;
        HIGHEST_KEY(from, hi, count_from(row, vocab, mid) >= top_k)
    }
    double total = tree_from(w, row, vocab, segment, from, -1, tree);
    if (top_p < 1.0f) {
        double target = __dmul_rn((double)top_p, total);
        u64 hi = most;
        HIGHEST_KEY(from, hi, tree_from(w, row, vocab, segment, mid, -1, tree) >= target)
        total = tree_from(w, row, vocab, segment, from, -1, tree);
    }
    u64 seed = d[3] | (u64)d[4] << 32, request = d[5] | (u64)d[6] << 32, position = d[7] | (u64)d[8] << 32;
    int skip = -1;
    u32 fallback = (u32)s.token;  // rounding left no token: the most likely one drawn from
    if (d[9] != NO_DRAFT) {
        // a draft: kept with probability w(draft) / total, else drawn from the other kept tokens
        int draft = (int)d[9];
        double p = draft < vocab && rank_key(row[draft], draft) >= from ? w[draft] : 0.0;
        u64 other = most_likely_except(row, vocab, from, draft);
        if (__dmul_rn(uniform_draw(seed ^ ACCEPT_STREAM, request, position), total) < p || other == 0) {
            write_sample(results, ring, ring_slots, i, (u32)draft, s);
            return;
        }
        skip = draft;
        fallback = 0xffffffffu - (u32)(other & 0xffffffffull);
        total = tree_from(w, row, vocab, segment, from, skip, tree);
    }
    if (threadIdx.x != 0) return;
    double target = __dmul_rn(uniform_draw(seed, request, position), total);
    // the levels' offsets, then the walk from the root: left while the target is below the sum
    // through the left child
    int offsets[16], lens[16], levels = 0, segments = (vocab + segment - 1) / segment;
    for (int at = 0, len = segments;; len = (len + 1) / 2) {
        offsets[levels] = at;
        lens[levels++] = len;
        if (len == 1) break;
        at += len;
    }
    int node = 0;
    double before = 0.0;
    for (int l = levels - 2; l >= 0; l--) {
        int left = 2 * node;
        if (left + 1 < lens[l]) {
            double through_left = __dadd_rn(before, tree[offsets[l] + left]);
            if (target < through_left) node = left;
            else { before = through_left; node = left + 1; }
        } else {
            node = left;
        }
    }
    u32 token = fallback;
    double running = before;
    for (int c = node * segment, end = min(vocab, (node + 1) * segment); c < end; c++) {
        if (c == skip || rank_key(row[c], c) < from) continue;
        running = __dadd_rn(running, w[c]);
        if (target < running) { token = (u32)c; break; }
    }
    write_sample(results, ring, ring_slots, i, token, s);
}
