//! Build script of erdma: tells the crate what its compiler offers beyond the declared minimum
//! Rust (1.85).
//!
//! `erdma_vpclmulqdq`: the AVX2 and AVX-512 VPCLMULQDQ intrinsics and target features (Rust
//! 1.89), which the soft device's in-place CRC (`soft/engine/crc_raw.rs`) uses when the CPU has
//! them. Without the cfg it folds with PCLMULQDQ alone.

use std::env;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=RUSTC");
    println!("cargo::rustc-check-cfg=cfg(erdma_vpclmulqdq)");
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let minor = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| {
            v.split_whitespace()
                .nth(1)?
                .split('.')
                .nth(1)?
                .parse::<u32>()
                .ok()
        });
    if minor.is_some_and(|m| m >= 89) {
        println!("cargo::rustc-cfg=erdma_vpclmulqdq");
    }
}
