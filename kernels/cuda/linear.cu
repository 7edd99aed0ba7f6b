// Linear-attention kernels of the CUDA executor: Gated DeltaNet (Qwen3-Next's linear attention)
// and Kimi Delta Attention (Kimi Linear's) token by token, as the CPU executor computes it (kernels/src/models/parts/gated_delta.rs,
// kernels/src/cpu/recurrent.rs), against each sequence's state slot in device memory. A
// sequence's rows advance its state in row order (its rows are contiguous, in position order);
// every value a row gets is reduced in an order fixed by the layer's sizes, never by the batch
// (DESIGN §6). Compiled at run time by NVRTC (kernels/src/cuda/sources.rs).
//
// A slot holds, per linear layer from its offset: the conv window [channels × (K − 1)], oldest
// input first, then S per value head [v_heads × d_k × d_v] (row = key channel).
//
// A sequence that verifies drafts (keeps[s] != NO_SLOT) also has the state after each of its
// rows written to kept row keeps[s] + (row − row_at[s]) (each kernel its own part of the layer's
// section), so a rejected draft rolls back by one copy (kernels/src/cuda/state.rs).

#define NO_SLOT 0xffffffffu

__device__ __forceinline__ float la_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float la_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch's softplus (threshold 20)
__device__ __forceinline__ float la_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Where channel c of the conv input [q | k | v] sits in a row of the fused projection, grouped per
// key head as [q (d_k) | k (d_k) | v (r·d_v) | z (r·d_v)] (r = v_heads / k_heads).
__device__ __forceinline__ int gdn_channel(int c, int nk, int dk, int r, int dv) {
    int group = 2 * dk + 2 * r * dv;
    if (c < nk * dk) return (c / dk) * group + c % dk;
    c -= nk * dk;
    if (c < nk * dk) return (c / dk) * group + dk + c % dk;
    c -= nk * dk;
    return (c / (r * dv)) * group + 2 * dk + c % (r * dv);
}

// One row's delta-rule step on column j of a head's state S [d_k × d_v] (row = key channel), with
// q and k scaled by qs and ks (their L2 normalisation, q's also × d_k^−½): each row i decays by
// decays[i]; mem = Σ_i S[i, j]·k_i; S[i, j] += k_i·β(v − mem); returns o_j = Σ_i S[i, j]·q_i.
__device__ float la_delta_column(float* S, int dk, int dv, int j, const float* q, float qs, const float* k, float ks,
                                 float v, float beta, const float* decays) {
    float mem = 0.0f;
    for (int i = 0; i < dk; i++) {
        S[i * dv + j] *= decays[i];
        mem += S[i * dv + j] * (k[i] * ks);
    }
    float delta = (v - mem) * beta;
    for (int i = 0; i < dk; i++) S[i * dv + j] += (k[i] * ks) * delta;
    float o = 0.0f;
    for (int i = 0; i < dk; i++) o += S[i * dv + j] * (q[i] * qs);
    return o;
}

// The same step with column j held in registers (col[i] = S[i, j], d_k ≤ LA_REG_DK) while a
// sequence's rows go by: the same operations in the same order, one load and one store of the
// column per launch instead of three passes over it per row.
#define LA_REG_DK 128
__device__ __forceinline__ float la_delta_registers(float* col, int dk, const float* q, float qs, const float* k,
                                                    float ks, float v, float beta, const float* decays) {
    float mem = 0.0f;
#pragma unroll
    for (int i = 0; i < LA_REG_DK; i++)
        if (i < dk) {
            col[i] *= decays[i];
            mem += col[i] * (k[i] * ks);
        }
    float delta = (v - mem) * beta;
#pragma unroll
    for (int i = 0; i < LA_REG_DK; i++)
        if (i < dk) col[i] += (k[i] * ks) * delta;
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < LA_REG_DK; i++)
        if (i < dk) o += col[i] * (q[i] * qs);
    return o;
}

// Moves column j of S [d_k × d_v] into col (load) or back (store), where it fits in registers.
__device__ __forceinline__ void la_move_column(float* col, float* S, int dk, int dv, int j, bool load) {
#pragma unroll
    for (int i = 0; i < LA_REG_DK; i++)
        if (i < dk) {
            if (load) col[i] = S[i * dv + j];
            else S[i * dv + j] = col[i];
        }
}

// Thread j's column of head h's state (in registers or in S) into the kept section `keep` (null:
// the sequence keeps nothing), at the head's place after the conv window.
__device__ __forceinline__ void la_keep_column(float* keep, int conv_width, int h, const float* col, const float* S,
                                               bool in_registers, int dk, int dv, int j) {
    if (!keep || j >= dv) return;
    float* K = keep + conv_width + (size_t)h * dk * dv;
    if (in_registers) {
#pragma unroll
        for (int i = 0; i < LA_REG_DK; i++)
            if (i < dk) K[i * dv + j] = col[i];
    } else {
        for (int i = 0; i < dk; i++) K[i * dv + j] = S[i * dv + j];
    }
}

// The sum of the block's values x (one per thread) over a fixed shared-memory tree of blockDim
// (a power of two) partial sums; every thread gets it.
__device__ float la_block_sum(float* partial, int j, float x) {
    partial[j] = x;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (j < step) partial[j] += partial[j + step];
        __syncthreads();
    }
    float sum = partial[0];
    __syncthreads();
    return sum;
}

// 1 / rms of the block's values o (thread j < n holds o_j, the others 0).
__device__ float la_inverse_rms(float* partial, int j, float o, int n, float eps) {
    return 1.0f / sqrtf(la_block_sum(partial, j, o * o) / (float)n + eps);
}

__device__ float la_block_sum(float* partial, int j, float x);

// Stages q and k of a row (d values each) in shared memory and gives 1/‖q‖ and 1/‖k‖: thread j
// sums the squares of its values j, j + blockDim, … in order, then a fixed tree over the block.
__device__ void la_stage_qk(float* qs, float* ks, float* partial, int j, const float* q, const float* k, int d,
                            float eps, float* iq, float* ik) {
    float sq = 0.0f, sk = 0.0f;
    for (int i = j; i < d; i += blockDim.x) {
        float a = q[i], b = k[i];
        qs[i] = a;
        ks[i] = b;
        sq += a * a;
        sk += b * b;
    }
    *iq = 1.0f / sqrtf(la_block_sum(partial, j, sq) + eps);
    *ik = 1.0f / sqrtf(la_block_sum(partial, j, sk) + eps);
}

// Where sequence s keeps the state after row `row` (its layer's section; null when it keeps none).
__device__ __forceinline__ float* la_kept(float* kept, const u32* keeps, const u32* row_at, int s, int row,
                                          long long state_width, int layer_offset) {
    if (keeps[s] == NO_SLOT) return nullptr;
    return kept + (size_t)(keeps[s] + (row - row_at[s])) * state_width + layer_offset;
}

// Zeroes n floats (a slot that starts from the zero state).
extern "C" __global__ void zero_floats(float* p, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = 0.0f;
}

// Depthwise causal conv1d of kernel K, then SiLU, over each sequence's rows in order: one thread
// per (sequence, channel), reading and shifting the window kept in the sequence's slot.
// out[r, c] = silu(Σ_j<K−1 w[c, j]·window[c, j] + w[c, K − 1]·x[r, c]). The input channels are
// grouped per key head in the projection (`grouped`, Gated DeltaNet) or its first ones in order
// (KDA: [q | k | v], nk = heads, r = 1).
extern "C" __global__ void gdn_conv(float* out, const float* proj, int proj_width, const float* weight, float* states,
                                    long long state_width, int layer_offset, const u32* slots, const u32* row_at,
                                    float* kept, const u32* keeps, int seqs, int rows, int nk, int dk, int r, int dv,
                                    int K, int grouped) {
    int s = blockIdx.x;
    int channels = 2 * nk * dk + nk * r * dv;
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= channels || slots[s] == NO_SLOT) return;
    float* window = states + (size_t)slots[s] * state_width + layer_offset + (size_t)c * (K - 1);
    const float* w = weight + (size_t)c * K;
    int at = grouped ? gdn_channel(c, nk, dk, r, dv) : c;
    for (int row = row_at[s]; row < seq_end(row_at, s, seqs, rows); row++) {
        float x = proj[(size_t)row * proj_width + at];
        float acc = 0.0f;
        for (int j = 0; j < K - 1; j++) acc += w[j] * window[j];
        acc += w[K - 1] * x;
        out[(size_t)row * channels + c] = la_silu(acc);
        for (int j = 0; j + 1 < K - 1; j++) window[j] = window[j + 1];
        if (K > 1) window[K - 2] = x;
        float* keep = la_kept(kept, keeps, row_at, s, row, state_width, layer_offset);
        if (keep)
            for (int j = 0; j < K - 1; j++) keep[(size_t)c * (K - 1) + j] = window[j];
    }
}

// The gated delta rule of one value head of one sequence over its rows in order, then the gated
// RMSNorm of its output: one block per (sequence, value head), thread j owning column j of the
// head's state S [d_k × d_v] (no two threads write one value). Per row: q and k (of key head
// h / r) L2-normalised (q also × d_k^−½), β = sigmoid(b), decay = exp(−exp(A_log)·softplus(a +
// dt_bias)); S ← decay·S; mem = Sᵀk; S += k ⊗ β(v − mem); o = Sᵀq; out = w·rmsnorm(o)·silu(z).
// q and k are staged in shared memory and their norms, like the RMSNorm of o, reduce over a
// fixed shared-memory tree of blockDim (a power of two ≥ d_v) partial sums.
extern "C" __global__ void gdn_recurrent(float* out, const float* conv, const float* proj, int proj_width,
                                         float* states, long long state_width, int layer_offset, int conv_width,
                                         const u32* slots, const u32* row_at, float* kept, const u32* keeps, int seqs,
                                         int rows, const float* neg_a, const float* dt_bias, const float* norm_w,
                                         float norm_eps, float l2_eps, int nk, int nv, int dk, int dv) {
    DYNAMIC_SHARED(float, partial);  // blockDim partial sums, then d_k decays, q and k
    float* decays = partial + blockDim.x;
    float *qs = decays + dk, *ks = qs + dk;
    int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    if (slots[s] == NO_SLOT) return;
    int r = nv / nk, kh = h / r, g = h / r, jl = h % r;
    int channels = 2 * nk * dk + nv * dv;
    int group = 2 * dk + 2 * r * dv;
    int qkvz_width = nk * group;
    float* S = states + (size_t)slots[s] * state_width + layer_offset + conv_width + (size_t)h * dk * dv;
    float q_scale = 1.0f / sqrtf((float)dk);
    float col[LA_REG_DK];
    bool in_registers = dk <= LA_REG_DK && j < dv;
    if (in_registers) la_move_column(col, S, dk, dv, j, true);
    for (int row = row_at[s]; row < seq_end(row_at, s, seqs, rows); row++) {
        const float* c = conv + (size_t)row * channels;
        const float* q = c + kh * dk;
        const float* k = c + nk * dk + kh * dk;
        const float* p = proj + (size_t)row * proj_width;
        float iq, ik;
        la_stage_qk(qs, ks, partial, j, q, k, dk, l2_eps, &iq, &ik);
        float beta = la_sigmoid(p[qkvz_width + g * 2 * r + jl]);
        float decay = expf(neg_a[h] * la_softplus(p[qkvz_width + g * 2 * r + r + jl] + dt_bias[h]));
        for (int i = j; i < dk; i += blockDim.x) decays[i] = decay;
        __syncthreads();
        float o = 0.0f;
        float v = j < dv ? c[2 * nk * dk + h * dv + j] : 0.0f;
        if (in_registers) o = la_delta_registers(col, dk, qs, iq * q_scale, ks, ik, v, beta, decays);
        else if (j < dv) o = la_delta_column(S, dk, dv, j, qs, iq * q_scale, ks, ik, v, beta, decays);
        float inv = la_inverse_rms(partial, j, o, dv, norm_eps);
        if (j < dv) {
            float z = p[g * group + 2 * dk + r * dv + jl * dv + j];
            out[((size_t)row * nv + h) * dv + j] = norm_w[j] * (o * inv) * la_silu(z);
        }
        la_keep_column(la_kept(kept, keeps, row_at, s, row, state_width, layer_offset), conv_width, h, col, S,
                       in_registers, dk, dv, j);
    }
    if (in_registers) la_move_column(col, S, dk, dv, j, false);
}

// Kimi Delta Attention of one head of one sequence over its rows in order, then its gated RMSNorm
// (kernels/src/models/parts/kda.rs): as gdn_recurrent, with q, k, v of head h at h·d in the
// conv output [q | k | v], a decay per key channel i — exp(−exp(A_log[h])·softplus(forget[r,
// h·d + i] + dt_bias[h·d + i])) — β = sigmoid(proj[r, 3·h·d + 2·d + h]) and the output gated by
// sigmoid(gate[r, h·d + j]).
extern "C" __global__ void kda_recurrent(float* out, const float* conv, const float* proj, int proj_width,
                                         const float* forget, const float* gate, float* states, long long state_width,
                                         int layer_offset, int conv_width, const u32* slots, const u32* row_at,
                                         float* kept, const u32* keeps, int seqs, int rows, const float* neg_a,
                                         const float* dt_bias, const float* norm_w, float norm_eps, float l2_eps,
                                         int heads, int d) {
    DYNAMIC_SHARED(float, partial);  // blockDim partial sums, then d decays, q and k
    float* decays = partial + blockDim.x;
    float *qs = decays + d, *ks = qs + d;
    int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    if (slots[s] == NO_SLOT) return;
    int hd = heads * d;
    float* S = states + (size_t)slots[s] * state_width + layer_offset + conv_width + (size_t)h * d * d;
    float q_scale = 1.0f / sqrtf((float)d);
    float col[LA_REG_DK];
    bool in_registers = d <= LA_REG_DK && j < d;
    if (in_registers) la_move_column(col, S, d, d, j, true);
    for (int row = row_at[s]; row < seq_end(row_at, s, seqs, rows); row++) {
        const float* c = conv + (size_t)row * 3 * hd;
        const float* q = c + h * d;
        const float* k = c + hd + h * d;
        const float* f = forget + (size_t)row * hd + h * d;
        float iq, ik;
        la_stage_qk(qs, ks, partial, j, q, k, d, l2_eps, &iq, &ik);
        float beta = la_sigmoid(proj[(size_t)row * proj_width + 3 * hd + 2 * d + h]);
        for (int i = j; i < d; i += blockDim.x) decays[i] = expf(neg_a[h] * la_softplus(f[i] + dt_bias[h * d + i]));
        __syncthreads();
        float o = 0.0f;
        float v = j < d ? c[2 * hd + h * d + j] : 0.0f;
        if (in_registers) o = la_delta_registers(col, d, qs, iq * q_scale, ks, ik, v, beta, decays);
        else if (j < d) o = la_delta_column(S, d, d, j, qs, iq * q_scale, ks, ik, v, beta, decays);
        float inv = la_inverse_rms(partial, j, o, d, norm_eps);
        if (j < d) {
            float g = gate[(size_t)row * hd + h * d + j];
            out[(size_t)row * hd + h * d + j] = norm_w[j] * (o * inv) * la_sigmoid(g);
        }
        la_keep_column(la_kept(kept, keeps, row_at, s, row, state_width, layer_offset), conv_width, h, col, S,
                       in_registers, d, d, j);
    }
    if (in_registers) la_move_column(col, S, d, d, j, false);
}
