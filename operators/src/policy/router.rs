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

impl LeastOutstanding {
    pub fn new(slack: usize) -> Self {
        LeastOutstanding { affinity: HashMap::new(), remembered: VecDeque::new(), capacity: 1 << 20, slack }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(hashes: &'a [u64]) -> RouteRequest<'a> {
        RouteRequest { id: 0, prompt: &[], block_hashes: hashes, cached: &[] }
    }

    #[test]
    fn new_prefixes_go_to_the_least_loaded_rank() {
        let mut r = LeastOutstanding::new(100);
        assert_eq!(r.route(&req(&[1, 2]), &[50, 10, 30]), 1);
        assert_eq!(r.route(&req(&[9]), &[5, 10, 30]), 0);
    }

    #[test]
    fn a_shared_prefix_follows_its_rank_unless_that_rank_is_too_busy() {
        let mut r = LeastOutstanding::new(100);
        assert_eq!(r.route(&req(&[1, 2]), &[0, 10]), 0);
        assert_eq!(r.route(&req(&[1, 2, 3]), &[80, 0]), 0, "affinity within the slack");
        assert_eq!(r.route(&req(&[1, 5]), &[500, 0]), 1, "too busy: least loaded wins");
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
        let mut r =
            (reg.get("always-last").unwrap())(RouterContext { ranks: 4, max_batched_tokens: 8, block_size: 16 });
        assert_eq!(r.route(&req(&[]), &[0, 0, 0, 0]), 3);
    }
}
