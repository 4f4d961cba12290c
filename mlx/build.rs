//! Finds MLX's C++ library and headers, compiles the C++ shim, and links it.
//!
//! Search order: `$MLX_DIR` (a folder with `include/mlx/mlx.h` and
//! `lib/libmlx.{so,dylib}`, such as the `mlx/` folder inside an MLX wheel),
//! else the project's install location `~/.cache/tether/mlx/mlx`, which
//! `scripts/setup.sh` fills from the pinned wheel. The library folder is
//! written into the binaries' rpath so they run without LD_LIBRARY_PATH; it
//! is exported to dependent build scripts as `DEP_MLX_LIB_DIR`.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-changed=src/shim.h");
    println!("cargo:rerun-if-changed=src/shim.cc");
    println!("cargo:rerun-if-changed=src/cpu_isa.h");
    println!("cargo:rerun-if-changed=src/cpu_isa.cc");
    println!("cargo:rerun-if-changed=src/cpu_qmm.h");
    println!("cargo:rerun-if-changed=src/cpu_qmm.cc");
    println!("cargo:rerun-if-changed=src/cpu_dequantize.h");
    println!("cargo:rerun-if-changed=src/cpu_dequantize.cc");
    println!("cargo:rerun-if-changed=src/cpu_panels.h");
    println!("cargo:rerun-if-changed=src/cpu_panels.cc");
    println!("cargo:rerun-if-changed=src/cpu_attention.h");
    println!("cargo:rerun-if-changed=src/cpu_attention.cc");
    println!("cargo:rerun-if-changed=src/cpu_swiglu.h");
    println!("cargo:rerun-if-changed=src/cpu_swiglu.cc");
    println!("cargo:rerun-if-changed=src/simd_exp.h");
    println!("cargo:rerun-if-changed=src/row_pool.h");
    println!("cargo:rerun-if-changed=src/cpu_eval.h");
    println!("cargo:rerun-if-changed=src/cuda_kernel.h");
    println!("cargo:rerun-if-changed=src/cuda_kernel.cc");
    println!("cargo:rerun-if-changed=src/ffi.rs");

    let dir = match std::env::var_os("MLX_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache/tether/mlx/mlx")
        }
    };
    let include = dir.join("include");
    let lib = dir.join("lib");
    if !include.join("mlx/mlx.h").exists() {
        panic!(
            "MLX not found at {}: run scripts/setup.sh (installs the pinned mlx wheel) or set MLX_DIR \
             to a folder holding include/mlx/mlx.h and lib/libmlx.so",
            dir.display()
        );
    }

    cxx_build::bridge("src/ffi.rs")
        .file("src/shim.cc")
        .file("src/cpu_isa.cc")
        .file("src/cpu_qmm.cc")
        .file("src/cpu_dequantize.cc")
        .file("src/cpu_panels.cc")
        .file("src/cpu_attention.cc")
        .file("src/cpu_swiglu.cc")
        .file("src/cuda_kernel.cc")
        .include(&include)
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        // GCC 12 flags its own AVX-512 intrinsics headers (_mm512_undefined_*).
        .flag_if_supported("-Wno-maybe-uninitialized")
        .flag_if_supported("-Wno-uninitialized")
        .opt_level(2)
        .compile("tether_mlx_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:lib_dir={}", lib.display());
}
