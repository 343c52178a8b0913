//! Compiles `src/kernels.cu` (which includes `src/attention.cuh`, `src/logit_rows.cuh`,
//! `src/rows.cuh` and `src/gemv_quant.cuh`) to PTX
//! with nvcc, only when the `cuda` feature is on, so the default (CPU) build never needs a
//! CUDA toolkit.
//!
//! Three PTX modules, each JIT-compiled by the driver for the GPU it runs on: `compute_80` for
//! Ampere (sm_80/86); `compute_90` for Hopper and later, whose kernels also wait for and
//! release their neighbours on the stream (programmatic dependent launch, `pdl_enter` in
//! kernels.cu), which compute_80 cannot express; and `compute_90a` for compute capability 9.0
//! exactly (H100, H200), which adds the warpgroup engine (`gemv_wgmma.cuh`: its `wgmma`
//! instructions exist in the arch-specific target only). launch.rs picks one per device.
//! (candle's own kernels are built for `CUDA_COMPUTE_CAP` only.)

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/kernels.cu");
    println!("cargo:rerun-if-changed=src/logit_rows.cuh");
    println!("cargo:rerun-if-changed=src/rows.cuh");
    println!("cargo:rerun-if-changed=src/attention.cuh");
    println!("cargo:rerun-if-changed=src/attention_tc.cuh");
    println!("cargo:rerun-if-changed=src/gemv_quant.cuh");
    println!("cargo:rerun-if-changed=src/gemv_wgmma.cuh");
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
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    for (arch, file) in [
        ("compute_80", "kestrel_kernels.ptx"),
        ("compute_90", "kestrel_kernels_sm90.ptx"),
        ("compute_90a", "kestrel_kernels_sm90a.ptx"),
    ] {
        let status = Command::new(&nvcc)
            .args(["--ptx", &format!("-arch={arch}"), "-O3", "-std=c++17", "-o"])
            .arg(out_dir.join(file))
            .arg("src/kernels.cu")
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "kestrel-kernels: cannot run {} ({e}): the `cuda` feature needs the CUDA \
                     toolkit (set CUDA_HOME or NVCC)",
                    nvcc.display()
                )
            });
        if !status.success() {
            panic!("kestrel-kernels: nvcc failed on src/kernels.cu for {arch} ({status})");
        }
    }
}
