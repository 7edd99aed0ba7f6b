//! A stored chunk: its KV (packed by layer, as `export_blocks` lays it out) and, for recurrent
//! families, the state snapshot at the chunk's end — one object, so a load restores both or
//! neither. On the wire: a magic, the lengths, the floats, and a CRC32C of everything before it.

use crate::checksum::Crc32c;

const MAGIC: &[u8; 8] = b"kvflowc1";
const HEADER: usize = 8 + 8 + 8;
/// Bytes read (and checksummed) at a time by [`read_object`].
const READ_PIECE: usize = 128 << 10;

/// What one chunk's object holds.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkObject {
    pub kv: Vec<f32>,
    pub state: Option<Vec<f32>>,
}

/// Why bytes are not a sound object.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ObjectError {
    #[error("{0} bytes are too few for an object")]
    Truncated(usize),
    #[error("not a kvflow chunk object (bad magic)")]
    Magic,
    #[error("the lengths say {expected} bytes, the object has {got}")]
    Length { expected: usize, got: usize },
    #[error("checksum mismatch: stored {stored:08x}, computed {computed:08x}")]
    Checksum { stored: u32, computed: u32 },
}

/// The bytes an object of `kv` KV floats and `state` state floats (`None`: no state) takes.
pub fn object_bytes(kv: usize, state: Option<usize>) -> u64 {
    (HEADER + 4 * (kv + state.unwrap_or(0)) + 4) as u64
}

/// The bytes of `object`.
pub fn encode_object(object: &ChunkObject) -> Vec<u8> {
    let state = object.state.as_deref().unwrap_or(&[]);
    let mut out = Vec::with_capacity(HEADER + 4 * (object.kv.len() + state.len()) + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(object.kv.len() as u64).to_le_bytes());
    let state_len = object.state.as_ref().map_or(u64::MAX, |s| s.len() as u64);
    out.extend_from_slice(&state_len.to_le_bytes());
    out.extend_from_slice(&le_bytes(&object.kv));
    out.extend_from_slice(&le_bytes(state));
    let crc = Crc32c::of(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The object in `bytes`, checked: magic, lengths and checksum.
pub fn decode_object(bytes: &[u8]) -> Result<ChunkObject, ObjectError> {
    let (kv_len, state_len) = check_object(bytes)?;
    let body = bytes.len() - 4;
    let split = HEADER + kv_len * 4;
    let kv = from_le_bytes(&bytes[HEADER..split]);
    let state = state_len.map(|_| from_le_bytes(&bytes[split..body]));
    Ok(ChunkObject { kv, state })
}

/// Checks `bytes` (magic, lengths, checksum) without copying them out; returns the KV's and
/// the state's float counts.
pub fn check_object(bytes: &[u8]) -> Result<(usize, Option<usize>), ObjectError> {
    if bytes.len() < HEADER + 4 {
        return Err(ObjectError::Truncated(bytes.len()));
    }
    let (kv_len, state_len) = parse_header(bytes[..HEADER].try_into().expect("HEADER bytes"), bytes.len())?;
    let body = bytes.len() - 4;
    let stored = u32::from_le_bytes(bytes[body..].try_into().expect("4 bytes"));
    let computed = Crc32c::of(&bytes[..body]);
    if stored != computed {
        return Err(ObjectError::Checksum { stored, computed });
    }
    Ok((kv_len, state_len))
}

/// The float counts a header gives (KV, and the state's if it has one), checked against the
/// object's length `len`.
fn parse_header(header: &[u8; HEADER], len: usize) -> Result<(usize, Option<usize>), ObjectError> {
    if &header[..8] != MAGIC {
        return Err(ObjectError::Magic);
    }
    let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes"));
    let (kv_len, state_len) = (word(8), word(16));
    let floats = kv_len.checked_add(if state_len == u64::MAX { 0 } else { state_len });
    let expected = floats.and_then(|f| f.checked_mul(4)).and_then(|b| b.checked_add((HEADER + 4) as u64));
    if expected != Some(len as u64) {
        let expected = expected.map_or(usize::MAX, |e| e.min(usize::MAX as u64) as usize);
        return Err(ObjectError::Length { expected, got: len });
    }
    Ok((kv_len as usize, (state_len != u64::MAX).then_some(state_len as usize)))
}

/// The object read from `r`, `len` bytes long, checked like [`decode_object`], its floats read
/// straight into their vectors (no copy of the whole object in between), and its checksum.
pub fn read_object(r: &mut impl std::io::Read, len: usize) -> Result<(ChunkObject, u32), ObjectError> {
    if len < HEADER + 4 {
        return Err(ObjectError::Truncated(len));
    }
    let mut header = [0u8; HEADER];
    r.read_exact(&mut header).map_err(|_| ObjectError::Truncated(len))?;
    let (kv_len, state_len) = parse_header(&header, len)?;
    let mut crc = Crc32c::new();
    crc.update(&header);
    let mut read_floats = |n: usize| -> Result<Vec<f32>, ObjectError> {
        let mut v = vec![0f32; n];
        // In pieces that stay in the core's cache between the read and the checksum.
        for piece in floats_as_bytes_mut(&mut v).chunks_mut(READ_PIECE) {
            r.read_exact(piece).map_err(|_| ObjectError::Truncated(len))?;
            crc.update(piece);
        }
        #[cfg(not(target_endian = "little"))]
        for x in v.iter_mut() {
            *x = f32::from_le_bytes(x.to_ne_bytes());
        }
        Ok(v)
    };
    let kv = read_floats(kv_len)?;
    let state = state_len.map(&mut read_floats).transpose()?;
    let mut stored = [0u8; 4];
    r.read_exact(&mut stored).map_err(|_| ObjectError::Truncated(len))?;
    let (stored, computed) = (u32::from_le_bytes(stored), crc.value());
    if stored != computed {
        return Err(ObjectError::Checksum { stored, computed });
    }
    Ok((ChunkObject { kv, state }, stored))
}

/// The bytes of `v`, writable.
fn floats_as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: f32 has no padding and any bit pattern is a valid f32; the slice covers exactly
    // the floats' bytes and borrows `v` mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The little-endian bytes of `v` (one copy).
fn le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f32 has no padding and every bit pattern is a valid u8 sequence; the slice
        // covers exactly the floats' bytes and lives as long as `v`.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
        })
    }
    #[cfg(not(target_endian = "little"))]
    {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// The floats of little-endian `bytes` (a multiple of 4 long), in one copy.
fn from_le_bytes(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / 4];
    #[cfg(target_endian = "little")]
    {
        // SAFETY: `out` holds exactly `bytes.len()` bytes (a multiple of 4, checked by the
        // caller's lengths) and any bit pattern is a valid f32.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), bytes.len()) };
    }
    #[cfg(not(target_endian = "little"))]
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_round_trips_and_any_damage_is_named() {
        for state in [None, Some(vec![]), Some(vec![1.5, -2.0])] {
            let object = ChunkObject { kv: vec![0.25, f32::MIN_POSITIVE, -0.0], state };
            let bytes = encode_object(&object);
            assert_eq!(decode_object(&bytes).unwrap(), object);
            for cut in [0, 10, bytes.len() - 1] {
                assert!(decode_object(&bytes[..cut]).is_err(), "truncated at {cut}");
            }
            let mut flipped = bytes.clone();
            flipped[HEADER + 1] ^= 0x10;
            assert!(matches!(decode_object(&flipped), Err(ObjectError::Checksum { .. })));
            let mut lengths = bytes.clone();
            lengths[8] = 200;
            assert!(matches!(decode_object(&lengths), Err(ObjectError::Length { .. })));
            let mut magic = bytes.clone();
            magic[0] = b'X';
            assert_eq!(decode_object(&magic), Err(ObjectError::Magic));
            // Read from a stream, the same checks.
            assert_eq!(read_object(&mut &bytes[..], bytes.len()).unwrap().0, object);
            assert!(matches!(read_object(&mut &flipped[..], flipped.len()), Err(ObjectError::Checksum { .. })));
            assert!(read_object(&mut &bytes[..bytes.len() - 2], bytes.len()).is_err(), "a short stream");
            assert_eq!(read_object(&mut &magic[..], magic.len()), Err(ObjectError::Magic));
        }
    }
}
