//! The kernel sources `kernels/cuda/*.cu` (each compiled after `common.cuh`), the kernels each
//! defines, and their compilation to PTX by NVRTC for a compute capability (no GPU needed). The
//! device (`gpu.rs`) loads the PTX; the emulation (`emulate.rs`) compiles the same sources for the
//! CPU.

use super::error::CudaError;

/// `kernels/cuda/common.cuh`: put before each source (see there).
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// The kernel sources, compiled at run time (the build needs no CUDA).
pub const SOURCES: &[(&str, &str)] = &[
    ("model.cu", include_str!("../../cuda/model.cu")),
    ("bf16.cu", include_str!("../../cuda/bf16.cu")),
    ("kv.cu", include_str!("../../cuda/kv.cu")),
    ("linear.cu", include_str!("../../cuda/linear.cu")),
    ("indexer.cu", include_str!("../../cuda/indexer.cu")),
    ("attention.cu", include_str!("../../cuda/attention.cu")),
];

/// The dynamic shared memory a kernel takes where it may be more than a launch may take without
/// asking (48 KiB): the device raises the kernel's limit to it when it loads the kernel.
pub fn large_shared(kernel: &str) -> Option<u32> {
    if kernel == "linear_bf16_wide" {
        return Some(WIDE_SHARED);
    }
    let base = kernel.strip_prefix("flash_attention_")?;
    let (width, one_warp) = match base.strip_suffix("x1") {
        Some(width) => (width, true),
        None => (base, false),
    };
    width.parse().ok().map(|width| flash_shared(width, one_warp))
}

/// attention.cu's stages of K and V tiles by default (FA_STAGES, FA_X1_STAGES; `--tune` sets them).
const FA_STAGES_DEFAULT: i64 = 2;

/// `kernels/cuda/attention.cu`'s dynamic shared memory for heads up to `width` wide, of a 4-warp
/// kernel or a 1-warp one (`…x1`): its stages of K and V, 64 keys of (width / 2 + 4) u32 each.
pub fn flash_shared(width: usize, one_warp: bool) -> u32 {
    let stages = tuned(if one_warp { "FA_X1_STAGES" } else { "FA_STAGES" }, FA_STAGES_DEFAULT) as usize;
    (stages * 2 * 64 * (width / 2 + 4) * 4) as u32
}

/// A tuning constant's value for this process: set by [`set_tuning`], else `default` (the
/// source's own).
pub fn tuned(name: &str, default: i64) -> i64 {
    TUNING.get().and_then(|v| v.iter().find(|(n, _)| n == name).map(|(_, x)| *x)).unwrap_or(default)
}

/// `kernels/cuda/bf16.cu`'s linear_bf16_wide: WIDE_STAGES (3) × (128 W rows + 128 x rows) ×
/// WIDE_PAD (36) u32.
pub const WIDE_SHARED: u32 = 3 * 2 * 128 * 36 * 4;

/// A kernel tuning constant a benchmark may set (`kvflow bench speed --tune NAME=VALUE`). None
/// changes a value's bits (each only moves work between stages, loads or blocks).
pub struct Tunable {
    pub name: &'static str,
    pub lo: i64,
    pub hi: i64,
    /// Read by the host through [`tuned`] (its default there), not a source's `#ifndef` default.
    pub host: bool,
    pub what: &'static str,
}

/// The tuning constants.
pub const TUNABLES: &[Tunable] = &[
    Tunable {
        name: "BF16_STAGES",
        lo: 2,
        hi: 4,
        host: false,
        what: "bf16.cu: stages of a 64-square product tile in shared memory (default 3)",
    },
    Tunable {
        name: "FA_MERGE_AHEAD",
        lo: 1,
        hi: 64,
        host: false,
        what: "attention.cu: parts flash_attention_merge reads at once (default 16)",
    },
    Tunable {
        name: "FA_MIN_BLOCKS",
        lo: 1,
        hi: 4,
        host: false,
        what: "attention.cu: __launch_bounds__ blocks a SM of the 4-warp kernels (default 1)",
    },
    Tunable {
        name: "FA_X1_MIN_BLOCKS",
        lo: 1,
        hi: 16,
        host: false,
        what: "attention.cu: __launch_bounds__ blocks a SM of the 1-warp kernels (default 1)",
    },
    Tunable {
        name: "FA_STAGES",
        lo: 2,
        hi: 4,
        host: false,
        what: "attention.cu: stages of K and V tiles of the 4-warp kernels (default 2)",
    },
    Tunable {
        name: "FA_X1_STAGES",
        lo: 2,
        hi: 4,
        host: false,
        what: "attention.cu: stages of K and V tiles of the 1-warp kernels (default 2)",
    },
    Tunable {
        name: "PDL",
        lo: 0,
        hi: 1,
        host: true,
        what: "launch.rs: 1 launches PDL_KERNELS with programmatic stream serialization (default 0)",
    },
    Tunable {
        name: "SPLIT_CHUNKS",
        lo: 1,
        hi: 8,
        host: true,
        what: "product.rs: chunks of k a block of linear_bf16_split runs (default 1)",
    },
    Tunable {
        name: "SPLIT_SUM_AHEAD",
        lo: 1,
        hi: 16,
        host: false,
        what: "bf16.cu: chunks of an element linear_bf16_split's last block reads at once (default 8)",
    },
    Tunable {
        name: "SPLIT_SUM_LAUNCH",
        lo: 0,
        hi: 1,
        host: true,
        what: "product.rs: 0 has the last block of a split product's tile add its chunks (default 1: linear_chunks_sum, a launch of their own)",
    },
    Tunable {
        name: "SPLIT_UNDER",
        lo: 1,
        hi: 4,
        host: true,
        what: "product.rs: a bf16 product's 64-square tiles split by chunk while fewer than this many a SM (default 1)",
    },
];

static TUNING: std::sync::OnceLock<Vec<(String, i64)>> = std::sync::OnceLock::new();

/// Sets the tuning constants (`NAME=VALUE` each, names from [`TUNABLES`]) for every compilation of
/// this process, before the first GPU or emulation is opened; errors name the setting and what it
/// takes.
pub fn set_tuning(settings: &[String]) -> Result<(), String> {
    let values = parse_tuning(settings)?;
    TUNING.set(values).map_err(|_| "the kernels' tuning is set once, before they are compiled".to_string())
}

/// `NAME=VALUE` settings checked against [`TUNABLES`] (a later one of a name wins).
fn parse_tuning(settings: &[String]) -> Result<Vec<(String, i64)>, String> {
    let mut values = Vec::new();
    for setting in settings {
        let (name, value) = setting.split_once('=').ok_or_else(|| format!("--tune {setting}: expected NAME=VALUE"))?;
        let Some(&Tunable { lo, hi, .. }) = TUNABLES.iter().find(|t| t.name == name) else {
            let names: Vec<&str> = TUNABLES.iter().map(|t| t.name).collect();
            return Err(format!("--tune {setting}: no tuning constant {name} (there are {})", names.join(", ")));
        };
        let value: i64 = value.parse().map_err(|_| format!("--tune {setting}: {name} takes an integer"))?;
        if !(lo..=hi).contains(&value) {
            return Err(format!("--tune {setting}: {name} takes {lo} to {hi}"));
        }
        values.retain(|(n, _): &(String, i64)| n != name);
        values.push((name.to_string(), value));
    }
    Ok(values)
}

/// `#define` lines of the tuning set by [`set_tuning`] (empty without), put before `common.cuh`.
pub fn tuning_prelude() -> String {
    TUNING.get().map(|v| v.iter().map(|(n, x)| format!("#define {n} {x}\n")).collect()).unwrap_or_default()
}

/// Whether NVRTC can be loaded here (it needs no GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles every source of [`SOURCES`] to PTX for `arch` (`compute_90`): needs NVRTC, not a GPU.
pub fn compile_sources(arch: &str) -> Result<Vec<(&'static str, cudarc::nvrtc::Ptx)>, CudaError> {
    compile_with(arch, &tuning_prelude(), SOURCES)
}

/// [`compile_sources`] of `sources` after `prelude` (the tuning's `#define`s).
fn compile_with(
    arch: &str,
    prelude: &str,
    sources: &[(&'static str, &str)],
) -> Result<Vec<(&'static str, cudarc::nvrtc::Ptx)>, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    sources
        .iter()
        .map(|(file, source)| {
            let opts = cudarc::nvrtc::CompileOptions {
                options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()],
                name: Some(file.to_string()),
                ..Default::default()
            };
            let source = format!("{prelude}{COMMON}\n{source}");
            match std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(source, opts)) {
                Ok(Ok(ptx)) => Ok((*file, ptx)),
                Ok(Err(e)) => {
                    Err(CudaError::Compile { file: file.to_string(), arch: arch.to_string(), log: format!("{e:?}") })
                }
                Err(_) => Err(CudaError::NoNvrtc),
            }
        })
        .collect()
}

/// The `extern "C" __global__` functions a source defines, in order.
pub fn kernel_names(source: &str) -> Vec<String> {
    source
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| {
            // `__launch_bounds__(..) name(`: the name follows the bounds
            let rest = match rest.strip_prefix("__launch_bounds__(") {
                Some(bounded) => bounded.split_once(") ").map_or(bounded, |(_, after)| after),
                None => rest,
            };
            rest.split('(').next().map(|n| n.trim().to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether NVRTC can be loaded; where it cannot, says what was not run, and fails when
    /// `KVFLOW_REQUIRE_NVRTC` is set (CI sets it, after installing NVRTC from PyPI).
    fn nvrtc_or_not_run(what: &str) -> bool {
        if nvrtc_present() {
            return true;
        }
        assert!(
            std::env::var_os("KVFLOW_REQUIRE_NVRTC").is_none(),
            "KVFLOW_REQUIRE_NVRTC is set and libnvrtc.so cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("NOT RUN: libnvrtc.so cannot be loaded here, so {what}");
        false
    }

    /// The sources compile under NVRTC for Hopper (no GPU needed; see `nvrtc_or_not_run`).
    #[test]
    fn the_cuda_sources_compile_under_nvrtc_for_hopper() {
        if !nvrtc_or_not_run("the CUDA sources were not compiled") {
            return;
        }
        let compiled = compile_sources("compute_90").unwrap_or_else(|e| panic!("{e}"));
        for (file, ptx) in compiled {
            let text = ptx.to_src();
            let source = SOURCES.iter().find(|(f, _)| *f == file).map(|(_, s)| *s).unwrap();
            for name in kernel_names(source) {
                assert!(text.contains(&format!(".entry {name}(")), "{file}: no entry {name} in the PTX");
            }
        }
    }

    /// `--tune` takes known names within their ranges, each source keeps a default for every
    /// tunable it reads, and the sources compile at each tunable's smallest and largest value.
    #[test]
    fn tuning_constants_are_checked_and_compile_at_their_limits() {
        let parse = |s: &[&str]| parse_tuning(&s.iter().map(|x| x.to_string()).collect::<Vec<_>>());
        assert_eq!(parse(&["BF16_STAGES=3", "BF16_STAGES=2"]).unwrap(), vec![("BF16_STAGES".to_string(), 2)]);
        assert!(parse(&["BF16_STAGES=5"]).unwrap_err().contains("BF16_STAGES takes 2 to 4"));
        assert!(parse(&["NO_SUCH=1"]).unwrap_err().contains("no tuning constant NO_SUCH"));
        assert!(parse(&["BF16_STAGES"]).unwrap_err().contains("expected NAME=VALUE"));
        assert!(parse(&["FA_MIN_BLOCKS=two"]).unwrap_err().contains("takes an integer"));
        for Tunable { name, .. } in TUNABLES.iter().filter(|t| !t.host) {
            let guarded = SOURCES.iter().any(|(_, s)| s.contains(&format!("#ifndef {name}\n#define {name} ")));
            assert!(guarded, "{name}: no source defines its default under #ifndef");
        }
        // the host sizes the stages' shared memory with the source's default
        let attention = SOURCES.iter().find(|(f, _)| *f == "attention.cu").unwrap().1;
        for name in ["FA_STAGES", "FA_X1_STAGES"] {
            let default = format!("#define {name} {FA_STAGES_DEFAULT} ");
            assert!(attention.contains(&default), "attention.cu: no {default:?} (sources.rs FA_STAGES_DEFAULT)");
        }
        assert_eq!(large_shared("flash_attention_64x1"), Some(2 * 2 * 64 * 36 * 4));
        assert_eq!(large_shared("flash_attention_128"), Some(2 * 2 * 64 * 68 * 4));
        assert_eq!(large_shared("flash_attention_merge"), None);
        if !nvrtc_or_not_run("the tuned sources were not compiled") {
            return;
        }
        let tuned: Vec<(&'static str, &str)> =
            SOURCES.iter().filter(|(f, _)| *f == "bf16.cu" || *f == "attention.cu").cloned().collect();
        for pick in [|t: &Tunable| t.lo, |t: &Tunable| t.hi] {
            let prelude: String = TUNABLES.iter().map(|t| format!("#define {} {}\n", t.name, pick(t))).collect();
            compile_with("compute_90", &prelude, &tuned).unwrap_or_else(|e| panic!("{prelude}: {e}"));
        }
    }

    /// The text of function `name`'s body in the sources (from its signature's `{` to the matching `}`).
    fn body_of(name: &str) -> String {
        let (_, source) = SOURCES
            .iter()
            .find(|(_, s)| s.contains(&format!(" {name}(")))
            .unwrap_or_else(|| panic!("no function {name} in kernels/cuda"));
        let from = source.find(&format!(" {name}(")).unwrap();
        let open = from + source[from..].find('{').unwrap();
        let mut depth = 0;
        for (i, c) in source[open..].char_indices() {
            depth += match c {
                '{' => 1,
                '}' => -1,
                _ => 0,
            };
            if depth == 0 {
                return source[open..=open + i].to_string();
            }
        }
        panic!("{name}'s body does not close")
    }

    /// A kernel the host may launch before the one ahead of it has finished (PDL_KERNELS) waits for
    /// it (`griddep_wait`) first thing, or — the product tiles — once its first weights are staged
    /// and before the first x is.
    #[test]
    fn every_programmatically_launched_kernel_waits_for_the_kernel_before_it() {
        for name in super::super::launch::PDL_KERNELS {
            let body = body_of(name);
            if body.contains("linear_bf16_tile(") {
                let tile = body_of("linear_bf16_tile");
                let wait = tile.find("griddep_wait();").expect("linear_bf16_tile calls griddep_wait()");
                let first_x = tile.find("load_x(s)").expect("linear_bf16_tile stages x");
                assert!(wait < first_x, "linear_bf16_tile stages x before griddep_wait()");
                continue;
            }
            let first = body[1..].trim_start().lines().next().unwrap_or_default();
            assert_eq!(first, "griddep_wait();", "{name} does not start with griddep_wait()");
        }
    }

    #[test]
    fn kernel_names_are_read_from_the_sources() {
        let names: Vec<String> = SOURCES.iter().flat_map(|(_, s)| kernel_names(s)).collect();
        for expected in ["linear", "paged_attention", "sample_greedy", "pack_blocks", "unpack_blocks", "route"] {
            assert!(names.iter().any(|n| n == expected), "no kernel {expected} in {names:?}");
        }
    }
}
