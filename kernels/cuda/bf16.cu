// The bfloat16 products of the CUDA executor (`dtype = "bfloat16"`): weights in bf16, each
// product's input rounded to bf16 (round to nearest even) once — by the kernel that writes it
// (model.cu's rms_norm, swiglu) or by `round_rows_bf16` — tensor-core matrix products (mma.sync
// m16n8k16, f32 accumulation), outputs and everything between products in f32. Compiled at run time by NVRTC (kernels/src/cuda/sources.rs).
//
// Batch invariance (DESIGN §6), as model.cu's `linear`: an element of y = x · Wᵀ is the sum, in
// order from 0, of its chunks' chains (LINEAR_CHUNK = 256 inputs each, 16 products of 16 inputs
// accumulated in k order) — fixed by the layer's K alone. Every element goes through the same
// instruction whatever its place in a tile, so the host may split a skinny product by chunk
// (`linear_bf16_split`, then model.cu's `linear_chunks_sum`) or not, by the batch's shape.
//
// Stages of 32 inputs of W and x go to shared memory by cp.async, all but one of them in flight
// while a stage is multiplied (rows that are not 16-byte aligned are staged element by element,
// the same values in the same places): 64-square tiles of four warps (decode, and the skinny
// products split by chunk), 128-square tiles of eight (prefill).

#define BF16_TILE 64     // W rows and x rows of a block's tile
#define BF16_BK 32       // inputs per stage
#define BF16_PAIRS 16    // bf16 pairs of a stage's row
#define BF16_PAD 20      // a staged row's u32 stride (conflict-free fragment loads, 16-byte aligned)
#define SPLIT_SUM_ELEMENTS 4  // linear_bf16_split's last block: elements a thread adds at once
#ifndef SPLIT_SUM_AHEAD
#define SPLIT_SUM_AHEAD 8     // ... and each one's chunks it reads at once (a tuning constant, sources.rs)
#endif
#ifndef BF16_STAGES
#define BF16_STAGES 3    // stages in shared memory (static: 3 · 10 KiB; a tuning constant, sources.rs)
#endif

// out[m, k] = bf16(x[m · x_stride + k]): a product's input rounded once; grid (M, K / 256).
extern "C" __global__ void round_rows_bf16(u16* out, const float* x, int M, int K, long long x_stride) {
    griddep_wait();
    int k = blockIdx.y * blockDim.x + threadIdx.x, m = blockIdx.x;
    if (k < K && m < M) out[(size_t)m * K + k] = (u16)bf16_bits(x[(size_t)m * x_stride + k]);
}

// Whether rows of W and xb can be staged 16 bytes at a time (K a multiple of 8, both aligned).
__device__ __forceinline__ bool bf16_rows_aligned(const u16* w, const u16* xb, int K) {
    return K % 8 == 0 && ((size_t)w | (size_t)xb) % 16 == 0;
}

// The 8 bf16 of row r (of R, K long) at inputs k .. k + 8 into dst (4 u32), zero past R and k_hi.
__device__ __forceinline__ void bf16_stage_chunk(u32* dst, const u16* src, int r, int R, int K, int k, int k_hi,
                                                 bool vector) {
    if (vector) {  // k and k_hi are multiples of 8: the chunk is wholly in or out
        bool in = r < R && k < k_hi;
        cp_async16(dst, in ? src + (size_t)r * K + k : src, in);
        return;
    }
    for (int p = 0; p < 4; p++) {
        int kk = k + 2 * p;
        u32 lo = r < R && kk < k_hi ? src[(size_t)r * K + kk] : 0u;
        u32 hi = r < R && kk + 1 < k_hi ? src[(size_t)r * K + kk + 1] : 0u;
        dst[p] = lo | (hi << 16);
    }
}

// A block of four warps: warp w multiplies W rows n0 + 16w .. + 16 with x rows m0 .. m0 + 64, eight
// 16 × 8 products per step of 16 inputs (those past M skipped), x rounded to bf16 once before
// (by the kernel that wrote it, or `round_rows_bf16`; as for linear_bf16_wide). Stages of W and x go to shared memory by
// cp.async, all but one of them in flight while a stage is multiplied. `chunk_out` set: each
// chunk's chains (k_lo and k_hi on chunk bounds) to chunk_out[chunk · M · N + m · N + n]; else y
// as model.cu's `linear` writes it.
__device__ __forceinline__ void linear_bf16_tile(float* y, const u16* xb, const u16* w, const float* bias, int M,
                                                 int N, int K, long long y_stride, int accumulate, int k_lo, int k_hi,
                                                 float* chunk_out) {
    __shared__ __align__(16) u32 Ws[BF16_STAGES][BF16_TILE][BF16_PAD];
    __shared__ __align__(16) u32 Xs[BF16_STAGES][BF16_TILE][BF16_PAD];
    int n0 = blockIdx.x * BF16_TILE, m0 = blockIdx.y * BF16_TILE;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    float acc[8][4], total[8][4];
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = total[j][c] = 0.0f;
    bool vector = bf16_rows_aligned(w, xb, K);
    int stages = (k_hi - k_lo + BF16_BK - 1) / BF16_BK;
    int rows = min(BF16_TILE, (M - m0 + 7) / 8 * 8);  // x rows the products read (whole groups of 8)
    // stage s's W and x rows into its buffers by cp.async, each in 256 chunks of 8 inputs (x's
    // rows past those read are not staged)
    auto load_w = [&](int s) {
        int buf = s % BF16_STAGES, k0 = k_lo + s * BF16_BK;
        for (int i = 0; i < 2; i++) {
            int c = tid + 128 * i, row = c / 4, part = c % 4;
            bf16_stage_chunk(&Ws[buf][row][4 * part], w, n0 + row, N, K, k0 + 8 * part, k_hi, vector);
        }
    };
    auto load_x = [&](int s) {
        int buf = s % BF16_STAGES, k0 = k_lo + s * BF16_BK;
        for (int i = 0; i < 2; i++) {
            int c = tid + 128 * i, row = c / 4, part = c % 4;
            if (row < rows)
                bf16_stage_chunk(&Xs[buf][row][4 * part], xb, m0 + row, M, K, k0 + 8 * part, k_hi, vector);
        }
    };
    // chunk `chunk`'s chains (acc) to chunk_out[chunk · M · N + m · N + n]
    auto store_chunk = [&](int chunk) {
        float* dst = chunk_out + (size_t)chunk * M * N;
        for (int j = 0; j < 8; j++)
            for (int c = 0; c < 4; c++) {
                int n = n0 + 16 * warp + gid + 8 * (c / 2), m = m0 + 8 * j + 2 * tig + c % 2;
                if (n < N && m < M) dst[(size_t)m * N + n] = acc[j][c];
            }
    };
    // the first stages' weights on their way before the kernel before this one has finished (a
    // programmatic dependent launch), x's once it has: the first group holds them all
    for (int s = 0; s < BF16_STAGES - 1; s++)
        if (s < stages) load_w(s);
    griddep_wait();
    for (int s = 0; s < BF16_STAGES - 1; s++) {
        if (s < stages) load_x(s);
        cp_async_commit();
    }
    for (int s = 0; s < stages; s++) {
        cp_async_wait<BF16_STAGES - 2>();  // stage s has landed (this thread's part of it) ...
        __syncthreads();                   // ... every thread's, and stage s − 1 is multiplied
        if (s + BF16_STAGES - 1 < stages) {  // into stage s − 1's buffers
            load_w(s + BF16_STAGES - 1);
            load_x(s + BF16_STAGES - 1);
        }
        cp_async_commit();
        int k0 = k_lo + s * BF16_BK, buf = s % BF16_STAGES;
        if (k0 > k_lo && (k0 - k_lo) % LINEAR_CHUNK == 0) {
            if (chunk_out) store_chunk(k0 / LINEAR_CHUNK - 1);  // the chunk just ended
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 4; c++) {
                    if (!chunk_out) total[j][c] += acc[j][c];
                    acc[j][c] = 0.0f;
                }
        }
        for (int kk = 0; kk < BF16_PAIRS; kk += 8) {
            u32 a[4], b[2];
            int r = 16 * warp + gid;
            a[0] = Ws[buf][r][kk + tig];
            a[1] = Ws[buf][r + 8][kk + tig];
            a[2] = Ws[buf][r][kk + 4 + tig];
            a[3] = Ws[buf][r + 8][kk + 4 + tig];
            for (int j = 0; j < 8; j++) {
                if (8 * j >= rows) break;  // the same for every lane of the warp
                b[0] = Xs[buf][8 * j + gid][kk + tig];  // inputs 2(kk + tig), + 1 and + 8, + 9
                b[1] = Xs[buf][8 * j + gid][kk + 4 + tig];
                mma_bf16_16816(acc[j], a, b);
            }
        }
    }
    griddep_launch_dependents();
    if (chunk_out) {
        store_chunk((k_hi - 1) / LINEAR_CHUNK);
        return;
    }
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) {
            int n = n0 + 16 * warp + gid + 8 * (c / 2), m = m0 + 8 * j + 2 * tig + c % 2;
            if (n >= N || m >= M) continue;
            float v = total[j][c] + acc[j][c];
            if (bias) v += bias[n];
            float* dst = y + (size_t)m * y_stride + n;
            *dst = accumulate ? *dst + v : v;
        }
}

#define WIDE_TILE 128   // linear_bf16_wide: W rows and x rows of a block's tile
#define WIDE_BK 64      // its inputs per stage
#define WIDE_PAD 36     // a staged row's u32 stride (32 pairs and 4 of padding: conflict-free ldmatrix)
#define WIDE_STAGES 3   // its stages in (dynamic) shared memory: sources.rs WIDE_SHARED

// linear_bf16's products on 128 × 128 tiles of eight warps for long inputs (prefill): warp w
// multiplies W rows n0 + 32(w % 4) .. + 32 with x rows m0 + 64(w / 4) .. + 64, its fragments read
// by ldmatrix. Each element goes through the same instructions in the same k order as in
// linear_bf16_tile — the same bits. FULL: every x row of the tile is within M (no row checks).
template <bool FULL>
__device__ __forceinline__ void linear_bf16_wide_tile(float* y, const u16* xb, const u16* w, const float* bias, int M,
                                                      int N, int K, long long y_stride, int accumulate) {
    DYNAMIC_SHARED(u32, staged);  // WIDE_STAGES × [W rows | x rows] × WIDE_PAD
    int n0 = blockIdx.x * WIDE_TILE, m0 = blockIdx.y * WIDE_TILE;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    int wn = warp % 4, wm = warp / 4;
    auto at = [&](int buf, int row) { return staged + ((size_t)buf * 2 * WIDE_TILE + row) * WIDE_PAD; };
    float acc[2][8][4], total[2][8][4];
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[t][j][c] = total[t][j][c] = 0.0f;
    bool vector = bf16_rows_aligned(w, xb, K);
    int stages = (K + WIDE_BK - 1) / WIDE_BK;
    // a stage: W and x each in 1024 chunks of 8 inputs (four of each a thread)
    auto load = [&](int s) {
        int buf = s % WIDE_STAGES, k0 = s * WIDE_BK;
        for (int i = 0; i < 4; i++) {
            int c = tid + 256 * i, row = c / 8, part = c % 8;
            bf16_stage_chunk(at(buf, row) + 4 * part, w, n0 + row, N, K, k0 + 8 * part, K, vector);
            bf16_stage_chunk(at(buf, WIDE_TILE + row) + 4 * part, xb, m0 + row, M, K, k0 + 8 * part, K, vector);
        }
    };
    for (int s = 0; s < WIDE_STAGES - 1; s++) {
        if (s < stages) load(s);
        cp_async_commit();
    }
    int x_rows = FULL ? 64 : min(64, max(0, M - m0 - 64 * wm));  // this warp's x rows within M
    int i = lane / 8, r = lane % 8;
    for (int s = 0; s < stages; s++) {
        cp_async_wait<WIDE_STAGES - 2>();
        __syncthreads();
        if (s + WIDE_STAGES - 1 < stages) load(s + WIDE_STAGES - 1);
        cp_async_commit();
        int buf = s % WIDE_STAGES;
        if (s > 0 && (s * WIDE_BK) % LINEAR_CHUNK == 0)
#pragma unroll
            for (int t = 0; t < 2; t++)
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        total[t][j][c] += acc[t][j][c];
                        acc[t][j][c] = 0.0f;
                    }
#pragma unroll
        for (int kk = 0; kk < WIDE_BK / 2; kk += 8) {
            u32 a[2][4];
#pragma unroll
            for (int t = 0; t < 2; t++)
                ldmatrix_x4(a[t], at(buf, 32 * wn + 16 * t + 8 * (i % 2) + r) + kk + 4 * (i / 2));
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                if (!FULL && 8 * j >= x_rows) continue;  // the same for every lane of the warp
                u32 b[4];
                ldmatrix_x4(b, at(buf, WIDE_TILE + 64 * wm + 8 * j + 8 * (i / 2) + r) + kk + 4 * (i % 2));
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    mma_bf16_16816(acc[t][j], a[t], b);
                    if (FULL || 8 * (j + 1) < x_rows) mma_bf16_16816(acc[t][j + 1], a[t], b + 2);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int n = n0 + 32 * wn + 16 * t + gid + 8 * (c / 2), m = m0 + 64 * wm + 8 * j + 2 * tig + c % 2;
                if (n >= N || m >= M) continue;
                float v = total[t][j][c] + acc[t][j][c];
                if (bias) v += bias[n];
                float* dst = y + (size_t)m * y_stride + n;
                *dst = accumulate ? *dst + v : v;
            }
}

// As linear_bf16, on 128-square tiles (256 threads; WIDE_STAGES · 2 · 128 · WIDE_PAD u32 of
// dynamic shared memory); grid (N / 128, M / 128).
extern "C" __global__ void __launch_bounds__(256) linear_bf16_wide(float* y, const u16* xb, const u16* w, const float* bias, int M, int N, int K,
                                            long long y_stride, int accumulate) {
    if ((blockIdx.y + 1) * WIDE_TILE <= M)
        linear_bf16_wide_tile<true>(y, xb, w, bias, M, N, K, y_stride, accumulate);
    else
        linear_bf16_wide_tile<false>(y, xb, w, bias, M, N, K, y_stride, accumulate);
}

// y[m, n] = (accumulate ? y : 0) + (xb[m] · W[n] + bias[n]), W and xb bf16 ([N × K], [M × K]);
// grid (N / 64, M / 64).
extern "C" __global__ void linear_bf16(float* y, const u16* xb, const u16* w, const float* bias, int M, int N, int K,
                                       long long y_stride, int accumulate) {
    linear_bf16_tile(y, xb, w, bias, M, N, K, y_stride, accumulate, 0, K, nullptr);
}

// The chains of `group` consecutive chunks of each 64 × 64 tile (blockIdx.z = chunk / group) to
// partial[chunk · M · N ..].
// With `arrivals` (a zeroed counter per tile, left zeroed), the tile's last block to finish adds
// the tile's chunks in order into y as model.cu's linear_chunks_sum does — the same operations
// in the same order, whichever block it is — which saves that launch; without, the host
// launches linear_chunks_sum.
extern "C" __global__ void __launch_bounds__(128, 4) linear_bf16_split(float* partial, const u16* xb, const u16* w, int M,
                                             int N, int K, float* y, const float* bias, long long y_stride,
                                             int accumulate, u32* arrivals, int group) {
    int k_lo = blockIdx.z * group * LINEAR_CHUNK, k_hi = min(K, k_lo + group * LINEAR_CHUNK);
    linear_bf16_tile(nullptr, xb, w, nullptr, M, N, K, 0, 0, k_lo, k_hi, partial);
    if (!arrivals) return;
    __shared__ int last;
    __threadfence();  // this block's chains are visible to the block that adds them ...
    __syncthreads();  // ... once every thread's are written
    u32 tile = blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) last = atomicAdd(&arrivals[tile], 1u) == gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    int n0 = blockIdx.x * BF16_TILE, m0 = blockIdx.y * BF16_TILE, chunks = (K + LINEAR_CHUNK - 1) / LINEAR_CHUNK;
    // each thread adds SPLIT_SUM_ELEMENTS elements at once, their chunks SPLIT_SUM_AHEAD at a time:
    // that many loads in flight, each element's chains still added one after another from chunk 0
    for (int e0 = threadIdx.x; e0 < BF16_TILE * BF16_TILE; e0 += SPLIT_SUM_ELEMENTS * blockDim.x) {
        const float* p[SPLIT_SUM_ELEMENTS];
        float v[SPLIT_SUM_ELEMENTS];
        bool in[SPLIT_SUM_ELEMENTS];
        for (int q = 0; q < SPLIT_SUM_ELEMENTS; q++) {
            int e = e0 + q * blockDim.x, m = m0 + e / BF16_TILE, n = n0 + e % BF16_TILE;
            in[q] = e < BF16_TILE * BF16_TILE && m < M && n < N;
            p[q] = partial + (in[q] ? (size_t)m * N + n : 0);
            v[q] = 0.0f;
        }
        for (int c0 = 0; c0 < chunks; c0 += SPLIT_SUM_AHEAD) {
            float t[SPLIT_SUM_ELEMENTS][SPLIT_SUM_AHEAD];
            for (int q = 0; q < SPLIT_SUM_ELEMENTS; q++)
                for (int c = 0; c < SPLIT_SUM_AHEAD; c++)
                    t[q][c] = in[q] && c0 + c < chunks ? __ldcg(p[q] + (size_t)(c0 + c) * M * N) : 0.0f;
            for (int q = 0; q < SPLIT_SUM_ELEMENTS; q++)
                for (int c = 0; c < SPLIT_SUM_AHEAD; c++)
                    if (c0 + c < chunks) v[q] += t[q][c];
        }
        for (int q = 0; q < SPLIT_SUM_ELEMENTS; q++) {
            if (!in[q]) continue;
            int e = e0 + q * blockDim.x, m = m0 + e / BF16_TILE, n = n0 + e % BF16_TILE;
            float r = v[q];
            if (bias) r += bias[n];
            float* dst = y + (size_t)m * y_stride + n;
            *dst = accumulate ? *dst + r : r;
        }
    }
    if (threadIdx.x == 0) arrivals[tile] = 0u;  // for the next product on this stream
}
