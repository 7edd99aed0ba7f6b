//! Routers: which rank of a pool a new request goes to. Every rank runs the same router over the
//! same admissions of `StepPlan(t)` with the same load figures, so every rank reaches the same
//! decision without another exchange. Routers are chosen by name from a registry that code
//! outside kvflow can extend (`RouterRegistry`).

pub use super::routers::{RouterRegistry, KV_AWARE};
use std::collections::{HashMap, VecDeque};

/// What a router sees of a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    pub id: u64,
    pub prompt: &'a [u32],
    /// Chained hashes of the prompt's full blocks (the prefix cache's keys).
    pub block_hashes: &'a [u64],
    /// Each rank's cached prefix of those blocks per tier, as the routing index last reported
    /// it to the admitting rank (`kv_index`); empty where no index runs.
    pub cached: &'a [super::kv_index::PrefixLen],
}

/// Picks a rank for each request. `outstanding[r]` is the tokens rank `r` still has to compute
/// (reported at this step, plus what was routed to it earlier in this step).
pub trait Router {
    fn route(&mut self, req: &RouteRequest, outstanding: &[usize]) -> usize;

    /// Of the request just routed, the prompt tokens its rank is expected to hold already: the
    /// load added for it leaves them out (a prefix hit is not work). 0 for a router that does not
    /// know.
    fn expected_hit_tokens(&self) -> usize {
        0
    }

    /// The pool's cache events, each rank's in order after its snapshot (if it sent one), as
    /// `align` takes them from the step's reports before routing the step's admissions — the
    /// same on every rank. A router that keeps its own view of the ranks' caches reads them.
    fn observe(&mut self, _snapshot: Option<&super::kv_index::CacheSnapshot>, _events: &[super::kv_index::CacheEvent]) {
    }
}

/// Least outstanding tokens, with prefix affinity: a request whose prompt starts with blocks
/// routed to some rank before goes there too, unless that rank is loaded more than `slack` tokens
/// above the least loaded one.
pub struct LeastOutstanding {
    affinity: HashMap<u64, usize>,
    remembered: VecDeque<u64>,
    capacity: usize,
    slack: usize,
}

/// Block hashes a [`LeastOutstanding`] remembers per KV block its pool holds. The pool's ranks
/// hold at most `ranks × blocks_per_rank` blocks at once, so an older hash names a prefix every
/// rank has most likely evicted, where following it saves nothing; twice that keeps the prefixes
/// routed but not yet computed (they hold no block yet) and those evicted only lately (maybe
/// still in the offload tier).
const AFFINITY_PER_BLOCK: usize = 2;
/// The fewest hashes remembered, whatever the pools hold: a pool of a few blocks (tests, a tiny
/// model) still routes a working set of shared prompts together (4096 hashes are about 100 KB).
const MIN_AFFINITY: usize = 1 << 12;
/// The most remembered (the table's size before it followed the pools: about 40 MB at most).
const MAX_AFFINITY: usize = 1 << 20;

/// How many block hashes a [`LeastOutstanding`] of the pool `ctx` describes remembers: a
/// multiple of the KV blocks its ranks hold, within [`MIN_AFFINITY`]..=[`MAX_AFFINITY`].
pub fn affinity_capacity(ctx: &RouterContext) -> usize {
    ctx.ranks.saturating_mul(ctx.blocks_per_rank).saturating_mul(AFFINITY_PER_BLOCK).clamp(MIN_AFFINITY, MAX_AFFINITY)
}

impl LeastOutstanding {
    /// A router that lets affinity pass over a rank `slack` tokens busier than the least loaded,
    /// remembering the last `capacity` block hashes routed (memory bounded however many
    /// requests it routes).
    pub fn new(slack: usize, capacity: usize) -> Self {
        LeastOutstanding { affinity: HashMap::new(), remembered: VecDeque::new(), capacity, slack }
    }

    /// Block hashes remembered now.
    pub fn remembered(&self) -> usize {
        debug_assert_eq!(self.affinity.len(), self.remembered.len());
        self.remembered.len()
    }
}

fn least_loaded(outstanding: &[usize]) -> usize {
    (0..outstanding.len()).min_by_key(|&r| (outstanding[r], r)).unwrap_or(0)
}

impl Router for LeastOutstanding {
    fn route(&mut self, req: &RouteRequest, outstanding: &[usize]) -> usize {
        let least = least_loaded(outstanding);
        let preferred = req.block_hashes.iter().map_while(|h| self.affinity.get(h)).last().copied();
        let rank = match preferred {
            Some(r) if r < outstanding.len() && outstanding[r] <= outstanding[least] + self.slack => r,
            _ => least,
        };
        for &h in req.block_hashes {
            if self.affinity.insert(h, rank).is_none() {
                self.remembered.push_back(h);
            }
        }
        while self.remembered.len() > self.capacity {
            if let Some(old) = self.remembered.pop_front() {
                self.affinity.remove(&old);
            }
        }
        rank
    }
}

/// Each request to the next rank in turn.
#[derive(Default)]
pub struct RoundRobin {
    next: usize,
}

impl Router for RoundRobin {
    fn route(&mut self, _req: &RouteRequest, outstanding: &[usize]) -> usize {
        let r = self.next % outstanding.len().max(1);
        self.next += 1;
        r
    }
}

/// Builds a router for a pool of `ranks` ranks whose scheduler batches `max_batched_tokens`.
pub type RouterFactory = std::sync::Arc<dyn Fn(RouterContext) -> Box<dyn Router> + Send + Sync>;

/// What a router factory knows about the pool.
#[derive(Clone, Copy, Debug)]
pub struct RouterContext {
    pub ranks: usize,
    pub max_batched_tokens: usize,
    /// Tokens per paged block (the routing index's unit).
    pub block_size: usize,
    /// KV blocks each rank holds (what the pool can cache: routers size their tables by it).
    pub blocks_per_rank: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(hashes: &'a [u64]) -> RouteRequest<'a> {
        RouteRequest { id: 0, prompt: &[], block_hashes: hashes, cached: &[] }
    }

    #[test]
    fn new_prefixes_go_to_the_least_loaded_rank() {
        let mut r = LeastOutstanding::new(100, MIN_AFFINITY);
        assert_eq!(r.route(&req(&[1, 2]), &[50, 10, 30]), 1);
        assert_eq!(r.route(&req(&[9]), &[5, 10, 30]), 0);
    }

    #[test]
    fn a_shared_prefix_follows_its_rank_unless_that_rank_is_too_busy() {
        let mut r = LeastOutstanding::new(100, MIN_AFFINITY);
        assert_eq!(r.route(&req(&[1, 2]), &[0, 10]), 0);
        assert_eq!(r.route(&req(&[1, 2, 3]), &[80, 0]), 0, "affinity within the slack");
        assert_eq!(r.route(&req(&[1, 5]), &[500, 0]), 1, "too busy: least loaded wins");
    }

    /// However many requests it routes, the table keeps only the latest `capacity` hashes, and
    /// that capacity follows the pool's blocks between its floor and its ceiling.
    #[test]
    fn the_affinity_table_is_bounded_by_what_the_pool_holds() {
        let ctx =
            |ranks, blocks_per_rank| RouterContext { ranks, max_batched_tokens: 8, block_size: 16, blocks_per_rank };
        assert_eq!(affinity_capacity(&ctx(4, 10_000)), 80_000, "twice the pool's blocks");
        assert_eq!(affinity_capacity(&ctx(1, 64)), MIN_AFFINITY, "a floor for a small pool");
        assert_eq!(affinity_capacity(&ctx(8, 1 << 20)), MAX_AFFINITY, "a ceiling for a huge one");
        assert_eq!(affinity_capacity(&ctx(usize::MAX, usize::MAX)), MAX_AFFINITY, "no overflow");
        let capacity = affinity_capacity(&ctx(2, 2048));
        let mut r = LeastOutstanding::new(100, capacity);
        for i in 0..2_000u64 {
            // requests of 32 blocks each, no two alike: 64,000 hashes in all
            let hashes: Vec<u64> = (0..32).map(|b| i << 8 | b).collect();
            r.route(&req(&hashes), &[0, 0]);
            assert!(r.remembered() <= capacity);
        }
        assert_eq!(r.remembered(), capacity, "full, no more");
        let last: Vec<u64> = (0..32).map(|b| 1999 << 8 | b).collect();
        let rank = r.route(&req(&last), &[0, 0]);
        assert_eq!(r.route(&req(&last), &[1, 0]), rank, "the latest prefixes are still remembered");
    }

    #[test]
    fn the_registry_builds_routers_by_name_and_can_be_extended() {
        let mut reg = RouterRegistry::default();
        assert!(reg.get("least-outstanding").is_some() && reg.get("nope").is_none());
        reg.register("always-last", |ctx: RouterContext| {
            struct Last(usize);
            impl Router for Last {
                fn route(&mut self, _: &RouteRequest, _: &[usize]) -> usize {
                    self.0 - 1
                }
            }
            Box::new(Last(ctx.ranks)) as Box<dyn Router>
        });
        let mut r = (reg.get("always-last").unwrap())(RouterContext {
            ranks: 4,
            max_batched_tokens: 8,
            block_size: 16,
            blocks_per_rank: 64,
        });
        assert_eq!(r.route(&req(&[]), &[0, 0, 0, 0]), 3);
    }
}
