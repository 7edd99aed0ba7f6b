// Causal attention over a bf16 paged KV cache on tensor cores, in the FlashAttention manner, for
// prefill and decode alike (kernels/src/cuda/parts/attention.rs picks it where the cache holds
// bf16, keys and values are one width d ≤ 128 with d % 16 == 0 and no indexer selection applies;
// model.cu's paged_attention takes the rest). Compiled at run time by NVRTC
// (kernels/src/cuda/sources.rs).
//
// A block takes a tile of one sequence's consecutive rows and one kv head: its mma rows are
// (row, query head of the group) pairs, 16 a warp (four warps, or one for decode steps), so a
// decode row's group shares one key read and a prefill tile's rows share every staged key tile.
// Keys are staged 64 at a time by cp.async, the next tiles in flight while one is multiplied
// (FA_STAGES, or FA_X1_STAGES, stages of K and V rows in dynamic shared memory: sources.rs
// `flash_shared`), and each warp runs S = Q·Kᵀ and O += P·V as mma.sync
// m16n8k16 (q and the probabilities rounded to bf16, f32 accumulation; V's fragments by
// ldmatrix.trans).
//
// Batch invariance (DESIGN §6): a row's keys are cut at fixed positions counted from key 0 —
// parts of FA_PART keys, tiles of FA_KEYS — never by the batch, the tile it shares or the grid.
// Within a part, its scores, running max, sum and output go tile by tile from a fresh start, each
// value through the same instructions whatever the other rows of its mma (a tile beyond the row's
// own keys is an exact identity: probabilities 0, correction 1). The parts then fold in order
// (fa_fold_*), either in the block itself (`split` 0) or, when the host splits a few rows' parts
// over blocks, through `parts` and flash_attention_merge with the same operations: so the host
// may choose either by the shape of the step and a row's bits do not change. (That rests on the
// cache holding finite values: a key a row does not see but its tile stages still meets the
// row's zero probability in the P·V product, and 0 · ∞ would not be 0.)

// A block has WARPS warps (4: flash_attention_<D>; 1: flash_attention_<D>x1, for steps of one or
// a few rows a sequence: decode), 16 mma rows each: (row, query head) pairs.
#define FA_KEYS 64      // keys staged at a time
#ifndef FA_MIN_BLOCKS
#define FA_MIN_BLOCKS 1     // __launch_bounds__ blocks a SM, 4-warp kernels (tuning constants: sources.rs)
#endif
#ifndef FA_X1_MIN_BLOCKS
#define FA_X1_MIN_BLOCKS 1  // and 1-warp kernels
#endif
#ifndef FA_STAGES
#define FA_STAGES 2         // stages of K and V tiles in shared memory, 4-warp kernels (sources.rs flash_shared)
#endif
#ifndef FA_X1_STAGES
#define FA_X1_STAGES 2      // and 1-warp kernels
#endif
#define FA_PART 256     // a row's keys fold in parts of this many from key 0 (parts/attention.rs: FA_PART)

// The fold of a part (max m, sum l) into the running (big, sum): the weights of what was folded
// (wa) and of the part (wb). Scores and maxima are in base 2 (scaled by log2 e: exp2f is one
// special-function instruction where expf is several). Written with rounded intrinsics so that no
// contraction makes the block's fold and flash_attention_merge's differ.
__device__ __forceinline__ void fa_fold_weights(float* big, float* sum, float m, float l, float* wa, float* wb) {
    float next = fmaxf(*big, m);
    *wa = exp2f(__fsub_rn(*big, next));  // the first part: 2^−∞ = 0
    *wb = exp2f(__fsub_rn(m, next));
    *sum = __fadd_rn(__fmul_rn(*sum, *wa), __fmul_rn(l, *wb));
    *big = next;
}
__device__ __forceinline__ float fa_fold_value(float acc, float wa, float o, float wb) {
    return __fadd_rn(__fmul_rn(acc, wa), __fmul_rn(o, wb));
}

// The sum (or max) of the four lanes of a quad (the lanes holding one mma row), the same bits in each.
__device__ __forceinline__ float fa_quad_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float fa_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Starts staging keys k0 .. k0 + 63 of the tile's sequence into K and V ([key][d pair] each), zero
// for keys outside [lo, hi] (those no row of the tile sees, never read from the cache) and past d.
// `blocks` holds each key's cache block (read from the table a tile ahead: key_blocks below).
template <int D, int THREADS>
__device__ __forceinline__ void fa_stage(u32* K, u32* V, const u16* cache, const u32* blocks, int block_size,
                                         int row_width, size_t k_base, size_t v_base, int d, int k0, int lo, int hi) {
    constexpr int KP = D / 2 + 4, CHUNKS = D / 8;
    // consecutive threads take consecutive 16-byte chunks of a key
#pragma unroll 4
    for (int e = threadIdx.x; e < FA_KEYS * CHUNKS; e += THREADS) {
        int u = e / CHUNKS, c = e % CHUNKS, key = k0 + u;
        bool in = key >= lo && key <= hi && 8 * c < d;
        size_t row = in ? ((size_t)blocks[u] * block_size + key % block_size) * row_width : 0;
        cp_async16(K + u * KP + 4 * c, cache + (in ? row + k_base + 8 * c : 0), in);
        cp_async16(V + u * KP + 4 * c, cache + (in ? row + v_base + 8 * c : 0), in);
    }
}

// Folds a part's max m, sum l and output o of this thread's two rows into the running fold (big,
// total) and the output accumulating in `out` (a row without keys in the part is skipped).
template <int NT>
__device__ __forceinline__ void fa_fold_part(float* out, int q_heads, int d, int tig, const bool* valid,
                                             const int* row_of, const int* head_of, float* big, float* total,
                                             const float* m, const float* l, float (*o)[4]) {
#pragma unroll
    for (int u = 0; u < 2; u++) {
        if (!valid[u] || m[u] == -KV_INFINITY) continue;
        bool first_part = big[u] == -KV_INFINITY;
        float wa, wb;
        fa_fold_weights(&big[u], &total[u], m[u], l[u], &wa, &wb);
        float* dst = out + ((size_t)row_of[u] * q_heads + head_of[u]) * d;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int c = 2 * u; c < 2 * u + 2; c++) {
                int col = 8 * nt + 2 * tig + c % 2;
                if (col < d) dst[col] = fa_fold_value(first_part ? 0.0f : dst[col], wa, o[nt][c], wb);
            }
    }
}

// Block (tile x, kv head × head part, part when split). Rows are [row, head, d] f32 in `out`;
// q is f32 (row stride q_stride, head h at h·d); the cache's row of a position holds K of kv head
// g at k_offset + g·d and V at v_offset + g·d. A row at position p sees keys max(0, p + 1 −
// window) ..= p (window 0: all). heads_per_block ≤ 64 query heads of the group per block (the
// group in head parts beyond), 64 / heads_per_block rows a tile.
template <int D, int WARPS, int STAGES>
__device__ void flash_attention_block(float* out, float* parts, const float* q, long long q_stride, const u16* cache,
                                      const u32* tables, const u32* table_at, const int* positions, const u32* row_at,
                                      int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset,
                                      int v_offset, int row_width, int block_size, int window, float scale,
                                      int heads_per_block, int split) {
    constexpr int KP = D / 2 + 4, NT = D / 8, KS = D / 16;
    DYNAMIC_SHARED(u32, staged);  // STAGES stages of [K | V], FA_KEYS rows of KP u32 each
    constexpr int THREADS = 32 * WARPS, ROWS = 16 * WARPS;
    __shared__ int scan[THREADS];
    __shared__ int tile[3];  // sequence, first row, rows
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    int per_tile = ROWS / heads_per_block;

    // This block's tile: the blockIdx.x-th of the sequences' tiles (each sequence's rows cut
    // every per_tile from its first), found by a prefix sum over the sequences' tile counts.
    if (tid == 0) tile[0] = -1;
    __syncthreads();
    int before = 0, x = blockIdx.x;
    for (int s0 = 0; s0 < seqs; s0 += THREADS) {
        int s = s0 + tid;
        int n = s < seqs ? seq_end(row_at, s, seqs, rows) - (int)row_at[s] : 0;
        int count = (n + per_tile - 1) / per_tile;
        scan[tid] = count;
        __syncthreads();
        for (int off = 1; off < THREADS; off *= 2) {
            int add = tid >= off ? scan[tid - off] : 0;
            __syncthreads();
            scan[tid] += add;
            __syncthreads();
        }
        int hi = before + scan[tid], lo = hi - count;
        if (x >= lo && x < hi) {
            tile[0] = s;
            tile[1] = (int)row_at[s] + (x - lo) * per_tile;
            tile[2] = min(per_tile, n - (x - lo) * per_tile);
        }
        before += scan[THREADS - 1];
        __syncthreads();
        if (tile[0] >= 0 || before > x) break;
    }
    if (tile[0] < 0) return;  // past the step's tiles (the grid is a bound)
    int seq = tile[0], first = tile[1], n = tile[2];
    int group = q_heads / kv_heads, head_parts = (group + heads_per_block - 1) / heads_per_block;
    int g = blockIdx.y / head_parts, hp = blockIdx.y % head_parts;
    const u32* table = tables + table_at[seq];
    int p_first = positions[first], p_last = positions[first + n - 1];  // a sequence's rows ascend
    int lo_first = window > 0 ? max(0, p_first + 1 - window) : 0;
    int lo_last = window > 0 ? max(0, p_last + 1 - window) : 0;
    float scale2 = __fmul_rn(scale, 1.4426950408889634f);  // scores in base 2: · log2 e

    // this thread's two mma rows: gid and gid + 8 of the warp's 16
    int row_of[2], head_of[2], pos_of[2], lo_of[2];
    bool valid[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
        int rho = 16 * warp + gid + 8 * u;
        int i = rho / heads_per_block, c = hp * heads_per_block + rho % heads_per_block;
        valid[u] = i < per_tile && i < n && c < group;
        row_of[u] = first + min(i, n - 1);
        head_of[u] = g * group + min(c, group - 1);
        pos_of[u] = valid[u] ? positions[row_of[u]] : -1;
        lo_of[u] = window > 0 ? max(0, pos_of[u] + 1 - window) : 0;
    }
    bool busy = __ballot_sync(0xffffffffu, valid[0] || valid[1]) != 0u;  // the warp has rows

    // q as the A fragments of S = Q·Kᵀ (bf16, zero past d and for rows without a pair)
    u32 qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int f = 0; f < 4; f++) {
            int u = f % 2, dd = 16 * ks + 8 * (f / 2) + 2 * tig;
            const float* qrow = q + (size_t)row_of[u] * q_stride + (size_t)head_of[u] * d;
            float lo_v = valid[u] && dd < d ? qrow[dd] : 0.0f, hi_v = valid[u] && dd + 1 < d ? qrow[dd + 1] : 0.0f;
            qa[ks][f] = bf16_bits(lo_v) | (bf16_bits(hi_v) << 16);
        }

    size_t k_base = k_offset + (size_t)g * d, v_base = v_offset + (size_t)g * d;
    // the fold's running max and sum per row; its output accumulates in `out` itself (each
    // element is this thread's alone, and a float goes through memory unchanged)
    float big[2] = {-KV_INFINITY, -KV_INFINITY}, total[2] = {0.0f, 0.0f};
    // the key tiles this block runs, in order: every tile from the first row's first key to the
    // last row's key (a part's only, when split); a part's state starts fresh at its first tile
    constexpr int PER_PART = FA_PART / FA_KEYS;
    int t_lo = lo_first / FA_KEYS, t_hi = p_last / FA_KEYS;
    if (split) {
        t_lo = max(t_lo, (int)blockIdx.z * PER_PART);
        t_hi = min(t_hi, (int)blockIdx.z * PER_PART + PER_PART - 1);
    }
    auto stage_k = [&](int buf) { return staged + (size_t)buf * 2 * FA_KEYS * KP; };
    // Tile u's keys' cache blocks, in key_blocks[u % 2]: read from the table into registers as the
    // tile LEAD − 1 before it begins, stored once that one is multiplied (their loads in flight
    // meanwhile, and none of fa_stage's copies waits on a table read).
    constexpr int LEAD = STAGES - 1;  // tiles in flight while one is multiplied
    __shared__ u32 key_blocks[2][FA_KEYS];
    constexpr int ENTRIES = (FA_KEYS + THREADS - 1) / THREADS;
    u32 entries[ENTRIES];
    auto read_entries = [&](int t) {
#pragma unroll
        for (int e = 0; e < ENTRIES; e++) {
            int key = t * FA_KEYS + tid + e * THREADS;
            bool in = t <= t_hi && tid + e * THREADS < FA_KEYS && key >= lo_first && key <= p_last;
            entries[e] = in ? table[key / block_size] : 0u;
        }
    };
    auto store_entries = [&](int t) {
#pragma unroll
        for (int e = 0; e < ENTRIES; e++)
            if (tid + e * THREADS < FA_KEYS) key_blocks[t % 2][tid + e * THREADS] = entries[e];
    };
    // tile u goes to stage buffer (u − t_lo) % STAGES; the first LEAD tiles before the loop (a
    // group each, empty past t_hi), and tile t_lo + LEAD's entries ready for the loop's first stage
    for (int u = t_lo; u <= t_lo + LEAD; u++) {
        read_entries(u);
        store_entries(u);  // its slot was last read before the barrier below, two tiles ago
        __syncthreads();
        if (u < t_lo + LEAD) {
            if (u <= t_hi)
                fa_stage<D, THREADS>(stage_k(u - t_lo), stage_k(u - t_lo) + FA_KEYS * KP, cache, key_blocks[u % 2],
                            block_size, row_width, k_base, v_base, d, u * FA_KEYS, lo_first, p_last);
            cp_async_commit();
        }
    }
    float m[2] = {-KV_INFINITY, -KV_INFINITY}, l[2] = {0.0f, 0.0f}, o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[nt][c] = 0.0f;
    for (int t = t_lo; t <= t_hi; t++) {
        int buf = (t - t_lo) % STAGES;
        read_entries(t + LEAD + 1);
        if (t % PER_PART == 0 && t > t_lo) {
            // a part ends: fold it in, start the next from fresh (registers and `out` only; the
            // barrier below brings the warp back together before its mma)
            fa_fold_part<NT>(out, q_heads, d, tig, valid, row_of, head_of, big, total, m, l, o);
            m[0] = m[1] = -KV_INFINITY;
            l[0] = l[1] = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) o[nt][c] = 0.0f;
        }
        cp_async_wait<LEAD - 1>();  // this tile has landed (this thread's part of it) ...
        __syncthreads();            // ... every thread's, and every warp is done with tile t − 1
        if (t + LEAD <= t_hi)       // so tile t + LEAD goes to its buffer, in flight meanwhile
            fa_stage<D, THREADS>(stage_k((buf + LEAD) % STAGES), stage_k((buf + LEAD) % STAGES) + FA_KEYS * KP, cache,
                        key_blocks[(t + LEAD) % 2], block_size, row_width, k_base, v_base, d, (t + LEAD) * FA_KEYS,
                        lo_first, p_last);
        cp_async_commit();
        const u32* Ks = stage_k(buf);
        const u32* Vs = Ks + FA_KEYS * KP;
        int k0 = t * FA_KEYS;
        if (busy) {
            float sc[8][4];
#pragma unroll
            for (int j = 0; j < 8; j++) {
#pragma unroll
                for (int c = 0; c < 4; c++) sc[j][c] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    const u32* kr = Ks + (8 * j + gid) * KP + 8 * ks + tig;
                    u32 b[2] = {kr[0], kr[4]};
                    mma_bf16_16816(sc[j], qa[ks], b);
                }
            }
            // scores in base 2, the rows' masks and maxima (a row's value c / 2 of each pair is row
            // gid + 8u); a tile every row of the block sees whole needs no mask (the same values)
            float tile_max[2] = {-KV_INFINITY, -KV_INFINITY};
            bool whole = k0 + FA_KEYS - 1 <= p_first && k0 >= lo_last;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int u = c / 2, key = k0 + 8 * j + 2 * tig + c % 2;
                    bool sees = whole || (valid[u] && key >= lo_of[u] && key <= pos_of[u]);
                    sc[j][c] = sees ? __fmul_rn(sc[j][c], scale2) : -KV_INFINITY;
                    tile_max[u] = fmaxf(tile_max[u], sc[j][c]);
                }
            float corr[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int u = 0; u < 2; u++) {
                float next = fmaxf(m[u], fa_quad_max(tile_max[u]));
                corr[u] = next == -KV_INFINITY ? 1.0f : exp2f(__fsub_rn(m[u], next));
                m[u] = next;
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int u = c / 2;
                    float p = sc[j][c] == -KV_INFINITY ? 0.0f : exp2f(__fsub_rn(sc[j][c], m[u]));
                    sc[j][c] = p;
                    sum[u] = __fadd_rn(sum[u], p);
                }
#pragma unroll
            for (int u = 0; u < 2; u++) l[u] = __fadd_rn(__fmul_rn(l[u], corr[u]), fa_quad_sum(sum[u]));
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) o[nt][c] = __fmul_rn(o[nt][c], corr[c / 2]);
            // O += P·V, 16 keys a step: P's A fragments are the score tiles 2t and 2t + 1; V's B
            // fragments (keys × d, two d tiles a load) by ldmatrix.trans of its [key][d] rows
            int i = lane / 8, r = lane % 8;
#pragma unroll
            for (int kt = 0; kt < FA_KEYS / 16; kt++) {
                u32 a[4] = {bf16_bits(sc[2 * kt][0]) | (bf16_bits(sc[2 * kt][1]) << 16),
                            bf16_bits(sc[2 * kt][2]) | (bf16_bits(sc[2 * kt][3]) << 16),
                            bf16_bits(sc[2 * kt + 1][0]) | (bf16_bits(sc[2 * kt + 1][1]) << 16),
                            bf16_bits(sc[2 * kt + 1][2]) | (bf16_bits(sc[2 * kt + 1][3]) << 16)};
#pragma unroll
                for (int nt = 0; nt < NT; nt += 2) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, Vs + (16 * kt + 8 * (i % 2) + r) * KP + 4 * (nt + i / 2));
                    mma_bf16_16816(o[nt], a, b);
                    mma_bf16_16816(o[nt + 1], a, b + 2);
                }
            }
        }
        store_entries(t + LEAD + 1);  // its slot was read last staging tile t + LEAD − 1, before this barrier
    }
    if (split) {
        // the part's max, sum and output to `parts` for flash_attention_merge (m = −∞: no keys)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (!valid[u]) continue;
            float* dst = parts + (((size_t)row_of[u] * q_heads + head_of[u]) * gridDim.z + blockIdx.z) * (d + 2);
            if (tig == 0) {
                dst[0] = m[u];
                dst[1] = l[u];
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 2 * u; c < 2 * u + 2; c++) {
                    int col = 8 * nt + 2 * tig + c % 2;
                    if (col < d) dst[2 + col] = o[nt][c];
                }
        }
        return;
    }
    if (t_lo <= t_hi) fa_fold_part<NT>(out, q_heads, d, tig, valid, row_of, head_of, big, total, m, l, o);
#pragma unroll
    for (int u = 0; u < 2; u++) {
        if (!valid[u]) continue;
        float* dst = out + ((size_t)row_of[u] * q_heads + head_of[u]) * d;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int c = 2 * u; c < 2 * u + 2; c++) {
                int col = 8 * nt + 2 * tig + c % 2;
                if (col < d) dst[col] = __fdiv_rn(dst[col], total[u]);
            }
    }
}

// One kernel per largest head width (d is zero-padded up to it) and block size.
extern "C" __global__ void __launch_bounds__(128, FA_MIN_BLOCKS) flash_attention_16(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<16, 4, FA_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}
extern "C" __global__ void __launch_bounds__(32, FA_X1_MIN_BLOCKS) flash_attention_16x1(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<16, 1, FA_X1_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}
extern "C" __global__ void __launch_bounds__(128, FA_MIN_BLOCKS) flash_attention_32(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<32, 4, FA_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}
extern "C" __global__ void __launch_bounds__(32, FA_X1_MIN_BLOCKS) flash_attention_32x1(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<32, 1, FA_X1_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}
extern "C" __global__ void __launch_bounds__(128, FA_MIN_BLOCKS) flash_attention_64(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<64, 4, FA_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}
extern "C" __global__ void __launch_bounds__(32, FA_X1_MIN_BLOCKS) flash_attention_64x1(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<64, 1, FA_X1_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}
extern "C" __global__ void __launch_bounds__(128, FA_MIN_BLOCKS) flash_attention_128(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<128, 4, FA_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}
extern "C" __global__ void __launch_bounds__(32, FA_X1_MIN_BLOCKS) flash_attention_128x1(float* out, float* parts, const float* q, long long q_stride, const u16* cache, const u32* tables, const u32* table_at, const int* positions, const u32* row_at, int seqs, int rows, int q_heads, int kv_heads, int d, int k_offset, int v_offset, int row_width, int block_size, int window, float scale, int heads_per_block, int split) {
    flash_attention_block<128, 1, FA_X1_STAGES>(out, parts, q, q_stride, cache, tables, table_at, positions, row_at, seqs, rows, q_heads, kv_heads, d, k_offset, v_offset, row_width, block_size, window, scale, heads_per_block, split);
}

#ifndef FA_MERGE_AHEAD
#define FA_MERGE_AHEAD 16  // parts whose loads are in flight together (the fold itself is serial)
#endif

// out[row, h, :] from the row's parts in `parts` [row, h, part, (m, l, output)], folded in order
// as flash_attention_block folds them (a part without keys, m = −∞, is skipped). Block = row ·
// q_heads + h, threads over d; each thread reads FA_MERGE_AHEAD parts at once, then folds them.
extern "C" __global__ void flash_attention_merge(float* out, const float* parts, int d, int splits) {
    const float* p = parts + (size_t)blockIdx.x * splits * (d + 2);
    for (int col = threadIdx.x; col < d; col += blockDim.x) {
        float big = -KV_INFINITY, total = 0.0f, acc = 0.0f;
        for (int s0 = 0; s0 < splits; s0 += FA_MERGE_AHEAD) {
            float m[FA_MERGE_AHEAD], l[FA_MERGE_AHEAD], o[FA_MERGE_AHEAD];
#pragma unroll
            for (int u = 0; u < FA_MERGE_AHEAD; u++) {
                const float* part = p + (size_t)(s0 + u) * (d + 2);
                bool in = s0 + u < splits;
                m[u] = in ? part[0] : -KV_INFINITY;
                l[u] = in ? part[1] : 0.0f;
                o[u] = in ? part[2 + col] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < FA_MERGE_AHEAD; u++) {
                if (m[u] == -KV_INFINITY) continue;
                float wa, wb;
                fa_fold_weights(&big, &total, m[u], l[u], &wa, &wb);
                acc = fa_fold_value(acc, wa, o[u], wb);
            }
        }
        out[(size_t)blockIdx.x * d + col] = __fdiv_rn(acc, total);
    }
}
