//! Compiles `src/kernels.cu` to PTX with nvcc, only when the `cuda` feature is on, so the
//! default (CPU) build never needs a CUDA toolkit.
//!
//! PTX for `compute_80` is JIT-compiled by the driver for the GPU it runs on, so one binary
//! serves Ampere (sm_80/86) and Hopper (sm_90) alike. (candle's own kernels are built for
//! `CUDA_COMPUTE_CAP` only.)

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            let home = std::env::var_os("CUDA_HOME").or_else(|| std::env::var_os("CUDA_PATH"))?;
            let p = PathBuf::from(home).join("bin").join("nvcc");
            p.is_file().then_some(p)
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("kestrel_kernels.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-arch=compute_80", "-O3", "-std=c++17", "-o"])
        .arg(&out)
        .arg("src/kernels.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "kestrel-kernels: cannot run {} ({e}): the `cuda` feature needs the CUDA toolkit \
                 (set CUDA_HOME or NVCC)",
                nvcc.display()
            )
        });
    if !status.success() {
        panic!("kestrel-kernels: nvcc failed on src/kernels.cu ({status})");
    }
}
