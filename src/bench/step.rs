//! `kvflow bench step`: what coordination costs per step.
//!
//! 1. `policy_us_per_step`: the CPU time of the scheduling policy and of `StepPlan` derivation,
//!    summed over `R` ranks each holding `S` running (decoding) sequences, measured on one thread
//!    with that thread's CPU clock (time the thread was not running does not count).
//! 2. The wall time per step of the real `R`-rank pool (every operator, exchange and the parking
//!    of workers) with an executor that does no math, beside a bare timely loop with the same
//!    number of frontier-waited exchanges per step (one all-to-all) on the same `R` workers,
//!    measured in the same run, alternating. Last line `round_ratio=<pool over bare>`.
//!
//! Every figure is the least of several runs (noise on a shared machine only adds time).
//!
//! Both are first measured with completions delayed by one launch (each decode names the token
//! still in flight; the `null` executor with `delay_steps = 1`), printed as `deferred_…` figures
//! beside the same baselines; the synchronous figures come last.

use crate::graph::PoolChoice;
use crate::runtime::collector::{spawn_collector_thread, Collector, CollectorSink};
use crate::runtime::driver::{spawn_driver, DriverJob, EntryPool, Placement};
use crate::runtime::pool::{start_pool, PoolJob};
use crate::trace::Request;
use crate::workload::{ArrivalMode, Selection};
use anyhow::{bail, Result};
use kvflow_kernels::checkpoint::ModelSpec;
use kvflow_kernels::models;
use kvflow_operators::executor::ExecutorRegistry;
use kvflow_operators::messages::RankReport;
use kvflow_operators::policy::memory::{MemoryLayout, RankMemory};
use kvflow_operators::policy::router::{RouterContext, RouterRegistry};
use kvflow_operators::policy::scheduler::{AdmissionPolicy, Scheduler, SchedulerConfig, StepDecision};
use kvflow_operators::policy::sequence::{Sequence, Sequences};
use kvflow_operators::pool::admit::Ingress;
use kvflow_operators::pool::align::{derive_plan, Collectives, RoutingKeys};
use kvflow_operators::rank::StepTimes;
use kvflow_operators::rank::TestSwitches;
use std::sync::Arc;

pub struct StepBenchArgs {
    pub ranks: usize,
    pub seqs: usize,
    pub steps: usize,
}

const SPEC: &str = r#"
model_type = "llama"
seed = 1
vocab_size = 64
hidden_size = 16
intermediate_size = 16
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
"#;

fn scheduler_config(seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_running: seqs,
        max_batched_tokens: seqs.max(64),
        chunk_tokens: 64,
        prefix_cache: true,
        snapshot_interval_blocks: 4,
        admission: AdmissionPolicy::Optimistic,
        spec: None,
    }
}

/// Policy CPU time per step, summed over ranks (µs). With `delay` > 0, each step's sampled tokens
/// become known only `delay` steps later (the decodes in between name them in flight).
fn policy_us_per_step(ranks: usize, seqs: usize, steps: usize, delay: u64) -> f64 {
    let block_size = 16;
    let context = 512;
    let blocks = seqs * (context + steps + 16).div_ceil(block_size);
    let layout = MemoryLayout::kv_only(block_size, blocks);
    let mut rank_state: Vec<(Scheduler, Sequences, RankMemory)> = (0..ranks)
        .map(|r| {
            let mut mem = RankMemory::new(layout);
            let mut scheduler = Scheduler::new(scheduler_config(seqs));
            let mut sequences = Sequences::default();
            for i in 0..seqs {
                // A decoding sequence: its prompt computed, one token sampled and not yet fed.
                let mut seq = Sequence::new((r * seqs + i) as u64, vec![1; context], steps + 8, false);
                seq.tokens.push(2);
                seq.computed = context;
                assert!(mem.ensure_blocks(&mut seq, context));
                let index = sequences.insert(seq);
                scheduler.enqueue(index);
            }
            (scheduler, sequences, mem)
        })
        .collect();
    // Admit everyone (one step: the prefix cache holds nothing yet), then measure steady decoding.
    for (s, q, m) in rank_state.iter_mut() {
        let d = s.schedule(q, m, 0);
        assert_eq!(d.chunks.len(), seqs);
        for c in &d.chunks {
            let seq = q.get_mut(c.seq);
            seq.pending.pop(0);
            seq.tokens.push(3);
        }
    }
    let mut router = (RouterRegistry::default().get("least-outstanding").expect("built in"))(RouterContext {
        ranks,
        max_batched_tokens: seqs,
        block_size: 16,
        blocks_per_rank: layout.blocks,
    });
    let keys = RoutingKeys { block_size, keyed_by_prompt_len: false };
    // Each rank decides into the same buffers every step, as `Rank` does.
    let mut decisions: Vec<StepDecision> = (0..ranks).map(|_| StepDecision::default()).collect();
    let started = thread_cpu_s();
    for step in 1..=steps as u64 {
        let mut reports = Vec::with_capacity(ranks);
        for (r, ((s, q, m), d)) in rank_state.iter_mut().zip(&mut decisions).enumerate() {
            s.schedule_into(q, m, step, d);
            // What a completion does to the policy's state: the token sampled `delay` steps ago
            // arrives (with delay 0, the one this step sampled).
            for c in &d.chunks {
                let seq = q.get_mut(c.seq);
                if step > delay && seq.pending.pop(step - delay) {
                    seq.tokens.push(3);
                }
            }
            reports.push(RankReport {
                rank: r,
                scheduled_tokens: d.chunks.len(),
                scheduled_seqs: d.chunks.len(),
                outstanding_tokens: 0,
                waiting: s.num_waiting(),
                running: s.num_running(),
                in_flight: delay as usize,
                admissions: Vec::new(),
                cancels: Vec::new(),
                closing: false,
                capacity: None,
                cache_events: Vec::new(),
                cache_snapshot: None,
            });
        }
        std::hint::black_box(derive_plan(0, reports, router.as_mut(), keys, &Collectives::default()));
    }
    (thread_cpu_s() - started) * 1e6 / steps as f64
}

/// CPU time the calling thread has used, in seconds.
fn thread_cpu_s() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to fill in; the clock id is a constant.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0;
    if ok {
        t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
    } else {
        0.0
    }
}

/// Mean gap between the step times of the middle of a run (the first and last
/// `STEADY_SKIP` steps, start-up and the final drain, are left out; `StepTimes` keeps just
/// those it needs).
fn steady_ms_per_step(times: &StepTimes) -> Result<f64> {
    times.steady_ms_per_step().ok_or_else(|| anyhow::anyhow!("the loop took no step"))
}

/// Wall time per step of a bare timely loop: `steps` steps of one frontier-waited all-to-all.
fn bare_loop_ms_per_step(ranks: usize, steps: usize) -> Result<f64> {
    use std::collections::BTreeMap;
    use timely::dataflow::channels::pact::Pipeline;
    use timely::dataflow::operators::generic::operator::Operator;
    use timely::dataflow::operators::vec::Broadcast;
    use timely::dataflow::operators::{Capability, Concat, ConnectLoop, Feedback, ToStream};
    let steps = steps as u64;
    let times = Arc::new(parking_lot::Mutex::new(StepTimes::default()));
    let times_in = times.clone();
    let guards = timely::execute(timely::Config::process(ranks), move |worker| {
        let index = worker.index() as u64;
        let times = times_in.clone();
        worker.dataflow::<u64, _, _>(|scope| {
            let (handle, cycle) = scope.feedback::<Vec<u64>>(1);
            vec![index]
                .to_stream(scope)
                .container::<Vec<u64>>()
                .concat(cycle)
                .broadcast()
                .unary_frontier::<timely::container::CapacityContainerBuilder<Vec<u64>>, _, _, _>(
                    Pipeline,
                    "aligned",
                    move |_cap, _| {
                        let mut stash: BTreeMap<u64, Capability<u64>> = BTreeMap::new();
                        move |(input, frontier), output| {
                            input.for_each_stamp(|stamp, data| {
                                data.for_each(|d| d.clear());
                                if let Some(cap) = stamp.retain_least(output.output_index()) {
                                    stash.entry(*cap.time()).or_insert(cap);
                                }
                            });
                            while let Some((&t, _)) = stash.first_key_value() {
                                if frontier.frontier().less_equal(&t) {
                                    break;
                                }
                                let cap = stash.remove(&t).expect("first");
                                if index == 0 {
                                    times.lock().record(kvflow_operators::messages::wall_ms());
                                }
                                if t + 1 < steps {
                                    output.session(&cap).give(index);
                                }
                            }
                        }
                    },
                )
                .connect_loop(handle);
        });
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    guards.join();
    let times = times.lock().clone();
    steady_ms_per_step(&times)
}

/// Wall time per step of the real pool with the no-math executor completing `delay` launches
/// late (ms), and its step count.
fn pool_ms_per_step(ranks: usize, seqs: usize, outputs: usize, delay: u64) -> Result<(f64, u64)> {
    let spec = ModelSpec::parse("<bench step model>".into(), SPEC)?;
    let model = Arc::new(models::build(&spec.config, &spec.weights)?);
    let mut settings = toml::Table::new();
    settings.insert("delay_steps".into(), toml::Value::Integer(delay as i64));
    pool_run(PoolRun { ranks, seqs, outputs, model, executor: "null", settings, experts: None })
}

/// The engine's host time a step (seconds) of a one-rank pool batching `rows` decoding
/// requests, with the no-math executor completing one launch late as a deferred GPU rank does:
/// the least of a few runs (`kvflow bench calibrate`'s host figures).
pub(crate) fn engine_seconds_per_step(rows: usize) -> Result<f64> {
    let runs = (0..3).map(|_| pool_ms_per_step(1, rows, 200, 1).map(|(ms, _)| ms / 1e3));
    Ok(least(runs.collect::<Result<Vec<_>>>()?))
}

/// One bench pool: `ranks` ranks of `seqs` decoding requests of `outputs` tokens each.
pub(crate) struct PoolRun {
    pub ranks: usize,
    pub seqs: usize,
    pub outputs: usize,
    pub model: Arc<models::Model>,
    pub executor: &'static str,
    pub settings: toml::Table,
    pub experts: Option<crate::runtime::ExpertParallelJob>,
}

/// Wall time per step of a bench pool (ms, steady state) and its step count.
pub(crate) fn pool_run(run: PoolRun) -> Result<(f64, u64)> {
    let PoolRun { ranks, seqs, outputs, model, executor, settings: executor_settings, experts } = run;
    let block_size = 16;
    let layout = MemoryLayout {
        block_size,
        blocks: seqs * (outputs + 2).div_ceil(block_size) + 16,
        slots: 0,
        snapshots: 0,
        keeps_kv: true,
        keeps_state: false,
        prefix_keyed_by_prompt_len: false,
        verify_rows: 0,
    };
    let requests: Vec<Request> = (0..ranks * seqs)
        .map(|i| Request {
            id: i as u64,
            arrival_ms: 0.0,
            prompt: vec![(i % 64) as u32],
            max_output_tokens: outputs,
            trace_line: i + 1,
            sampling: None,
        })
        .collect();
    let n = requests.len();
    let selection = Selection { requests, warmup: 0, measured: n, note: None };
    let (tx, rx) = std::sync::mpsc::channel();
    let collector = Collector::new(n, tx, false);
    let (batches, collector_thread) = spawn_collector_thread(collector.clone())?;
    let starting = Arc::new(crate::runtime::starting::Starting::default());
    starting.expect(ranks);
    let job = PoolJob {
        handoff: Default::default(),
        routing_index: false,
        links_here: None,
        gauges: Vec::new(),
        starting: Some(starting.clone()),
        lockstep: None,
        log_steps: false,
        name: "bench".into(),
        ranks,
        model,
        layout,
        scheduler: scheduler_config(seqs),
        router: RouterRegistry::default().get("least-outstanding").expect("built in"),
        executor: ExecutorRegistry::default().get(executor).expect("built in"),
        executor_settings,
        cluster: None,
        switches: TestSwitches::default(),
        experts,
        offload: None,
    };
    let ingress = Arc::new(Ingress::default());
    let sink = CollectorSink { pool: "bench".into(), batches };
    let pool = start_pool(job, Some(ingress.clone()), Some(Box::new(sink)), None)?;
    let driver = spawn_driver(DriverJob {
        pools: vec![EntryPool { name: "bench".into(), ingress, kind: Default::default(), also_cancel: Vec::new() }],
        starting,
        placement: Placement { choice: PoolChoice::Seeded, seed: 0 },
        selection,
        mode: ArrivalMode::Concurrency(n),
        collector,
        completions: rx,
        cancel: Default::default(),
        interrupted: Default::default(),
        grace: std::time::Duration::from_secs(1),
        max_context: None,
        sampling: Default::default(),
    })?;
    let result = pool.join();
    let _ = collector_thread.join();
    let _ = driver.join();
    let mut rank0 = None;
    for r in result.ranks {
        match r {
            Ok(s) => {
                rank0.get_or_insert(s);
            }
            Err(e) => bail!("{e}"),
        }
    }
    let stats = rank0.ok_or_else(|| anyhow::anyhow!("the pool reported no rank"))?;
    Ok((steady_ms_per_step(&stats.step_times)?, stats.steps))
}

/// Pool figures at one delay: (pool ms per step, bare ms per step, pool steps), per run.
fn measure(r: usize, s: usize, steps: usize, delay: u64) -> Result<(Vec<f64>, Vec<f64>, u64)> {
    // Pool and bare loop alternate, three runs each, so both see the same machine.
    let (mut pools, mut bares, mut n) = (Vec::new(), Vec::new(), 0);
    for _ in 0..RUNS {
        let (pool, steps_run) = pool_ms_per_step(r, s, steps, delay)?;
        n = steps_run;
        pools.push(pool);
        bares.push(bare_loop_ms_per_step(r, steps_run as usize)?);
    }
    Ok((pools, bares, n))
}

/// Runs of each measurement. Each figure is the least over its runs: on a shared machine noise
/// only ever adds time, so the least run is the closest to what the work itself costs. (A policy
/// run is 200 steps on one thread, a few milliseconds: it gets more runs.)
const RUNS: usize = 5;
const POLICY_RUNS: usize = 15;

fn least(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

pub fn run(args: &StepBenchArgs) -> Result<()> {
    if args.ranks == 0 || args.seqs == 0 || args.steps < 2 {
        bail!("--ranks and --seqs must be positive, --steps at least 2");
    }
    // Each sequence holds a 512-token context: bound what the bench allocates up front.
    const MAX_SEQUENCES: usize = 1 << 16;
    if args.ranks > 1024 || args.ranks.saturating_mul(args.seqs) > MAX_SEQUENCES || args.steps > 100_000 {
        bail!(
            "--ranks {} × --seqs {} (--steps {}): at most 1024 ranks, {MAX_SEQUENCES} sequences in all and 100000 \
             steps",
            args.ranks,
            args.seqs,
            args.steps
        );
    }
    let (r, s) = (args.ranks, args.seqs);
    println!(
        "ranks        {r}, {s} running sequences each, {} cores here",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    // The policy figures first, on a fresh heap (the pool runs leave it fragmented).
    let policies = [1, 0].map(|delay| least((0..POLICY_RUNS).map(|_| policy_us_per_step(r, s, 200, delay)).collect()));
    let (pools, bares, steps) = measure(r, s, args.steps, 1)?;
    let policy = policies[0];
    let (pool, bare) = (least(pools.clone()), least(bares.clone()));
    println!("deferred     completions one launch late: scheduling + StepPlan {policy:.1} µs per step; pool {pool:.3} ms per step over {steps} steps (runs {pools:.3?}), bare loop {bare:.3} ms (runs {bares:.3?})");
    println!("deferred_scheduling_us={policy:.1}");
    println!("deferred_pool_over_bare={:.3}", pool / bare);
    let (pools, bares, steps) = measure(r, s, args.steps, 0)?;
    let policy = policies[1];
    let (pool, bare) = (least(pools.clone()), least(bares.clone()));
    println!("policy       scheduling + StepPlan, summed over ranks: {policy:.1} µs CPU per step (least of {POLICY_RUNS} runs of 200 steps)");
    println!(
        "pool         {steps} steps, no-math executor: {pool:.3} ms per step (steady state, least of runs {pools:.3?})"
    );
    println!("bare loop    {steps} steps, one frontier-waited all-to-all: {bare:.3} ms per step (steady state, least of runs {bares:.3?})");
    println!("policy_us_per_step={policy:.1}");
    println!("round_ratio={:.3}", pool / bare);
    Ok(())
}
