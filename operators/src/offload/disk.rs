//! `disk`: one file per object under a folder, named by its key. A put writes a temporary file
//! and renames it over the name, so a reader never sees half an object; objects carry their own
//! checksum (`object.rs`), and a get of a corrupt or truncated file is a miss with a warning —
//! the file is removed — never a crash. What is on disk outlives the run: a second run over the
//! same folder finds it.

use super::{check_object, read_object, ChunkKey, ChunkObject, ObjectStore, StoreError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub struct DiskStore {
    dir: PathBuf,
    /// Bytes of the objects written or found, as far as this process knows.
    bytes: AtomicU64,
    /// Distinguishes this process's temporary files.
    next_temp: AtomicU64,
}

impl DiskStore {
    /// A store in `dir` (created if missing), which this process must be able to write: a
    /// folder that exists but refuses files would drop every save, so it is refused here,
    /// before the run serves anything.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Io(format!("cannot create the store folder {}: {e}", dir.display())))?;
        let probe = dir.join(format!(".{}.probe.tmp", std::process::id()));
        std::fs::File::create(&probe).and_then(|_| std::fs::remove_file(&probe)).map_err(|e| {
            StoreError::Io(format!(
                "the store folder {} cannot be written (a saved chunk is a file there): {e}",
                dir.display()
            ))
        })?;
        let bytes = std::fs::read_dir(dir)
            .map_err(|e| StoreError::Io(format!("cannot read the store folder {}: {e}", dir.display())))?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".kvc"))
            .filter_map(|e| e.metadata().ok().map(|m| m.len()))
            .sum();
        Ok(DiskStore { dir: dir.to_path_buf(), bytes: AtomicU64::new(bytes), next_temp: AtomicU64::new(0) })
    }

    /// The file of `key`: its text form with `/` as `_`.
    fn path(&self, key: &ChunkKey) -> PathBuf {
        self.dir.join(format!("{}.kvc", key.to_string().replace('/', "_")))
    }
}

impl ObjectStore for DiskStore {
    fn put(&self, key: &ChunkKey, object: &[u8]) -> Result<(), StoreError> {
        let path = self.path(key);
        let n = self.next_temp.fetch_add(1, Ordering::Relaxed);
        let temp = self.dir.join(format!(".{}.{}.{n}.tmp", std::process::id(), key.digest.0[0]));
        let written = (|| {
            let mut f = std::fs::File::create(&temp)?;
            f.write_all(object)?;
            f.sync_data()?;
            std::fs::rename(&temp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            let full = e.raw_os_error() == Some(28); // ENOSPC
            let what = format!("writing {}: {e}", path.display());
            return Err(if full { StoreError::Full(what) } else { StoreError::Io(what) });
        }
        self.bytes.fetch_add(object.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn get(&self, key: &ChunkKey) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.path(key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                tracing::warn!("offload store: reading {}: {e}; treated as a miss", path.display());
                return Ok(None);
            }
        };
        if let Err(e) = check_object(&bytes) {
            tracing::warn!("offload store: {} is not a sound object ({e}); removed, treated as a miss", path.display());
            let _ = std::fs::remove_file(&path);
            return Ok(None);
        }
        Ok(Some(bytes))
    }

    fn contains(&self, key: &ChunkKey) -> bool {
        self.path(key).is_file()
    }

    fn get_object(&self, key: &ChunkKey) -> Result<Option<ChunkObject>, StoreError> {
        let path = self.path(key);
        let opened = std::fs::File::open(&path).and_then(|f| f.metadata().map(|m| (f, m.len())));
        let (file, len) = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                tracing::warn!("offload store: opening {}: {e}; treated as a miss", path.display());
                return Ok(None);
            }
        };
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        match read_object(&mut std::io::BufReader::with_capacity(1 << 16, file), len) {
            Ok((object, _)) => Ok(Some(object)),
            Err(e) => {
                tracing::warn!(
                    "offload store: {} is not a sound object ({e}); removed, treated as a miss",
                    path.display()
                );
                let _ = std::fs::remove_file(&path);
                Ok(None)
            }
        }
    }

    fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{chunk_digests, encode_object, ChunkObject, Namespace};
    use super::*;

    #[test]
    fn objects_survive_a_reopen_and_a_damaged_one_is_a_miss() {
        let dir = std::env::temp_dir().join(format!("kvflow-disk-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ns = Namespace::of(&[("family", "hybrid_kda")]);
        let d = chunk_digests(&(0..16).collect::<Vec<u32>>(), 8, 0);
        let key = |c: usize| ChunkKey { namespace: ns, shard: 0, shards: 1, digest: d[c] };
        let object = encode_object(&ChunkObject { kv: vec![1.0, 2.0], state: Some(vec![3.0]) });
        {
            let store = DiskStore::open(&dir).unwrap();
            store.put(&key(0), &object).unwrap();
            store.put(&key(1), &object).unwrap();
        }
        let store = DiskStore::open(&dir).unwrap();
        assert_eq!(store.bytes(), 2 * object.len() as u64, "a second run finds what the first wrote");
        assert_eq!(store.get(&key(0)).unwrap().as_deref(), Some(&object[..]));
        assert_eq!(store.get_object(&key(0)).unwrap().map(|o| o.state), Some(Some(vec![3.0])));
        // Truncate one file: a miss, and the file is gone.
        let path = store.path(&key(1));
        std::fs::write(&path, &object[..object.len() - 3]).unwrap();
        assert_eq!(store.get(&key(1)).unwrap(), None);
        assert!(!store.contains(&key(1)));
        assert!(std::fs::read_dir(&dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp")));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
