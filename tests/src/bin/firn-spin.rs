//! A Rust release workload for the unwinding tests: main -> spin_top -> spin_mid ->
//! spin_leaf, for argv[1] seconds. Rust's release builds on x86_64 keep no frame
//! pointers, so only the unwind tables walk it.

use std::hint::black_box;
use std::time::{Duration, Instant};

#[inline(never)]
fn spin_leaf(mut x: u64) -> u64 {
    for _ in 0..400_000 {
        x = black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
    }
    x
}

#[inline(never)]
fn spin_mid(x: u64) -> u64 {
    let pad = black_box([x, x + 1, x + 2]);
    black_box(spin_leaf(x ^ pad[1])) + pad[2]
}

#[inline(never)]
fn spin_top(until: Instant) -> u64 {
    let mut x = 1;
    while Instant::now() < until {
        x = black_box(spin_mid(x));
    }
    x
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10.0);
    println!("ready {}", std::process::id());
    let until = Instant::now() + Duration::from_secs_f64(secs);
    black_box(spin_top(until));
}
