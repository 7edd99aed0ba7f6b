//! The `inproc` transfer backend: producer and consumer pools in one process. A handoff moves as
//! an `Arc` (no serialization, no socket): the consumer's executor copies it into the blocks and
//! slot it allocated, before the step that first reads them. The consumer acks a handoff when it
//! takes it (it owns the bytes from then on); the producer holds the request's blocks and slot
//! until that ack arrives.

use super::{locked, Handoff, TransferId};
use crate::admit::Ingress;
use crate::messages::{Admission, AdmissionKind};
use crate::wake::RankWaker;
use kvflow_kernels::hash;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Where a consumer's answer to one handoff goes: `Ok` once it has the bytes, `Err` when it
/// refused them (a bad checksum, a layout it cannot hold).
pub trait Ack: Send + Sync {
    fn ack(&self, request: u64, transfer: TransferId, outcome: Result<(), String>);
}

/// An ack as the producer rank reads it.
pub type AckRecord = (u64, TransferId, Result<(), String>);

/// Acks for one producer rank, raised by consumers; draining them releases what the rank held.
pub struct AckQueue {
    acks: Mutex<Vec<AckRecord>>,
    waker: Arc<RankWaker>,
}

impl AckQueue {
    pub fn new(waker: Arc<RankWaker>) -> Arc<Self> {
        Arc::new(AckQueue { acks: Mutex::new(Vec::new()), waker })
    }

    /// Every ack raised since the last call.
    pub fn drain(&self) -> Vec<AckRecord> {
        std::mem::take(&mut *locked(&self.acks))
    }
}

impl Ack for AckQueue {
    /// The consumer answered request `request`'s handoff `transfer`: wake the producer rank.
    fn ack(&self, request: u64, transfer: TransferId, outcome: Result<(), String>) {
        locked(&self.acks).push((request, transfer, outcome));
        self.waker.wake();
    }
}

/// Handoffs that reached a consumer pool, by request id, until the rank the router chose takes
/// its one (every rank of the pool in this process shares the inbox).
#[derive(Default)]
pub struct HandoffInbox {
    arrived: Mutex<HashMap<u64, Arrived>>,
}

/// A handoff waiting in an inbox, with where its ack goes.
type Arrived = (Arc<Handoff>, Arc<dyn Ack>);

impl HandoffInbox {
    /// A handoff arrived (its admission follows through the pool's ingress).
    pub fn put(&self, h: Arc<Handoff>, ack: Arc<dyn Ack>) {
        locked(&self.arrived).insert(h.request, (h, ack));
    }

    /// Takes request `id`'s handoff and acks it (the taker owns the bytes now).
    pub fn take(&self, id: u64) -> Option<Arc<Handoff>> {
        let (h, ack) = locked(&self.arrived).remove(&id)?;
        ack.ack(id, h.transfer, Ok(()));
        Some(h)
    }

    /// Handoffs not taken yet.
    pub fn len(&self) -> usize {
        locked(&self.arrived).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A decode pool a producer may hand off to: its ingress and its inbox.
#[derive(Clone)]
pub struct ConsumerPool {
    pub name: String,
    pub ingress: Arc<Ingress>,
    pub inbox: Arc<HandoffInbox>,
}

/// Where a producer rank's finished prefills go: the decode pools its links name, one chosen
/// per request (a seeded draw on its id, so a run is repeatable).
pub trait HandoffSink: Send + Sync {
    /// Sends `h`; `ack` is raised when the consumer has it. Returns the pool it went to.
    fn send(&self, h: Handoff, ack: Arc<AckQueue>) -> Result<String, String>;
}

/// The admission a handoff enters its decode pool with.
pub fn handoff_admission(h: &Handoff) -> Admission {
    Admission {
        id: h.request,
        prompt: h.prompt.clone(),
        max_output_tokens: h.max_output_tokens,
        warmup: h.warmup,
        kind: AdmissionKind::Handoff,
    }
}

/// `inproc` links to decode pools of this process.
pub struct InprocLinks {
    pub consumers: Vec<ConsumerPool>,
}

impl HandoffSink for InprocLinks {
    fn send(&self, h: Handoff, ack: Arc<AckQueue>) -> Result<String, String> {
        if self.consumers.is_empty() {
            return Err("no decode pool is linked".into());
        }
        let pick = (hash::mix(hash::EMPTY, h.request) % self.consumers.len() as u64) as usize;
        let to = &self.consumers[pick];
        if to.ingress.is_closed() {
            return Err(format!("decode pool {} no longer takes handoffs", to.name));
        }
        let admission = handoff_admission(&h);
        to.inbox.put(Arc::new(h), ack);
        to.ingress.push(admission);
        Ok(to.name.clone())
    }
}
