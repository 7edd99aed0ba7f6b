//! A rank's load thread: it takes a load job (the keys of consecutive chunks of one request's
//! prefix), gets every object from the store and returns them in one completion record — all of
//! them or none (a chunk that went missing or is damaged fails the whole load, and the request
//! recomputes). The thread only reads the store: the objects are written into the request's
//! blocks by the step that admits it, before its forward (`rank/load.rs`).

use super::worker::Worker;
use super::{ChunkKey, ChunkObject, ObjectStore};
use crate::pool::wake::RankWaker;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The chunks `keys` (in prefix order) to load, for the load `id`.
#[derive(Clone, Debug)]
pub struct LoadJob {
    pub id: u64,
    pub keys: Vec<ChunkKey>,
}

/// Every chunk of a load, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    pub objects: Vec<ChunkObject>,
    pub bytes: u64,
    pub seconds: f64,
    /// A simulated run's load (`store = "sim"`): its objects hold no floats, `bytes` is what
    /// they would have held.
    pub sized: bool,
}

impl Loaded {
    /// A simulated load of `chunks` chunks, `bytes` in all.
    pub fn sized(chunks: usize, bytes: u64, seconds: f64) -> Self {
        let objects = vec![ChunkObject { kv: Vec::new(), state: None }; chunks];
        Loaded { objects, bytes, seconds, sized: true }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LoadDone {
    pub id: u64,
    pub outcome: Result<Loaded, String>,
}

/// A prefix loaded for a request: chunks `first_chunk..` of its prompt, `chunk_tokens` each, kept
/// until the step that admits the request writes them into its blocks (and slot).
#[derive(Clone, Debug)]
pub struct RestoredPrefix {
    pub first_chunk: usize,
    pub chunk_tokens: usize,
    pub objects: Vec<Arc<ChunkObject>>,
}

impl RestoredPrefix {
    /// The prompt position it restores up to.
    pub fn end(&self) -> usize {
        (self.first_chunk + self.objects.len()) * self.chunk_tokens
    }
}

/// A rank's load thread.
pub type Loader = Worker<LoadJob, LoadDone>;

/// Starts the load thread of one rank. `delay` (test only: a slow store) is waited before each
/// load.
pub fn spawn_loader(
    store: Arc<dyn ObjectStore>,
    waker: Arc<RankWaker>,
    delay: Duration,
    name: String,
) -> Result<Loader, String> {
    Worker::spawn(name, waker, move |job: LoadJob| {
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        LoadDone { id: job.id, outcome: load_all(&*store, &job.keys) }
    })
}

fn load_all(store: &dyn ObjectStore, keys: &[ChunkKey]) -> Result<Loaded, String> {
    let started = Instant::now();
    let mut objects = Vec::with_capacity(keys.len());
    for (i, key) in keys.iter().enumerate() {
        match store.get_object(key) {
            Ok(Some(object)) => objects.push(object),
            Ok(None) => return Err(format!("chunk {i} of {} ({key}) is missing or damaged", keys.len())),
            Err(e) => return Err(format!("chunk {i} of {} ({key}): {e}", keys.len())),
        }
    }
    let floats: usize = objects.iter().map(|o| o.kv.len() + o.state.as_ref().map_or(0, Vec::len)).sum();
    Ok(Loaded { objects, bytes: 4 * floats as u64, seconds: started.elapsed().as_secs_f64(), sized: false })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offload::{chunk_digests, encode_object, MemoryStore, Namespace};

    #[test]
    fn a_load_is_all_or_nothing() {
        let ns = Namespace::of(&[("family", "mha")]);
        let keys: Vec<ChunkKey> = chunk_digests(&(0..24).collect::<Vec<u32>>(), 8, 0)
            .into_iter()
            .map(|digest| ChunkKey { namespace: ns, shard: 0, shards: 1, digest })
            .collect();
        let store = MemoryStore::new(1 << 20);
        for (i, k) in keys.iter().enumerate() {
            store.put(k, &encode_object(&ChunkObject { kv: vec![i as f32; 4], state: None })).unwrap();
        }
        let loaded = load_all(&store, &keys).unwrap();
        assert_eq!(loaded.objects.iter().map(|o| o.kv[0]).collect::<Vec<_>>(), vec![0.0, 1.0, 2.0]);
        assert_eq!(loaded.bytes, 3 * 16);
        store.put(&keys[1], b"damaged").unwrap();
        let why = load_all(&store, &keys).unwrap_err();
        assert!(why.contains("chunk 1 of 3") && why.contains("missing or damaged"), "{why}");
    }
}
