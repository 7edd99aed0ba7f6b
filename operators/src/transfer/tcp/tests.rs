//! A link of several connections really spreads the handoffs in flight over them.

use super::{LinkOptions, LinkTarget, TcpConsumer, TcpLink, TcpLinks};
use crate::pool::admit::Ingress;
use crate::pool::wake::RankWaker;
use crate::transfer::inproc::{AckQueue, ConsumerPool, HandoffInbox, HandoffSink, Taken};
use crate::transfer::wire::tests::{handoff, layout};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sends four handoffs that nobody takes (so none is answered) over a link of `connections`;
/// returns the handoffs each connection holds and the bytes each wrote.
fn spread(connections: usize) -> (Vec<usize>, Vec<u64>) {
    let inbox = Arc::new(HandoffInbox::default());
    let pool = ConsumerPool { name: "d".into(), ingress: Arc::new(Ingress::default()), inbox: inbox.clone() };
    let consumer = TcpConsumer::bind("127.0.0.1:0", pool, layout(), Default::default()).expect("binds");
    let written: Vec<Arc<AtomicU64>> = (0..connections).map(|_| Arc::default()).collect();
    let links = written
        .iter()
        .map(|bytes| {
            let target = LinkTarget {
                to: "d".into(),
                addr: consumer.addr(),
                fingerprint: layout().fingerprint,
                token: None,
                link_id: 0,
            };
            let options = LinkOptions { checksum: true, socket_bytes: bytes.clone(), ..Default::default() };
            Arc::new(TcpLink::connect(target, options).expect("registers"))
        })
        .collect();
    let sink = TcpLinks::new(links, connections, Vec::new());
    let acks = AckQueue::new(Arc::new(RankWaker::default()));
    for id in 0..4 {
        let mut h = handoff();
        (h.request, h.transfer.nonce) = (id, id);
        sink.send(h, acks.clone()).expect("queued");
    }
    let held = sink.links.iter().map(|link| link.unanswered()).collect();
    // Every handoff arrives whole (the consumer checks its checksum), then each is taken.
    let deadline = Instant::now() + Duration::from_secs(30);
    for id in 0..4 {
        while !matches!(inbox.take(id), Taken::Handoff(_)) {
            assert!(Instant::now() < deadline, "handoff {id} never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // A link counts its bytes once a frame is written whole, which may be just after it arrived.
    while written.iter().any(|b| b.load(Ordering::Relaxed) == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    (held, written.iter().map(|b| b.load(Ordering::Relaxed)).collect())
}

#[test]
fn handoffs_in_flight_together_go_over_different_connections() {
    let (held, written) = spread(2);
    assert_eq!(held, vec![2, 2], "each connection carries half of the handoffs in flight");
    assert!(written.iter().all(|&b| b > 0), "bytes crossed both connections: {written:?}");
    let (held, written) = spread(1);
    assert_eq!(held, vec![4]);
    assert!(written[0] > 0);
}
