//! Bit-exact emulation of which indices `torch.topk(x, k, dim=-1, largest=True, sorted=True)`
//! returns for one float32 row on CPU, including the order in which tied values come out.
//!
//! Why: DeepSeek-V3.2's sparse-attention indexer chooses the keys each query attends to with
//! `torch.topk` over per-key scores. Those scores tie exactly all the time (the indexer's ReLU
//! turns many of them into `0.0`, and masked future keys are all `-inf`), and torch does not
//! break ties by index, so "the k largest" alone does not say which keys are picked or in what
//! order. To reproduce the reference model key for key we replay torch's algorithm step by step.
//!
//! What torch does (aten/src/ATen/native/TopKImpl.h, `topk_impl_loop`, reached from
//! `topk_out_cpu` → `topk_stub` → `topk_kernel` in aten/src/ATen/native/cpu/SortingKernel.cpp):
//! it compares `(value, index)` pairs with the largest-first comparator
//! `less(x, y) = (isnan(x) && !isnan(y)) || x > y` (NaN ranks above everything; the index is
//! never looked at, so equal values are "equivalent" and their order is whatever the algorithm
//! leaves), then
//! * if `k * 64 <= n`: `std::partial_sort(q, q + k, q + n)` over all `n` pairs;
//! * otherwise: `std::nth_element(q, q + k - 1, q + n)`, then (`sorted` defaults to true)
//!   `std::sort(q, q + k - 1)` — note `k - 1`, not `k`: the k-th pair stays where
//!   `nth_element` put it (it is in the right place anyway, being the k-th);
//!
//! and returns the first `k` pairs. The standard algorithms come from libstdc++ (torch 2.11's
//! wheels are built with GCC 13; `bits/stl_algo.h` / `bits/stl_heap.h` are unchanged in the
//! relevant parts from GCC 11 to 13): `nth_element` is `__introselect` (depth limit `2·⌊log2 n⌋`,
//! median-of-three pivot moved to the front, Hoare-style unguarded partition, insertion sort
//! once at most 3 elements remain, `__heap_select` when the depth runs out); `sort` is
//! `__introsort_loop` (threshold 16, `__partial_sort` fallback) followed by
//! `__final_insertion_sort`; the heap routines are `__push_heap` / `__adjust_heap` /
//! `__pop_heap` / `__make_heap` / `__sort_heap`; `partial_sort` is `__heap_select` +
//! `__sort_heap`. This module transcribes each of them onto a
//! slice, generic over a strict-weak-order "less" predicate, with the same comparisons in the
//! same order, so ties land exactly where libstdc++ puts them.
//!
//! Version note: pytorch's main branch later rewrote the `k * 64 <= n` path to keep only a
//! `k`-element heap and stream the rest through `std::pop_heap` / `std::push_heap`, which orders
//! ties differently. Torch 2.11 (checked against its outputs, see `torch_topk_cases.json`) still
//! uses `std::partial_sort`; re-record the cases when moving the reference to a newer torch.

/// Indices of the `k` largest values of `values` in the order torch.topk(largest=True, sorted=True) returns them on CPU.
pub fn torch_topk_indices(values: &[f32], k: usize) -> Vec<usize> {
    let n = values.len();
    let k = k.min(n);
    if k == 0 {
        return Vec::new();
    }
    let mut less = |x: &(f32, usize), y: &(f32, usize)| torch_largest_less(x.0, y.0);
    let mut queue: Vec<(f32, usize)> = values.iter().copied().zip(0..n).collect();
    if k.saturating_mul(64) <= n {
        partial_sort(&mut queue, k, &mut less);
    } else {
        nth_element(&mut queue, k - 1, &mut less);
        sort(&mut queue[..k - 1], &mut less);
    }
    queue.truncate(k);
    queue.into_iter().map(|(_, i)| i).collect()
}

/// torch 2.11's own choices on CPU, recorded (`torch_topk_cases.json`): per case the row, `k`
/// and the indices torch.topk returned, in its order.
pub fn recorded_cases() -> Vec<(Vec<f32>, usize, Vec<usize>)> {
    #[derive(serde::Deserialize)]
    struct Case {
        k: usize,
        values: String,
        indices: Vec<usize>,
    }
    let cases: Vec<Case> =
        serde_json::from_str(include_str!("torch_topk_cases.json")).expect("the recorded cases parse");
    cases
        .into_iter()
        .map(|c| {
            let values = c.values.split_whitespace().map(|s| s.parse::<f32>().expect("a recorded float")).collect();
            (values, c.k, c.indices)
        })
        .collect()
}

/// torch's `largest=True` comparator: `x` goes before `y` when `x` is NaN and `y` is not, or
/// `x > y`. (torch compares in `acc_type<float> = double`; widening f32 → f64 is exact, so
/// comparing the f32s directly gives the same answers.)
#[inline]
fn torch_largest_less(x: f32, y: f32) -> bool {
    (x.is_nan() && !y.is_nan()) || x > y
}

// ---------------------------------------------------------------------------------------------
// libstdc++ bits/stl_heap.h. A heap is a max-heap under `less` (no parent is `less` than either
// of its children), so with torch's largest-first comparator the root holds the *smallest* value
// kept: the one the next better candidate evicts.
// ---------------------------------------------------------------------------------------------

/// `std::__push_heap`: move `value` up from `hole` towards `top`.
fn push_heap_hole<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], mut hole: usize, top: usize, value: T, less: &mut F) {
    while hole > top {
        let parent = (hole - 1) / 2;
        if !less(&v[parent], &value) {
            break;
        }
        v[hole] = v[parent];
        hole = parent;
    }
    v[hole] = value;
}

/// `std::__adjust_heap`: sift the hole at `hole` down to a leaf (taking the right child unless it
/// is `less` than the left one), then push `value` back up from there.
fn adjust_heap<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], mut hole: usize, len: usize, value: T, less: &mut F) {
    let top = hole;
    let mut second = hole;
    while second < len.saturating_sub(1) / 2 {
        second = 2 * (second + 1);
        if less(&v[second], &v[second - 1]) {
            second -= 1;
        }
        v[hole] = v[second];
        hole = second;
    }
    if len.is_multiple_of(2) && len >= 2 && second == (len - 2) / 2 {
        second = 2 * (second + 1);
        v[hole] = v[second - 1];
        hole = second - 1;
    }
    push_heap_hole(v, hole, top, value, less);
}

/// `std::__pop_heap(first, first + len, result)`: the root goes to `result`, the old
/// `v[result]` is re-inserted into the heap `v[..len]`.
fn pop_heap_into<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], len: usize, result: usize, less: &mut F) {
    let value = v[result];
    v[result] = v[0];
    adjust_heap(v, 0, len, value, less);
}

/// `std::__make_heap` over the whole slice.
fn make_heap<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], less: &mut F) {
    let len = v.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let value = v[parent];
        adjust_heap(v, parent, len, value, less);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// `std::__sort_heap`.
fn sort_heap<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], less: &mut F) {
    let mut last = v.len();
    while last > 1 {
        last -= 1;
        pop_heap_into(v, last, last, less);
    }
}

// ---------------------------------------------------------------------------------------------
// libstdc++ bits/stl_algo.h.
// ---------------------------------------------------------------------------------------------

/// libstdc++'s `_S_threshold`.
const S_THRESHOLD: usize = 16;

/// `std::__lg`: ⌊log2 n⌋ for n ≥ 1.
fn lg(n: usize) -> usize {
    (usize::BITS - 1 - n.leading_zeros()) as usize
}

/// `std::__heap_select(first, first + middle, last)`.
fn heap_select<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], middle: usize, less: &mut F) {
    make_heap(&mut v[..middle], less);
    for i in middle..v.len() {
        if less(&v[i], &v[0]) {
            pop_heap_into(v, middle, i, less);
        }
    }
}

/// `std::__partial_sort(first, first + middle, last)`.
fn partial_sort<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], middle: usize, less: &mut F) {
    heap_select(v, middle, less);
    sort_heap(&mut v[..middle], less);
}

/// `std::__unguarded_linear_insert`: `v[last]` moves left past everything it is `less` than.
fn unguarded_linear_insert<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], mut last: usize, less: &mut F) {
    let val = v[last];
    let mut next = last - 1;
    while less(&val, &v[next]) {
        v[last] = v[next];
        last = next;
        next -= 1;
    }
    v[last] = val;
}

/// `std::__insertion_sort` over the whole slice.
fn insertion_sort<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], less: &mut F) {
    for i in 1..v.len() {
        if less(&v[i], &v[0]) {
            let val = v[i];
            v.copy_within(0..i, 1);
            v[0] = val;
        } else {
            unguarded_linear_insert(v, i, less);
        }
    }
}

/// `std::__final_insertion_sort` over the whole slice.
fn final_insertion_sort<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], less: &mut F) {
    if v.len() > S_THRESHOLD {
        insertion_sort(&mut v[..S_THRESHOLD], less);
        // `__unguarded_insertion_sort(first + 16, last)`: the sorted prefix is the sentinel.
        for i in S_THRESHOLD..v.len() {
            unguarded_linear_insert(v, i, less);
        }
    } else {
        insertion_sort(v, less);
    }
}

/// `std::__move_median_to_first(result, a, b, c)`.
fn move_median_to_first<T: Copy, F: FnMut(&T, &T) -> bool>(
    v: &mut [T],
    result: usize,
    a: usize,
    b: usize,
    c: usize,
    less: &mut F,
) {
    let pick = if less(&v[a], &v[b]) {
        if less(&v[b], &v[c]) {
            b
        } else if less(&v[a], &v[c]) {
            c
        } else {
            a
        }
    } else if less(&v[a], &v[c]) {
        a
    } else if less(&v[b], &v[c]) {
        c
    } else {
        b
    };
    v.swap(result, pick);
}

/// `std::__unguarded_partition(first, last, pivot)`; the pivot lies outside `[first, last)`.
fn unguarded_partition<T: Copy, F: FnMut(&T, &T) -> bool>(
    v: &mut [T],
    mut first: usize,
    mut last: usize,
    pivot: usize,
    less: &mut F,
) -> usize {
    loop {
        while less(&v[first], &v[pivot]) {
            first += 1;
        }
        last -= 1;
        while less(&v[pivot], &v[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        v.swap(first, last);
        first += 1;
    }
}

/// `std::__unguarded_partition_pivot` over `v[first..last]`; returns the cut.
fn unguarded_partition_pivot<T: Copy, F: FnMut(&T, &T) -> bool>(
    v: &mut [T],
    first: usize,
    last: usize,
    less: &mut F,
) -> usize {
    let mid = first + (last - first) / 2;
    move_median_to_first(v, first, first + 1, mid, last - 1, less);
    unguarded_partition(v, first + 1, last, first, less)
}

/// `std::__introsort_loop` over `v[first..last]`.
fn introsort_loop<T: Copy, F: FnMut(&T, &T) -> bool>(
    v: &mut [T],
    first: usize,
    mut last: usize,
    mut depth_limit: usize,
    less: &mut F,
) {
    while last - first > S_THRESHOLD {
        if depth_limit == 0 {
            let len = last - first;
            partial_sort(&mut v[first..last], len, less);
            return;
        }
        depth_limit -= 1;
        let cut = unguarded_partition_pivot(v, first, last, less);
        introsort_loop(v, cut, last, depth_limit, less);
        last = cut;
    }
}

/// `std::sort(first, last, comp)` over the whole slice.
fn sort<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], less: &mut F) {
    if v.is_empty() {
        return;
    }
    let n = v.len();
    introsort_loop(v, 0, n, lg(n) * 2, less);
    final_insertion_sort(v, less);
}

/// `std::nth_element(first, first + nth, last, comp)` over the whole slice (`__introselect`).
fn nth_element<T: Copy, F: FnMut(&T, &T) -> bool>(v: &mut [T], nth: usize, less: &mut F) {
    let n = v.len();
    if n == 0 || nth >= n {
        return;
    }
    let mut first = 0;
    let mut last = n;
    let mut depth_limit = lg(n) * 2;
    while last - first > 3 {
        if depth_limit == 0 {
            heap_select(&mut v[first..last], nth + 1 - first, less);
            // Place the nth largest element in its final position.
            v.swap(first, nth);
            return;
        }
        depth_limit -= 1;
        let cut = unguarded_partition_pivot(v, first, last, less);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut v[first..last], less);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_topk_distinct_values_give_the_k_largest_in_order() {
        let values = [0.5f32, -1.0, 3.0, 2.0, 7.0, -4.0, 1.0];
        assert_eq!(torch_topk_indices(&values, 3), vec![4, 2, 3]);
        assert_eq!(torch_topk_indices(&values, 1), vec![4]);
        // Large n, small k: the partial_sort path.
        let values: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32).collect();
        let top = torch_topk_indices(&values, 5);
        let expect: Vec<usize> =
            (995..1000).rev().map(|v| values.iter().position(|&x| x == v as f32).unwrap()).collect();
        assert_eq!(top, expect);
    }

    #[test]
    fn torch_topk_k_equal_n_and_degenerate_k() {
        let values = [3.0f32, 1.0, 2.0, 5.0, 4.0];
        assert_eq!(torch_topk_indices(&values, 5), vec![3, 4, 0, 2, 1]);
        assert_eq!(torch_topk_indices(&values, 9), vec![3, 4, 0, 2, 1]);
        assert!(torch_topk_indices(&values, 0).is_empty());
        assert!(torch_topk_indices(&[], 3).is_empty());
    }

    #[test]
    fn torch_topk_all_equal_row() {
        // An all-zero row: every order is "correct", torch's is the one below (torch 2.11 CPU).
        let zeros = [0.0f32; 20];
        assert_eq!(
            torch_topk_indices(&zeros, 20),
            vec![11, 0, 8, 9, 7, 4, 3, 2, 1, 5, 10, 12, 13, 14, 15, 16, 17, 18, 19, 6]
        );
        assert_eq!(torch_topk_indices(&zeros, 7), vec![15, 11, 12, 13, 14, 17, 19]);
        // partial_sort path (k * 64 <= n).
        assert_eq!(torch_topk_indices(&[0.0f32; 200], 3), vec![0, 1, 2]);
    }

    #[test]
    fn torch_topk_nan_ranks_first() {
        let values = [1.0f32, f32::NAN, 2.0, f32::NEG_INFINITY];
        assert_eq!(torch_topk_indices(&values, 2), vec![1, 2]);
    }

    #[test]
    fn torch_topk_matches_recorded_torch_outputs() {
        let cases = recorded_cases();
        assert!(!cases.is_empty());
        for (c, (values, k, indices)) in cases.iter().enumerate() {
            assert_eq!(torch_topk_indices(values, *k), *indices, "case {c}: n = {}, k = {k}", values.len());
        }
    }
}
