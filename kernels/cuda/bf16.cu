// The bfloat16 products of the CUDA executor (`dtype = "bfloat16"`): weights in bf16, each
// product's input rounded to bf16 (round to nearest even) as it is loaded, tensor-core matrix
// products (mma.sync m16n8k16, f32 accumulation), outputs and everything between products in f32.
// Compiled at run time by NVRTC (kernels/src/cuda/sources.rs).
//
// Batch invariance (DESIGN §6), as model.cu's `linear`: an element of y = x · Wᵀ is the sum, in
// order from 0, of its chunks' chains (LINEAR_CHUNK = 256 inputs each, 16 products of 16 inputs
// accumulated in k order) — fixed by the layer's K alone. Every element goes through the same
// instruction whatever its place in a tile, so the host may split a skinny product by chunk
// (`linear_bf16_split`, then model.cu's `linear_chunks_sum`) or not, by the batch's shape.

#define BF16_TILE 64     // W rows and x rows of a block's tile
#define BF16_BK 32       // inputs per stage
#define BF16_PAIRS 16    // bf16 pairs of a stage's row
#define BF16_PAD 20      // a staged row's u32 stride (conflict-free fragment loads)

// A block of four warps: warp w multiplies W rows n0 + 16w .. + 16 with x rows m0 .. m0 + 64,
// eight 16 × 8 products per step of 16 inputs (those past M skipped). `chunk_out` set: one
// chunk's chains only, to chunk_out[m · N + n]; else y as model.cu's `linear` writes it.
__device__ __forceinline__ void linear_bf16_tile(float* y, const float* x, const u16* w, const float* bias, int M,
                                                 int N, int K, long long x_stride, long long y_stride,
                                                 int accumulate, int k_lo, int k_hi, float* chunk_out) {
    __shared__ u32 Ws[2][BF16_TILE][BF16_PAD];
    __shared__ u32 Xs[2][BF16_TILE][BF16_PAD];
    int n0 = blockIdx.x * BF16_TILE, m0 = blockIdx.y * BF16_TILE;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    float acc[8][4], total[8][4];
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = total[j][c] = 0.0f;
    // this thread's share of a stage: W row tid / 2 and x row tid / 2, inputs 16 · (tid % 2) ..
    // + 16 of the stage, as eight bf16 pairs each (zero past the edges)
    u32 wp[8], xp[8];
    int row = tid / 2, half = tid % 2;
    bool vector_w = K % 8 == 0, vector_x = x_stride % 4 == 0;
    auto fetch = [&](int k0) {
        int kb = k0 + 16 * half, n = n0 + row, m = m0 + row;
        if (n < N && vector_w && kb + 16 <= k_hi) {
            const uint4* src = (const uint4*)(w + (size_t)n * K + kb);
            uint4 a = src[0], b = src[1];
            wp[0] = a.x; wp[1] = a.y; wp[2] = a.z; wp[3] = a.w;
            wp[4] = b.x; wp[5] = b.y; wp[6] = b.z; wp[7] = b.w;
        } else {
            for (int p = 0; p < 8; p++) {
                int k = kb + 2 * p;
                u32 lo = n < N && k < k_hi ? w[(size_t)n * K + k] : 0u;
                u32 hi = n < N && k + 1 < k_hi ? w[(size_t)n * K + k + 1] : 0u;
                wp[p] = lo | (hi << 16);
            }
        }
        if (m < M && vector_x && kb + 16 <= k_hi) {
            const float4* src = (const float4*)(x + (size_t)m * x_stride + kb);
            for (int q = 0; q < 4; q++) {
                float4 v = src[q];
                xp[2 * q] = bf16_bits(v.x) | (bf16_bits(v.y) << 16);
                xp[2 * q + 1] = bf16_bits(v.z) | (bf16_bits(v.w) << 16);
            }
        } else {
            for (int p = 0; p < 8; p++) {
                int k = kb + 2 * p;
                u32 lo = m < M && k < k_hi ? bf16_bits(x[(size_t)m * x_stride + k]) : 0u;
                u32 hi = m < M && k + 1 < k_hi ? bf16_bits(x[(size_t)m * x_stride + k + 1]) : 0u;
                xp[p] = lo | (hi << 16);
            }
        }
    };
    auto store = [&](int buf) {
        for (int p = 0; p < 8; p++) {
            Ws[buf][row][8 * half + p] = wp[p];
            Xs[buf][row][8 * half + p] = xp[p];
        }
    };
    fetch(k_lo);
    store(0);
    __syncthreads();
    int buf = 0;
    for (int k0 = k_lo; k0 < k_hi; k0 += BF16_BK) {
        if (k0 > k_lo && (k0 - k_lo) % LINEAR_CHUNK == 0)
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 4; c++) {
                    total[j][c] += acc[j][c];
                    acc[j][c] = 0.0f;
                }
        bool more = k0 + BF16_BK < k_hi;
        if (more) fetch(k0 + BF16_BK);
        for (int kk = 0; kk < BF16_PAIRS; kk += 8) {
            u32 a[4], b[2];
            int r = 16 * warp + gid;
            a[0] = Ws[buf][r][kk + tig];
            a[1] = Ws[buf][r + 8][kk + tig];
            a[2] = Ws[buf][r][kk + 4 + tig];
            a[3] = Ws[buf][r + 8][kk + 4 + tig];
            for (int j = 0; j < 8; j++) {
                if (m0 + 8 * j >= M) break;  // the same for every lane of the warp
                b[0] = Xs[buf][8 * j + gid][kk + tig];
                b[1] = Xs[buf][8 * j + gid][kk + 4 + tig];
                mma_bf16_16816(acc[j], a, b);
            }
        }
        if (more) store(buf ^ 1);
        __syncthreads();
        buf ^= 1;
    }
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) {
            int n = n0 + 16 * warp + gid + 8 * (c / 2), m = m0 + 8 * j + 2 * tig + c % 2;
            if (n >= N || m >= M) continue;
            if (chunk_out) {
                chunk_out[(size_t)m * N + n] = acc[j][c];
                continue;
            }
            float v = total[j][c] + acc[j][c];
            if (bias) v += bias[n];
            float* dst = y + (size_t)m * y_stride + n;
            *dst = accumulate ? *dst + v : v;
        }
}

// y[m, n] = (accumulate ? y : 0) + (x[m] · W[n] + bias[n]), W bf16 [N × K]; grid (N / 64, M / 64).
extern "C" __global__ void linear_bf16(float* y, const float* x, const u16* w, const float* bias, int M, int N, int K,
                                       long long x_stride, long long y_stride, int accumulate) {
    linear_bf16_tile(y, x, w, bias, M, N, K, x_stride, y_stride, accumulate, 0, K, nullptr);
}

// One chunk's chains of each 64 × 64 tile (blockIdx.z = chunk) to partial[chunk · M · N ..].
extern "C" __global__ void linear_bf16_split(float* partial, const float* x, const u16* w, int M, int N, int K,
                                             long long x_stride) {
    int k_lo = blockIdx.z * LINEAR_CHUNK, k_hi = min(K, k_lo + LINEAR_CHUNK);
    linear_bf16_tile(nullptr, x, w, nullptr, M, N, K, x_stride, 0, 0, k_lo, k_hi,
                     partial + (size_t)blockIdx.z * M * N);
}
