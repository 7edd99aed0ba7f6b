//! A simulated run (issue 44): every pool's executor is `sim`, and the run keeps a virtual clock
//! (`kvflow_operators::sim::clock`). Every worker of every pool runs on its thread as always, but
//! steps only when the stepper tells it to, one worker at a time, in a fixed order ([`Lockstep`]);
//! when a whole pass over them schedules no operator, nothing more can happen at the current
//! instant, and the clock moves to the next due event (a step's completion, a request's release or
//! cancellation) and runs it. Everything a rank stamps and the collector records is virtual time,
//! the requests' events reach the collector on the workers' threads as they step, and the KV usage
//! is sampled by the stepper: a run is reproducible from its seed, byte for byte, however fast
//! this machine is. The operators — admit, schedule, align, forward, verify,
//! the router, the scheduler, the accounting — are the real ones, unchanged.
//!
//! Not simulated yet: streamed handoffs, `kvflow serve` and pools spread over processes
//! (refused, naming what).
//!
//! Which time it holds: the run's virtual time, from the first release to the last pool's end.
//! Which guarantee it carries: the clock moves only when no worker anywhere can progress (the
//! discrete-event rule), and a run whose pools wait on nothing due is named as stalled.

use super::collector::{Collector, SharedCollector};
use super::driver::CancelPlan;
use super::entry::{Entries, Release};
use super::front::PoolGauges;
use super::kv_usage::KvSamples;
use super::options::RunOptions;
use crate::graph::{Graph, OffloadStore, PoolConfig, TransferBackend};
use crate::trace::Request;
use crate::workload::{release_offsets, ArrivalMode, Selection};
use anyhow::{anyhow, Result};
use kvflow_kernels::cpu::sampling::RequestSampling;
use kvflow_operators::messages::Event;
use kvflow_operators::pool::emit::EventSink;
use kvflow_operators::sim::clock::VirtualClock;
use std::cell::Cell;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::rc::Rc;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use timely::logging::{StartStop, TimelyEvent, TimelyEventBuilder};

/// The executor that makes a run simulated.
pub const SIM: &str = "sim";

/// Whether the run is simulated (every pool's executor `sim`); an error names what a simulated
/// run cannot do yet, or a pool that mixes real and simulated executors.
pub fn is_simulated(graph: &Graph, pools: &[&PoolConfig], opts: &RunOptions) -> Result<bool> {
    let sim = pools.iter().filter(|p| p.executor == SIM).count();
    if sim == 0 {
        return Ok(false);
    }
    let at = graph.path.display();
    if let Some(real) = pools.iter().find(|p| p.executor != SIM) {
        return Err(anyhow!(
            "{at}: pool `{}` has executor {:?} beside simulated pools: a simulated run keeps one virtual clock, so \
             every pool's executor must be \"sim\"",
            real.name,
            real.executor
        ));
    }
    let refuse = |what: &str| Err(anyhow!("{at}: a simulated run (executor \"sim\") cannot {what} yet (issue 44)"));
    if let Some(link) = graph.links.iter().find(|l| l.backend != TransferBackend::Sim) {
        return Err(anyhow!(
            "{at}: link {} → {} has backend \"{}\": a simulated run's handoffs move on its virtual clock, over \
             backend = \"sim\" links",
            link.from,
            link.to,
            link.backend
        ));
    }
    if let Some(link) = graph.links.iter().find(|l| l.stream_min_tokens.is_some()) {
        return refuse(&format!("stream handoffs in pieces (link {} → {} stream_min_tokens)", link.from, link.to));
    }
    if let Some(offload) = graph.offload.as_ref().filter(|o| !matches!(o.store, OffloadStore::Sim(_))) {
        return Err(anyhow!(
            "{at}: offload.store is \"{}\": a simulated run's chunks move on its virtual clock, in store = \"sim\"",
            offload.store.kind()
        ));
    }
    if opts.front_end.is_some() {
        return refuse("serve requests over HTTP (kvflow serve): it replays a trace");
    }
    if opts.verify {
        return Err(anyhow!(
            "{at}: --verify replays each request on the reference path, but a simulated run (executor \"sim\") \
             computes no tokens; its accounting is checked at every park and at the end, as in every run"
        ));
    }
    if opts.cluster.is_some() {
        return refuse("spread its pools over processes");
    }
    Ok(true)
}

/// A simulated pool's sink: its events are applied to the collector on the stepper's thread, at
/// the virtual instant they happen (no collector thread between).
pub struct AppliedSink {
    pub pool: Arc<str>,
    pub collector: SharedCollector,
}

impl EventSink for AppliedSink {
    fn events(&mut self, _step: u64, events: Vec<Event>) {
        let mut c = self.collector.lock();
        for e in events {
            c.apply(&self.pool, e);
        }
    }
}

/// What releases a simulated run's requests: the driver's rules (open loop at the trace's or a
/// rate's times, or closed loop at a concurrency), as events on the virtual clock.
pub struct SimReleases {
    pub entries: Arc<Entries>,
    pub selection: Selection,
    pub mode: ArrivalMode,
    pub cancel: CancelPlan,
    pub sampling: RequestSampling,
    /// The collector's completions (closed loop: one release each).
    pub completions: Receiver<u64>,
}

/// The part of [`SimReleases`] the clock's events share.
struct Releaser {
    entries: Arc<Entries>,
    /// Requests of the workload.
    total: usize,
    warmup: usize,
    cancel: CancelPlan,
    sampling: RequestSampling,
}

impl Releaser {
    /// Releases `request` now (and queues its cancellation if the workload cancels it).
    fn release(&self, clock: &Arc<VirtualClock>, request: Request) {
        let id = request.id;
        let release = Release::of_trace(request, self.warmup, self.sampling);
        let entered = self.entries.release(|_: &Collector| Ok::<_, Infallible>(release)).unwrap_or_else(|n| match n {});
        if entered && self.cancel.picks(id) {
            let entries = self.entries.clone();
            let at = clock.now_ns() + (self.cancel.after_ms * 1e6) as u64;
            clock.at(at, id, Box::new(move || entries.cancel(id)));
        }
    }
}

/// The requests' ends the collector reports: a closed loop releases one of the requests left
/// for each; once every request has ended, the entry pools close (as the driver closes them —
/// not at the last release: a decode pool that took new requests takes their handoffs after).
struct Ends {
    /// Requests not released yet (closed loop).
    left: VecDeque<Request>,
    closed_loop: bool,
    completions: Receiver<u64>,
    ended: usize,
    closed: bool,
}

impl SimReleases {
    /// Queues the open loop's releases; a closed loop releases its first requests now and keeps
    /// the rest, one to release per end.
    fn start(self, clock: &Arc<VirtualClock>) -> (Arc<Releaser>, Ends) {
        let SimReleases { entries, selection, mode, cancel, sampling, completions } = self;
        let (total, warmup) = (selection.requests.len(), selection.warmup);
        let releaser = Arc::new(Releaser { entries, total, warmup, cancel, sampling });
        let offsets = release_offsets(&selection, &mode);
        let mut requests: VecDeque<Request> = selection.requests.into();
        let Some(offsets) = offsets else {
            let limit = match mode {
                ArrivalMode::Concurrency(n) => n.max(1),
                _ => usize::MAX,
            };
            let first: Vec<Request> = requests.drain(..limit.min(requests.len())).collect();
            for request in first {
                releaser.release(clock, request);
            }
            return (releaser, Ends { left: requests, closed_loop: true, completions, ended: 0, closed: false });
        };
        for (request, offset) in requests.into_iter().zip(offsets) {
            let (r, c) = (releaser.clone(), clock.clone());
            clock.at(offset.as_nanos() as u64, request.id, Box::new(move || r.release(&c, request)));
        }
        (releaser, Ends { left: VecDeque::new(), closed_loop: false, completions, ended: 0, closed: false })
    }
}

impl Ends {
    /// Takes the ends the collector reported: a closed loop releases one request now for each;
    /// the entry pools close once every request has ended.
    fn on_completions(&mut self, releaser: &Arc<Releaser>, clock: &Arc<VirtualClock>) {
        while self.completions.try_recv().is_ok() {
            self.ended += 1;
            let Some(request) = self.left.pop_front().filter(|_| self.closed_loop) else { continue };
            let (r, c) = (releaser.clone(), clock.clone());
            clock.at(clock.now_ns(), request.id, Box::new(move || r.release(&c, request)));
        }
        if !self.closed && self.ended >= releaser.total {
            releaser.entries.close();
            self.closed = true;
        }
    }
}

/// What makes a simulated pool's workers step in lockstep: the run's clock, and the line on
/// which each worker gives the stepper its controls.
#[derive(Clone)]
pub struct Lockstep {
    pub clock: Arc<VirtualClock>,
    register: Sender<WorkerLine>,
}

/// One worker's controls: the stepper tells it to step (or to give up), and it answers whether
/// it ran anything and whether its pool ended.
struct WorkerLine {
    pool: String,
    index: usize,
    go: Sender<Go>,
    stepped: Receiver<Stepped>,
}

enum Go {
    Step,
    /// The run stalled: drop the dataflow and end.
    Abandon,
}

#[derive(Clone, Copy)]
struct Stepped {
    active: bool,
    ended: bool,
}

impl Lockstep {
    /// Counts the operators the worker schedules (timely's own log of it); call before it
    /// builds its dataflow.
    pub fn count_schedules(&self, worker: &mut timely::worker::Worker) -> Rc<Cell<u64>> {
        let scheduled: Rc<Cell<u64>> = Rc::default();
        let count = scheduled.clone();
        if let Some(mut registry) = worker.log_register() {
            registry.insert::<TimelyEventBuilder, _>("timely", move |_time, data| {
                if let Some(events) = data {
                    let starts = events
                        .iter()
                        .filter(|(_, e)| matches!(e, TimelyEvent::Schedule(s) if s.start_stop == StartStop::Start));
                    count.set(count.get() + starts.count() as u64);
                }
            });
        }
        scheduled
    }

    /// Steps the worker whenever the stepper says — each time until nothing more runs on it — until
    /// its pool ends (or the stepper gives up).
    pub fn run(&self, worker: &mut timely::worker::Worker, pool: &str, scheduled: &Rc<Cell<u64>>) {
        let _entered = self.clock.enter();
        let (go, orders) = channel();
        let (report, stepped) = channel();
        let line = WorkerLine { pool: pool.to_string(), index: worker.index(), go, stepped };
        if self.register.send(line).is_ok() {
            while let Ok(Go::Step) = orders.recv() {
                // Steps until nothing more runs here (what it sent the others waits for their turn).
                let (mut active, mut ended) = (false, false);
                while !ended {
                    let before = scheduled.get();
                    worker.step_or_park(Some(Duration::ZERO));
                    ended = !worker.has_dataflows();
                    if scheduled.get() == before {
                        break;
                    }
                    active = true;
                }
                if report.send(Stepped { active, ended }).is_err() || ended {
                    break;
                }
            }
        }
        for dataflow in worker.installed_dataflows() {
            worker.drop_dataflow(dataflow);
        }
    }
}

/// What the stepper is handed: the workers' lines, how many there are, the pools in order.
pub struct StepperJob {
    pub clock: Arc<VirtualClock>,
    /// Test switch `advance-clock-while-busy`: the clock moves after every pass.
    pub advance_while_busy: bool,
    lines: Receiver<WorkerLine>,
    pub workers: usize,
    pub pools: Vec<String>,
}

/// The run's lockstep (for every pool's job) and its stepper's job.
pub fn lockstep(clock: Arc<VirtualClock>, pools: &[(String, usize)]) -> (Lockstep, StepperJob) {
    let (register, lines) = channel();
    let job = StepperJob {
        clock: clock.clone(),
        advance_while_busy: false,
        lines,
        workers: pools.iter().map(|(_, ranks)| ranks).sum(),
        pools: pools.iter().map(|(name, _)| name.clone()).collect(),
    };
    (Lockstep { clock, register }, job)
}

/// Starts the stepper: it takes every worker's line, releases the workload and steps the run on
/// the virtual clock until every pool has ended; returns the `kv_usage` timeline. A run whose
/// How long a simulated run with nothing due and nothing running waits (wall time) for a pool's
/// end to reach the pools after it before it is called stalled.
const ENDING_GRACE: Duration = Duration::from_millis(250);

/// pools wait on nothing due stalls: `on_stall` hears why.
pub fn spawn_stepper(
    job: StepperJob,
    releases: SimReleases,
    gauges: PoolGauges,
    on_stall: Box<dyn FnOnce(String) + Send>,
) -> std::io::Result<std::thread::JoinHandle<Vec<serde_json::Value>>> {
    std::thread::Builder::new().name("kvflow-stepper".into()).spawn(move || {
        let StepperJob { clock, lines, workers, pools, advance_while_busy } = job;
        let _entered = clock.enter();
        let mut lines: Vec<WorkerLine> = lines.iter().take(workers).collect();
        let place = |l: &WorkerLine| (pools.iter().position(|p| *p == l.pool), l.index);
        lines.sort_by_key(place);
        let started = Instant::now();
        let (releaser, mut ends) = releases.start(&clock);
        let mut samples = KvSamples::default();
        let mut next_sample_ns = 0u64;
        let mut ended = vec![false; lines.len()];
        let mut quiet_since = None;
        // Each pool's workers, by their place in `lines`.
        let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            match spans.last_mut() {
                Some(span) if place(&lines[span.start]).0 == place(line).0 => span.end = i + 1,
                _ => spans.push(i..i + 1),
            }
        }
        loop {
            // A round: each pool in turn, its workers stepped until a pass over them is quiet (an
            // exchange between its ranks takes several passes, and the other pools need not step
            // through them); the instant is over when a whole round is quiet.
            let mut active = false;
            for span in &spans {
                loop {
                    let mut pool_active = false;
                    for i in span.clone() {
                        if ended[i] {
                            continue;
                        }
                        let line = &lines[i];
                        let step = line.go.send(Go::Step).ok().and_then(|_| line.stepped.recv().ok());
                        let step = step.unwrap_or(Stepped { active: false, ended: true });
                        pool_active |= step.active;
                        ended[i] = step.ended;
                    }
                    active |= pool_active;
                    if !pool_active || advance_while_busy {
                        break;
                    }
                }
            }
            if ended.iter().all(|e| *e) {
                break;
            }
            ends.on_completions(&releaser, &clock);
            if active {
                quiet_since = None;
            }
            if active && !advance_while_busy {
                continue;
            }
            // Nothing more happens at this instant: on to the next event.
            let Some(due) = clock.next_due_ns() else {
                if active {
                    continue;
                }
                // A pool that ended closes the pools after it from its joiner's thread: a
                // moment of wall time for that before the run is called stalled (the virtual
                // clock stands still meanwhile, so the run's figures do not depend on it).
                if quiet_since.get_or_insert_with(Instant::now).elapsed() < ENDING_GRACE {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                let mut waiting: Vec<&str> =
                    lines.iter().zip(&ended).filter(|(_, e)| !**e).map(|(l, _)| l.pool.as_str()).collect();
                waiting.dedup();
                for line in &lines {
                    let _ = line.go.send(Go::Abandon);
                }
                on_stall(format!(
                    "simulated run stalled at {:.3} ms of virtual time: nothing is due, and pool(s) {} have not ended",
                    clock.now_ms(),
                    waiting.join(", ")
                ));
                return Vec::new();
            };
            while next_sample_ns <= due {
                samples.take(next_sample_ns as f64 / 1e9, &gauges);
                next_sample_ns += samples.interval.as_nanos() as u64;
            }
            clock.fire_next();
        }
        let wall = started.elapsed().as_secs_f64();
        eprintln!(
            "simulated {} requests over {:.3} s of virtual time in {wall:.2} s of wall time ({:.0} requests per wall second, {} events)",
            releaser.total,
            clock.now_ms() / 1e3,
            releaser.total as f64 / wall.max(1e-9),
            clock.fired()
        );
        samples.json(&gauges)
    })
}
