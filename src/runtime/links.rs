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
use kvflow_operators::transfer::wire::ConsumerLayout;
use kvflow_operators::transfer::{
    ConsumerPool, HandoffInbox, HandoffSink, InprocLinks, TcpConsumer, TcpLink, TcpLinks,
};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Each pool's ingress and handoff role.
pub struct Wiring {
    pub ingress: HashMap<String, Arc<Ingress>>,
    pub handoff: HashMap<String, PoolHandoff>,
    /// The decode pools' tcp listeners (they stop when dropped, after the run).
    pub listeners: Vec<TcpConsumer>,
    /// Bytes that crossed a socket (tcp links).
    pub socket_bytes: Arc<AtomicU64>,
}

/// What a decode pool's rank holds per block and slot, as a tcp consumer checks descriptors.
fn consumer_layout(model: &Model, pool: &PoolConfig) -> ConsumerLayout {
    let bs = pool.memory.block_size;
    ConsumerLayout {
        fingerprint: model.layout_fingerprint(bs),
        block_size: bs,
        floats_per_block: if model.needs_blocks() { model.kv_row_widths().iter().sum::<usize>() * bs } else { 0 },
        state_floats: model.state_bytes_per_slot() / 4,
        vocab_size: model.vocab_size,
        max_prompt: model.max_positions.unwrap_or(1 << 24),
    }
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
    // The decode pools with tcp links in bind first; producers connect to the bound address.
    let token = graph.transfer.deployment_token.clone();
    let mut listeners = Vec::new();
    let mut bound: HashMap<String, std::net::SocketAddr> = HashMap::new();
    for pool in pools.iter().filter(|p| p.role == PoolRole::Decode) {
        let Some(link) = graph.links.iter().find(|l| l.to == pool.name && l.backend == TransferBackend::Tcp) else {
            continue;
        };
        let endpoint = link.endpoint.as_ref().map_or("127.0.0.1:0".to_string(), ToString::to_string);
        let consumer = ConsumerPool {
            name: pool.name.clone(),
            ingress: ingress[&pool.name].clone(),
            inbox: inboxes[&pool.name].clone(),
        };
        let listener = TcpConsumer::bind(&endpoint, consumer, consumer_layout(model, pool), token.clone())
            .map_err(|e| anyhow::anyhow!("{}: decode pool `{}`: {e}", graph.path.display(), pool.name))?;
        bound.insert(pool.name.clone(), listener.addr());
        listeners.push(listener);
    }
    let socket_bytes = Arc::new(AtomicU64::new(0));
    let mut handoff = HashMap::new();
    for pool in pools {
        let role = match pool.role {
            PoolRole::Aggregated => PoolHandoff::None,
            PoolRole::Decode => PoolHandoff::In(inboxes[&pool.name].clone()),
            PoolRole::Prefill => {
                let out: Vec<_> = graph.links.iter().filter(|l| l.from == pool.name).collect();
                let fingerprint = model.layout_fingerprint(pool.memory.block_size);
                for link in &out {
                    let to = graph.pool(&link.to)?;
                    if !ingress.contains_key(&link.to) {
                        bail!(
                            "{}: link {} → {}: pool `{}` is not part of this run",
                            graph.path.display(),
                            link.from,
                            link.to,
                            link.to
                        );
                    }
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
                let sink: Arc<dyn HandoffSink> = if out.iter().all(|l| l.backend == TransferBackend::Inproc) {
                    let consumers = out
                        .iter()
                        .map(|l| ConsumerPool {
                            name: l.to.clone(),
                            ingress: ingress[&l.to].clone(),
                            inbox: inboxes[&l.to].clone(),
                        })
                        .collect();
                    Arc::new(InprocLinks { consumers })
                } else if out.iter().all(|l| l.backend == TransferBackend::Tcp) {
                    let links = out
                        .iter()
                        .map(|l| {
                            let mut link = TcpLink::connect(
                                &l.to,
                                bound[&l.to],
                                fingerprint,
                                token.as_deref(),
                                socket_bytes.clone(),
                            )?;
                            link.checksum = graph.transfer.checksum;
                            Ok(link)
                        })
                        .collect::<Result<Vec<_>, String>>()
                        .map_err(|e| anyhow::anyhow!("{}: prefill pool `{}`: {e}", graph.path.display(), pool.name))?;
                    Arc::new(TcpLinks { links })
                } else {
                    bail!(
                        "{}: prefill pool `{}` has both inproc and tcp links; one backend per prefill pool",
                        graph.path.display(),
                        pool.name
                    );
                };
                PoolHandoff::Out { sink, fingerprint }
            }
        };
        handoff.insert(pool.name.clone(), role);
    }
    Ok(Wiring { ingress, handoff, listeners, socket_bytes })
}
