use crate::array::wrap;
use crate::ffi::bridge;
use crate::{Array, Error, Result};

/// A `.safetensors` file's tensors with their names, and its string
/// metadata as key/value pairs.
pub type SafetensorsFile = (Vec<(String, Array)>, Vec<(String, String)>);

/// Loads every tensor of a `.safetensors` file (lazily mapped by MLX) with its
/// name, plus the file's string metadata as key/value pairs.
pub fn load_safetensors(path: &std::path::Path) -> Result<SafetensorsFile> {
    let path = path.to_str().ok_or_else(|| Error::new("load_safetensors", "path is not UTF-8"))?;
    let file = bridge::load_safetensors(path).map_err(|e| Error::from_cxx("load_safetensors", e))?;
    let mut tensors = Vec::with_capacity(bridge::safetensors_len(&file));
    for i in 0..bridge::safetensors_len(&file) {
        let name = bridge::safetensors_name(&file, i).map_err(|e| Error::from_cxx("load_safetensors", e))?;
        let array = wrap("load_safetensors", bridge::safetensors_array(&file, i))?;
        tensors.push((name, array));
    }
    let flat = bridge::safetensors_metadata(&file);
    let meta = flat.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect();
    Ok((tensors, meta))
}
