//! An arbitrary byte blob handed to the symbolizer as if the broker had opened it as a
//! mapped binary: no panic escapes (a panic inside blazesym is contained and counted,
//! see the enricher's symbolize module), and libFuzzer's -timeout / -rss_limit_mb bound
//! time and memory per input.
#![no_main]

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use firn_enricher::{Metrics, SymbolLimits as Limits, Symbolizer};
use libfuzzer_sys::fuzz_target;

fn memfd(data: &[u8]) -> OwnedFd {
    // SAFETY: memfd_create with a valid C string; the fd is owned from here on.
    let fd = unsafe { libc::memfd_create(c"fuzz-elf".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create");
    // The symbolizer reads a file's own DWARF only when no one but root may write it
    // (a memfd is born 0777): 0755 keeps that parser fuzzed (the fuzzer runs as root).
    // SAFETY: fchmod on the fd just created.
    unsafe { libc::fchmod(fd, 0o755) };
    // SAFETY: fd was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut file = std::fs::File::from(fd);
    std::io::Write::write_all(&mut file, data).expect("write memfd");
    file.into()
}

fuzz_target!(
    init: {
        // A panic the symbolizer contains (counted, binary poisoned) is the designed
        // outcome; any other panic still aborts for libFuzzer to report.
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !firn_enricher::panic_is_contained() {
                abort(info);
            }
        }));
    },
    |data: &[u8]| {
    let mut sym = Symbolizer::new(Limits { binaries: 2, ..Limits::default() }, Arc::new(Metrics::default()));
    let Ok(id) = sym.load(memfd(data)) else {
        return;
    };
    // Offsets across the file and a few beyond it.
    let len = data.len() as u64;
    let offsets: Vec<u64> = (0..64u64)
        .map(|i| i * (len / 48 + 1))
        .chain([0, u64::MAX, 0x1000, len])
        .collect();
    let out = sym.symbolize(&id, &offsets);
    assert_eq!(out.len(), offsets.len());
    // A budget of 0 keeps no parse: the symbol tables are read by the scan instead.
    let mut scan = Symbolizer::new(
        Limits { binaries: 2, budget_bytes: 0, ..Limits::default() },
        Arc::new(Metrics::default()),
    );
    if let Ok(id) = scan.load(memfd(data)) {
        assert_eq!(scan.symbolize(&id, &offsets).len(), offsets.len());
    }
    let _ = sym.build_id(&id);
    let _ = sym.stripped(&id);
});
