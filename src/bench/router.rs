//! `kvflow bench router`: the KV-aware routing index (kvflow_operators::policy::kv_index) with
//! `ranks` ranks holding `blocks` cached blocks between them — its cost per applied event and
//! per routing decision (the longest cached prefix per rank and tier of a request's chain),
//! beside a brute-force scan of every rank's cache for the same decisions in the same run. Every
//! decision's answer is checked against the scan's.

use anyhow::{bail, Result};
use kvflow_operators::policy::kv_index::{
    scan_caches, CacheChange, CacheEvent, CacheEvents, KvIndex, PrefixLen, Tier, DEVICE, OFFLOAD,
};
use std::time::Instant;

pub struct RouterBenchArgs {
    pub ranks: usize,
    pub blocks: usize,
    /// Blocks of each request's chain.
    pub chain: usize,
    pub decisions: usize,
}

struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n.max(1) as u64) as usize
    }
}

/// Blocks an event stores or removes.
fn blocks_of(e: &CacheEvent) -> usize {
    match &e.change {
        CacheChange::Stored { hashes, .. } | CacheChange::Removed { hashes, .. } => hashes.len(),
    }
}

pub fn run(args: &RouterBenchArgs) -> Result<()> {
    if args.ranks == 0 || args.chain == 0 || args.decisions == 0 {
        bail!("--ranks, --chain and --decisions must be at least 1");
    }
    let mut rng = Lcg(11);
    // request families: each a chain of distinct chained hashes
    let families = (args.blocks / args.chain).max(1) * 2;
    let chain_of = |f: usize| -> Vec<u64> { (0..args.chain).map(|i| ((f as u64) << 20) | i as u64).collect() };
    let mut ranks: Vec<CacheEvents> = (0..args.ranks as u32).map(CacheEvents::new).collect();
    let mut events: Vec<CacheEvent> = Vec::new();
    let mut held = 0usize;
    while held < args.blocks {
        let (r, f) = (rng.below(args.ranks), rng.below(families));
        let tier: Tier = if rng.below(4) == 0 { OFFLOAD } else { DEVICE };
        let len = 1 + rng.below(args.chain);
        if let Some(e) = ranks[r].stored(tier, &chain_of(f)[..len]) {
            held += blocks_of(&e);
            events.push(e);
        }
    }
    let mut index = KvIndex::start();
    let t = Instant::now();
    for e in &events {
        index.apply(e)?;
    }
    index.prefix_lengths(&[]); // waits until every event is in
    let load = t.elapsed().as_secs_f64();
    println!(
        "index        {} ranks, {held} cached blocks from {} events: loaded in {:.1} ms = {:.2} µs per block",
        args.ranks,
        events.len(),
        load * 1e3,
        load * 1e6 / held as f64
    );

    // steady state: removals and stores of whole prefixes, then one decision to catch up
    let mut churn = Vec::new();
    for _ in 0..200 {
        let (r, f) = (rng.below(args.ranks), rng.below(families));
        let len = 1 + rng.below(args.chain);
        let chain = chain_of(f);
        let e = if rng.below(2) == 0 {
            ranks[r].removed(DEVICE, &chain[..len])
        } else {
            ranks[r].stored(DEVICE, &chain[..len])
        };
        churn.extend(e);
    }
    let t = Instant::now();
    for e in &churn {
        index.apply(e)?;
    }
    index.prefix_lengths(&[]);
    let churn_s = t.elapsed().as_secs_f64();
    let churn_blocks = churn.iter().map(blocks_of).sum::<usize>().max(1);
    println!(
        "update       {} events of {churn_blocks} blocks in {:.1} ms: {:.1} µs per event, {:.2} µs per block",
        churn.len(),
        churn_s * 1e3,
        churn_s * 1e6 / churn.len().max(1) as f64,
        churn_s * 1e6 / churn_blocks as f64
    );

    // decisions: chains of families both cached and not
    let queries: Vec<Vec<u64>> = (0..args.decisions).map(|_| chain_of(rng.below(families))).collect();
    let t = Instant::now();
    let answers: Vec<Vec<PrefixLen>> = queries.iter().map(|q| index.prefix_lengths(q)).collect();
    let index_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let scanned: Vec<Vec<PrefixLen>> = queries.iter().map(|q| scan_caches(&ranks, q)).collect();
    let scan_s = t.elapsed().as_secs_f64();
    let differ = answers.iter().zip(&scanned).filter(|(a, b)| a != b).count();
    let hits = answers.iter().filter(|a| !a.is_empty()).count();
    let (index_us, scan_us) = (index_s * 1e6 / queries.len() as f64, scan_s * 1e6 / queries.len() as f64);
    println!(
        "decision     index {index_us:.1} µs, brute-force scan of every rank's cache {scan_us:.2} µs per decision \
         (chains of {} blocks, {} decisions, {hits} with a cached prefix); index_over_scan={:.1}",
        args.chain,
        queries.len(),
        index_us / scan_us.max(1e-9)
    );
    if differ > 0 {
        bail!("{differ} of {} decisions differ from the scan", queries.len());
    }
    println!("checks       every decision equals the scan");
    Ok(())
}
