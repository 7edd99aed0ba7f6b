//! `kvflow bench transfer`: handoffs over the tcp backend on loopback against a plain TCP stream
//! of the same bytes, measured in the same run. Each handoff is one request of `--tokens` tokens
//! of the default bench model (its prompt's KV, packed by layer: the copy a prefill rank's step
//! makes of its blocks), sent by a link of `--connections` tcp connections (a graph's `[transfer]
//! connections`) to a `TcpConsumer` that checks the descriptor, receives and checksums the
//! payload, and puts it in its inbox; a handoff counts when the consumer has taken it. The
//! baseline writes the same total bytes over one TCP connection in 4 MiB `write_all` calls with
//! TCP_NODELAY, timed until the reader has them all. Each figure is the median of `--rounds`
//! rounds, the ways of measuring taking turns within a round (so a slow spell of the machine
//! hits them alike); the ratio is the median of the rounds' own ratios. Also printed, earlier: the handoff figures with checksums off and over one
//! connection, and the inproc cost (the producer's step copying the blocks out, the consumer's
//! import copying them into its own) per MiB beside two plain memcpys of the same bytes.

use super::median;
use anyhow::{anyhow, Result};
use kvflow_kernels::checkpoint::ModelSpec;
use kvflow_kernels::kv::PagedKvCache;
use kvflow_kernels::models;
use kvflow_operators::pool::admit::Ingress;
use kvflow_operators::pool::wake::RankWaker;
use kvflow_operators::transfer::wire::ConsumerLayout;
use kvflow_operators::transfer::{
    AckQueue, ConsumerPool, Handoff, HandoffInbox, HandoffSink, LinkOptions, LinkTarget, Taken, TcpConsumer, TcpLink,
    TcpLinks, TransferId,
};
use std::io::{Read, Write};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

pub struct TransferBenchArgs {
    pub tokens: usize,
    /// Total bytes to move (each way of measuring moves the same, each round).
    pub bytes: u64,
    /// Tcp connections of the link.
    pub connections: usize,
    pub rounds: usize,
}

const BLOCK: usize = 16;
/// Handoffs queued on the link at most (sent, not yet taken).
const WINDOW: usize = 4;

/// GB/s of handoffs of `h` over a link of `connections` until `total` bytes moved, checksummed
/// or not.
fn handoffs_gb_per_s(
    h: &Handoff,
    layout: ConsumerLayout,
    total: u64,
    checksum: bool,
    connections: usize,
) -> Result<f64> {
    let inbox = Arc::new(HandoffInbox::default());
    let pool = ConsumerPool { name: "bench".into(), ingress: Arc::new(Ingress::default()), inbox: inbox.clone() };
    let consumer = TcpConsumer::bind("127.0.0.1:0", pool, layout, Default::default()).map_err(|e| anyhow!(e))?;
    let target = LinkTarget {
        to: "bench".into(),
        addr: consumer.addr(),
        fingerprint: layout.fingerprint,
        token: None,
        link_id: 0,
    };
    let links = (0..connections)
        .map(|_| {
            let link = TcpLink::connect(target.clone(), LinkOptions { checksum, ..Default::default() });
            link.map(Arc::new).map_err(|e| anyhow!(e))
        })
        .collect::<Result<_>>()?;
    let link = TcpLinks::new(links, connections, Vec::new());
    let acks = AckQueue::new(Arc::new(RankWaker::default()));
    let bytes = h.payload_bytes();
    let count = total.div_ceil(bytes).max(1);
    let taken = Arc::new(AtomicU64::new(0));
    let wait_for = |id: u64| loop {
        if matches!(inbox.take(id), Taken::Handoff(_)) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    };
    let numbered = |id: u64| {
        let mut h = h.clone();
        h.request = id;
        h.transfer.nonce = id;
        h
    };
    // A window's worth of handoffs to warm the connection and the receiving side's buffers (a
    // serving consumer's steady state), then the timed ones back to back (at most 4 queued on
    // the link, as a rank's few prefills in flight), taken as they arrive (as a decode rank
    // takes them), so the receiving side reuses its buffers.
    let warm: Vec<u64> = (0..WINDOW as u64 + 1).map(|k| u64::MAX - k).collect();
    for &id in &warm {
        link.send(numbered(id), acks.clone()).map_err(|e| anyhow!(e))?;
    }
    for &id in &warm {
        wait_for(id);
    }
    let drainer = {
        let (inbox, taken) = (inbox.clone(), taken.clone());
        std::thread::spawn(move || {
            for i in 0..count {
                while !matches!(inbox.take(i), Taken::Handoff(_)) {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                taken.store(i + 1, std::sync::atomic::Ordering::Release);
            }
            Instant::now()
        })
    };
    let started = Instant::now();
    for i in 0..count {
        let next = numbered(i);
        while i >= taken.load(std::sync::atomic::Ordering::Acquire) + WINDOW as u64 {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        link.send(next, acks.clone()).map_err(|e| anyhow!(e))?;
    }
    let done = drainer.join().map_err(|_| anyhow!("the draining thread panicked"))?;
    let secs = done.duration_since(started).as_secs_f64();
    drop(consumer);
    Ok((count * bytes) as f64 / secs / 1e9)
}

/// GB/s of `total` bytes over one plain TCP connection, 4 MiB writes, TCP_NODELAY.
fn plain_tcp_gb_per_s(total: u64) -> Result<f64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut conn, _) = listener.accept()?;
        let mut buf = vec![0u8; 4 << 20];
        let mut left = total + (4 << 20);
        while left > 0 {
            let n = conn.read(&mut buf)?;
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n as u64);
        }
        conn.write_all(&[1])
    });
    let mut conn = std::net::TcpStream::connect(addr)?;
    conn.set_nodelay(true)?;
    let chunk = vec![7u8; 4 << 20];
    conn.write_all(&chunk)?; // warm-up, like the handoff run's first one
    let started = Instant::now();
    let mut sent = 0;
    while sent < total {
        conn.write_all(&chunk)?;
        sent += chunk.len() as u64;
    }
    let mut done = [0u8];
    conn.read_exact(&mut done)?;
    let secs = started.elapsed().as_secs_f64();
    reader.join().map_err(|_| anyhow!("the baseline reader panicked"))??;
    Ok(sent as f64 / secs / 1e9)
}

pub fn run(args: &TransferBenchArgs) -> Result<()> {
    let spec = ModelSpec::parse("<default bench spec>".into(), super::model::DEFAULT_SPEC)?;
    let model = models::build(&spec.config, &spec.weights)?;
    let widths = model.kv_row_widths();
    let blocks = args.tokens.div_ceil(BLOCK);
    let floats_per_block = widths.iter().sum::<usize>() * BLOCK;
    let kv: Vec<f32> = (0..blocks * floats_per_block).map(|i| (i % 1013) as f32 * 0.001).collect();
    let prompt: Vec<u32> = (0..args.tokens as u32).map(|i| i % model.vocab_size as u32).collect();
    let h = Handoff {
        sampling: Default::default(),
        drafts: Vec::new(),
        delivery: Default::default(),
        transfer: TransferId { nonce: 0, generation: 1 },
        request: 0,
        prompt,
        max_output_tokens: 1,
        warmup: false,
        t0: 1,
        logits_hash: 0,
        fingerprint: model.layout_fingerprint(BLOCK),
        block_size: BLOCK,
        skip_blocks: 0,
        kv_blocks: blocks,
        floats_per_block,
        streamed: Vec::new(),
        kv,
        source: None,
        landed: None,
        state: None,
        started_ms: 0.0,
        t0_ms: 0.0,
        to: None,
        recycle: None,
        on_drop: Default::default(),
        simulated: None,
    };
    let layout = ConsumerLayout {
        fingerprint: h.fingerprint,
        block_size: BLOCK,
        floats_per_block,
        state_floats: 0,
        vocab_size: model.vocab_size,
        max_prompt: args.tokens,
    };
    let mib = (4 * h.kv.len()) as f64 / (1 << 20) as f64;
    println!(
        "handoff      one request of {} tokens of the default bench model: {mib:.1} MiB of KV ({} blocks)",
        args.tokens, blocks
    );
    // inproc: the producer's step copies the prompt's blocks out (the handoff owns them) and the
    // consumer's import copies them into its own blocks — what an inproc handoff costs — against
    // a memcpy of the same bytes, twice.
    let mut a = PagedKvCache::new(BLOCK, blocks, &widths);
    let mut b = PagedKvCache::new(BLOCK, blocks, &widths);
    let ids: Vec<u32> = (0..blocks as u32).collect();
    a.import_blocks(&ids, &h.kv).map_err(|e| anyhow!("{e}"))?;
    let mut out = Vec::new();
    a.export_blocks(&ids, &mut out); // fault the pages in first
    b.import_blocks(&ids, &out).map_err(|e| anyhow!("{e}"))?;
    let started = Instant::now();
    out.clear();
    a.export_blocks(&ids, &mut out);
    b.import_blocks(&ids, &out).map_err(|e| anyhow!("{e}"))?;
    let inproc_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut copy = vec![0f32; h.kv.len()];
    copy.copy_from_slice(std::hint::black_box(&h.kv)); // fault the pages in first, as above
    let started = Instant::now();
    copy.copy_from_slice(std::hint::black_box(&h.kv));
    out.copy_from_slice(std::hint::black_box(&copy));
    let memcpy_ms = started.elapsed().as_secs_f64() * 1e3;
    std::hint::black_box(&out);
    println!(
        "inproc       copy-out by the producer's step and import into the consumer's blocks {:.3} ms per MiB; \
         two memcpys {:.3} ms per MiB",
        inproc_ms / mib,
        memcpy_ms / mib
    );
    // Over tcp the handoffs send the copy the producer's step made, as a prefill rank's do.
    let (n, total) = (args.connections, args.bytes);
    let mut rounds: [Vec<f64>; 4] = Default::default();
    let progress = indicatif::ProgressBar::new(args.rounds as u64);
    progress.set_style(indicatif::ProgressStyle::with_template("rounds {bar:30} {pos}/{len}").expect("valid template"));
    for _ in 0..args.rounds {
        rounds[0].push(handoffs_gb_per_s(&h, layout, total, false, n)?);
        rounds[1].push(handoffs_gb_per_s(&h, layout, total, true, 1)?);
        rounds[2].push(handoffs_gb_per_s(&h, layout, total, true, n)?);
        rounds[3].push(plain_tcp_gb_per_s(total)?);
        progress.inc(1);
    }
    progress.finish_and_clear();
    // The ratio pairs each round's handoff figure with that round's baseline.
    let paired: Vec<f64> = rounds[2].iter().zip(&rounds[3]).map(|(h, b)| h / b).collect();
    let [unchecked, one_connection, checked, plain] = rounds.map(median);
    println!("handoff_unchecked_gb_per_s={unchecked:.3} ({n} connection(s), checksums off)");
    println!("handoff_one_connection_gb_per_s={one_connection:.3} (CRC32C on)");
    println!("handoff_gb_per_s={checked:.3} ({n} connection(s), CRC32C on)");
    println!("tcp_baseline_gb_per_s={plain:.3} (one connection, 4 MiB write_all, TCP_NODELAY)");
    println!("ratio={:.3}", median(paired));
    Ok(())
}
