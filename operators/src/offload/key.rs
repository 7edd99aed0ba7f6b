//! Chunk keys: `kvflow1-<namespace>/s<shard>of<shards>/<digest>` (DESIGN §9).

use kvflow_kernels::hash;
use std::fmt;

/// Everything that changes a chunk's bytes, hashed: two pools share chunks only when theirs
/// agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(pub u64);

impl Namespace {
    /// The namespace of a layout described by `(name, value)` pairs (family, geometry, dtype,
    /// block size, chunk size, layer split…); the order of the pairs does not matter.
    pub fn of(facts: &[(&str, &str)]) -> Self {
        let mut facts: Vec<(&str, &str)> = facts.to_vec();
        facts.sort_unstable();
        let mut h = hash::mix(hash::EMPTY, 0x006b_7666_6c6f_7731); // "kvflow1"
        for (name, value) in facts {
            h = bytes(bytes(h, name.as_bytes()), value.as_bytes());
        }
        Namespace(h)
    }
}

fn bytes(state: u64, b: &[u8]) -> u64 {
    let state = hash::mix(state, b.len() as u64);
    b.chunks(8).fold(state, |s, c| {
        let mut word = [0u8; 8];
        word[..c.len()].copy_from_slice(c);
        hash::mix(s, u64::from_le_bytes(word))
    })
}

/// A prefix up to a chunk's end: 128 bits, two independent chains over the same tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u64; 2]);

/// The digests of the full chunks of `tokens` (`chunk_tokens` each), each chaining the one before;
/// `seed` separates prompts whose rows depend on more than their tokens (DeepSeek-V3.2's prompt
/// length), as the prefix cache's keys do.
pub fn chunk_digests(tokens: &[u32], chunk_tokens: usize, seed: u64) -> Vec<Digest> {
    let mut d = [hash::mix(hash::mix(hash::EMPTY, 1), seed), hash::mix(hash::mix(hash::EMPTY, 2), seed)];
    tokens
        .chunks_exact(chunk_tokens.max(1))
        .map(|chunk| {
            d = [hash::tokens(d[0], chunk), hash::tokens(hash::mix(d[1], 0x9e37_79b9), chunk)];
            Digest(d)
        })
        .collect()
}

/// One shard's object of one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey {
    pub namespace: Namespace,
    pub shard: u16,
    pub shards: u16,
    pub digest: Digest,
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "kvflow1-{:016x}/s{}of{}/{:016x}{:016x}",
            self.namespace.0, self.shard, self.shards, self.digest.0[0], self.digest.0[1]
        )
    }
}

impl ChunkKey {
    /// The key whose text form is `text` (as [`fmt::Display`] writes it), if it is one.
    pub fn parse(text: &str) -> Option<ChunkKey> {
        let rest = text.strip_prefix("kvflow1-")?;
        let (namespace, rest) = rest.split_once("/s")?;
        let (shards, digest) = rest.split_once('/')?;
        let (shard, shards) = shards.split_once("of")?;
        let hex = |s: &str| (s.len() == 16).then(|| u64::from_str_radix(s, 16).ok()).flatten();
        if digest.len() != 32 {
            return None;
        }
        Some(ChunkKey {
            namespace: Namespace(hex(namespace)?),
            shard: shard.parse().ok()?,
            shards: shards.parse().ok()?,
            digest: Digest([hex(&digest[..16])?, hex(&digest[16..])?]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_names_the_whole_prefix_and_a_namespace_every_fact() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[3] = 99; // differs in the first chunk only
        let (da, db) = (chunk_digests(&a, 8, 0), chunk_digests(&b, 8, 0));
        assert_eq!(da.len(), 4);
        assert!(da.iter().zip(&db).all(|(x, y)| x != y), "a change early changes every later digest");
        assert_eq!(chunk_digests(&a[..20], 8, 0), da[..2], "a prefix has the same digests (partial chunks none)");
        let ns = Namespace::of(&[("family", "mla"), ("block_size", "16"), ("chunk_tokens", "64")]);
        assert_eq!(ns, Namespace::of(&[("chunk_tokens", "64"), ("family", "mla"), ("block_size", "16")]));
        assert_ne!(ns, Namespace::of(&[("family", "mla"), ("block_size", "32"), ("chunk_tokens", "64")]));
        let key = ChunkKey { namespace: ns, shard: 0, shards: 1, digest: da[0] };
        let text = key.to_string();
        assert!(text.starts_with("kvflow1-") && text.contains("/s0of1/") && text.len() == 8 + 16 + 7 + 32, "{text}");
        assert_eq!(ChunkKey::parse(&text), Some(key), "the text form reads back");
        assert_eq!(ChunkKey::parse(&text[..text.len() - 1]), None);
        assert_eq!(ChunkKey::parse("kvflow1-zz/s0of1/00"), None);
    }
}
