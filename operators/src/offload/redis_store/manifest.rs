//! A chunk's manifest in the shared store, written beside its object in the same transaction:
//! the object's length and checksum (its CRC32C trailer) and the run id of the server it was
//! written to. A load trusts an object only when all three agree with what it read and with the
//! server it reads from now.

const MAGIC: &[u8; 4] = b"kvm1";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub len: u64,
    pub crc: u32,
    pub run_id: String,
}

impl Manifest {
    /// The manifest of `object` (an encoded chunk object, CRC32C last) on server `run_id`.
    pub fn of(object: &[u8], run_id: &str) -> Self {
        Manifest { len: object.len() as u64, crc: trailer_crc(object), run_id: run_id.to_string() }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.run_id.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.crc.to_le_bytes());
        out.extend_from_slice(self.run_id.as_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 16 || &bytes[..4] != MAGIC {
            return None;
        }
        Some(Manifest {
            len: u64::from_le_bytes(bytes[4..12].try_into().ok()?),
            crc: u32::from_le_bytes(bytes[12..16].try_into().ok()?),
            run_id: String::from_utf8(bytes[16..].to_vec()).ok()?,
        })
    }

    /// Why an object of `len` bytes with checksum `crc`, read from server `run_id`, is not the one
    /// this manifest describes.
    pub fn mismatch(&self, len: u64, crc: u32, run_id: &str) -> Option<String> {
        let found = Manifest { len, crc, run_id: run_id.to_string() };
        if self.run_id != run_id {
            Some(format!("written to the server before its restart (run id {}, now {run_id})", self.run_id))
        } else if found.len != self.len || found.crc != self.crc {
            Some(format!(
                "{} bytes with checksum {:08x}, the manifest says {} bytes with {:08x}",
                found.len, found.crc, self.len, self.crc
            ))
        } else {
            None
        }
    }
}

/// The checksum an encoded object ends with (0 for fewer than 4 bytes).
pub fn trailer_crc(object: &[u8]) -> u32 {
    object.len().checked_sub(4).map_or(0, |at| u32::from_le_bytes(object[at..].try_into().expect("4")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_reads_back_and_names_what_differs() {
        let object = b"some object bytes\x01\x02\x03\x04";
        let m = Manifest::of(object, "abc");
        assert_eq!(Manifest::decode(&m.encode()), Some(m.clone()));
        assert_eq!(m.mismatch(m.len, m.crc, "abc"), None);
        assert!(m.mismatch(m.len, m.crc, "def").unwrap().contains("restart"));
        assert!(m.mismatch(m.len - 1, m.crc, "abc").unwrap().contains("the manifest says"));
        assert!(m.mismatch(m.len, m.crc ^ 1, "abc").unwrap().contains("the manifest says"));
        assert_eq!(Manifest::decode(b"kvm1short"), None);
    }
}
