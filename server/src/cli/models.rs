//! `tether fetch-model` and `tether models`: the registry of known models.
use tether::registry;

/// Downloads a known model into the model cache, verifies it, and prints its path.
pub(super) fn fetch(name: &str) -> anyhow::Result<()> {
    let path = registry::fetch(name, &mut |msg| eprintln!("[fetch] {msg}"))?;
    println!("{}", path.display());
    Ok(())
}

/// Prints the known models, marking those already fetched.
pub(super) fn list() -> anyhow::Result<()> {
    for m in registry::KNOWN_MODELS {
        let here = registry::models_dir().join(m.file_name).exists();
        println!("{:<22} {}{}", m.name, m.description, if here { " [fetched]" } else { "" });
    }
    Ok(())
}
