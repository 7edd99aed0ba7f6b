// DeepSeek-V3.2's DSA indexer on the device, as the CPU executor computes it
// (kernels/src/models/parts/indexer.rs): the LayerNorm of the index keys, each query's scores
// against the keys it can see, and its top-k chosen exactly as torch's CPU top-k chooses them,
// ties included (kernels/src/cpu/torch_topk.rs), so a query attends to the same keys on both
// executors. Compiled at run time by NVRTC (kernels/src/cuda/sources.rs).
//
// A row's index row is as long as transformers makes it: the prompt for prompt rows (its prefill
// scores against the whole prompt, later keys masked to −inf), the position + 1 for generated
// rows. The top-k's choice among equal scores depends on that length, never on the batch.

#define IX_INFINITY __int_as_float(0x7f800000)

// The length of row r's index row: max(prompt length, position + 1).
__device__ __forceinline__ int ix_row_len(const int* positions, const int* seqs, const u32* prompt_lens, int r) {
    return max((int)prompt_lens[seqs[r]], positions[r] + 1);
}

// LayerNorm (weight and bias) of one vector of `dim` floats per block, in place, at
// blockIdx.x * row_stride + offset: thread t sums t, t + blockDim, … in order, a fixed
// shared-memory tree adds the partial sums (the mean, then the variance around it).
extern "C" __global__ void layer_norm(float* x, const float* weight, const float* bias, int dim, long long row_stride,
                                      int offset, float eps) {
    DYNAMIC_SHARED(float, partial);
    float* v = x + (size_t)blockIdx.x * row_stride + offset;
    float stats[2];
    for (int pass = 0; pass < 2; pass++) {
        float mean = pass == 0 ? 0.0f : stats[0];
        float s = 0.0f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float d = v[i] - mean;
            s += pass == 0 ? v[i] : d * d;
        }
        partial[threadIdx.x] = s;
        __syncthreads();
        for (int step = blockDim.x / 2; step > 0; step /= 2) {
            if (threadIdx.x < step) partial[threadIdx.x] += partial[threadIdx.x + step];
            __syncthreads();
        }
        stats[pass] = partial[0] / (float)dim;
        __syncthreads();
    }
    float inv = 1.0f / sqrtf(stats[1] + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) v[i] = (v[i] - stats[0]) * inv * weight[i] + bias[i];
}

// scores[r * stride + p] for every row r whose position s has more than `topk` keys to see
// (the others attend to all of them): Σ_h w_h · heads^-½ · relu(q_h · k_p · head_dim^-½) for
// p ≤ s, −inf for s < p < row length. One warp per (row, p); heads in order, each dot product
// over lanes then a fixed warp sum. The index key of position p sits at `key_offset` of its
// cache row (f32, or bf16 where kv_bf16), found through the sequence's block table.
extern "C" __global__ void index_scores(float* scores, const float* q, const float* weights, const void* cache, int kv_bf16,
                                        const u32* tables, const u32* table_at, const int* positions, const int* seqs,
                                        const u32* prompt_lens, int rows, long long stride, int heads, int head_dim,
                                        int key_offset, int row_width, int block_size, int topk) {
    long long item = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (item >= (long long)rows * stride) return;
    int r = (int)(item / stride), p = (int)(item % stride);
    int s = positions[r];
    if (s + 1 <= topk || p >= ix_row_len(positions, seqs, prompt_lens, r)) return;
    float* out = scores + (size_t)r * stride + p;
    if (p > s) {
        if (lane == 0) *out = -IX_INFINITY;
        return;
    }
    const u32* table = tables + table_at[seqs[r]];
    size_t row = (size_t)table[p / block_size] * block_size + p % block_size;
    size_t key = row * row_width + key_offset;
    float head_scale = 1.0f / sqrtf((float)heads), score_scale = 1.0f / sqrtf((float)head_dim);
    float total = 0.0f;
    for (int h = 0; h < heads; h++) {
        const float* qh = q + ((size_t)r * heads + h) * head_dim;
        float d = 0.0f;
        for (int i = lane; i < head_dim; i += 32) d = fmaf(qh[i], kv_load(cache, key + i, kv_bf16), d);
        float score = fmaxf(warp_sum(d) * score_scale, 0.0f);
        total += weights[(size_t)r * heads + h] * head_scale * score;
    }
    if (lane == 0) *out = total;
}

// ---- torch.topk(largest=True) on CPU, which libstdc++'s algorithms decide: only which pairs
// end up in the first k matters here (the keys are attended in position order), so this is
// `std::partial_sort`'s `__heap_select` when k · 64 ≤ n, else `std::nth_element`'s
// `__introselect`. The same comparisons in the same order as kernels/src/cpu/torch_topk.rs.

struct IndexPair {
    float v;
    int i;
};

// torch's largest-first comparator: x goes before y when x is NaN and y is not, or x > y.
__device__ __forceinline__ bool ix_less(IndexPair x, IndexPair y) {
    return (x.v != x.v && y.v == y.v) || x.v > y.v;
}

__device__ void ix_push_heap(IndexPair* v, int hole, int top, IndexPair value) {
    while (hole > top) {
        int parent = (hole - 1) / 2;
        if (!ix_less(v[parent], value)) break;
        v[hole] = v[parent];
        hole = parent;
    }
    v[hole] = value;
}

__device__ void ix_adjust_heap(IndexPair* v, int hole, int len, IndexPair value) {
    int top = hole, second = hole;
    while (second < (len > 0 ? (len - 1) / 2 : 0)) {
        second = 2 * (second + 1);
        if (ix_less(v[second], v[second - 1])) second--;
        v[hole] = v[second];
        hole = second;
    }
    if (len % 2 == 0 && len >= 2 && second == (len - 2) / 2) {
        second = 2 * (second + 1);
        v[hole] = v[second - 1];
        hole = second - 1;
    }
    ix_push_heap(v, hole, top, value);
}

// `std::__heap_select(v, v + middle, v + len)`: the first `middle` pairs become the best ones.
__device__ void ix_heap_select(IndexPair* v, int len, int middle) {
    if (middle >= 2) {
        for (int parent = (middle - 2) / 2;; parent--) {
            ix_adjust_heap(v, parent, middle, v[parent]);
            if (parent == 0) break;
        }
    }
    for (int i = middle; i < len; i++) {
        if (ix_less(v[i], v[0])) {
            IndexPair value = v[i];
            v[i] = v[0];
            ix_adjust_heap(v, 0, middle, value);
        }
    }
}

__device__ void ix_linear_insert(IndexPair* v, int last) {
    IndexPair value = v[last];
    int next = last - 1;
    while (ix_less(value, v[next])) {
        v[last] = v[next];
        last = next;
        next--;
    }
    v[last] = value;
}

__device__ void ix_insertion_sort(IndexPair* v, int len) {
    for (int i = 1; i < len; i++) {
        if (ix_less(v[i], v[0])) {
            IndexPair value = v[i];
            for (int j = i; j > 0; j--) v[j] = v[j - 1];
            v[0] = value;
        } else {
            ix_linear_insert(v, i);
        }
    }
}

__device__ __forceinline__ void ix_swap(IndexPair* v, int a, int b) {
    IndexPair t = v[a];
    v[a] = v[b];
    v[b] = t;
}

// `std::__move_median_to_first` then `std::__unguarded_partition` around v[first].
__device__ int ix_partition_pivot(IndexPair* v, int first, int last) {
    int a = first + 1, b = first + (last - first) / 2, c = last - 1, pick;
    if (ix_less(v[a], v[b])) pick = ix_less(v[b], v[c]) ? b : ix_less(v[a], v[c]) ? c : a;
    else pick = ix_less(v[a], v[c]) ? a : ix_less(v[b], v[c]) ? c : b;
    ix_swap(v, first, pick);
    int lo = first + 1, hi = last;
    for (;;) {
        while (ix_less(v[lo], v[first])) lo++;
        hi--;
        while (ix_less(v[first], v[hi])) hi--;
        if (lo >= hi) return lo;
        ix_swap(v, lo, hi);
        lo++;
    }
}

// `std::nth_element(v, v + nth, v + len)` (`__introselect`).
__device__ void ix_nth_element(IndexPair* v, int len, int nth) {
    if (len == 0 || nth >= len) return;
    int lg = 0;
    while ((len >> (lg + 1)) != 0) lg++;
    int first = 0, last = len, depth = 2 * lg;
    while (last - first > 3) {
        if (depth == 0) {
            ix_heap_select(v + first, last - first, nth + 1 - first);
            ix_swap(v, first, nth);
            return;
        }
        depth--;
        int cut = ix_partition_pivot(v, first, last);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    ix_insertion_sort(v + first, last - first);
}

// Per row, one thread: the positions it attends to, ascending, into selected[r * topk ..] and
// their count into counts[r] (−1: it sees at most topk keys and attends to all of them). The
// row's scores are its pairs' values, then its marks.
extern "C" __global__ void index_topk(int* selected, int* counts, float* scores, IndexPair* pairs,
                                      const int* positions, const int* seqs, const u32* prompt_lens, int rows,
                                      long long stride, int topk) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int s = positions[r];
    if (s + 1 <= topk) {
        counts[r] = -1;
        return;
    }
    int n = ix_row_len(positions, seqs, prompt_lens, r);
    float* row = scores + (size_t)r * stride;
    IndexPair* v = pairs + (size_t)r * stride;
    for (int i = 0; i < n; i++) v[i] = IndexPair{row[i], i};
    if ((long long)topk * 64 <= n) ix_heap_select(v, n, topk);
    else ix_nth_element(v, n, topk - 1);
    for (int p = 0; p <= s; p++) row[p] = 0.0f;
    for (int i = 0; i < topk; i++)
        if (v[i].i <= s) row[v[i].i] = 1.0f;
    int count = 0;
    for (int p = 0; p <= s; p++)
        if (row[p] != 0.0f) selected[(size_t)r * topk + count++] = p;
    counts[r] = count;
}
