//! A KV cache as one self-checking file, for the prefix cache's disk tier:
//! what an idle session's state is written as when RAM runs short, and
//! read back from when the session takes its next turn.
//!
//! Layout (integers little-endian):
//!   `TETHERKV` | version u32 | header length u32 | header (JSON) |
//!   each layer's key buffer then value buffer (raw bytes) |
//!   a hybrid model's recurrent state, if it has one: its own, then each
//!   checkpoint's (lengths in the header), each as every recurrent layer's
//!   convolution inputs then delta-rule matrices (raw bytes) |
//!   CRC-32 of everything before it, u32
//!
//! The buffers are stored as the cache holds them (spare room and the key
//! layout included; at most one growth step of room, see
//! [`super::KV_CAPACITY_STEP`]): writing is one copy out of each buffer and
//! reading one copy into it, with no reordering, which matters at the
//! ~180 MB of a 4k-token SmolLM2 history. The header names the tokens the
//! state is of and the namespace (model and KV layout) it was computed
//! under; a reader checks the checksum ([`check`], on the disk tier's
//! thread), then both names and the geometry ([`decode`]), so a stale,
//! truncated or corrupt file is an error, never wrong state.
//!
//! A file may leave out its first positions, a *base*: the state of
//! `tokens[..base]` that another cache holds (a session's history after a
//! shared system prompt leaves out the shared prompt, which the prefix
//! cache's shared scope keeps). Such a file holds positions `base..` of each
//! buffer, and reading it back takes the base's first positions from a
//! cache of those tokens. Most of an agent session's bytes can be such a
//! prompt, so this shrinks its file, and the disk traffic of every turn
//! that spills or restores one, by that share.
use std::io::Write;

use mlx::fast::KEY_BLOCK;
use mlx::Array;
use serde::{Deserialize, Serialize};

use super::{KvCache, LayerState, RecurrentState, StoredCache};

const MAGIC: &[u8; 8] = b"TETHERKV";
/// 3: the recurrent state.
const VERSION: u32 = 3;
/// Magic, version and header length.
const PREAMBLE: usize = MAGIC.len() + 8;

#[derive(Serialize, Deserialize)]
struct Header {
    namespace: u64,
    tokens: Vec<u32>,
    /// (layers, kv heads, head dim), and the dtype's name.
    geometry: (usize, usize, usize),
    dtype: String,
    stored: StoredCache,
    /// Per layer, the positions of room its buffers have.
    rooms: Vec<usize>,
    /// Leading positions left out of every buffer: the base's.
    base: usize,
    /// A hybrid model's recurrent state, after the KV buffers.
    state: Option<StateHeader>,
}

/// The shapes of a recurrent state's arrays (every layer's are alike, in
/// the KV's dtype), and the lengths of its checkpoints, ascending.
#[derive(Serialize, Deserialize)]
struct StateHeader {
    layers: usize,
    conv: Vec<usize>,
    delta: Vec<usize>,
    checkpoints: Vec<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum KvFileError {
    #[error("not a KV file of this version")]
    Format,
    #[error("checksum mismatch (the file is corrupt)")]
    Checksum,
    #[error("the file holds other state: {0}")]
    Mismatch(&'static str),
    #[error("the file's first {0} positions are a base's, and no fitting base was given")]
    NoBase(usize),
    #[error("bad header: {0}")]
    Header(#[from] serde_json::Error),
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
}

/// A cache's file, whole: what the disk tier writes, and what the host
/// tier keeps in memory.
pub struct Encoded {
    bytes: Vec<u8>,
    base: usize,
}

impl Encoded {
    /// The leading positions the file leaves to a base (0: none).
    pub fn base(&self) -> usize {
        self.base
    }

    /// The file's size in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Never: a file has at least its preamble and checksum.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The file's bytes, checksum included.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Writes the file.
    pub fn write_to(&self, out: &mut impl Write) -> std::io::Result<()> {
        out.write_all(&self.bytes)
    }
}

/// `cache` (holding exactly `tokens`) as a file, leaving out up to
/// `base` leading positions, which another cache holds (see the module
/// notes): rounded down to whole key blocks, and none for a cache with
/// window layers (they no longer hold their first positions). Evaluates
/// the cache.
pub fn encode(cache: &KvCache, namespace: u64, tokens: &[u32], base: usize) -> Result<Encoded, KvFileError> {
    let (layers, heads, dim, dtype) = cache.geometry();
    let (stored, buffers) = cache.as_stored().ok_or(KvFileError::Mismatch("a layer holds nothing"))?;
    let (state, state_arrays) = match cache.recurrent() {
        Some(s) => state_parts(s, cache.len(), dtype).map(|(h, a)| (Some(h), a)).ok_or(KvFileError::Mismatch("a recurrent state this file cannot hold"))?,
        None => (None, Vec::new()),
    };
    let base = if cache.has_windows() { 0 } else { base.min(stored.len) / KEY_BLOCK * KEY_BLOCK };
    let header = Header {
        namespace,
        tokens: tokens.to_vec(),
        geometry: (layers, heads, dim),
        dtype: format!("{dtype:?}"),
        stored,
        rooms: buffers.iter().map(|(k, _)| k.dim(2)).collect(),
        base,
        state,
    };
    let header = serde_json::to_vec(&header)?;
    let mut parts = buffers.iter().flat_map(|(k, v)| [past_base(k, base), past_base(v, base)]).collect::<mlx::Result<Vec<_>>>()?;
    parts.extend(state_arrays);
    let mut bytes = Vec::with_capacity(PREAMBLE + header.len() + parts.iter().map(Array::nbytes).sum::<usize>() + 4);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&header);
    for part in &parts {
        let at = bytes.len();
        bytes.resize(at + part.nbytes(), 0);
        part.copy_bytes_into(&mut bytes[at..])?;
    }
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    Ok(Encoded { bytes, base })
}

/// A recurrent state's header and arrays, in the file's order: its own
/// state, then each complete checkpoint's below `len`; `None` when a layer
/// has no state yet or an array is not in `dtype` or of its layer's shape.
fn state_parts(state: &RecurrentState, len: usize, dtype: mlx::Dtype) -> Option<(StateHeader, Vec<Array>)> {
    let (own, checkpoints) = state.parts();
    let checkpoints: Vec<_> = checkpoints.into_iter().filter(|(at, l)| *at < len && l.iter().all(Option::is_some)).collect();
    let first = own.first()?.as_ref()?;
    let (conv, delta) = (first.conv.shape(), first.delta.shape());
    let mut arrays = Vec::new();
    for layers in std::iter::once(own).chain(checkpoints.iter().map(|(_, l)| *l)) {
        for s in layers {
            let s = s.as_ref()?;
            let fits = s.conv.shape() == conv && s.delta.shape() == delta && s.conv.dtype() == dtype && s.delta.dtype() == dtype;
            if !fits {
                return None;
            }
            arrays.extend([s.conv.clone(), s.delta.clone()]);
        }
    }
    let header = StateHeader { layers: own.len(), conv, delta, checkpoints: checkpoints.iter().map(|(at, _)| *at).collect() };
    Some((header, arrays))
}

/// The recurrent state a file's `header` describes (of a cache of `len`),
/// read from `body` at `at` into a state shaped like `template`'s; with
/// where it ends.
fn read_state(
    body: &[u8],
    mut at: usize,
    header: &StateHeader,
    len: usize,
    template: &RecurrentState,
    dtype: mlx::Dtype,
) -> Result<(RecurrentState, usize), KvFileError> {
    let mut array = |shape: &[usize]| -> Result<Array, KvFileError> {
        let n = shape.iter().try_fold(dtype.size(), |n, &d| n.checked_mul(d)).ok_or(KvFileError::Format)?;
        let end = at.checked_add(n).filter(|&e| e <= body.len()).ok_or(KvFileError::Format)?;
        let a = Array::from_bytes(&body[at..end], shape, dtype)?;
        at = end;
        Ok(a)
    };
    let mut layers = |_| -> Result<Vec<Option<LayerState>>, KvFileError> {
        (0..header.layers).map(|_| Ok(Some(LayerState { conv: array(&header.conv)?, delta: array(&header.delta)? }))).collect()
    };
    if header.checkpoints.iter().any(|&c| c >= len) {
        return Err(KvFileError::Format);
    }
    let own = layers(0)?;
    let checkpoints = header.checkpoints.iter().map(|&len| Ok((len, layers(len)?))).collect::<Result<Vec<_>, KvFileError>>()?;
    let state = template.from_parts(own, checkpoints).ok_or(KvFileError::Mismatch("recurrent layers"))?;
    Ok((state, at))
}

/// A `[1, heads, room, width]` buffer's positions from `base` on.
fn past_base(buffer: &Array, base: usize) -> mlx::Result<Array> {
    if base == 0 {
        return Ok(buffer.clone());
    }
    let shape = buffer.shape();
    buffer.slice(&[0, 0, base as i32, 0], &[1, shape[1] as i32, shape[2] as i32, shape[3] as i32])
}

/// The leading positions a file leaves to a base (0: none), read from its
/// header; the file must have passed [`check`].
pub fn base_of(bytes: &[u8]) -> Result<usize, KvFileError> {
    Ok(header(body(bytes)?)?.0.base)
}

/// A checked file's header, and where its buffers start.
fn header(body: &[u8]) -> Result<(Header, usize), KvFileError> {
    let header_end = PREAMBLE.checked_add(u32_at(body, MAGIC.len() + 4) as usize).filter(|&e| e <= body.len()).ok_or(KvFileError::Format)?;
    Ok((serde_json::from_slice(&body[PREAMBLE..header_end])?, header_end))
}

/// Whether `bytes` are a whole, uncorrupted KV file of this version.
pub fn check(bytes: &[u8]) -> Result<(), KvFileError> {
    let body = body(bytes)?;
    let crc = &bytes[body.len()..];
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err(KvFileError::Checksum);
    }
    Ok(())
}

/// Everything before the checksum, if the preamble is this version's.
fn body(bytes: &[u8]) -> Result<&[u8], KvFileError> {
    let body = &bytes[..bytes.len().checked_sub(4).ok_or(KvFileError::Format)?];
    if body.len() < PREAMBLE || &body[..MAGIC.len()] != MAGIC || u32_at(body, MAGIC.len()) != VERSION {
        return Err(KvFileError::Format);
    }
    Ok(body)
}

/// The cache a file that passed [`check`] holds, restored into a cache
/// shaped like `template`, provided it is of `tokens` computed under
/// `namespace`. A file with a base ([`base_of`]) takes its first positions
/// from `base`: a cache holding at least those tokens' state, in the same
/// layout and codes (the caller vouches for its tokens).
pub fn decode(bytes: &[u8], template: &KvCache, namespace: u64, tokens: &[u32], base: Option<&KvCache>) -> Result<KvCache, KvFileError> {
    let body = body(bytes)?;
    let (header, header_end) = header(body)?;
    let (layers, heads, dim, dtype) = template.geometry();
    if header.namespace != namespace {
        return Err(KvFileError::Mismatch("namespace"));
    }
    if header.tokens != tokens || header.stored.len != tokens.len() {
        return Err(KvFileError::Mismatch("tokens"));
    }
    if header.geometry != (layers, heads, dim) || header.dtype != format!("{dtype:?}") || header.rooms.len() != layers {
        return Err(KvFileError::Mismatch("geometry"));
    }
    let base_buffers = match header.base {
        0 => None,
        b => Some(base_buffers(base.filter(|c| c.key_layout() == template.key_layout()), &header, b).ok_or(KvFileError::NoBase(b))?),
    };
    let mut at = header_end;
    let mut buffers = Vec::with_capacity(layers);
    // Buffers of codes are uint8 rows of their own width.
    let (width, stored_dtype) = template.stored_form(&header.stored);
    for (layer, &room) in header.rooms.iter().enumerate() {
        let held = room.checked_sub(header.base).ok_or(KvFileError::Format)?;
        let shape = [1, heads, held, width];
        let n = held.checked_mul(heads * width * stored_dtype.size()).ok_or(KvFileError::Format)?;
        let end = at.checked_add(2 * n).filter(|&e| e <= body.len()).ok_or(KvFileError::Format)?;
        let (k, v) = (Array::from_bytes(&body[at..at + n], &shape, stored_dtype)?, Array::from_bytes(&body[at + n..end], &shape, stored_dtype)?);
        buffers.push(match &base_buffers {
            None => (k, v),
            Some(base) => {
                let (base_k, base_v) = &base[layer];
                (mlx::concatenate(&[base_k, &k], 2)?, mlx::concatenate(&[base_v, &v], 2)?)
            }
        });
        at = end;
    }
    let state = match (&header.state, template.recurrent()) {
        (None, None) => None,
        (Some(h), Some(t)) => {
            let (state, end) = read_state(body, at, h, header.stored.len, t, dtype)?;
            at = end;
            Some(state)
        }
        _ => return Err(KvFileError::Mismatch("recurrent state")),
    };
    if at != body.len() {
        return Err(KvFileError::Format);
    }
    let cache = template.emptied().from_stored(&header.stored, buffers)?;
    Ok(match state {
        Some(state) => cache.with_recurrent_state(state)?,
        None => cache,
    })
}

/// Each layer's first `len` positions of `base`, when it can be the base
/// `header` names: the same layout and codes, no window layers, holding at
/// least `len` positions.
fn base_buffers(base: Option<&KvCache>, header: &Header, len: usize) -> Option<Vec<(Array, Array)>> {
    let base = base?;
    let (stored, buffers) = base.as_stored()?;
    let (layers, heads, dim, dtype) = base.geometry();
    let fits = (layers, heads, dim) == header.geometry
        && format!("{dtype:?}") == header.dtype
        && stored.codes == header.stored.codes
        && !base.has_windows()
        && stored.len >= len;
    if !fits {
        return None;
    }
    let first = |a: &Array| a.slice(&[0; 4], &[1, heads as i32, len as i32, a.dim(3) as i32]).ok();
    buffers.into_iter().map(|(k, v)| Some((first(k)?, first(v)?))).collect()
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

#[cfg(test)]
mod tests {
    use mlx::Dtype;

    use super::*;
    use crate::models::KvQuantization;

    /// A cache of 2 layers (the second a window layer when `window`) holding
    /// `len` tokens whose values name their position, written in two steps
    /// (so window layers have dropped old positions).
    fn filled(len: usize, blocks: bool, window: Option<usize>) -> KvCache {
        filled_turning(len, blocks, window, None)
    }

    /// [`filled`] into a cache with quantization `q`.
    fn filled_turning(len: usize, blocks: bool, window: Option<usize>, q: Option<KvQuantization>) -> KvCache {
        let (heads, dim) = (2, 8);
        let empty = if blocks { KvCache::with_keys_in_blocks(2, heads, dim, Dtype::F32) } else { KvCache::new(2, heads, dim, Dtype::F32) };
        let mut cache = empty.with_windows(vec![None, window]).with_quantization(q).unwrap();
        let window_first = window.map_or(0, |w| super::super::kv_cache::window_first(len, w));
        let layer = |first: usize, salt: f32| {
            let held = len - first;
            let data: Vec<f32> = (0..heads * held * dim).map(|i| ((first + (i / dim) % held) as f32) + salt).collect();
            let a = Array::from_f32(&data, &[1, heads, held, dim]).unwrap();
            (a.clone(), a.multiply(&Array::scalar(-1.0, Dtype::F32).unwrap()).unwrap())
        };
        cache.fill(&[layer(0, 0.25), layer(window_first, 0.5)], len, window_first).unwrap();
        cache
    }

    fn contents(cache: &KvCache) -> Vec<Vec<f32>> {
        (0..2)
            .flat_map(|l| {
                let (k, v) = cache.positions(l).unwrap().unwrap();
                [k.to_vec_f32().unwrap(), v.to_vec_f32().unwrap()]
            })
            .collect()
    }

    fn file(cache: &KvCache, namespace: u64, tokens: &[u32]) -> Vec<u8> {
        file_past(cache, namespace, tokens, 0)
    }

    /// A file of `cache` leaving up to `base` positions to a base.
    fn file_past(cache: &KvCache, namespace: u64, tokens: &[u32], base: usize) -> Vec<u8> {
        let encoded = encode(cache, namespace, tokens, base).unwrap();
        let mut bytes = Vec::new();
        encoded.write_to(&mut bytes).unwrap();
        assert_eq!(bytes.len(), encoded.len());
        bytes
    }

    #[test]
    fn round_trip_in_every_layout() {
        for (blocks, window) in [(false, None), (true, None), (true, Some(40)), (false, Some(40))] {
            let cache = filled(123, blocks, window);
            let tokens: Vec<u32> = (0..123).collect();
            let bytes = file(&cache, 7, &tokens);
            check(&bytes).unwrap();
            let mut back = decode(&bytes, &cache.emptied(), 7, &tokens, None).unwrap();
            assert_eq!(back.len(), 123);
            assert_eq!(back.window_first(), cache.window_first());
            assert_eq!(back.key_layout(), cache.key_layout());
            assert_eq!(back.nbytes(), cache.nbytes());
            assert_eq!(contents(&back), contents(&cache), "blocks {blocks}, window {window:?}");
            // The restored cache goes on: room to grow and append into.
            back.reserve(300).unwrap();
            assert_eq!(contents(&back), contents(&cache));
        }
    }

    #[test]
    fn codes_round_trip_and_need_their_bits_and_group() {
        for bits in [8, 4] {
            let q = KvQuantization { bits, group: 8, start: 0 };
            let cache = filled_turning(123, true, Some(40), Some(q));
            assert_eq!(cache.codes(), q.codes());
            let tokens: Vec<u32> = (0..123).collect();
            let bytes = file(&cache, 7, &tokens);
            let back = decode(&bytes, &cache.emptied(), 7, &tokens, None).unwrap();
            assert_eq!((back.codes(), back.nbytes()), (cache.codes(), cache.nbytes()));
            assert_eq!(contents(&back), contents(&cache));
            // A server reading codes in other groups or bits, or none, misses.
            let other = KvCache::with_keys_in_blocks(2, 2, 8, Dtype::F32).with_windows(vec![None, Some(40)]);
            assert!(decode(&bytes, &other, 7, &tokens, None).is_err());
            for (bits, group) in [(bits, 4), (12 - bits, 8)] {
                let other = other.clone().with_quantization(Some(KvQuantization { bits, group, start: 0 })).unwrap();
                assert!(decode(&bytes, &other, 7, &tokens, None).is_err(), "{bits} bits, group {group}");
            }
        }
    }

    /// A history after a shared prompt is filed without the prompt's
    /// positions and comes back whole from a cache holding the prompt; with
    /// no base, a short one or one in other codes it is an error.
    #[test]
    fn a_file_past_its_base_comes_back_whole_with_the_base() {
        for q in [None, Some(KvQuantization { bits: 8, group: 8, start: 0 })] {
            // Values name their position, so a shorter cache holds the same
            // first positions, as a shared prompt's entry does.
            let cache = filled_turning(300, true, None, q);
            let prompt = filled_turning(200, true, None, q);
            let tokens: Vec<u32> = (0..300).collect();
            let whole = file(&cache, 7, &tokens);
            let bytes = file_past(&cache, 7, &tokens, 190);
            check(&bytes).unwrap();
            assert_eq!(base_of(&bytes).unwrap(), 128, "rounded down to whole key blocks");
            // 128 of 512 positions of room are left to the base.
            assert!(bytes.len() < whole.len() * 4 / 5, "{} of {} bytes", bytes.len(), whole.len());
            let back = decode(&bytes, &cache.emptied(), 7, &tokens, Some(&prompt)).unwrap();
            assert_eq!((back.len(), back.codes(), back.nbytes()), (300, cache.codes(), cache.nbytes()));
            assert_eq!(contents(&back), contents(&cache));
            assert!(matches!(decode(&bytes, &cache.emptied(), 7, &tokens, None), Err(KvFileError::NoBase(128))));
            let short = filled_turning(100, true, None, q);
            assert!(matches!(decode(&bytes, &cache.emptied(), 7, &tokens, Some(&short)), Err(KvFileError::NoBase(128))));
            let other = filled_turning(200, true, None, if q.is_some() { None } else { Some(KvQuantization { bits: 8, group: 8, start: 0 }) });
            assert!(decode(&bytes, &cache.emptied(), 7, &tokens, Some(&other)).is_err());
        }
        // Window layers no longer hold their first positions: filed whole.
        let windowed = filled(300, true, Some(40));
        let bytes = file_past(&windowed, 7, &(0..300).collect::<Vec<u32>>(), 190);
        assert_eq!(base_of(&bytes).unwrap(), 0);
    }

    /// A hybrid model's cache of `len` tokens: [`filled`]'s KV and a
    /// 3-layer recurrent state whose arrays hold `len` (and the layer),
    /// with checkpoints at the block boundaries below it.
    fn hybrid(len: usize) -> KvCache {
        use crate::models::LayerState;
        let layer = |at: usize, l: usize| {
            let conv = Array::from_f32(&[at as f32 + l as f32 / 8.0; 6], &[3, 2]).unwrap();
            LayerState { conv: conv.clone(), delta: Array::from_f32(&[-(at as f32); 8], &[2, 2, 2]).unwrap() }
        };
        let kv = filled(len, true, None);
        let layers = (0..2).map(|l| kv.positions(l).unwrap().unwrap()).collect::<Vec<_>>();
        let mut cache = KvCache::with_keys_in_blocks(2, 2, 8, Dtype::F32).with_recurrent_layers(3);
        cache.fill(&layers, len, 0).unwrap();
        let state = cache.recurrent_mut().unwrap();
        for t in state.capture_points(0, len, 1) {
            (0..3).for_each(|l| state.record(l, t, layer(t, l)));
        }
        (0..3).for_each(|l| state.set_layer(l, layer(len, l)));
        state.thin(len);
        cache
    }

    fn state_values(cache: &KvCache) -> Vec<Vec<f32>> {
        let state = cache.recurrent().unwrap();
        (0..3).flat_map(|l| state.layer(l).unwrap().map(|s| [s.conv.to_vec_f32().unwrap(), s.delta.to_vec_f32().unwrap()])).flatten().collect()
    }

    /// A hybrid model's state and its checkpoints come back as they were
    /// (the restored cache rewinds to a checkpoint as the stored one does);
    /// a cache without such state, or with other layers, refuses the file,
    /// and one with such state refuses a file without it.
    #[test]
    fn a_recurrent_state_and_its_checkpoints_round_trip() {
        let cache = hybrid(200);
        let tokens: Vec<u32> = (0..200).collect();
        assert_eq!(cache.checkpoint_lens(), [128, 192]);
        for base in [0, 100] {
            let bytes = file_past(&cache, 7, &tokens, base);
            check(&bytes).unwrap();
            let prompt = filled(100, true, None);
            let back = decode(&bytes, &cache.emptied(), 7, &tokens, Some(&prompt)).unwrap();
            assert_eq!((back.len(), back.nbytes(), back.checkpoint_lens()), (200, cache.nbytes(), vec![128, 192]));
            assert_eq!((contents(&back), state_values(&back)), (contents(&cache), state_values(&cache)));
            for at in [192, 128] {
                let (mut a, mut b) = (cache.clone(), back.clone());
                a.truncate(at);
                b.truncate(at);
                assert_eq!(state_values(&b), state_values(&a), "rewound to {at}");
            }
        }
        let bytes = file(&cache, 7, &tokens);
        let plain = KvCache::with_keys_in_blocks(2, 2, 8, Dtype::F32);
        assert!(matches!(decode(&bytes, &plain, 7, &tokens, None), Err(KvFileError::Mismatch("recurrent state"))));
        let fewer = plain.clone().with_recurrent_layers(2);
        assert!(matches!(decode(&bytes, &fewer, 7, &tokens, None), Err(KvFileError::Mismatch("recurrent layers"))));
        let kv_only = file(&filled(200, true, None), 7, &tokens);
        assert!(matches!(decode(&kv_only, &cache.emptied(), 7, &tokens, None), Err(KvFileError::Mismatch("recurrent state"))));
    }

    #[test]
    fn damaged_or_foreign_files_are_errors() {
        let cache = filled(40, true, None);
        let tokens: Vec<u32> = (0..40).collect();
        let bytes = file(&cache, 7, &tokens);
        let template = cache.emptied();
        let mut flipped = bytes.clone();
        flipped[bytes.len() / 2] ^= 1;
        assert!(matches!(check(&flipped), Err(KvFileError::Checksum)));
        assert!(matches!(check(&bytes[..bytes.len() - 9]), Err(KvFileError::Checksum)));
        assert!(matches!(check(&bytes[..3]), Err(KvFileError::Format)));
        assert!(matches!(decode(&bytes, &template, 8, &tokens, None), Err(KvFileError::Mismatch("namespace"))));
        let mut other = tokens.clone();
        other[5] = 99;
        assert!(matches!(decode(&bytes, &template, 7, &other, None), Err(KvFileError::Mismatch("tokens"))));
        assert!(matches!(decode(&bytes, &template, 7, &tokens[..39], None), Err(KvFileError::Mismatch("tokens"))));
        let bf16 = KvCache::new(2, 2, 8, Dtype::BF16);
        assert!(matches!(decode(&bytes, &bf16, 7, &tokens, None), Err(KvFileError::Mismatch("geometry"))));
        let windowed = KvCache::with_keys_in_blocks(2, 2, 8, Dtype::F32).with_windows(vec![None, Some(16)]);
        assert!(decode(&bytes, &windowed, 7, &tokens, None).is_err(), "buffers that do not fit the cache's layers");
    }
}
