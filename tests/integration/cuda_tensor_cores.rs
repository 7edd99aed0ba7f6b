//! The tensor-core kernels (`kernels/cuda/attention.cu`, `kernels/cuda/bf16.cu`) under the CPU
//! emulation, through the checks `bench device` runs on the GPU (`kvflow::bench::kernel_checks`):
//! a row's attention output is the same bits whole, in chunks, alone with its parts split over
//! blocks and merged, and among other sequences, with and without a sliding window, near a
//! float64 softmax; every bf16 product kernel gives an element the same bits. Through the
//! executor, the bf16 families whose attention takes the tensor cores keep `bench device`'s
//! checks: batch invariance and agreement with f32.

use kvflow_kernels::cuda::Gpu;

#[test]
fn the_tensor_core_kernels_give_a_row_the_same_bits_however_the_work_is_cut() {
    let gpu = Gpu::emulated().unwrap_or_else(|e| panic!("{e}"));
    let mut failures = kvflow::bench::kernel_checks::attention_check(&gpu).unwrap();
    failures.extend(kvflow::bench::kernel_checks::product_check(&gpu).unwrap());
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A kernel variant set by `--tune` keeps the bits: `kvflow bench kernels` with every tuning
/// constant away from its default (four and three stages of keys, two of products, merges one
/// part at a time, tighter launch bounds, the split's last block reading 3 chunks at once) passes
/// the same checks.
#[test]
fn tuned_kernel_variants_keep_the_bits() {
    let out = crate::common::kvflow(&[
        "bench",
        "kernels",
        "--emulate",
        "--tune",
        "FA_STAGES=4",
        "--tune",
        "FA_X1_STAGES=3",
        "--tune",
        "BF16_STAGES=2",
        "--tune",
        "FA_MERGE_AHEAD=1",
        "--tune",
        "FA_MIN_BLOCKS=2",
        "--tune",
        "FA_X1_MIN_BLOCKS=4",
        "--tune",
        "SPLIT_SUM_AHEAD=3",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    for line in
        ["tuning       FA_STAGES=4", "attention    tensor cores", "products     bf16", "checks       all passed"]
    {
        assert!(stdout.contains(line), "no {line:?} in {stdout}");
    }
    assert!(!stdout.contains("DIFFERENT"), "{stdout}");
}

/// The families whose attention takes the tensor-core kernel in bf16 (grouped-query heads of 16:
/// llama, qwen3, qwen3_next's gated attention) keep `bench device`'s bf16 checks through the
/// executor: a prompt alone = in a batch of 64 = in chunks of 7, a decode alone = in a batch of
/// 64, bit for bit; greedy tokens and logits within the bf16 tolerance of the f32 path.
#[test]
fn bf16_families_on_tensor_core_attention_keep_the_device_checks() {
    let gpu = Gpu::emulated().unwrap_or_else(|e| panic!("{e}"));
    let gaps = crate::common::repo().join("benches/results/2026-12-03-h200-transformers-bf16-gap.json");
    for family in ["llama", "qwen3", "qwen3_next"] {
        let dir = crate::common::fixture(&format!("hf/{family}"));
        let launches = |kernel: &str| gpu.emulated_launches(kernel);
        let (flash, decode, paged) =
            (launches("flash_attention_16"), launches("flash_attention_16x1"), launches("paged_attention"));
        let failures = kvflow::bench::device::bf16_checks(&gpu, &dir, family, &gaps).unwrap();
        assert!(failures.is_empty(), "{family}: {failures:#?}");
        // the f32 model keeps model.cu's kernel; the bf16 one took the tensor cores, its decode
        // steps in one-warp blocks
        assert!(launches("flash_attention_16") > flash, "{family}: bf16 prefill did not take flash_attention_16");
        assert!(launches("flash_attention_16x1") > decode, "{family}: bf16 decode did not take flash_attention_16x1");
        assert!(launches("paged_attention") > paged, "{family}: f32 attention did not take paged_attention");
    }
}
