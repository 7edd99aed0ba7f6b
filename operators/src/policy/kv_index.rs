//! The KV-aware routing index (the control plane; issue "KV-aware router"): which rank, in which
//! tier, holds how much of a request's prefix. Every rank's prefix cache (and the offload tier)
//! publishes stored/removed block events numbered per rank ([`CacheEvents`]); the index applies
//! them in order, and a consumer that sees a gap in a rank's numbering asks that rank for a
//! snapshot of its index and resumes from it (the resync contract of vLLM's and Dynamo's KV
//! events): [`KvIndex::apply`] reports the gap, [`KvIndex::resync`] takes the snapshot. The
//! events travel in the ranks' step reports, so they cross processes with them; [`EventOrder`],
//! kept by every rank's `align`, sees a gap the same way everywhere, and the plan asks the rank
//! for its snapshot.
//!
//! The index is a differential-dataflow computation on a thread of its own, never on a pool's
//! step path: a collection of `(block hash, (rank, tier))` maintained from the events and
//! arranged once, joined against each query's chained block hashes `(hash, (query, position))`,
//! then reduced per `(query, rank, tier)` to the longest run of positions 0, 1, 2, … present:
//! the cached prefix in blocks (a block whose parent was evicted does not extend it).
//!
//! Which time it holds: its own (one timestamp per batch of commands, on its thread). Which
//! guarantee it carries: none of DESIGN §5; its answers equal a scan of every rank's cache at
//! the same point of the event streams (`tests`), and a dropped event is detected by its rank's
//! numbering and repaired by resync.

use differential_dataflow::input::Input;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::mpsc;

/// Where a cached block sits: 0 the rank's device (KV memory), 1 and up the offload tier's levels.
pub type Tier = u8;
pub const DEVICE: Tier = 0;
pub const OFFLOAD: Tier = 1;

/// A change to one rank's cache, numbered from 1 per rank.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheEvent {
    pub rank: u32,
    pub seq: u64,
    pub change: CacheChange,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CacheChange {
    Stored { tier: Tier, hashes: Vec<u64> },
    Removed { tier: Tier, hashes: Vec<u64> },
}

/// A rank's whole index as of its event `seq` (what a consumer resumes from after a gap).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheSnapshot {
    pub rank: u32,
    pub seq: u64,
    pub blocks: Vec<(Tier, u64)>,
}

/// The publishing side of one rank: numbers its changes and keeps what it holds, to answer a
/// snapshot request. (The prefix cache and the offload tier report into it.)
#[derive(Debug, Default)]
pub struct CacheEvents {
    rank: u32,
    seq: u64,
    held: HashSet<(Tier, u64)>,
}

impl CacheEvents {
    pub fn new(rank: u32) -> Self {
        CacheEvents { rank, ..Default::default() }
    }

    /// Blocks newly held in `tier` (those already held are left out); `None` when none are new.
    pub fn stored(&mut self, tier: Tier, hashes: &[u64]) -> Option<CacheEvent> {
        let new: Vec<u64> = hashes.iter().copied().filter(|&h| self.held.insert((tier, h))).collect();
        self.event(CacheChange::Stored { tier, hashes: new })
    }

    /// Blocks no longer held in `tier` (those not held are left out).
    pub fn removed(&mut self, tier: Tier, hashes: &[u64]) -> Option<CacheEvent> {
        let gone: Vec<u64> = hashes.iter().copied().filter(|&h| self.held.remove(&(tier, h))).collect();
        self.event(CacheChange::Removed { tier, hashes: gone })
    }

    fn event(&mut self, change: CacheChange) -> Option<CacheEvent> {
        let (CacheChange::Stored { hashes, .. } | CacheChange::Removed { hashes, .. }) = &change;
        if hashes.is_empty() {
            return None;
        }
        self.seq += 1;
        Some(CacheEvent { rank: self.rank, seq: self.seq, change })
    }

    /// Everything held now, as of the latest event.
    pub fn snapshot(&self) -> CacheSnapshot {
        let mut blocks: Vec<(Tier, u64)> = self.held.iter().copied().collect();
        blocks.sort_unstable();
        CacheSnapshot { rank: self.rank, seq: self.seq, blocks }
    }

    /// Whether `tier` holds `hash` (a scan's view, for checks).
    pub fn holds(&self, tier: Tier, hash: u64) -> bool {
        self.held.contains(&(tier, hash))
    }
}

/// The order of every rank's events as they travel in the ranks' reports (`align` keeps one on
/// every rank, so all agree): which events may be applied, and which ranks owe a snapshot
/// because an event of theirs went missing (the resync contract across processes).
#[derive(Debug, Default)]
pub struct EventOrder {
    applied: HashMap<u32, u64>,
    owing: std::collections::BTreeSet<u32>,
}

impl EventOrder {
    /// Takes in one rank's events (after its snapshot, if it sent one) and returns what to hand
    /// the index: the snapshot and the events that follow their rank's last without a gap. A
    /// rank with a gap owes a snapshot; its events are passed over until it comes.
    pub fn take(
        &mut self,
        snapshot: Option<CacheSnapshot>,
        events: Vec<CacheEvent>,
    ) -> (Option<CacheSnapshot>, Vec<CacheEvent>) {
        if let Some(s) = &snapshot {
            self.applied.insert(s.rank, s.seq);
            self.owing.remove(&s.rank);
        }
        let mut next = Vec::with_capacity(events.len());
        for e in events {
            if self.owing.contains(&e.rank) {
                continue;
            }
            let expected = self.applied.get(&e.rank).map_or(1, |s| s + 1);
            if e.seq == expected {
                self.applied.insert(e.rank, e.seq);
                next.push(e);
            } else if e.seq > expected {
                self.owing.insert(e.rank);
            }
        }
        (snapshot, next)
    }

    /// The ranks that owe a snapshot, in order.
    pub fn owing(&self) -> Vec<usize> {
        self.owing.iter().map(|&r| r as usize).collect()
    }
}

/// The longest prefix of `chain` each rank holds per tier, by walking every rank's cache (the
/// brute-force answer the index must equal: its tests and `kvflow bench router` compare them).
pub fn scan_caches(ranks: &[CacheEvents], chain: &[u64]) -> Vec<PrefixLen> {
    let mut out = Vec::new();
    for events in ranks {
        for tier in [DEVICE, OFFLOAD] {
            let blocks = chain.iter().take_while(|&&h| events.holds(tier, h)).count();
            if blocks > 0 {
                out.push(PrefixLen { rank: events.rank, tier, blocks });
            }
        }
    }
    out.sort_unstable();
    out
}

/// A rank's event arrived out of order: events `expected ..` were not seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}'s cache events skip from {expected} to {got}: resync from a snapshot of its index")]
pub struct Gap {
    pub rank: u32,
    pub expected: u64,
    pub got: u64,
}

/// How much of a request's prefix a rank holds in a tier, in full blocks from the start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct PrefixLen {
    pub rank: u32,
    pub tier: Tier,
    pub blocks: usize,
}

enum Command {
    Update { rank: u32, tier: Tier, hash: u64, diff: isize },
    Query { hashes: Vec<u64>, reply: mpsc::Sender<Vec<PrefixLen>> },
}

/// The index of a pool, shared by its ingress (which asks it) and worker 0's `align` (which hands
/// it every rank's events).
pub type SharedKvIndex = std::sync::Arc<parking_lot::Mutex<KvIndex>>;

/// The index's handle: the computation runs on its own thread until this drops.
pub struct KvIndex {
    commands: Option<mpsc::Sender<Command>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Per rank: the last event applied, and what the index holds for it (to retract on resync).
    applied: HashMap<u32, u64>,
    held: HashMap<u32, HashSet<(Tier, u64)>>,
    pub events: u64,
    pub resyncs: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::start()
    }
}

impl KvIndex {
    /// Starts the index's computation on a thread of its own.
    pub fn start() -> KvIndex {
        let (commands, received) = mpsc::channel::<Command>();
        let thread = std::thread::Builder::new()
            .name("kvflow-kv-index".into())
            .spawn(move || {
                // (execute_directly wants a closure it could share; the receiver moves in whole)
                let received = parking_lot::Mutex::new(Some(received));
                timely::execute_directly(move |worker| {
                    if let Some(r) = received.lock().take() {
                        run(worker, r)
                    }
                })
            })
            .expect("spawning the kv index thread");
        KvIndex {
            commands: Some(commands),
            thread: Some(thread),
            applied: HashMap::new(),
            held: HashMap::new(),
            events: 0,
            resyncs: 0,
        }
    }

    fn send(&self, c: Command) {
        if let Some(tx) = &self.commands {
            // the thread ends only when this handle drops
            let _ = tx.send(c);
        }
    }

    /// Applies `event` if it is its rank's next; otherwise applies nothing and says which were
    /// missed (the caller fetches that rank's snapshot for [`KvIndex::resync`]).
    pub fn apply(&mut self, event: &CacheEvent) -> Result<(), Gap> {
        let expected = self.applied.get(&event.rank).map_or(1, |s| s + 1);
        if event.seq != expected {
            return Err(Gap { rank: event.rank, expected, got: event.seq });
        }
        self.applied.insert(event.rank, event.seq);
        self.events += 1;
        let held = self.held.entry(event.rank).or_default();
        let (tier, hashes, diff) = match &event.change {
            CacheChange::Stored { tier, hashes } => (*tier, hashes, 1),
            CacheChange::Removed { tier, hashes } => (*tier, hashes, -1),
        };
        let changed: Vec<u64> = hashes
            .iter()
            .copied()
            .filter(|&hash| if diff > 0 { held.insert((tier, hash)) } else { held.remove(&(tier, hash)) })
            .collect();
        for hash in changed {
            self.send(Command::Update { rank: event.rank, tier, hash, diff });
        }
        Ok(())
    }

    /// Replaces what the index holds for the snapshot's rank with the snapshot, and resumes that
    /// rank's events after it.
    pub fn resync(&mut self, snapshot: &CacheSnapshot) {
        self.resyncs += 1;
        let now: HashSet<(Tier, u64)> = snapshot.blocks.iter().copied().collect();
        let held = self.held.entry(snapshot.rank).or_default();
        let rank = snapshot.rank;
        let updates: Vec<Command> = held
            .difference(&now)
            .map(|&(tier, hash)| Command::Update { rank, tier, hash, diff: -1 })
            .chain(now.difference(held).map(|&(tier, hash)| Command::Update { rank, tier, hash, diff: 1 }))
            .collect();
        *held = now;
        self.applied.insert(snapshot.rank, snapshot.seq);
        for c in updates {
            self.send(c);
        }
    }

    /// Per rank, the number of the last event applied (a resync jumps to its snapshot's).
    pub fn applied(&self) -> std::collections::BTreeMap<u32, u64> {
        self.applied.iter().map(|(&r, &s)| (r, s)).collect()
    }

    /// The longest prefix of `hashes` (a request's chained block hashes) each rank holds, per
    /// tier, once every event applied so far is in: only nonzero lengths, sorted.
    pub fn prefix_lengths(&self, hashes: &[u64]) -> Vec<PrefixLen> {
        self.ask(hashes).recv().unwrap_or_default()
    }

    /// Queues the question [`KvIndex::prefix_lengths`] answers and returns where its answer will
    /// arrive, so a caller that shares the index can wait for it without holding the index.
    pub fn ask(&self, hashes: &[u64]) -> mpsc::Receiver<Vec<PrefixLen>> {
        let (reply, answer) = mpsc::channel();
        self.send(Command::Query { hashes: hashes.to_vec(), reply });
        answer
    }
}

impl Drop for KvIndex {
    fn drop(&mut self) {
        self.commands.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The index's thread: applies commands in order, a timestamp per batch of updates, and answers
/// each query once the computation has caught up with it.
fn run(worker: &mut timely::worker::Worker, commands: mpsc::Receiver<Command>) {
    type Answer = ((u64, u32, Tier), usize);
    let answers: Rc<RefCell<Vec<(Answer, isize)>>> = Rc::default();
    let sink = answers.clone();
    let (mut cached, mut queries, probe) = worker.dataflow::<u64, _, _>(|scope| {
        let (cached_in, cached) = scope.new_collection::<(u64, (u32, Tier)), isize>();
        let (queries_in, queries) = scope.new_collection::<(u64, (u64, u32)), isize>();
        let by_hash = cached.arrange_by_key();
        let (probe, _) = queries
            .arrange_by_key()
            .join_core(by_hash, |_hash, &(query, position), &(rank, tier)| Some(((query, rank, tier), position)))
            .reduce(|_key, positions, out| {
                // positions ascending: the run 0, 1, 2, … present from the start
                let mut run = 0u32;
                for (&position, count) in positions {
                    if *count <= 0 || position != run {
                        break;
                    }
                    run += 1;
                }
                if run > 0 {
                    out.push((run as usize, 1));
                }
            })
            .inspect_batch(move |_time, batch| {
                sink.borrow_mut().extend(batch.iter().map(|(data, _time, diff)| (*data, *diff)));
            })
            .probe();
        (cached_in, queries_in, probe)
    });
    let mut query_id = 0u64;
    // closes the current time on both inputs and steps until the computation has caught up
    macro_rules! catch_up {
        () => {{
            let at = cached.time() + 1;
            cached.advance_to(at);
            queries.advance_to(at);
            cached.flush();
            queries.flush();
            worker.step_while(|| probe.less_than(&at));
        }};
    }
    while let Ok(first) = commands.recv() {
        let mut next = Some(first);
        while let Some(command) = next.take() {
            match command {
                Command::Update { rank, tier, hash, diff } => {
                    cached.update((hash, (rank, tier)), diff);
                    next = commands.try_recv().ok();
                }
                Command::Query { hashes, reply } => {
                    query_id += 1;
                    for (position, &hash) in hashes.iter().enumerate() {
                        queries.insert((hash, (query_id, position as u32)));
                    }
                    catch_up!();
                    let mut found: HashMap<(u32, Tier), (usize, isize)> = HashMap::new();
                    for (((query, rank, tier), blocks), diff) in answers.borrow_mut().drain(..) {
                        if query == query_id {
                            let e = found.entry((rank, tier)).or_insert((blocks, 0));
                            e.0 = blocks;
                            e.1 += diff;
                        }
                    }
                    let mut lengths: Vec<PrefixLen> = found
                        .into_iter()
                        .filter(|(_, (_, count))| *count > 0)
                        .map(|((rank, tier), (blocks, _))| PrefixLen { rank, tier, blocks })
                        .collect();
                    lengths.sort_unstable();
                    let _ = reply.send(lengths);
                    // the query leaves the collection at the next time
                    for (position, &hash) in hashes.iter().enumerate() {
                        queries.remove((hash, (query_id, position as u32)));
                    }
                }
            }
        }
        catch_up!();
        answers.borrow_mut().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// Random stores and removals on 4 ranks over chains of 4 prompt families; at random points
    /// the index's answers for random chains equal a scan of every rank's cache. `drop_every`:
    /// one event in that many is lost on its way (a test-only fault), which the numbering
    /// reveals and resync repairs.
    fn random_run(seed: u64, drop_every: Option<u64>) -> (u64, u64) {
        let mut rng = Lcg(seed);
        let chains: Vec<Vec<u64>> = (0..4).map(|f| (0..24).map(|i| (f + 1) * 1000 + i).collect()).collect();
        let mut ranks: Vec<CacheEvents> = (0..4).map(CacheEvents::new).collect();
        let mut index = KvIndex::start();
        let (mut checked, mut dropped) = (0, 0);
        for step in 0..400u64 {
            let rank = rng.next(4) as usize;
            let chain = &chains[rng.next(4) as usize];
            let tier = if rng.next(3) == 0 { OFFLOAD } else { DEVICE };
            let (from, len) = (rng.next(8) as usize, 1 + rng.next(8) as usize);
            let blocks = &chain[from..(from + len).min(chain.len())];
            let event = if rng.next(3) == 0 {
                ranks[rank].removed(tier, blocks)
            } else {
                // stores extend a prefix from its start, as a prefix cache does
                ranks[rank].stored(tier, &chain[..(from + len).min(chain.len())])
            };
            let lost = event.is_some() && drop_every.is_some_and(|n| rng.next(n) == 0);
            dropped += lost as u64;
            if let Some(e) = event.filter(|_| !lost) {
                if let Err(gap) = index.apply(&e) {
                    assert_eq!((gap.rank, gap.got), (e.rank, e.seq));
                    assert!(gap.expected < gap.got, "{gap}");
                    index.resync(&ranks[gap.rank as usize].snapshot());
                }
            }
            if step % 10 == 9 {
                // a gap not yet revealed by a later event leaves that rank stale: resync the
                // ranks whose latest event the index has not applied, as a consumer polling
                // each rank's sequence number does
                for r in &ranks {
                    if index.applied.get(&r.rank).copied().unwrap_or(0) != r.seq {
                        index.resync(&r.snapshot());
                    }
                }
                for chain in &chains {
                    let cut = &chain[..1 + rng.next(chain.len() as u64) as usize];
                    assert_eq!(index.prefix_lengths(cut), scan_caches(&ranks, cut), "seed {seed} step {step}");
                    checked += 1;
                }
            }
        }
        (checked, dropped)
    }

    #[test]
    fn the_index_answers_what_a_scan_of_every_rank_finds() {
        for seed in 1..4 {
            let (checked, _) = random_run(seed, None);
            assert_eq!(checked, 160);
        }
    }

    #[test]
    fn a_dropped_event_is_detected_and_repaired_by_resync() {
        let (checked, dropped) = random_run(7, Some(10));
        assert!(dropped > 5 && checked == 160, "dropped {dropped}");
        // without resync the answers go wrong: the gap must matter
        let mut rank = CacheEvents::new(0);
        let mut index = KvIndex::start();
        let first = rank.stored(DEVICE, &[1, 2]).unwrap();
        let lost = rank.stored(DEVICE, &[1, 2, 3, 4]).unwrap();
        let after = rank.removed(DEVICE, &[1]).unwrap();
        index.apply(&first).unwrap();
        drop(lost);
        let gap = index.apply(&after).unwrap_err();
        assert_eq!(gap, Gap { rank: 0, expected: 2, got: 3 });
        assert_eq!(index.prefix_lengths(&[1, 2, 3, 4]), vec![PrefixLen { rank: 0, tier: DEVICE, blocks: 2 }]);
        index.resync(&rank.snapshot());
        assert_eq!(index.prefix_lengths(&[1, 2, 3, 4]), vec![]);
        assert_eq!(index.prefix_lengths(&[2, 3, 4]), vec![PrefixLen { rank: 0, tier: DEVICE, blocks: 3 }]);
        assert_eq!(index.resyncs, 1);
    }

    #[test]
    fn the_event_order_passes_events_in_sequence_and_names_a_rank_with_a_gap_until_its_snapshot() {
        let mut events = CacheEvents::new(2);
        let e: Vec<CacheEvent> = (0..4).filter_map(|h| events.stored(DEVICE, &[h])).collect();
        let mut order = EventOrder::default();
        let (_, passed) = order.take(None, vec![e[0].clone(), e[2].clone(), e[3].clone()]);
        assert_eq!(passed, vec![e[0].clone()], "event 2 missing: 3 and 4 wait");
        assert_eq!(order.owing(), vec![2]);
        let (snapshot, passed) = order.take(Some(events.snapshot()), Vec::new());
        assert!(snapshot.is_some() && passed.is_empty());
        assert!(order.owing().is_empty());
        let next = events.stored(DEVICE, &[9]).unwrap();
        assert_eq!(order.take(None, vec![next.clone()]).1, vec![next], "resumes after the snapshot");
    }
}
