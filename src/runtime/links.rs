//! The handoff wiring of a run (DESIGN §2, §8): every pool's ingress, and for a P/D graph what
//! each pool's ranks hand off to or take handoffs from — a prefill pool's `inproc` links to the
//! decode pools its `[[link]]`s name, a decode pool's inbox. New requests enter the aggregated
//! pools, or the prefill pools of a disaggregated graph.

use crate::graph::{Graph, PoolConfig, PoolRole, TransferBackend};
use crate::runtime::pool::PoolHandoff;
use anyhow::{bail, Result};
use kvflow_kernels::models::Model;
use kvflow_operators::admit::Ingress;
use kvflow_operators::messages::AdmissionKind;
use kvflow_operators::transfer::{ConsumerPool, HandoffInbox, InprocLinks};
use std::collections::HashMap;
use std::sync::Arc;

/// Each pool's ingress and handoff role.
pub struct Wiring {
    pub ingress: HashMap<String, Arc<Ingress>>,
    pub handoff: HashMap<String, PoolHandoff>,
}

impl Wiring {
    /// How new requests enter `pool`, if they do.
    pub fn entry_kind(pool: &PoolConfig) -> Option<AdmissionKind> {
        match pool.role {
            PoolRole::Aggregated => Some(AdmissionKind::Whole),
            PoolRole::Prefill => Some(AdmissionKind::PrefillOnly),
            PoolRole::Decode => None,
        }
    }

    /// The decode pools' ingresses (closed once every prefill pool has ended).
    pub fn decode_ingresses(&self, pools: &[&PoolConfig]) -> Vec<Arc<Ingress>> {
        pools.iter().filter(|p| p.role == PoolRole::Decode).map(|p| self.ingress[&p.name].clone()).collect()
    }
}

/// Wires the pools this run starts. Every link must join two of them (a run of only some pools
/// of a P/D graph needs the transfer engine across processes, which comes with `--pools`).
pub fn wire(graph: &Graph, pools: &[&PoolConfig], model: &Model) -> Result<Wiring> {
    let ingress: HashMap<String, Arc<Ingress>> =
        pools.iter().map(|p| (p.name.clone(), Arc::new(Ingress::default()))).collect();
    let inboxes: HashMap<String, Arc<HandoffInbox>> = pools
        .iter()
        .filter(|p| p.role == PoolRole::Decode)
        .map(|p| (p.name.clone(), Arc::new(HandoffInbox::default())))
        .collect();
    let mut handoff = HashMap::new();
    for pool in pools {
        let role = match pool.role {
            PoolRole::Aggregated => PoolHandoff::None,
            PoolRole::Decode => PoolHandoff::In(inboxes[&pool.name].clone()),
            PoolRole::Prefill => {
                let mut consumers = Vec::new();
                for link in graph.links.iter().filter(|l| l.from == pool.name) {
                    if link.backend != TransferBackend::Inproc {
                        bail!(
                            "{}: link {} → {}: backend `{}` is not built yet; use backend = \"inproc\"",
                            graph.path.display(),
                            link.from,
                            link.to,
                            link.backend.name()
                        );
                    }
                    let (Some(to_ingress), Some(inbox)) = (ingress.get(&link.to), inboxes.get(&link.to)) else {
                        bail!(
                            "{}: link {} → {}: pool `{}` is not part of this run",
                            graph.path.display(),
                            link.from,
                            link.to,
                            link.to
                        );
                    };
                    consumers.push(ConsumerPool {
                        name: link.to.clone(),
                        ingress: to_ingress.clone(),
                        inbox: inbox.clone(),
                    });
                }
                let fingerprint = model.layout_fingerprint(pool.memory.block_size);
                for link in graph.links.iter().filter(|l| l.from == pool.name) {
                    let to = graph.pool(&link.to)?;
                    if model.layout_fingerprint(to.memory.block_size) != fingerprint {
                        bail!(
                            "{}: link {} → {}: the pools' memory layouts differ (block size {} against {}); a handoff \
                             needs the same layout on both sides",
                            graph.path.display(),
                            link.from,
                            link.to,
                            pool.memory.block_size,
                            to.memory.block_size
                        );
                    }
                }
                PoolHandoff::Out { sink: Arc::new(InprocLinks { consumers }), fingerprint }
            }
        };
        handoff.insert(pool.name.clone(), role);
    }
    Ok(Wiring { ingress, handoff })
}
