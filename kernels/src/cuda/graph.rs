//! Steps replayed from CUDA graphs. A step's host side (a few hundred launches, each with its
//! grid, scalars and scratch sizes) follows from its [`StepShape`] alone: the rows themselves
//! are read on the device. So the launches of a shape are captured once into a graph — its
//! scratch allocations become the graph's own memory, its rows are read from a buffer the graph
//! owns — and every later step of that shape copies its packed rows into that buffer and
//! replays the graph: one launch instead of hundreds. Decode steps repeat their shape for
//! `KEY_SPLIT` tokens of context at a time, so nearly all of them replay.
//!
//! A decode or verification shape (every row samples; the executor pads them to few shapes) is
//! captured when first seen; any other on its second step (a shape seen once, as a prefill's
//! mostly is, is not worth a capture). Steps that move handoffs, models with DeepSeek-V3.2's indexer (its score
//! rows are as wide as the step's longest row, not a function of the key parts), and steps while
//! launches are being timed are launched directly. The rows' tables go last in the packed rows
//! (`StepRows::parts`), so a graph holds room for more tables than its first step had and is
//! captured again only when a step's tables outgrow it.
//!
//! Emulated (no GPU), a capture records the launches, zeroings and device copies instead of
//! running them, and keeps the scratch memory they name; a replay runs the record. CI thus runs
//! the same capture-and-replay path a GPU does.
//!
//! Which time it holds: none of its own (a rank's executor calls it while enqueuing a step).
//! Which guarantee it carries: none of DESIGN §5; a replayed step computes the bits a launched
//! one does (`cuda_emulated` tests compare them), and what it reads stays owned by the step's
//! record as before (the rows' pinned copy), while the graph's rows and results buffers are
//! reused only in stream order.

use super::error::CudaError;
use super::gpu::{Backend, DeviceBuf, Gpu, PinnedBuf};
use super::host_capture::{HostCapture, HostOp};
use super::kv::DeviceKv;
use super::model::DeviceModel;
use super::rows::{StepRows, StepShape, RESULT_WORDS};
use super::state::DeviceState;
use cudarc::driver::sys;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

/// Graphs one executor keeps (each holds its launches and a reservation of its scratch); the
/// least recently replayed goes first.
const KEPT: usize = 64;

/// Shapes remembered as seen once (then forgotten all at once: prefill shapes rarely repeat).
const SEEN_AT_MOST: usize = 4096;

/// Work captured from the rank's stream, replayed on it.
pub struct StepGraph(Recorded);

enum Recorded {
    Cuda(cudarc::driver::CudaGraph),
    Host(HostCapture),
}

impl Gpu {
    /// Captures what `enqueue` enqueues on the rank's stream (launches, stream-ordered
    /// allocations and frees, device copies) into a graph, without running it.
    pub fn capture(&self, enqueue: impl FnOnce() -> Result<(), CudaError>) -> Result<StepGraph, CudaError> {
        let driver = |what: &str, e: cudarc::driver::DriverError| CudaError::Driver {
            gpu: self.ordinal,
            what: what.to_string(),
            message: format!("{e:?}"),
        };
        match &self.backend {
            Backend::Cuda { stream, .. } => {
                let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
                stream.begin_capture(mode).map_err(|e| driver("starting a step capture", e))?;
                let enqueued = enqueue();
                // the capture always ends, so the stream is usable whatever `enqueue` did
                let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
                enqueued?;
                match graph.map_err(|e| driver("capturing a step", e))? {
                    Some(graph) => Ok(StepGraph(Recorded::Cuda(graph))),
                    None => Err(CudaError::Unsupported("a step capture recorded nothing".into())),
                }
            }
            Backend::Host(_) => {
                *self.host_capture.lock() = Some(HostCapture::default());
                let enqueued = enqueue();
                let capture = self.host_capture.lock().take();
                enqueued?;
                Ok(StepGraph(Recorded::Host(capture.unwrap_or_default())))
            }
        }
    }

    /// Enqueues a captured graph on the rank's stream (never waits).
    pub fn replay(&self, graph: &StepGraph) -> Result<(), CudaError> {
        match &graph.0 {
            Recorded::Cuda(g) => g.launch().map_err(|e| CudaError::Driver {
                gpu: self.ordinal,
                what: "launching a captured step".into(),
                message: format!("{e:?}"),
            }),
            Recorded::Host(capture) => {
                for op in &capture.ops {
                    match op {
                        HostOp::Launch { name, grid, block, smem, args } => {
                            self.launch(name, *grid, *block, *smem, args)?
                        }
                        // SAFETY: memory the capture owns, `bytes` long.
                        HostOp::Zero { ptr, bytes } => unsafe { std::ptr::write_bytes(*ptr as *mut u8, 0, *bytes) },
                        HostOp::Copy { dst, src, bytes } => self.copy_on_device(*dst, *src, *bytes)?,
                    }
                }
                Ok(())
            }
        }
    }
}

/// What a step's graph is captured for: its shape, with the context length reduced to the
/// attention's key parts (all a model without the indexer reads of it on the host).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub rows: usize,
    pub seqs: usize,
    pub sampled: usize,
    pub key_parts: usize,
    pub drawn: bool,
}

impl GraphKey {
    fn of(shape: StepShape) -> GraphKey {
        let (rows, seqs, sampled, drawn) = (shape.rows, shape.seqs, shape.sampled, shape.drawn);
        GraphKey { rows, seqs, sampled, key_parts: shape.key_parts(), drawn }
    }
}

/// One shape's graph and the buffers it reads its rows from and writes its results to.
struct Captured {
    graph: StepGraph,
    rows: DeviceBuf<u32>,
    /// Words of tables `rows` has room for.
    table_room: usize,
    results: DeviceBuf<u32>,
    /// Every row's final-normed hidden state (for the MTP drafter), when kept.
    hidden: Option<DeviceBuf<f32>>,
    last_replayed: u64,
}

/// Every rank's [`GraphCounts`] in this process, summed (captured, replayed, launched): what a
/// bench that runs a whole graph reads ([`process_graph_counts`]).
static PROCESS_COUNTS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// How every rank of this process offered steps to its graphs so far.
pub fn process_graph_counts() -> GraphCounts {
    let [captured, replayed, launched] = PROCESS_COUNTS.each_ref().map(|c| c.load(Ordering::Relaxed));
    GraphCounts { captured, replayed, launched }
}

/// How the steps offered to [`StepGraphs::enqueue`] went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCounts {
    pub captured: u64,
    pub replayed: u64,
    /// Offered and launched directly (first of their shape, indexer model, profiling).
    pub launched: u64,
}

/// A rank's captured steps, by shape.
#[derive(Default)]
pub struct StepGraphs {
    captured: HashMap<GraphKey, Captured>,
    /// Captured steps also write every row's final-normed hidden state (the MTP drafter reads it).
    pub keep_hidden: bool,
    seen: HashSet<GraphKey>,
    steps: u64,
    pub counts: GraphCounts,
}

impl StepGraphs {
    /// Enqueues a step through its shape's graph: `packed` holds `rows` as [`StepRows::pack`]
    /// packs them (any base). Returns the device address the step's results are written to (and
    /// with `keep_hidden` its hidden states, valid until the shape's next replay), or `None`:
    /// enqueue this step directly.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue(
        &mut self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        rows: &StepRows,
        packed: &PinnedBuf<u32>,
        ring: u64,
    ) -> Result<Option<(u64, u64)>, CudaError> {
        let shape = rows.shape();
        let key = GraphKey::of(shape);
        self.steps += 1;
        if self.seen.len() >= SEEN_AT_MOST {
            self.seen.clear();
        }
        // a decode or verification shape (every row samples) recurs: captured when first seen
        let first_sight = shape.rows != shape.sampled && self.seen.insert(key);
        if shape.rows == 0 || shape.sampled == 0 || model.has_indexer() || gpu.is_profiling() || first_sight {
            self.counts.launched += 1;
            PROCESS_COUNTS[2].fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        let tables = rows.words() - rows.words_before_tables();
        if self.captured.get(&key).is_none_or(|c| c.table_room < tables) {
            self.captured.remove(&key);
            if self.captured.len() >= KEPT {
                let oldest = self.captured.iter().min_by_key(|(_, c)| c.last_replayed).map(|(k, _)| *k);
                self.captured.remove(&oldest.expect("a kept graph"));
            }
            let captured = Self::capture(gpu, model, kv, state, rows, ring, self.keep_hidden)?;
            self.captured.insert(key, captured);
            self.counts.captured += 1;
            PROCESS_COUNTS[0].fetch_add(1, Ordering::Relaxed);
        }
        let c = self.captured.get_mut(&key).expect("captured above");
        c.last_replayed = self.steps;
        gpu.copy_to_device(c.rows.ptr(), packed, rows.words())?;
        gpu.replay(&c.graph)?;
        self.counts.replayed += 1;
        PROCESS_COUNTS[1].fetch_add(1, Ordering::Relaxed);
        Ok(Some((c.results.ptr(), c.hidden.as_ref().map_or(0, DeviceBuf::ptr))))
    }

    /// Captures `rows`' shape: its rows buffer has room for twice these tables.
    fn capture(
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        rows: &StepRows,
        ring: u64,
        keep_hidden: bool,
    ) -> Result<Captured, CudaError> {
        let table_room = (2 * (rows.words() - rows.words_before_tables())).max(64);
        let buffer = gpu.zeros::<u32>(rows.words_before_tables() + table_room)?;
        let results = gpu.zeros::<u32>(rows.sampled() * RESULT_WORDS)?;
        let hidden = keep_hidden.then(|| gpu.zeros::<f32>(rows.rows() * model.hidden)).transpose()?;
        let hidden_out = hidden.as_ref().map_or(0, DeviceBuf::ptr);
        // only the addresses matter here: each step copies its own rows in before the replay
        let at = rows.pack(&mut vec![0; rows.words()], buffer.ptr());
        let graph = gpu.capture(|| {
            model
                .enqueue_shaped(gpu, kv, state, rows.shape(), at, ring, results.ptr(), hidden_out, false, None)
                .map(|_| ())
        })?;
        Ok(Captured { graph, rows: buffer, table_room, results, hidden, last_replayed: 0 })
    }
}
