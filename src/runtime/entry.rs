//! Where requests enter a run: its entry pools (the aggregated pools, the prefill pools of a
//! disaggregated graph run in parts, or its decode pools with decode-first routing), which of them
//! each request goes to ([`Placement`]); a cancellation follows a request to the pool the
//! collector's record of it names. [`Entries::release`] and [`Entries::cancel`] are the one way a request enters and is
//! cancelled: the workload driver and a front end (`kvflow serve`) both go through them.

use super::collector::{Collector, SharedCollector, Watcher};
use crate::graph::PoolChoice;
use kvflow_kernels::cpu::sampling::RequestSampling;
use kvflow_kernels::hash;
use kvflow_kernels::models::check_context;
use kvflow_operators::messages::{Admission, AdmissionKind, Delivery};
use kvflow_operators::pool::admit::Ingress;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The failure cause of a request longer than the model's context.
pub const EXCEEDS_CONTEXT: &str = "exceeds-context";

/// Which of the run's entry pools a new request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub choice: PoolChoice,
    pub seed: u64,
}

impl Placement {
    /// The pool (index into the entry pools) the `nth` request released goes to. A seeded
    /// split deals each run of `pools` consecutive requests out in a seeded order, so the pools
    /// get equal shares whatever the seed, and the same split every run.
    pub fn pick(&self, nth: usize, pools: usize) -> usize {
        match self.choice {
            _ if pools <= 1 => 0,
            PoolChoice::RoundRobin => nth % pools,
            PoolChoice::Seeded => {
                let mut order: Vec<usize> = (0..pools).collect();
                let mut state = hash::mix(hash::mix(hash::EMPTY, self.seed ^ 0x9001), (nth / pools) as u64);
                for i in (1..pools).rev() {
                    state = hash::mix(state, i as u64);
                    order.swap(i, (state % (i as u64 + 1)) as usize);
                }
                order[nth % pools]
            }
        }
    }
}

/// A pool new requests enter.
pub struct EntryPool {
    pub name: String,
    pub ingress: Arc<Ingress>,
    /// Whole requests (aggregated pools) or prefills to hand off (prefill pools).
    pub kind: AdmissionKind,
    /// Where else a cancellation goes: the decode pools a handed-off request may have reached.
    pub also_cancel: Vec<Arc<Ingress>>,
}

/// One request to release.
pub struct Release {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_output_tokens: usize,
    pub warmup: bool,
    pub sampling: RequestSampling,
    /// Its stop tokens, and whether its tokens stream out as they come.
    pub delivery: Delivery,
    /// Who hears its progress as it runs (a server's connection).
    pub watcher: Option<Watcher>,
}

impl Release {
    /// A trace request as the workload releases it: a warmup request when its id is below
    /// `warmup`, sampling as its line says (else `sampling`), no stop tokens beyond the model's.
    pub fn of_trace(request: crate::trace::Request, warmup: usize, sampling: RequestSampling) -> Release {
        Release {
            id: request.id,
            warmup: (request.id as usize) < warmup,
            sampling: request.sampling(sampling),
            prompt: request.prompt,
            max_output_tokens: request.max_output_tokens,
            delivery: Default::default(),
            watcher: None,
        }
    }
}

/// A run's entry pools, and the entry pool each released request went to.
pub struct Entries {
    pools: Vec<EntryPool>,
    placement: Placement,
    collector: SharedCollector,
    /// The model's context (prompt + output tokens), when requests are checked against it at
    /// release: a longer one is refused, with its cause, and never enters a pool.
    max_context: Option<usize>,
    /// Requests released so far (refused ones too): the placement deals by it.
    released: AtomicUsize,
}

impl Entries {
    /// `pools`: at least one.
    pub fn new(
        pools: Vec<EntryPool>,
        placement: Placement,
        collector: SharedCollector,
        max_context: Option<usize>,
    ) -> Entries {
        Entries { pools, placement, collector, max_context, released: AtomicUsize::new(0) }
    }

    /// The collector every release is recorded with.
    pub fn collector(&self) -> &SharedCollector {
        &self.collector
    }

    /// Releases the request `decide` returns, into the entry pool the placement picks: the
    /// collector records it (and its watcher), a request longer than the context is refused, and
    /// the rest enter their pool's ingress. `decide` runs under the collector's lock, so what it
    /// checks (a front end draining, or full) holds when the request is released; its error
    /// releases nothing. Returns whether the request entered its pool.
    pub fn release<E>(&self, decide: impl FnOnce(&Collector) -> Result<Release, E>) -> Result<bool, E> {
        let mut collector = self.collector.lock();
        let request = decide(&collector)?;
        let nth = self.released.fetch_add(1, Ordering::SeqCst);
        let index = self.placement.pick(nth, self.pools.len());
        let pool = &self.pools[index];
        if let Some(watcher) = request.watcher {
            collector.watch(request.id, watcher);
        }
        collector.released(
            request.id,
            &pool.name,
            &request.prompt,
            request.max_output_tokens,
            request.warmup,
            request.sampling,
        );
        if let Err(why) = check_context(self.max_context, request.prompt.len(), request.max_output_tokens) {
            collector.refuse(request.id, &pool.name, EXCEEDS_CONTEXT, why);
            return Ok(false);
        }
        drop(collector);
        pool.ingress.push(Admission {
            id: request.id,
            prompt: request.prompt,
            max_output_tokens: request.max_output_tokens,
            warmup: request.warmup,
            kind: pool.kind,
            sampling: request.sampling,
            cached: Vec::new(),
            delivery: request.delivery,
        });
        Ok(true)
    }

    /// Cancels request `id` where it went: its entry pool, and the pools downstream of it that
    /// it may have reached. A request not in flight (never released, or ended) is left alone:
    /// where each request went is the collector's record of it, which leaves with its end.
    pub fn cancel(&self, id: u64) {
        let index = {
            let collector = self.collector.lock();
            let Some(entered) = collector.entry_pool_of(id) else { return };
            self.pools.iter().position(|p| p.name == entered)
        };
        if let Some(pool) = index.map(|i| &self.pools[i]) {
            pool.ingress.cancel(id);
            for other in &pool.also_cancel {
                other.cancel(id);
            }
        }
    }

    /// Closes every entry pool's ingress: no more requests, and the pools end once what they hold
    /// is done.
    pub fn close(&self) {
        for pool in &self.pools {
            pool.ingress.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seeded_pool_choice_splits_requests_evenly_and_the_same_every_run() {
        let seeded = Placement { choice: PoolChoice::Seeded, seed: 3 };
        for pools in [2, 3] {
            let requests = 333 * pools;
            let picks: Vec<usize> = (0..requests).map(|n| seeded.pick(n, pools)).collect();
            for p in 0..pools {
                assert_eq!(picks.iter().filter(|&&x| x == p).count(), 333, "pool {p} of {pools}");
            }
            assert_eq!(picks, (0..requests).map(|n| seeded.pick(n, pools)).collect::<Vec<_>>(), "the same every run");
            assert_ne!(picks, (0..requests).map(|n| n % pools).collect::<Vec<_>>(), "not plain turns");
            let other = Placement { seed: 4, ..seeded };
            assert_ne!(picks, (0..requests).map(|n| other.pick(n, pools)).collect::<Vec<_>>(), "the seed matters");
        }
        assert_eq!(Placement { choice: PoolChoice::RoundRobin, seed: 3 }.pick(3, 2), 1);
        assert_eq!(seeded.pick(3, 1), 0);
    }
}
