//! The `kv-aware` router's choice (Dynamo's formula): for each rank, the prefill blocks it would
//! still compute for the request — after its device hit, with an offload-tier hit credited at a
//! fraction, whichever rank saved it (the store is shared) — times a weight, plus its decode load in blocks; the lowest cost wins (among
//! equals, one drawn on the request id). With a temperature, a rank is drawn with probability
//! ∝ exp(−cost / temperature), also keyed on the request id, so every rank draws the same. A rank loaded above the
//! threshold is passed over unless every rank is; then the least loaded wins.
//!
//! The index learns of a prefix only once its rank has computed and published it, a step or more
//! after the request was routed; requests that share a prefix arrive in bursts (a Mooncake
//! timestamp holds up to 28). So the router also keeps where it sent each block
//! ([`RoutedBlocks`]: Dynamo's "active blocks", SGLang's approximate tree): a routed request's
//! blocks count for its rank at once, and the ranks' events confirm or withdraw them. A rank's
//! device prefix is the longer of what the index reports and what that table holds.
//!
//! In P/D, each pool naming `kv-aware` runs its own index: the prefill pool scores its ranks by
//! the prefix they would not recompute, and the decode pool — whose admissions are handoffs,
//! entering through the same ingress — scores its ranks by load and by the prefix they already
//! hold, which the handoff then does not send (decode-side reuse).
//!
//! It reads only what the request carries (`RouteRequest::cached`: each rank's prefix as the
//! routing index last reported it to the admitting rank) and the load figures every rank shares,
//! so every rank routes the same (DESIGN §11, for a given index lag).

use super::kv_index::{CacheEvent, CacheSnapshot};
use super::kv_index::{PrefixLen, DEVICE};
use super::routed_blocks::RoutedBlocks;
use super::router::{RouteRequest, Router};

/// The router's knobs. Dynamo's shape, with a prefill block weighing twice a block of load: a
/// prefix recomputed on another rank costs this request its blocks and the pool their memory a
/// second time, which evicts sooner what later requests would reuse. With the routed-blocks
/// table, it raised the hit rate by 0.01–0.03 on the heavy-reuse windows of the Mooncake
/// synthetic trace at about the same TTFT p99, and left the others within run-to-run noise
/// (benches/results/2026-12-06-cpu-4cc230b-router-windows.txt).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvAwareSettings {
    /// Tokens per block (the pool's paged block size, the index's unit).
    pub block_size: usize,
    /// Weight of a prefill block against a block of decode load.
    pub prefill_weight: f64,
    /// What an offload-tier block saves against a device hit (0..=1).
    pub offload_credit: f64,
    /// 0: always the cheapest; above: softmax sampling over −cost / temperature.
    pub temperature: f64,
    /// Outstanding tokens above which a rank is passed over (0: no threshold).
    pub load_threshold: usize,
    /// How many routed blocks not yet confirmed by their rank's events the router remembers (the
    /// pool's KV blocks, so no older prediction can still be held; 0: only the index).
    pub routed_capacity: usize,
}

impl Default for KvAwareSettings {
    fn default() -> Self {
        KvAwareSettings {
            block_size: 16,
            prefill_weight: 2.0,
            offload_credit: 0.5,
            temperature: 0.0,
            load_threshold: 0,
            routed_capacity: 4096,
        }
    }
}

pub struct KvAware {
    pub settings: KvAwareSettings,
    /// Where the router sent blocks, as the ranks' events confirmed or withdrew them.
    routed: RoutedBlocks,
    /// The device prefix, in tokens, the last routed request's rank was counted as holding.
    last_hit_tokens: usize,
}

impl KvAware {
    pub fn new(settings: KvAwareSettings) -> Self {
        KvAware { routed: RoutedBlocks::new(settings.routed_capacity), settings, last_hit_tokens: 0 }
    }

    /// The blocks of `req`'s prefix `rank` holds in a tier, as reported (and, on the device,
    /// as the router's table holds them). The offload tier's store is shared by
    /// the pool's ranks (any rank loads what another saved), so what any rank reported there
    /// counts for every rank.
    fn held(&self, req: &RouteRequest, rank: usize, device: bool) -> usize {
        let reported = req
            .cached
            .iter()
            .filter(|p: &&PrefixLen| (p.tier == DEVICE) == device && (!device || p.rank as usize == rank))
            .map(|p| p.blocks)
            .max()
            .unwrap_or(0);
        if device {
            reported.max(self.routed.prefix(req.block_hashes, rank))
        } else {
            reported
        }
    }

    /// Each rank's cost for `req`, given `outstanding` tokens per rank.
    pub fn costs(&self, req: &RouteRequest, outstanding: &[usize]) -> Vec<f64> {
        let s = &self.settings;
        let blocks = req.block_hashes.len() as f64;
        (0..outstanding.len())
            .map(|rank| {
                let device = self.held(req, rank, true) as f64;
                let offload = self.held(req, rank, false) as f64;
                let saved = device + s.offload_credit * (offload - device).max(0.0);
                let prefill = (blocks - saved).max(0.0);
                let decode = outstanding[rank] as f64 / s.block_size.max(1) as f64;
                s.prefill_weight * prefill + decode
            })
            .collect()
    }
}

/// A uniform draw in [0, 1) keyed on the request alone.
fn draw(id: u64) -> f64 {
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

impl Router for KvAware {
    fn route(&mut self, req: &RouteRequest, outstanding: &[usize]) -> usize {
        let rank = self.choose(req, outstanding);
        self.last_hit_tokens = self.held(req, rank, true) * self.settings.block_size;
        self.routed.routed(req.block_hashes, rank);
        rank
    }

    fn expected_hit_tokens(&self) -> usize {
        self.last_hit_tokens
    }

    fn observe(&mut self, snapshot: Option<&CacheSnapshot>, events: &[CacheEvent]) {
        self.routed.observe(snapshot, events);
    }
}

impl KvAware {
    fn choose(&self, req: &RouteRequest, outstanding: &[usize]) -> usize {
        let costs = self.costs(req, outstanding);
        let threshold = self.settings.load_threshold;
        let eligible: Vec<usize> =
            (0..costs.len()).filter(|&r| threshold == 0 || outstanding[r] <= threshold).collect();
        if eligible.is_empty() {
            return (0..outstanding.len()).min_by_key(|&r| (outstanding[r], r)).unwrap_or(0);
        }
        let t = self.settings.temperature;
        let best = eligible.iter().map(|&r| costs[r]).fold(f64::INFINITY, f64::min);
        if t <= 0.0 {
            // the cheapest; among equals, one drawn on the request id (not always the lowest
            // rank, which would pile an idle pool's new prefixes onto rank 0)
            let cheapest: Vec<usize> = eligible.into_iter().filter(|&r| costs[r] <= best + 1e-9).collect();
            return cheapest[((draw(req.id) * cheapest.len() as f64) as usize).min(cheapest.len() - 1)];
        }
        let weights: Vec<f64> = eligible.iter().map(|&r| (-(costs[r] - best) / t).exp()).collect();
        let mut at = draw(req.id) * weights.iter().sum::<f64>();
        for (i, w) in weights.iter().enumerate() {
            if at < *w {
                return eligible[i];
            }
            at -= w;
        }
        *eligible.last().unwrap_or(&0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::kv_index::{CacheChange, OFFLOAD};

    fn req<'a>(id: u64, hashes: &'a [u64], cached: &'a [PrefixLen]) -> RouteRequest<'a> {
        RouteRequest { id, prompt: &[], block_hashes: hashes, cached }
    }

    fn at(rank: u32, tier: u8, blocks: usize) -> PrefixLen {
        PrefixLen { rank, tier, blocks }
    }

    #[test]
    fn the_rank_holding_the_prefix_wins_until_its_load_outweighs_it() {
        let fresh = || KvAware::new(KvAwareSettings::default());
        let hashes: Vec<u64> = (0..10).collect();
        let cached = [at(2, DEVICE, 8)];
        assert_eq!(fresh().route(&req(1, &hashes, &cached), &[0, 0, 0, 0]), 2);
        // 8 saved blocks (16 at weight 2) against 320 outstanding tokens (20 blocks) of load: the
        // others are cheaper
        assert_ne!(fresh().route(&req(1, &hashes, &cached), &[0, 0, 320, 0]), 2);
        // nothing cached anywhere: the least loaded, drawn among equals on the request id
        let picks: Vec<usize> = (0..32).map(|id| fresh().route(&req(id, &hashes, &[]), &[32, 16, 16, 48])).collect();
        assert!(picks.iter().all(|&r| r == 1 || r == 2), "{picks:?}");
        assert!(picks.contains(&1) && picks.contains(&2), "equals share: {picks:?}");
    }

    #[test]
    fn an_offload_hit_counts_for_less_than_a_device_hit() {
        let r = KvAware::new(KvAwareSettings::default());
        let hashes: Vec<u64> = (0..10).collect();
        let cached = [at(0, OFFLOAD, 8), at(1, DEVICE, 8), at(1, OFFLOAD, 10)];
        let costs = r.costs(&req(1, &hashes, &cached), &[0, 0]);
        // the store is shared: both ranks can load the 10 offloaded blocks
        assert_eq!(costs, vec![2.0 * (10.0 - 5.0), 2.0 * (10.0 - 8.0 - 1.0)]);
    }

    #[test]
    fn a_loaded_rank_is_passed_over_and_sampling_is_the_same_on_every_rank() {
        let settings = KvAwareSettings { load_threshold: 100, ..Default::default() };
        let mut r = KvAware::new(settings);
        let hashes: Vec<u64> = (0..10).collect();
        let cached = [at(0, DEVICE, 10)];
        assert_eq!(r.route(&req(1, &hashes, &cached), &[200, 50, 0]), 2, "rank 0 above the threshold");
        assert_eq!(r.route(&req(1, &hashes, &cached), &[200, 300, 150]), 2, "all above: least loaded");
        let warm = KvAwareSettings { temperature: 4.0, ..Default::default() };
        let picks = |id| KvAware::new(warm).route(&req(id, &hashes, &[]), &[0, 0, 0, 0]);
        let first: Vec<usize> = (0..64).map(picks).collect();
        assert_eq!(first, (0..64).map(picks).collect::<Vec<_>>(), "a draw keyed on the request id");
        assert!((0..4).all(|r| first.contains(&r)), "equal costs spread over every rank: {first:?}");
    }

    #[test]
    fn a_burst_sharing_a_prefix_follows_its_first_request_before_the_index_knows() {
        let system: Vec<u64> = (0..12).collect();
        let chain = |tail: u64| system.iter().copied().chain([100 + tail]).collect::<Vec<u64>>();
        let mut r = KvAware::new(KvAwareSettings::default());
        let first = r.route(&req(1, &chain(1), &[]), &[0, 0, 0, 0]);
        // the index reports nothing yet; the first request's rank carries 13 blocks of load
        let mut load = [0, 0, 0, 0];
        load[first] = 10 * 16;
        assert_eq!(r.route(&req(2, &chain(2), &[]), &load), first, "12 predicted blocks outweigh 10 of load");
        let mut blind = KvAware::new(KvAwareSettings { routed_capacity: 0, ..Default::default() });
        let blind_first = blind.route(&req(1, &chain(1), &[]), &[0, 0, 0, 0]);
        let mut load = [0, 0, 0, 0];
        load[blind_first] = 10 * 16;
        assert_ne!(blind.route(&req(2, &chain(2), &[]), &load), blind_first, "without prediction: least loaded");
        // the rank's events withdraw a routed block it evicted (here the first)
        let mut evicted = KvAware::new(KvAwareSettings::default());
        let home = evicted.route(&req(1, &chain(1), &[]), &[0, 0, 0, 0]);
        let removed = CacheChange::Removed { tier: DEVICE, hashes: vec![0] };
        evicted.observe(None, &[CacheEvent { rank: home as u32, seq: 1, change: removed }]);
        let mut load = [0, 0, 0, 0];
        load[home] = 16;
        assert_ne!(evicted.route(&req(2, &chain(2), &[]), &load), home, "the prediction was withdrawn");
        // a prediction never confirmed is forgotten once `routed_capacity` later blocks were routed
        let mut short = KvAware::new(KvAwareSettings { routed_capacity: 13, ..Default::default() });
        let home = short.route(&req(1, &chain(1), &[]), &[0, 0, 0, 0]);
        short.route(&req(2, &[900], &[]), &[0, 0, 0, 0]);
        short.route(&req(3, &[901], &[]), &[0, 0, 0, 0]);
        let mut load = [0, 0, 0, 0];
        load[home] = 16;
        assert_ne!(short.route(&req(4, &chain(4), &[]), &load), home, "the prediction has expired");
    }
}
