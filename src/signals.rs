//! SIGINT and SIGTERM for `kvflow run`: both stop admissions and let in-flight requests finish for
//! the grace period (SIGTERM is what `timeout`, systemd, docker and Kubernetes send, so it must
//! not lose the run's report); a second signal exits at once. The signals are blocked in every
//! thread and taken by one thread with `sigwait`, so the handling is ordinary code (no
//! async-signal-safety limits) and knows which signal came.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

/// Which signal interrupted the run, once one has.
#[derive(Clone, Default)]
pub struct Interrupts {
    /// Set at the first signal (the runtime reads it as "interrupted").
    pub flag: Arc<AtomicBool>,
    signal: Arc<AtomicI32>,
}

impl Interrupts {
    /// The exit status of an interrupted run: 128 + the signal (130 for SIGINT, 143 for
    /// SIGTERM), or `None` if no signal came.
    pub fn exit_status(&self) -> Option<i32> {
        let signal = self.signal.load(Ordering::SeqCst);
        (signal != 0).then_some(128 + signal)
    }
}

fn name(signal: i32) -> &'static str {
    if signal == libc::SIGTERM {
        "SIGTERM"
    } else {
        "SIGINT (Ctrl-C)"
    }
}

/// Blocks SIGINT and SIGTERM in the calling thread (and so in every thread it starts after this)
/// and starts the thread that takes them. Call it before any other thread is started.
pub fn watch() -> std::io::Result<Interrupts> {
    let interrupts = Interrupts::default();
    // SAFETY: `set` is a local sigset_t initialised by sigemptyset before use; the calls only
    // read and write it and the calling thread's signal mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        set
    };
    let seen = interrupts.clone();
    std::thread::Builder::new().name("kvflow-signals".into()).spawn(move || loop {
        let mut signal: libc::c_int = 0;
        // SAFETY: `set` is a valid, initialised sigset_t owned by this closure; `signal` is a
        // valid out-pointer.
        if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
            continue;
        }
        if seen.flag.load(Ordering::SeqCst) {
            eprintln!("{} again: exiting now", name(signal));
            std::process::exit(128 + signal);
        }
        // The signal first: whoever sees the flag finds the signal set.
        seen.signal.store(signal, Ordering::SeqCst);
        seen.flag.store(true, Ordering::SeqCst);
        eprintln!(
            "{}: no more requests; finishing what is in flight within the grace period (send it again to exit now)",
            name(signal)
        );
    })?;
    Ok(interrupts)
}
