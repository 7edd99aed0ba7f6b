//! The handoff wiring of a run (DESIGN §2, §8): every pool's ingress, and for a P/D graph what
//! each pool's ranks hand off to or take handoffs from — a prefill pool's links to the decode
//! pools its `[[link]]`s name, a decode pool's inbox. New requests enter the aggregated pools;
//! in a disaggregated graph run whole in one process they enter the decode pools, which decide
//! where each is prefilled ([`decode_first`]), and in a run of some of its pools (`--pools`) the
//! prefill pools.
//!
//! With `--pools`, a link may join a pool of this process to one in another: it must be `tcp`.
//! A decode pool fed from other processes binds its endpoint (its address printed, for the
//! producers' `--endpoint`), sends its requests' events back over the links, and closes its
//! ingress once every producer link has closed. A prefill pool linked to a decode pool elsewhere
//! connects to the address `--endpoint POOL=HOST:PORT` (or the link's fixed port) gives, and
//! hands the events coming back to the collector.

use crate::graph::{Graph, LinkConfig, PoolConfig, PoolRole, TransferBackend};
use crate::runtime::pool::PoolHandoff;
use anyhow::{anyhow, bail, Result};
use kvflow_kernels::cuda::Landing;
use kvflow_kernels::models::Model;
use kvflow_operators::executor::CudaSettings;
use kvflow_operators::messages::AdmissionKind;
use kvflow_operators::pool::admit::Ingress;
use kvflow_operators::pool::emit::EventSink;
use kvflow_operators::rank::{PrefillTarget, RemotePrefill};
use kvflow_operators::transfer::wire::ConsumerLayout;
use kvflow_operators::transfer::{
    ConsumerOptions, ConsumerPool, EventRelay, Faults, HandoffInbox, HandoffSink, InprocLinks, LinkOptions, LinkRate,
    LinkTarget, TcpConsumer, TcpLink, TcpLinks, TransferCounters,
};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

/// Each pool's ingress and handoff role.
pub struct Wiring {
    pub ingress: HashMap<String, Arc<Ingress>>,
    pub handoff: HashMap<String, PoolHandoff>,
    /// The decode pools' tcp listeners, by pool (they stop when dropped, after the run).
    pub listeners: Vec<(String, TcpConsumer)>,
    /// The decode pools of this process fed by producers in other processes.
    pub served: Vec<String>,
    /// Links to decode pools in other processes.
    pub remote_links: Vec<Arc<TcpLink>>,
    /// Bytes that crossed a socket (tcp links).
    pub socket_bytes: Arc<AtomicU64>,
    /// What the transfer engine counted (retries, failures, duplicates, aborts, faults).
    pub counters: Arc<TransferCounters>,
    /// The decode pools' inboxes (empty at the end of a run: every handoff taken or aborted).
    pub inboxes: Vec<(String, Arc<HandoffInbox>)>,
}

/// What the wiring needs beyond the graph and the pools of this run.
pub struct WireOptions<'a> {
    /// `--endpoint POOL=HOST:PORT`: where a decode pool listens.
    pub endpoints: &'a HashMap<String, String>,
    /// Where the events of a decode pool in another process go (the collector).
    pub remote_events: &'a dyn Fn(&str) -> Box<dyn EventSink + Send>,
    /// How long a producer keeps trying to reach a decode pool in another process.
    pub patience: Duration,
    /// Test switch: the inboxes deliver duplicate handoffs (`TestSwitches::deliver_duplicate_handoffs`).
    pub deliver_duplicates: bool,
    /// Test switch: the consumers take a streamed handoff that lacks pieces
    /// (`TestSwitches::accept_missing_pieces`).
    pub accept_missing_pieces: bool,
    /// Test switch: the listeners register any number of producer links
    /// (`TestSwitches::serve_any_producer`).
    pub serve_any_producer: bool,
    /// A process of a prefill pool spread over processes that does not drive the workload: the
    /// events of a decode pool in another process come back through the ranks that handed
    /// their requests off (`transfer::relay`), not to `remote_events`.
    pub relay: Option<Arc<EventRelay>>,
    /// A simulated run's clock, for its `sim` links.
    pub clock: Option<Arc<kvflow_operators::sim::clock::VirtualClock>>,
}

/// The graph's `[faults]` as the transfer engine draws them.
fn faults(graph: &Graph) -> Faults {
    let f = &graph.faults;
    Faults {
        seed: f.seed,
        drop_connection: f.drop_connection,
        delay: Duration::from_secs_f64(f.delay_ms / 1000.0),
        delay_probability: f.delay_probability,
        corrupt: f.corrupt,
        duplicate_completion: f.duplicate_completion,
    }
}

/// What a decode pool's rank holds per block and slot, as a tcp consumer checks descriptors (and
/// an offload load checks the chunks it brings).
pub(crate) fn consumer_layout(model: &Model, pool: &PoolConfig) -> ConsumerLayout {
    let bs = pool.memory.block_size;
    ConsumerLayout {
        fingerprint: model.handoff_fingerprint(),
        block_size: bs,
        floats_per_block: kv_layers(model, bs).iter().sum(),
        state_floats: model.state_bytes_per_slot() / 4,
        vocab_size: model.vocab_size,
        max_prompt: model.max_positions.unwrap_or(1 << 24),
    }
}

/// The element type pool `pool` keeps its KV in: a cuda pool's `dtype` setting, float32 otherwise.
fn kv_dtype(pool: &PoolConfig) -> Result<&'static str> {
    if pool.executor != "cuda" {
        return Ok("float32");
    }
    let settings = CudaSettings::read(&pool.executor_settings).map_err(|e| anyhow!("pool `{}`: {e}", pool.name))?;
    Ok(settings.dtype.name())
}

/// Floats of one block in each layer of `model` at `block_size` (none for a model without KV).
fn kv_layers(model: &Model, block_size: usize) -> Vec<usize> {
    if !model.needs_blocks() {
        return Vec::new();
    }
    model.kv_row_widths().iter().map(|w| w * block_size).collect()
}

/// Whether new requests of a run of `pools` enter its decode pools, whose ranks pick up each
/// request at arrival and decide where it is prefilled (by their pool's `[pool.disaggregation]`
/// rule; the default: remotely) — every disaggregated graph run whole in one process. A run of
/// some of the pools (`--pools`) takes new requests in its prefill pools instead, every prefill
/// remote, each decode rank picked when its handoff arrives (a rule is refused there).
pub fn decode_first(graph: &Graph, pools: &[&PoolConfig]) -> bool {
    graph.is_disaggregated() && pools.len() == graph.pools.len()
}

/// The first decode pool that sets a `[pool.disaggregation]` rule of its own, if any.
pub fn pool_with_disaggregation_rule(graph: &Graph) -> Option<&PoolConfig> {
    graph.pools.iter().find(|p| p.role == PoolRole::Decode && p.disaggregation != Default::default())
}

impl Wiring {
    /// How new requests enter `pool`, if they do.
    pub fn entry_kind(graph: &Graph, pools: &[&PoolConfig], pool: &PoolConfig) -> Option<AdmissionKind> {
        match (pool.role, decode_first(graph, pools)) {
            (PoolRole::Aggregated, _) => Some(AdmissionKind::Whole),
            (PoolRole::Prefill, false) => Some(AdmissionKind::PrefillOnly { back_to: None }),
            (PoolRole::Decode, true) => Some(AdmissionKind::Decide),
            _ => None,
        }
    }

    /// The ingresses that close once every entry pool of this process has ended: the local
    /// decode pools (not those fed from other processes: their links close them), or with
    /// decode-first routing the prefill pools.
    pub fn downstream_ingresses(&self, graph: &Graph, pools: &[&PoolConfig]) -> Vec<Arc<Ingress>> {
        if decode_first(graph, pools) {
            pools.iter().filter(|p| p.role == PoolRole::Prefill).map(|p| self.ingress[&p.name].clone()).collect()
        } else {
            self.decode_ingresses(pools)
        }
    }

    /// The local decode pools' ingresses that close once every prefill pool of this process has
    /// ended (not those fed from other processes: their links close them).
    pub fn decode_ingresses(&self, pools: &[&PoolConfig]) -> Vec<Arc<Ingress>> {
        pools
            .iter()
            .filter(|p| p.role == PoolRole::Decode && !self.served.contains(&p.name))
            .map(|p| self.ingress[&p.name].clone())
            .collect()
    }

    /// The listener of decode pool `pool`, if it has one.
    pub fn listener(&self, pool: &str) -> Option<&TcpConsumer> {
        self.listeners.iter().find(|(name, _)| name == pool).map(|(_, l)| l)
    }
}

/// The producer connections a decode pool served in a process of its own takes: `[transfer]
/// connections` per link into it, from each process of the link's prefill pool.
pub fn producer_connections(graph: &Graph, decode: &str) -> usize {
    let processes = |pool: &str| graph.pool(pool).map_or(1, |p| p.hosts.len().max(1));
    graph.links_to(decode).iter().map(|l| processes(&l.from)).sum::<usize>() * graph.transfer.connections
}

/// Where decode pool `to` listens: `--endpoint`, else the endpoint of a tcp link into it
/// (default `127.0.0.1:0`).
fn listen_endpoint(graph: &Graph, to: &str, endpoints: &HashMap<String, String>) -> Option<String> {
    if let Some(e) = endpoints.get(to) {
        return Some(e.clone());
    }
    let link = graph.links.iter().find(|l| l.to == to && l.backend == TransferBackend::Tcp)?;
    Some(link.endpoint.as_ref().map_or("127.0.0.1:0".to_string(), ToString::to_string))
}

/// `link`'s rate (`bandwidth`), if it has one.
fn link_rate(link: &LinkConfig) -> Option<Arc<LinkRate>> {
    link.bandwidth.map(|bytes_per_s| Arc::new(LinkRate::new(bytes_per_s as f64)))
}

/// Where a producer of this process reaches decode pool `link.to`, which runs in another.
fn remote_address(graph: &Graph, link: &LinkConfig, endpoints: &HashMap<String, String>) -> Result<SocketAddr> {
    let place = format!("{}: link {} → {}", graph.path.display(), link.from, link.to);
    if link.backend != TransferBackend::Tcp {
        bail!(
            "{place}: decode pool `{}` is not in this process (--pools), so the link must be backend = \"tcp\"",
            link.to
        );
    }
    let text = match (endpoints.get(&link.to), &link.endpoint) {
        (Some(e), _) => e.clone(),
        (None, Some(e)) if e.port != 0 => e.to_string(),
        _ => bail!(
            "{place}: decode pool `{}` runs in another process: give its address with --endpoint {}=HOST:PORT (its \
             process prints it when it listens) or a fixed port in the link's endpoint",
            link.to,
            link.to
        ),
    };
    text.to_socket_addrs()
        .map_err(|e| anyhow!("{place}: cannot resolve {text}: {e}"))?
        .next()
        .ok_or_else(|| anyhow!("{place}: {text} resolves to no address"))
}

/// What a decode pool's ranks decide with when new requests enter it (decode-first routing):
/// its rule, and the linked prefill pools of this process.
fn remote_prefill(
    graph: &Graph,
    pools: &[&PoolConfig],
    pool: &PoolConfig,
    ingress: &HashMap<String, Arc<Ingress>>,
    queues: &HashMap<String, Arc<AtomicUsize>>,
) -> Option<RemotePrefill> {
    if !decode_first(graph, pools) {
        return None;
    }
    let rule = pool.disaggregation;
    let targets = graph
        .links_to(&pool.name)
        .into_iter()
        .filter(|l| ingress.contains_key(&l.from))
        .map(|l| PrefillTarget {
            name: l.from.clone(),
            ingress: ingress[&l.from].clone(),
            link: graph.links_from(&l.from).iter().position(|o| o.to == pool.name).unwrap_or(0) as u16,
            queue: queues[&l.from].clone(),
        })
        .collect();
    Some(RemotePrefill { rule, targets })
}

/// Wires the pools this run starts.
pub fn wire(graph: &Graph, pools: &[&PoolConfig], model: &Model, options: &WireOptions) -> Result<Wiring> {
    let ingress: HashMap<String, Arc<Ingress>> =
        pools.iter().map(|p| (p.name.clone(), Arc::new(Ingress::default()))).collect();
    let (faults, counters) = (faults(graph), Arc::new(TransferCounters::default()));
    let inboxes: HashMap<String, Arc<HandoffInbox>> = pools
        .iter()
        .filter(|p| p.role == PoolRole::Decode)
        .map(|p| {
            let mut inbox = HandoffInbox::new(faults, counters.clone());
            inbox.deliver_duplicates = options.deliver_duplicates;
            inbox.accept_missing_pieces = options.accept_missing_pieces;
            inbox.block_size = p.memory.block_size;
            inbox.kv_rows = if model.needs_blocks() { model.kv_row_widths() } else { Vec::new() };
            (p.name.clone(), Arc::new(inbox))
        })
        .collect();
    let mut wires = Wires {
        graph,
        pools,
        model,
        options,
        token: graph.transfer.deployment_token.clone(),
        faults,
        counters,
        socket_bytes: Arc::new(AtomicU64::new(0)),
        ingress,
        inboxes,
        bound: HashMap::new(),
        remote_links: Vec::new(),
    };
    // The decode pools with tcp links in bind first; producers connect to the bound address.
    let (listeners, served) = wires.bind_decode_pools()?;
    let queues: HashMap<String, Arc<AtomicUsize>> = pools
        .iter()
        .filter(|p| p.role == PoolRole::Prefill)
        .map(|p| (p.name.clone(), Arc::new(AtomicUsize::new(0))))
        .collect();
    let mut handoff = HashMap::new();
    for pool in pools {
        let role = match pool.role {
            PoolRole::Aggregated => PoolHandoff::None,
            PoolRole::Decode => PoolHandoff::In(
                wires.inboxes[&pool.name].clone(),
                remote_prefill(graph, pools, pool, &wires.ingress, &queues),
            ),
            PoolRole::Prefill => PoolHandoff::Out {
                sink: wires.handoff_sink(pool)?,
                fingerprint: model.handoff_fingerprint(),
                kv_layers: kv_layers(model, pool.memory.block_size),
                queue: queues[&pool.name].clone(),
                relay: options.relay.clone(),
            },
        };
        handoff.insert(pool.name.clone(), role);
    }
    let Wires { ingress, inboxes, remote_links, socket_bytes, counters, .. } = wires;
    let inboxes = inboxes.into_iter().collect();
    Ok(Wiring { ingress, handoff, listeners, served, remote_links, socket_bytes, counters, inboxes })
}

/// What the wiring of a run shares while it is built.
struct Wires<'a> {
    graph: &'a Graph,
    pools: &'a [&'a PoolConfig],
    model: &'a Model,
    options: &'a WireOptions<'a>,
    /// `[transfer] deployment_token`: what a consumer asks of every producer connecting.
    token: Option<String>,
    faults: Faults,
    counters: Arc<TransferCounters>,
    socket_bytes: Arc<AtomicU64>,
    ingress: HashMap<String, Arc<Ingress>>,
    inboxes: HashMap<String, Arc<HandoffInbox>>,
    /// Where each decode pool of this process with a tcp listener listens.
    bound: HashMap<String, SocketAddr>,
    remote_links: Vec<Arc<TcpLink>>,
}

impl Wires<'_> {
    fn local(&self, name: &str) -> bool {
        self.pools.iter().any(|p| p.name == name)
    }

    /// Binds the tcp listener of every decode pool of this process that has tcp links in (or an
    /// `--endpoint`): its listeners, and the decode pools fed from other processes.
    fn bind_decode_pools(&mut self) -> Result<(Vec<(String, TcpConsumer)>, Vec<String>)> {
        let (graph, model) = (self.graph, self.model);
        let (mut listeners, mut served) = (Vec::new(), Vec::new());
        for pool in self.pools.iter().filter(|p| p.role == PoolRole::Decode) {
            let into = graph.links_to(&pool.name);
            let remote_producers = into.iter().filter(|l| !self.local(&l.from)).count();
            if remote_producers > 0 && remote_producers < into.len() {
                bail!(
                    "{}: decode pool `{}` takes handoffs from pools in this process and in others; run it in a \
                     process with all of its prefill pools, or with none",
                    graph.path.display(),
                    pool.name
                );
            }
            let Some(endpoint) = listen_endpoint(graph, &pool.name, self.options.endpoints) else { continue };
            let consumer = ConsumerPool {
                name: pool.name.clone(),
                ingress: self.ingress[&pool.name].clone(),
                inbox: self.inboxes[&pool.name].clone(),
            };
            let served_here = remote_producers > 0;
            // As many producer links as the graph links into the pool: one more is refused.
            let links_in = producer_connections(graph, &pool.name);
            let consumer_options = ConsumerOptions {
                token: self.token.clone(),
                expect_links: served_here.then_some(links_in),
                max_links: (!self.options.serve_any_producer).then_some(links_in),
                landing: self.landing(pool)?,
            };
            let listener = TcpConsumer::bind(&endpoint, consumer, consumer_layout(model, pool), consumer_options)
                .map_err(|e| anyhow!("{}: decode pool `{}`: {e}", graph.path.display(), pool.name))?;
            if served_here {
                eprintln!("decode pool `{}` listening on {}", pool.name, listener.addr());
                served.push(pool.name.clone());
            }
            self.bound.insert(pool.name.clone(), listener.addr());
            listeners.push((pool.name.clone(), listener));
        }
        Ok((listeners, served))
    }

    /// Where a cuda decode pool's tcp handoffs land: in device memory on its first rank's GPU,
    /// piece by piece as they arrive (a rank on another GPU reads them back through the host).
    fn landing(&self, pool: &PoolConfig) -> Result<Option<(Arc<Landing>, Arc<TransferCounters>)>> {
        if pool.executor != "cuda" {
            return Ok(None);
        }
        let at = |e: String| {
            anyhow!("{}: decode pool `{}`: landing handoffs on the GPU: {e}", self.graph.path.display(), pool.name)
        };
        let settings = CudaSettings::read(&pool.executor_settings).map_err(|e| at(e.to_string()))?;
        let gpu = if settings.emulate { 0 } else { settings.gpu_of(0).map_err(|e| at(e.to_string()))? };
        let landing = Landing::open(gpu, settings.emulate).map_err(|e| at(e.to_string()))?;
        Ok(Some((Arc::new(landing), self.counters.clone())))
    }

    /// Where prefill pool `pool` hands off: its links, all inproc or all tcp, to decode pools
    /// whose KV has the same element type (block sizes may differ: the consumer re-cuts them).
    fn handoff_sink(&mut self, pool: &PoolConfig) -> Result<Arc<dyn HandoffSink>> {
        let graph = self.graph;
        let out = graph.links_from(&pool.name);
        let fingerprint = self.model.handoff_fingerprint();
        for link in &out {
            let to = graph.pool(&link.to)?;
            let (from_dtype, to_dtype) = (kv_dtype(pool)?, kv_dtype(to)?);
            if from_dtype != to_dtype {
                bail!(
                    "{}: link {} → {}: prefill pool `{}` keeps its KV in {from_dtype}, decode pool `{}` in {to_dtype}; \
                     a handoff is not converted between element types (it would not be exact): give both pools \
                     the same dtype",
                    graph.path.display(),
                    link.from,
                    link.to,
                    pool.name,
                    to.name
                );
            }
        }
        let simulated = out.iter().all(|l| l.backend == TransferBackend::Sim);
        if simulated || out.iter().all(|l| l.backend == TransferBackend::Inproc) {
            if let Some(l) = out.iter().find(|l| !self.local(&l.to)) {
                remote_address(graph, l, self.options.endpoints)?; // fails: names the fix
            }
            let consumers = out
                .iter()
                .map(|l| ConsumerPool {
                    name: l.to.clone(),
                    ingress: self.ingress[&l.to].clone(),
                    inbox: self.inboxes[&l.to].clone(),
                })
                .collect();
            let rates = out.iter().map(|l| link_rate(l)).collect();
            let stream_min_tokens = out.iter().map(|l| l.stream_min_tokens).collect();
            let (faults, counters) = (self.faults, self.counters.clone());
            let clock = match (simulated, &self.options.clock) {
                (false, _) => None,
                (true, Some(clock)) => Some(clock.clone()),
                (true, None) => bail!(
                    "{}: prefill pool `{}`: backend \"sim\" links run only in a simulated run (every pool's executor \
                     \"sim\"); use \"inproc\" or \"tcp\"",
                    graph.path.display(),
                    pool.name
                ),
            };
            Ok(Arc::new(InprocLinks { consumers, rates, stream_min_tokens, faults, counters, clock }))
        } else if out.iter().all(|l| l.backend == TransferBackend::Tcp) {
            self.tcp_links(pool, &out, fingerprint)
        } else {
            bail!(
                "{}: prefill pool `{}` has links of backends {}; one backend per prefill pool",
                graph.path.display(),
                pool.name,
                out.iter().map(|l| format!("\"{}\"", l.backend)).collect::<Vec<_>>().join(", ")
            );
        }
    }

    /// Prefill pool `pool`'s tcp links: `[transfer] connections` per link, to the bound address of
    /// a decode pool of this process or the address of one in another (whose events come back
    /// over the link).
    fn tcp_links(&mut self, pool: &PoolConfig, out: &[&LinkConfig], fingerprint: u64) -> Result<Arc<dyn HandoffSink>> {
        let (graph, options) = (self.graph, self.options);
        let mut links = Vec::new();
        let connections = graph.transfer.connections;
        // One rate per link, shared by its connections.
        let out: Vec<(&LinkConfig, Option<Arc<LinkRate>>)> = out.iter().map(|l| (*l, link_rate(l))).collect();
        for (l, rate) in out.iter().flat_map(|l| std::iter::repeat_n(l, connections)) {
            let remote = !self.local(&l.to);
            let addr = if remote { remote_address(graph, l, options.endpoints)? } else { self.bound[&l.to] };
            let target = LinkTarget { to: l.to.clone(), addr, fingerprint, token: self.token.clone(), link_id: 0 };
            let link_options = LinkOptions {
                checksum: graph.transfer.checksum,
                faults: self.faults,
                counters: self.counters.clone(),
                socket_bytes: self.socket_bytes.clone(),
                events: remote.then(|| match &options.relay {
                    Some(relay) => relay.sink(),
                    None => (options.remote_events)(&l.to),
                }),
                patience: if remote { options.patience } else { Duration::ZERO },
                rate: rate.clone(),
            };
            let link = Arc::new(
                TcpLink::connect(target, link_options)
                    .map_err(|e| anyhow!("{}: prefill pool `{}`: {e}", graph.path.display(), pool.name))?,
            );
            if remote {
                self.remote_links.push(link.clone());
            }
            links.push(link);
        }
        let stream_min_tokens = out.iter().map(|(l, _)| l.stream_min_tokens).collect();
        Ok(Arc::new(TcpLinks::new(links, connections, stream_min_tokens)))
    }
}
