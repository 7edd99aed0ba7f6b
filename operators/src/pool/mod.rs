//! One rank's loop: the operators (one per file in this folder: `admit.rs`, `schedule.rs`,
//! `align.rs`, `forward.rs`, `experts.rs`, `verify.rs`, `propose.rs`, `emit.rs`, `save.rs`,
//! `load.rs`, and the wake-ups they share in `wake.rs`) and the code that wires them into the
//! per-pool dataflow of DESIGN §4. [`build_pool_graph`] is the one place they are put together;
//! `kvflow run` builds it on every rank (timely worker) of every pool, and `kvflow check --dot`
//! draws what it builds.
//!
//! ```text
//! ingress ─▶ admit ─(wake, broadcast)─▶ schedule(t) ─▶ align(t) ─▶ forward(t) ─▶ verify(t) ─┬▶ emit(t) ─▶ sink
//!              ▲ ▲ └─ wake loop (t+1) ─┘     ▲        (broadcast)                           │ (sampled: held per step in flight)
//!              │ └── feedback: Launched / Waiting / Parked / Ended (t+1) ◀── propose(t) ◀───┘
//!              └── RankWaker (completions landing on this rank)
//! ```
//!
//! In order, per step `t` of a rank:
//! - `admit` takes new requests and cancellations from the pool's [`Ingress`] (rank 0) and the
//!   loop's feedback, and emits wakes; a wake loop at `t+1` keeps an idle rank's clock moving.
//! - `schedule(t)` turns the rank's queues into a step report (what it would run).
//! - `align(t)` broadcasts the reports so every rank agrees on one [`StepPlan`] (the router
//!   picks ranks there; `kv-aware` feeds its cache events to the routing index).
//! - `forward(t)` launches the step on the rank's executor; with `expert_parallel = true` it is
//!   followed per MoE layer ℓ by `dispatch[ℓ] ─(exchange)▶ experts[ℓ] ─(exchange)▶ combine[ℓ]`,
//!   then, with the MTP drafter, by the same three per draft pass (`dispatch[mtp.c]`), and the
//!   last `combine` feeds `verify(t)` (`crate::pool::experts`).
//! - `verify(t)` takes the step's completion: tokens kept, requests that ended. Its signals go
//!   back to `admit`/`schedule` through the feedback edge at `t+1`, through `propose(t)` (the
//!   drafter) in pools with `[speculative]`.
//! - `emit(t)` hands the requests that ended (and streamed tokens) to the pool's event sink
//!   (worker 0).
//! - With `[offload]`, `save(t)` takes `verify`'s *saved* output (jobs of completed steps) to the
//!   rank's save thread, and `load(t)` `forward`'s *loads* (jobs of requests admitted at `t`) to
//!   its load thread.

pub mod admit;
pub mod align;
pub mod emit;
pub mod experts;
pub mod forward;
pub mod load;
pub mod propose;
pub mod save;
pub mod schedule;
pub mod verify;
pub mod wake;

use self::admit::{admit, Ingress, Pending};
use self::align::{align, CacheEventRoute, Collectives, RoutingKeys};
use self::emit::{emit, EventSink};
use self::experts::{moe_layer, MoeLayer};
use self::forward::forward;
use self::load::load;
use self::propose::propose;
use self::save::save;
use self::schedule::schedule;
use self::verify::verify;
use self::wake::RankWaker;
use crate::messages::{Event, LoopSignal, StepPlan};
use crate::policy::router::Router;
use crate::rank::{Rank, TestSwitches};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use timely::dataflow::operators::vec::Map;
use timely::dataflow::operators::{ConnectLoop, Feedback};
use timely::dataflow::{Scope, StreamVec};

/// The operators of one rank's pool graph and what they share.
pub struct PoolParts {
    pub rank: Rc<RefCell<Rank>>,
    pub waker: Arc<RankWaker>,
    /// Rank 0 (of the process that drives the workload) only.
    pub ingress: Option<Arc<Ingress>>,
    pub router: Box<dyn Router>,
    pub keys: RoutingKeys,
    /// The MoE layers that exchange (expert parallelism) and the spec width.
    pub collectives: Collectives,
    /// Whether its ranks use an offload store (`save` and `load` operators after `forward`).
    pub offload: bool,
    pub ranks: usize,
    /// Worker 0 only.
    pub sink: Option<Box<dyn EventSink>>,
    /// Router `kv-aware`: the order of the ranks' cache events (every worker), and the routing
    /// index they go into (worker 0 of the process driving the pool).
    pub cache_events: Option<CacheEventRoute>,
    pub switches: TestSwitches,
}

/// Streams of a built pool graph that more operators may consume.
pub struct PoolStreams<'scope> {
    pub plans: StreamVec<'scope, u64, StepPlan>,
    /// Requests that ended, each at the step whose completion ended it.
    pub sampled: StreamVec<'scope, u64, Event>,
}

/// Builds the per-pool graph of DESIGN §4 on one rank. The same function builds what runs and
/// what `kvflow check --dot` draws.
pub fn build_pool_graph(scope: Scope<'_, u64>, parts: PoolParts) -> PoolStreams<'_> {
    let PoolParts { rank, waker, ingress, router, keys, collectives, offload, ranks, sink, cache_events, switches } =
        parts;
    let index = rank.borrow().index;
    let hold = |op: &str| switches.hold_at(op, index);
    let pending: Pending = Rc::new(RefCell::new(Default::default()));
    let (signal_loop, feedback) = scope.feedback::<Vec<LoopSignal>>(1);
    let (wake_loop, woken) = scope.feedback::<Vec<u64>>(1);
    let wakes = admit(feedback.clone(), woken, ingress, pending.clone(), waker, hold("admit"));
    wakes.clone().connect_loop(wake_loop);
    let reports = schedule(feedback, wakes, rank.clone(), pending, hold("schedule"));
    let plans = align(
        reports,
        ranks,
        router,
        keys,
        collectives.clone(),
        cache_events,
        hold("align"),
        switches.align_without_waiting,
    );
    let expert_parallel = !collectives.moe_layers.is_empty();
    let out = forward(plans.clone(), rank.clone(), expert_parallel, hold("forward"));
    let launched = if expert_parallel {
        // forward(t), then dispatch → experts → combine per MoE layer, then per draft pass of
        // the MTP drafter, the last to verify.
        let mut stages = out.stages;
        let count = collectives.moe_layers.len();
        let passes = (0..collectives.draft_passes).map(|c| (count + c, collectives.mtp_layer, Some(c)));
        let layers = collectives.moe_layers.iter().enumerate().map(|(moe, &layer)| (moe, layer, None));
        for (moe, layer, draft_pass) in layers.chain(passes) {
            let at = MoeLayer { moe, layer, draft_pass };
            stages = moe_layer(stages, rank.clone(), at, switches.exchange_switches(index, moe));
        }
        stages.map(|token| token.signal)
    } else {
        out.signals
    };
    let verified = verify(launched, rank.clone(), hold("verify"));
    if rank.borrow().scheduler.config.spec.is_some() {
        propose(verified.signals, rank.clone(), hold("propose")).connect_loop(signal_loop);
    } else {
        verified.signals.connect_loop(signal_loop);
    }
    emit(verified.sampled.clone(), sink);
    if offload {
        save(verified.saved, rank.clone());
        load(out.loads, rank);
    }
    PoolStreams { plans, sampled: verified.sampled }
}
