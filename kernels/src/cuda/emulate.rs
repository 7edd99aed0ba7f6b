//! The CPU emulation of the CUDA kernels (`executor_settings.emulate = true`, and the checks that
//! run without a GPU): `kernels/cuda/emulate.h`, the sources and a table of launchers generated
//! from the kernels' signatures are compiled once by the host C++ compiler (`$CXX`, else `c++`)
//! into a library cached in the temporary folder under the hash of what went in, then loaded.
//! A launch runs the kernel's blocks one after another, each block's threads as fibers (see the
//! header), on one of several copies of the library (one per core), so launches from different
//! threads run at once. Device memory is host memory: a "device pointer" is an address in this
//! process.

use super::error::CudaError;
use super::sources::{kernel_names, tuning_prelude, COMMON, SOURCES};
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

const HEADER: &str = include_str!("../../cuda/emulate.h");

type LaunchFn = unsafe extern "C" fn(
    name: *const std::ffi::c_char,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    smem: u32,
    args: *mut *mut std::ffi::c_void,
    err: *mut std::ffi::c_char,
    err_len: i32,
) -> i32;

/// The emulation: copies of one library, each with statics of its own (the launched block's
/// threadIdx, its fibers, its shared memory), so launches from different threads (ranks, tests)
/// run at once, each on a copy no other launch holds.
pub struct Emulator {
    copies: Vec<LibraryCopy>,
}

struct LibraryCopy {
    _lib: libloading::Library,
    launch: LaunchFn,
    /// Held for a launch: a copy's statics serve one launch at a time.
    busy: Mutex<()>,
}

/// The parameter types of kernel `name` in `source`, in order.
fn parameter_types(source: &str, name: &str) -> Vec<String> {
    let Some(at) = source.find(&format!(" {name}(")) else { return Vec::new() };
    let rest = &source[at + name.len() + 2..];
    let params = &rest[..rest.find(')').unwrap_or(0)];
    params
        .split(',')
        .map(|p| {
            let p = p.trim();
            let cut = p.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
            p[..cut].trim().to_string()
        })
        .filter(|t| !t.is_empty())
        .collect()
}

/// The whole translation unit: header, sources, one launcher per kernel and their table.
fn translation_unit() -> String {
    let mut text = format!("{HEADER}\n{}// ---- kernels/cuda/common.cuh\n{COMMON}\n", tuning_prelude());
    let mut table = String::from("static const KernelEntry KERNELS[] = {\n");
    for (file, source) in SOURCES {
        text.push_str(&format!("\n// ---- kernels/cuda/{file}\n{source}\n"));
        for name in kernel_names(source) {
            let args: Vec<String> =
                parameter_types(source, &name).iter().enumerate().map(|(i, t)| format!("*({t}*)a[{i}]")).collect();
            text.push_str(&format!("static void launch_{name}(void** a) {{ {name}({}); }}\n", args.join(", ")));
            table.push_str(&format!("    {{\"{name}\", launch_{name}}},\n"));
        }
    }
    table.push_str("    {nullptr, nullptr},\n};\n");
    text.push_str(&table);
    text.push_str(
        "extern \"C\" __attribute__((visibility(\"default\"))) int kvflow_emulate_launch(const char* name, unsigned gx, \
         unsigned gy, unsigned gz, unsigned bx, unsigned smem, void** args, char* err, int err_len) {\n    return \
         emulate_launch(KERNELS, name, gx, gy, gz, bx, smem, args, err, err_len);\n}\n",
    );
    text
}

fn library_path(text: &str) -> PathBuf {
    let hash = text.bytes().fold(crate::hash::EMPTY, |h, b| crate::hash::mix(h, b as u64));
    std::env::temp_dir().join(format!("kvflow-emulate-{hash:016x}.so"))
}

fn build() -> Result<Emulator, String> {
    let text = translation_unit();
    let lib = library_path(&text);
    if !lib.exists() {
        let pid = std::process::id();
        let src = lib.with_extension(format!("{pid}.cpp"));
        let tmp = lib.with_extension(format!("{pid}.so"));
        std::fs::write(&src, &text).map_err(|e| format!("cannot write {}: {e}", src.display()))?;
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let out = std::process::Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O2",
                "-shared",
                "-fPIC",
                "-fvisibility=hidden",
                "-fno-strict-aliasing",
                "-ffp-contract=off",
                "-w",
            ])
            .arg("-o")
            .arg(&tmp)
            .arg(&src)
            .output()
            .map_err(|e| format!("cannot run the C++ compiler `{cxx}` (set CXX): {e}"))?;
        let _ = std::fs::remove_file(&src);
        if !out.status.success() {
            return Err(format!("`{cxx}` could not compile the kernels: {}", String::from_utf8_lossy(&out.stderr)));
        }
        std::fs::rename(&tmp, &lib).map_err(|e| format!("cannot place {}: {e}", lib.display()))?;
    }
    // One copy per core (the loader shares one file's statics among its loads, so each copy is a
    // file of its own, written once beside the library).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    let mut copies = vec![load(&lib)?];
    for i in 1..cores {
        let copy = lib.with_extension(format!("copy{i}.so"));
        if !copy.exists() {
            let tmp = lib.with_extension(format!("copy{i}.{}.so", std::process::id()));
            std::fs::copy(&lib, &tmp)
                .map_err(|e| format!("cannot copy {} to {}: {e}", lib.display(), tmp.display()))?;
            std::fs::rename(&tmp, &copy).map_err(|e| format!("cannot place {}: {e}", copy.display()))?;
        }
        copies.push(load(&copy)?);
    }
    Ok(Emulator { copies })
}

fn load(lib: &std::path::Path) -> Result<LibraryCopy, String> {
    // SAFETY: the library is one built from this crate's sources; its one entry point has the
    // signature of `LaunchFn`.
    unsafe {
        let l = libloading::Library::new(lib).map_err(|e| format!("cannot load {}: {e}", lib.display()))?;
        let launch = *l
            .get::<LaunchFn>(b"kvflow_emulate_launch\0")
            .map_err(|e| format!("{}: no kvflow_emulate_launch: {e}", lib.display()))?;
        Ok(LibraryCopy { _lib: l, launch, busy: Mutex::new(()) })
    }
}

impl Emulator {
    /// The process's emulator (built on first use).
    pub fn get() -> Result<Arc<Emulator>, CudaError> {
        static EMULATOR: OnceLock<Result<Arc<Emulator>, String>> = OnceLock::new();
        EMULATOR
            .get_or_init(|| build().map(Arc::new))
            .clone()
            .map_err(|e| CudaError::Unsupported(format!("the CPU emulation of the CUDA kernels: {e}")))
    }

    /// Runs kernel `name` to the end. `args[i]` points at the i-th argument's value.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        let cname =
            std::ffi::CString::new(name).map_err(|_| CudaError::Unsupported("a kernel name with a NUL".into()))?;
        let mut err = [0 as std::ffi::c_char; 256];
        // a copy no launch holds, else this thread's own one to wait for
        let free = self.copies.iter().find_map(|c| c.busy.try_lock().map(|held| (c, held)));
        let (copy, _held) = free.unwrap_or_else(|| {
            let c = &self.copies[thread_number() % self.copies.len()];
            (c, c.busy.lock())
        });
        // SAFETY: `args` point at values of the kernel's parameter types (built by `Gpu::launch`
        // from the same signatures), alive for the call.
        let rc = unsafe {
            (copy.launch)(cname.as_ptr(), grid.0, grid.1, grid.2, block, smem, args.as_mut_ptr(), err.as_mut_ptr(), 256)
        };
        if rc != 0 {
            // SAFETY: the launcher wrote a NUL-terminated message.
            let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            return Err(CudaError::Unsupported(format!("emulated kernel: {msg}")));
        }
        Ok(())
    }
}

/// A number for the calling thread, given out in turn.
fn thread_number() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static NUMBER: usize = NEXT.fetch_add(1, Ordering::Relaxed));
    NUMBER.with(|n| *n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_signatures_are_read_with_their_types() {
        let t = parameter_types("extern \"C\" __global__ void f(float* y, const u32* t, int n, long long s) {", "f");
        assert_eq!(t, vec!["float*", "const u32*", "int", "long long"]);
    }
}
