//! Counter-based random numbers: explicit keys make sampling reproducible per
//! request (a `seed` gives the same tokens whatever else is batched with it).
use crate::array::{unwrap_list, wrap};
use crate::ffi::bridge;
use crate::{Array, Error, Result};

/// A PRNG key from a seed.
pub fn key(seed: u64) -> Result<Array> {
    wrap("random::key", bridge::random_key(seed))
}

/// Splits `key` into `num` independent keys.
pub fn split(key: &Array, num: i32) -> Result<Vec<Array>> {
    let list = bridge::random_split(key.raw(), num).map_err(|e| Error::from_cxx("random::split", e))?;
    unwrap_list("random::split", &list)
}

/// Samples one index per row from unnormalised log-probabilities along `axis`.
pub fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<Array> {
    wrap("random::categorical", bridge::categorical(logits.raw(), axis, key.raw()))
}

/// Uniform float32 samples in [0, 1).
pub fn uniform(shape: &[i32], key: &Array) -> Result<Array> {
    wrap("random::uniform", bridge::uniform(shape, key.raw()))
}
