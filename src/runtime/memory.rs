//! Sizing a rank's memory from its byte budget (DESIGN §7): state slots for every running request
//! (families with recurrent state), a share of the budget for prefix snapshots, and the rest as
//! paged KV blocks for the model at hand.

use crate::graph::{MemoryConfig, SchedulerConfig};
use anyhow::{bail, Result};
use kvflow_kernels::models::{Family, Model};
use kvflow_operators::policy::memory::MemoryLayout;

/// The layout of one rank's budget. `largest_request` is the most tokens (prompt + output) one
/// request of the workload needs; the budget must hold at least that. `verifies`: the pool
/// verifies drafts (with `[speculative]`, not a prefill pool), so each state slot also keeps the
/// state after every position a verification feeds.
pub fn plan_memory(
    model: &Model,
    mem: &MemoryConfig,
    sched: &SchedulerConfig,
    largest_request: usize,
    verifies: bool,
) -> Result<MemoryLayout> {
    let budget = mem.budget_bytes as usize;
    let state_bytes = model.state_bytes_per_slot();
    let block_bytes = model.kv_bytes_per_block(mem.block_size);
    let keeps_state = model.needs_slots();
    let keeps_kv = model.needs_blocks();
    let slots = if keeps_state { sched.max_running } else { 0 };
    let verify_rows = match sched.spec {
        Some(spec) if verifies && keeps_state => spec.draft_tokens + 1,
        _ => 0,
    };
    let slot_bytes = slots * state_bytes * (1 + verify_rows);
    if slot_bytes > budget {
        bail!(
            "memory.budget_bytes: {budget} bytes per rank cannot hold the state slots of scheduler.max_running = {} \
             requests ({state_bytes} bytes each for this {} model, {} per request with the {verify_rows} states a \
             verification keeps)",
            sched.max_running,
            model.family,
            state_bytes * (1 + verify_rows)
        );
    }
    let snapshots = if keeps_state && sched.prefix_cache && state_bytes > 0 {
        ((budget as f64 * mem.snapshot_fraction) as usize).min(budget - slot_bytes) / state_bytes
    } else {
        0
    };
    let kv_bytes = budget - slot_bytes - snapshots * state_bytes;
    let blocks = if keeps_kv { kv_bytes / block_bytes.max(1) } else { 0 };
    let needed = if keeps_kv { largest_request.div_ceil(mem.block_size) } else { 0 };
    if keeps_kv && blocks < needed.max(1) {
        bail!(
            "memory.budget_bytes: {budget} bytes per rank leave {kv_bytes} for paged KV, {blocks} blocks of {} tokens \
             ({block_bytes} bytes each), but the largest request needs {needed} blocks ({largest_request} tokens)",
            mem.block_size
        );
    }
    Ok(MemoryLayout {
        block_size: mem.block_size,
        blocks,
        slots,
        snapshots,
        keeps_kv,
        keeps_state,
        prefix_keyed_by_prompt_len: model.family == Family::SparseMla,
        verify_rows,
    })
}
