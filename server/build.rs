//! Puts MLX's library folder (exported by the binding crate's build script)
//! into this package's rpath, so `tether` runs without LD_LIBRARY_PATH.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
