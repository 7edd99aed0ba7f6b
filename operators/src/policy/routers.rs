//! Routers by name: the registry a pool's `router` key is looked up in, with kvflow's own
//! (`least-outstanding`, `round-robin`, `kv-aware`) registered; programs embedding kvflow add
//! theirs. Apart from the routers themselves so that they need not know each other.

use super::kv_router::{KvAware, KvAwareSettings};
use super::router::{affinity_capacity, LeastOutstanding, RoundRobin, Router, RouterContext, RouterFactory};

/// The router that reads the KV-aware routing index: a pool naming it starts the index
/// (`kv_index`), its ranks report their prefix caches into it, and the admitting rank attaches
/// each admission's cached prefixes per rank.
pub const KV_AWARE: &str = "kv-aware";

/// The fewest routed blocks `kv-aware` remembers unconfirmed, whatever the pool holds (a pool of
/// a few blocks still follows a burst; 4,096 entries are about 100 KB).
const MIN_ROUTED_CAPACITY: usize = 1 << 12;

/// Routers by name. kvflow registers `least-outstanding`, `round-robin` and `kv-aware`; programs embedding
/// kvflow add their own with [`RouterRegistry::register`] before building a pool.
#[derive(Clone)]
pub struct RouterRegistry {
    factories: Vec<(String, RouterFactory)>,
}

impl Default for RouterRegistry {
    fn default() -> Self {
        let mut r = RouterRegistry { factories: Vec::new() };
        r.register("least-outstanding", |ctx: RouterContext| {
            Box::new(LeastOutstanding::new(2 * ctx.max_batched_tokens, affinity_capacity(&ctx))) as Box<dyn Router>
        });
        r.register("round-robin", |_ctx: RouterContext| Box::new(RoundRobin::default()) as Box<dyn Router>);
        r.register(KV_AWARE, |ctx: RouterContext| {
            let routed_capacity = ctx.ranks.saturating_mul(ctx.blocks_per_rank).max(MIN_ROUTED_CAPACITY);
            let settings = KvAwareSettings { block_size: ctx.block_size, routed_capacity, ..Default::default() };
            Box::new(KvAware::new(settings)) as Box<dyn Router>
        });
        r
    }
}

impl RouterRegistry {
    /// Adds (or replaces) the router called `name`.
    pub fn register(&mut self, name: &str, factory: impl Fn(RouterContext) -> Box<dyn Router> + Send + Sync + 'static) {
        self.factories.retain(|(n, _)| n != name);
        self.factories.push((name.to_string(), std::sync::Arc::new(factory)));
    }

    pub fn names(&self) -> Vec<String> {
        self.factories.iter().map(|(n, _)| n.clone()).collect()
    }

    pub fn get(&self, name: &str) -> Option<RouterFactory> {
        self.factories.iter().find(|(n, _)| n == name).map(|(_, f)| f.clone())
    }
}
