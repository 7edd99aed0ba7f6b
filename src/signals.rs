//! SIGINT, SIGTERM and SIGHUP for `kvflow run`, `serve`, `compare` and `launch`: each stops
//! admissions and lets in-flight requests finish for the grace period (SIGTERM is what
//! `timeout`, systemd, docker and Kubernetes send, and SIGHUP what a closed terminal or ssh
//! session sends, so neither may lose the run's report); a second signal exits at once (`launch`
//! forwards it to its processes instead, [`OnSecondSignal::Record`]). The signals are blocked in
//! every thread and taken by one thread with `sigwait`, so the handling is ordinary code (no
//! async-signal-safety limits) and knows which signal came. A SIGHUP ignored before kvflow
//! started (`nohup`) stays ignored: an ignored signal is discarded, never queued for `sigwait`.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

/// The signals that interrupt a run.
pub const INTERRUPTING: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Which signal interrupted the run, once one has.
#[derive(Clone, Default)]
pub struct Interrupts {
    /// Set at the first signal (the runtime reads it as "interrupted").
    pub flag: Arc<AtomicBool>,
    signal: Arc<AtomicI32>,
    /// Signals taken so far (the first included).
    count: Arc<AtomicUsize>,
}

impl Interrupts {
    /// The exit status of an interrupted run: 128 + the signal (130 for SIGINT, 143 for
    /// SIGTERM, 129 for SIGHUP), or `None` if no signal came.
    pub fn exit_status(&self) -> Option<i32> {
        self.signal().map(|signal| 128 + signal)
    }

    /// The latest signal taken, if any.
    pub fn signal(&self) -> Option<i32> {
        let signal = self.signal.load(Ordering::SeqCst);
        (signal != 0).then_some(signal)
    }

    /// How many signals were taken so far.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// What a second signal does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnSecondSignal {
    /// Exit at once with 128 + the signal (`run`, `serve`, `compare`).
    ExitNow,
    /// Only count it: the caller acts on it, and says so (`launch` forwards it to its processes,
    /// which then exit at once, and must not leave them running by exiting first).
    Record,
}

/// The signal's name as the messages say it.
pub fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP (terminal closed)",
        libc::SIGINT => "SIGINT (Ctrl-C)",
        libc::SIGKILL => "SIGKILL",
        _ => "a signal",
    }
}

/// [`watch_with`] where a second signal exits at once.
pub fn watch() -> std::io::Result<Interrupts> {
    watch_with(OnSecondSignal::ExitNow)
}

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (and so in every thread it starts
/// after this) and starts the thread that takes them. Call it before any other thread is
/// started. (A child process started with `std::process::Command` gets an empty signal mask.)
pub fn watch_with(second: OnSecondSignal) -> std::io::Result<Interrupts> {
    let interrupts = Interrupts::default();
    // SAFETY: `set` is a local sigset_t initialised by sigemptyset before use; the calls only
    // read and write it and the calling thread's signal mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in INTERRUPTING {
            libc::sigaddset(&mut set, signal);
        }
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
        let again = seen.flag.load(Ordering::SeqCst);
        if again && second == OnSecondSignal::ExitNow {
            eprintln!("{} again: exiting now", name(signal));
            std::process::exit(128 + signal);
        }
        // The signal first: whoever sees the flag (or the count) finds the signal set.
        seen.signal.store(signal, Ordering::SeqCst);
        seen.count.fetch_add(1, Ordering::SeqCst);
        seen.flag.store(true, Ordering::SeqCst);
        if !again && second == OnSecondSignal::ExitNow {
            eprintln!(
                "{}: no more requests; finishing what is in flight within the grace period (send it again to exit \
                 now)",
                name(signal)
            );
        }
    })?;
    Ok(interrupts)
}
