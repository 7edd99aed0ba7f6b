//! The replay workload: which trace requests run, and when each is handed to the runtime
//! (docs/design.md §11, "honour timestamps (time-scaled), fixed concurrency, fixed rate").
//!
//! [`select`] cuts a synthesised trace into warmup and measured requests; [`drive`] then releases
//! them in trace order on the calling thread, in one of three [`ArrivalMode`]s, and waits until
//! every released request has completed (or a stop flag is raised). Each released request carries
//! `arrival_ms` = the moment it was actually released, relative to the start of [`drive`], so the
//! runtime measures queueing delay from release.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use crate::trace::{splitmix64, Request};

/// The longest [`drive`] waits between looks at its stop flag.
pub const STOP_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// When requests are released to the runtime.
#[derive(Clone, Debug, PartialEq)]
pub enum ArrivalMode {
    /// Open loop on the trace's own clock: request k is released at
    /// `start + arrival_ms(k) × time_scale` (0 releases everything at once, 0.5 replays twice as fast).
    Timestamps {
        /// Factor from trace milliseconds to wall milliseconds; finite and ≥ 0.
        time_scale: f64,
    },
    /// Closed loop: keep this many requests in flight (release the first N, then one per completion).
    Concurrency(usize),
    /// Open loop at a fixed mean rate: seeded Poisson arrivals ([`poisson_arrival_ms`]) replace the
    /// trace's timestamps.
    Rate {
        /// Mean arrivals per second; finite and > 0.
        per_second: f64,
        /// Seed of the exponential gaps.
        seed: u64,
    },
}

/// An [`ArrivalMode`] whose parameters cannot be replayed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum WorkloadError {
    /// `Timestamps { time_scale }` negative, NaN or infinite.
    #[error("arrival mode timestamps: time_scale must be a finite number ≥ 0, found {0}")]
    BadTimeScale(f64),
    /// `Concurrency(0)` would never release anything.
    #[error("arrival mode concurrency: the number of requests in flight must be at least 1, found 0")]
    ZeroConcurrency,
    /// `Rate { per_second }` zero, negative, NaN or infinite.
    #[error("arrival mode rate: per_second must be a finite number > 0, found {0}")]
    BadRate(f64),
}

impl ArrivalMode {
    /// Checks the mode's parameters. [`drive`] never panics on a bad mode, but degrades it (see
    /// there); call this first to report the mistake instead.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        match *self {
            ArrivalMode::Timestamps { time_scale } if !(time_scale.is_finite() && time_scale >= 0.0) => {
                Err(WorkloadError::BadTimeScale(time_scale))
            }
            ArrivalMode::Concurrency(0) => Err(WorkloadError::ZeroConcurrency),
            ArrivalMode::Rate { per_second, .. } if !(per_second.is_finite() && per_second > 0.0) => {
                Err(WorkloadError::BadRate(per_second))
            }
            _ => Ok(()),
        }
    }
}

/// The requests a run replays.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// Warmup requests first, then measured ones, in trace order; ids renumbered `0..len`.
    pub requests: Vec<Request>,
    /// How many of `requests` (the first ones) are warmup, excluded from the report.
    pub warmup: usize,
    /// How many of `requests` (the rest) are measured.
    pub measured: usize,
    /// Set when the trace was too short for what was asked, saying what runs instead.
    pub note: Option<String>,
}

/// Takes the first `warmup` requests as warmup and the next `limit` (all the rest if `None`) as
/// measured, renumbering ids from 0. Asking for more than the trace holds runs what there is and
/// says so in [`Selection::note`].
pub fn select(all: Vec<Request>, warmup: usize, limit: Option<usize>) -> Selection {
    let available = all.len();
    let warmup_taken = warmup.min(available);
    let after_warmup = available - warmup_taken;
    let measured = limit.map_or(after_warmup, |limit| limit.min(after_warmup));
    let note = if warmup > available {
        Some(format!(
            "warmup {warmup} is beyond the trace: running the {available} requests there are \
             ({warmup_taken} warmup + 0 measured)"
        ))
    } else {
        match limit {
            Some(limit) if limit > after_warmup => Some(format!(
                "limit {limit} is beyond the trace: running the {available} requests there are \
                 ({warmup_taken} warmup + {measured} measured)"
            )),
            _ => None,
        }
    };
    let requests = all
        .into_iter()
        .take(warmup_taken + measured)
        .enumerate()
        .map(|(index, mut request)| {
            request.id = index as u64;
            request
        })
        .collect();
    Selection { requests, warmup: warmup_taken, measured, note }
}

/// `n` arrival times in milliseconds, the first at 0, separated by exponential gaps of mean
/// `1000 / per_second` ms (a Poisson process), drawn from a splitmix64 stream seeded by `seed`:
/// the same arguments give the same times.
///
/// A rate that is not a finite positive number (see [`ArrivalMode::validate`]) gives every arrival
/// at 0, i.e. releases as fast as possible, rather than panicking or never arriving.
pub fn poisson_arrival_ms(n: usize, per_second: f64, seed: u64) -> Vec<f64> {
    const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let mean_gap_ms = 1000.0 / per_second;
    let rate_is_usable = per_second.is_finite() && per_second > 0.0 && mean_gap_ms.is_finite();
    let mut arrivals = Vec::with_capacity(n);
    let mut now_ms = 0.0;
    for index in 0..n {
        if index > 0 && rate_is_usable {
            let bits = splitmix64(seed.wrapping_add((index as u64).wrapping_mul(GOLDEN_GAMMA)));
            let uniform = (bits >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
            now_ms += -(1.0 - uniform).ln() * mean_gap_ms; // 1 - uniform is in (0, 1]: finite
        }
        arrivals.push(now_ms);
    }
    arrivals
}

/// A wait for the next request longer than this is printed when it starts.
pub const ANNOUNCED_WAIT: Duration = Duration::from_secs(10);

/// When each request of the selection is released, after the start, in the modes that set it
/// (`None`: concurrency mode releases as requests complete).
pub fn release_offsets(sel: &Selection, mode: &ArrivalMode) -> Option<Vec<Duration>> {
    match *mode {
        ArrivalMode::Timestamps { time_scale } => {
            let time_scale = if time_scale.is_finite() && time_scale >= 0.0 { time_scale } else { 0.0 };
            Some(sel.requests.iter().map(|request| duration_from_ms(request.arrival_ms * time_scale)).collect())
        }
        ArrivalMode::Rate { per_second, seed } => {
            Some(poisson_arrival_ms(sel.requests.len(), per_second, seed).into_iter().map(duration_from_ms).collect())
        }
        ArrivalMode::Concurrency(_) => None,
    }
}

/// The first gap before a release longer than `max_wait` (from the start, or from the request
/// before), known as soon as the workload is: the request, how long and after which request.
pub fn longest_wait_over(sel: &Selection, mode: &ArrivalMode, max_wait: Duration) -> Option<String> {
    let offsets = release_offsets(sel, mode)?;
    let mut before = Duration::ZERO;
    for (i, &at) in offsets.iter().enumerate() {
        let gap = at.saturating_sub(before);
        if gap > max_wait {
            let after = if i == 0 { "the start".to_string() } else { format!("request {}", sel.requests[i - 1].id) };
            let why = match mode {
                ArrivalMode::Rate { .. } => "workload.rate",
                _ => "the trace's timestamps × workload.time_scale",
            };
            return Some(format!(
                "request {} would be released {:.0} s after {after} ({why}), more than --max-wait {} s",
                sel.requests[i].id,
                gap.as_secs_f64(),
                max_wait.as_secs_f64()
            ));
        }
        before = at;
    }
    None
}

/// What [`drive`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriveOutcome {
    /// Requests handed to the runtime.
    pub released: usize,
    /// Released requests reported finished (completed or failed).
    pub completed: usize,
    /// Whether the stop flag ended the drive early.
    pub stopped: bool,
}

/// Releases requests in trace order according to the mode, on the calling thread, until all are
/// released and (for every mode) all are completed, or `stop` is set. `release` hands a request to
/// the runtime; `completions` delivers the ids of finished requests (completed or failed).
///
/// Each released request is the selected one (its prompt taken out of `sel`, which keeps the
/// rest) with `arrival_ms` replaced by its actual release time in milliseconds since `drive`
/// started. Completions are drained while waiting for
/// the next release time, and `stop` is looked at least every [`STOP_POLL_INTERVAL`]; once it is
/// set nothing more is released and `drive` returns with `stopped: true`. A completion for an id
/// not in flight is ignored (with a warning). If every sender of `completions` is dropped, no
/// further completion can come, so `drive` returns at once with `completed < released` (and a
/// warning).
///
/// Bad parameters ([`ArrivalMode::validate`]) are degraded, never a panic: a negative, NaN or
/// infinite `time_scale` counts as 0, `Concurrency(0)` as 1, a bad rate as "all at once".
pub fn drive(
    sel: &mut Selection,
    mode: &ArrivalMode,
    mut release: impl FnMut(Request),
    completions: &Receiver<u64>,
    stop: &AtomicBool,
) -> DriveOutcome {
    let start = Instant::now();
    let total = sel.requests.len();
    let release_offsets = release_offsets(sel, mode);
    // The request whose long wait was last announced.
    let mut announced = None;
    let in_flight_limit = match *mode {
        ArrivalMode::Concurrency(limit) => limit.max(1),
        _ => usize::MAX,
    };

    let mut tally = InFlightTally::default();
    let mut completion_senders_gone = false;
    loop {
        if stop.load(Ordering::Acquire) {
            return tally.outcome(true);
        }
        loop {
            match completions.try_recv() {
                Ok(id) => tally.note_completion(id),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    completion_senders_gone = true;
                    break;
                }
            }
        }

        while tally.released < total && tally.in_flight() < in_flight_limit && !stop.load(Ordering::Acquire) {
            if let Some(offsets) = &release_offsets {
                if start.elapsed() < offsets[tally.released] {
                    break;
                }
            }
            // The selection gives each request's prompt up as it releases it, so what it holds
            // shrinks as the workload is served and nothing of a request outlives its end here.
            let selected = &mut sel.requests[tally.released];
            let mut request = Request { prompt: std::mem::take(&mut selected.prompt), ..selected.clone() };
            request.arrival_ms = start.elapsed().as_secs_f64() * 1000.0;
            tally.note_release(request.id);
            release(request);
        }

        if tally.released == total && tally.completed == tally.released {
            return tally.outcome(false);
        }
        if completion_senders_gone {
            tracing::warn!(
                released = tally.released,
                completed = tally.completed,
                "completion channel closed with requests still in flight or unreleased: drive ends"
            );
            return tally.outcome(false);
        }

        let mut wait = STOP_POLL_INTERVAL;
        if let Some(offsets) = &release_offsets {
            if tally.released < total {
                let left = offsets[tally.released].saturating_sub(start.elapsed());
                let id = sel.requests[tally.released].id;
                if left > ANNOUNCED_WAIT && announced != Some(id) {
                    eprintln!("waiting {} s for request {id}", left.as_secs());
                    announced = Some(id);
                }
                wait = wait.min(left);
            }
        }
        match completions.recv_timeout(wait) {
            Ok(id) => tally.note_completion(id),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => completion_senders_gone = true,
        }
    }
}

/// Released and completed counts, and which ids are in flight (a count per id, so a selection
/// with repeated ids still balances).
#[derive(Default)]
struct InFlightTally {
    in_flight_by_id: HashMap<u64, usize>,
    released: usize,
    completed: usize,
}

impl InFlightTally {
    fn in_flight(&self) -> usize {
        self.released - self.completed
    }

    fn note_release(&mut self, id: u64) {
        *self.in_flight_by_id.entry(id).or_insert(0) += 1;
        self.released += 1;
    }

    fn note_completion(&mut self, id: u64) {
        let Some(count) = self.in_flight_by_id.get_mut(&id) else {
            tracing::warn!(request_id = id, "completion for a request that is not in flight: ignored");
            return;
        };
        *count -= 1;
        if *count == 0 {
            self.in_flight_by_id.remove(&id);
        }
        self.completed += 1;
    }

    fn outcome(&self, stopped: bool) -> DriveOutcome {
        DriveOutcome { released: self.released, completed: self.completed, stopped }
    }
}

/// Milliseconds as a `Duration`: negative or NaN is zero, too large is `Duration::MAX`.
fn duration_from_ms(ms: f64) -> Duration {
    if ms.is_nan() || ms <= 0.0 {
        Duration::ZERO
    } else {
        Duration::try_from_secs_f64(ms / 1000.0).unwrap_or(Duration::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::thread;

    fn request(id: u64, arrival_ms: f64) -> Request {
        Request {
            id,
            arrival_ms,
            prompt: vec![1, 2, 3],
            max_output_tokens: 4,
            trace_line: id as usize + 1,
            sampling: None,
        }
    }

    fn selection(arrivals_ms: &[f64]) -> Selection {
        let all = arrivals_ms.iter().enumerate().map(|(index, &ms)| request(index as u64, ms)).collect();
        select(all, 0, None)
    }

    /// A stand-in runtime: every request it is handed completes on its own thread after `delay`,
    /// decrementing `in_flight` just before reporting the completion.
    struct FakeRuntime {
        requests: mpsc::Sender<Request>,
        completions: mpsc::Receiver<u64>,
        in_flight: Arc<AtomicUsize>,
        most_in_flight: Arc<AtomicUsize>,
    }

    impl FakeRuntime {
        fn start(delay: Duration) -> Self {
            let (requests, incoming) = mpsc::channel::<Request>();
            let (done, completions) = mpsc::channel();
            let in_flight = Arc::new(AtomicUsize::new(0));
            let runtime_in_flight = Arc::clone(&in_flight);
            thread::spawn(move || {
                for request in incoming {
                    let done = done.clone();
                    let in_flight = Arc::clone(&runtime_in_flight);
                    thread::spawn(move || {
                        thread::sleep(delay);
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        let _ = done.send(request.id);
                    });
                }
            });
            FakeRuntime { requests, completions, in_flight, most_in_flight: Arc::new(AtomicUsize::new(0)) }
        }

        /// Drives `sel` against this runtime, returning the outcome and the requests as released.
        fn drive(&self, sel: &Selection, mode: &ArrivalMode, stop: &AtomicBool) -> (DriveOutcome, Vec<Request>) {
            let mut sel = sel.clone();
            let mut released = Vec::new();
            let outcome = drive(
                &mut sel,
                mode,
                |request| {
                    let now_in_flight = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    self.most_in_flight.fetch_max(now_in_flight, Ordering::SeqCst);
                    released.push(request.clone());
                    self.requests.send(request).unwrap();
                },
                &self.completions,
                stop,
            );
            (outcome, released)
        }
    }

    #[test]
    fn select_splits_warmup_then_measured_and_renumbers_ids() {
        let all: Vec<Request> = (10..20).map(|id| request(id, id as f64)).collect();
        let sel = select(all, 3, Some(4));
        assert_eq!((sel.warmup, sel.measured, sel.note.clone()), (3, 4, None));
        assert_eq!(sel.requests.iter().map(|request| request.id).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(
            sel.requests.iter().map(|request| request.trace_line).collect::<Vec<_>>(),
            [11, 12, 13, 14, 15, 16, 17]
        );
        let everything = select((0..10).map(|id| request(id, 0.0)).collect(), 2, None);
        assert_eq!((everything.warmup, everything.measured, everything.note), (2, 8, None));
    }

    #[test]
    fn select_beyond_the_trace_runs_what_there_is_and_says_so() {
        let sel = select((0..203).map(|id| request(id, 0.0)).collect(), 3, Some(500));
        assert_eq!((sel.warmup, sel.measured, sel.requests.len()), (3, 200, 203));
        assert_eq!(
            sel.note.as_deref(),
            Some("limit 500 is beyond the trace: running the 203 requests there are (3 warmup + 200 measured)")
        );
        let sel = select((0..5).map(|id| request(id, 0.0)).collect(), 8, Some(2));
        assert_eq!((sel.warmup, sel.measured, sel.requests.len()), (5, 0, 5));
        assert_eq!(
            sel.note.as_deref(),
            Some("warmup 8 is beyond the trace: running the 5 requests there are (5 warmup + 0 measured)")
        );
    }

    #[test]
    fn poisson_arrivals_start_at_zero_are_seeded_and_have_the_requested_mean_rate() {
        let arrivals = poisson_arrival_ms(20_000, 50.0, 42);
        assert_eq!(arrivals[0], 0.0);
        assert!(arrivals.windows(2).all(|pair| pair[1] >= pair[0]));
        assert_eq!(arrivals, poisson_arrival_ms(20_000, 50.0, 42));
        assert_ne!(arrivals, poisson_arrival_ms(20_000, 50.0, 43));
        let mean_gap_ms = arrivals[arrivals.len() - 1] / (arrivals.len() - 1) as f64;
        assert!((mean_gap_ms - 20.0).abs() < 0.5, "mean gap {mean_gap_ms} ms, expected 20 ms");
        assert!(poisson_arrival_ms(0, 50.0, 1).is_empty());
    }

    #[test]
    fn poisson_arrivals_with_an_unusable_rate_all_come_at_once() {
        for per_second in [0.0, -3.0, f64::NAN, f64::INFINITY] {
            assert_eq!(poisson_arrival_ms(3, per_second, 1), [0.0, 0.0, 0.0], "{per_second}");
        }
    }

    #[test]
    fn arrival_mode_validation_rejects_unreplayable_parameters() {
        assert!(ArrivalMode::Timestamps { time_scale: 0.0 }.validate().is_ok());
        assert!(ArrivalMode::Concurrency(1).validate().is_ok());
        assert!(ArrivalMode::Rate { per_second: 0.5, seed: 0 }.validate().is_ok());
        assert_eq!(ArrivalMode::Timestamps { time_scale: -1.0 }.validate(), Err(WorkloadError::BadTimeScale(-1.0)));
        assert_eq!(ArrivalMode::Concurrency(0).validate(), Err(WorkloadError::ZeroConcurrency));
        assert!(ArrivalMode::Rate { per_second: f64::NAN, seed: 0 }.validate().is_err());
        assert!(ArrivalMode::Rate { per_second: 0.0, seed: 0 }.validate().is_err());
    }

    #[test]
    fn timestamps_mode_releases_at_scaled_trace_times_and_waits_for_completions() {
        let runtime = FakeRuntime::start(Duration::from_millis(20));
        let sel = selection(&[0.0, 100.0, 200.0, 200.0]);
        let started = Instant::now();
        let (outcome, released) =
            runtime.drive(&sel, &ArrivalMode::Timestamps { time_scale: 0.5 }, &AtomicBool::new(false));
        assert_eq!(outcome, DriveOutcome { released: 4, completed: 4, stopped: false });
        assert!(started.elapsed() >= Duration::from_millis(120), "returned before the last completion");
        let due_ms = [0.0, 50.0, 100.0, 100.0];
        for (request, due) in released.iter().zip(due_ms) {
            assert!(
                request.arrival_ms >= due,
                "request {} released at {} ms, due {due}",
                request.id,
                request.arrival_ms
            );
            assert!(
                request.arrival_ms < due + 40.0,
                "request {} late: {} ms, due {due}",
                request.id,
                request.arrival_ms
            );
        }
        assert_eq!(released.iter().map(|request| request.id).collect::<Vec<_>>(), [0, 1, 2, 3]);
    }

    #[test]
    fn timestamps_mode_with_zero_scale_releases_everything_at_once() {
        let runtime = FakeRuntime::start(Duration::from_millis(30));
        let sel = selection(&[0.0, 1_000.0, 60_000.0]);
        let (outcome, released) =
            runtime.drive(&sel, &ArrivalMode::Timestamps { time_scale: 0.0 }, &AtomicBool::new(false));
        assert_eq!(outcome, DriveOutcome { released: 3, completed: 3, stopped: false });
        assert!(released.iter().all(|request| request.arrival_ms < 25.0), "{released:?}");
        assert_eq!(runtime.most_in_flight.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn concurrency_mode_never_has_more_than_n_in_flight() {
        let runtime = FakeRuntime::start(Duration::from_millis(10));
        let sel = selection(&[0.0; 9]);
        let (outcome, released) = runtime.drive(&sel, &ArrivalMode::Concurrency(2), &AtomicBool::new(false));
        assert_eq!(outcome, DriveOutcome { released: 9, completed: 9, stopped: false });
        assert_eq!(runtime.most_in_flight.load(Ordering::SeqCst), 2);
        assert_eq!(released.iter().map(|request| request.id).collect::<Vec<_>>(), (0..9).collect::<Vec<_>>());
        // The third request waits for a completion: released about one service time after start.
        assert!(released[2].arrival_ms >= 9.0, "third request released at {} ms", released[2].arrival_ms);
    }

    #[test]
    fn rate_mode_releases_at_poisson_times_instead_of_trace_times() {
        let runtime = FakeRuntime::start(Duration::from_millis(5));
        let sel = selection(&[0.0, 50_000.0, 90_000.0, 90_000.0, 120_000.0, 130_000.0]);
        let mode = ArrivalMode::Rate { per_second: 100.0, seed: 9 };
        let (outcome, released) = runtime.drive(&sel, &mode, &AtomicBool::new(false));
        assert_eq!(outcome, DriveOutcome { released: 6, completed: 6, stopped: false });
        let due_ms = poisson_arrival_ms(6, 100.0, 9);
        for (request, due) in released.iter().zip(&due_ms) {
            assert!(
                request.arrival_ms >= *due,
                "request {} released at {} ms, due {due}",
                request.id,
                request.arrival_ms
            );
            assert!(
                request.arrival_ms < due + 40.0,
                "request {} late: {} ms, due {due}",
                request.id,
                request.arrival_ms
            );
        }
    }

    #[test]
    fn stop_ends_a_drive_waiting_for_a_far_arrival() {
        let runtime = FakeRuntime::start(Duration::from_millis(1));
        let sel = selection(&[0.0, 600_000.0]);
        let stop = Arc::new(AtomicBool::new(false));
        let stopper = {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(100));
                stop.store(true, Ordering::Release);
            })
        };
        let started = Instant::now();
        let (outcome, _) = runtime.drive(&sel, &ArrivalMode::Timestamps { time_scale: 1.0 }, &stop);
        let took = started.elapsed();
        stopper.join().unwrap();
        assert_eq!(outcome, DriveOutcome { released: 1, completed: 1, stopped: true });
        assert!(took < Duration::from_millis(100) + STOP_POLL_INTERVAL * 4, "stop took {took:?}");
    }

    #[test]
    fn stop_ends_a_drive_waiting_for_completions_that_never_come() {
        let (_completion_sender, completions) = mpsc::channel::<u64>();
        let mut sel = selection(&[0.0; 5]);
        let stop = AtomicBool::new(false);
        let started = Instant::now();
        let mut released = 0;
        let outcome = thread::scope(|scope| {
            scope.spawn(|| {
                thread::sleep(Duration::from_millis(80));
                stop.store(true, Ordering::Release);
            });
            drive(&mut sel, &ArrivalMode::Concurrency(2), |_| released += 1, &completions, &stop)
        });
        assert_eq!(outcome, DriveOutcome { released: 2, completed: 0, stopped: true });
        assert_eq!(released, 2);
        assert!(started.elapsed() < Duration::from_millis(80) + STOP_POLL_INTERVAL * 4);
    }

    #[test]
    fn closed_completion_channel_ends_the_drive_instead_of_hanging() {
        let (completion_sender, completions) = mpsc::channel::<u64>();
        drop(completion_sender);
        let mut sel = selection(&[0.0, 0.0]);
        let outcome = drive(&mut sel, &ArrivalMode::Concurrency(1), |_| {}, &completions, &AtomicBool::new(false));
        assert_eq!(outcome, DriveOutcome { released: 1, completed: 0, stopped: false });
    }

    #[test]
    fn unknown_and_duplicate_completions_are_not_counted() {
        let (completion_sender, completions) = mpsc::channel::<u64>();
        let mut sel = selection(&[0.0, 0.0]);
        let outcome = drive(
            &mut sel,
            &ArrivalMode::Concurrency(1),
            |request| {
                completion_sender.send(99).unwrap();
                completion_sender.send(request.id).unwrap();
                completion_sender.send(request.id).unwrap();
            },
            &completions,
            &AtomicBool::new(false),
        );
        assert_eq!(outcome, DriveOutcome { released: 2, completed: 2, stopped: false });
    }

    #[test]
    fn empty_selection_returns_at_once() {
        let (_completion_sender, completions) = mpsc::channel::<u64>();
        let mut sel = select(Vec::new(), 0, None);
        let outcome = drive(
            &mut sel,
            &ArrivalMode::Rate { per_second: 1.0, seed: 0 },
            |_| {},
            &completions,
            &AtomicBool::new(false),
        );
        assert_eq!(outcome, DriveOutcome { released: 0, completed: 0, stopped: false });
    }
}
