use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const SRC: &str = "src/bpf/profile.bpf.c";

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"))
        .join("profile.skel.rs");
    let arch = match env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86",
        Ok("aarch64") => "arm64",
        Ok(other) => panic!("firn's BPF program has no vmlinux.h for {other}"),
        Err(_) => "x86",
    };
    SkeletonBuilder::new()
        .source(SRC)
        .clang_args([
            "-I",
            "src/bpf",
            "-O2",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            &format!("-D__TARGET_ARCH_{arch}"),
        ])
        .build_and_generate(&out)
        .expect("building the BPF program needs clang (apt-get install clang libelf-dev)");
    println!("cargo:rerun-if-changed=src/bpf");
}
