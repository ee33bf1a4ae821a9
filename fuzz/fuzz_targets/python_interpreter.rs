//! The enricher's CPython analysis on arbitrary bytes as if the broker had opened them as
//! a mapped `libpython3.N.so`: an error or a record, never a panic; a record's ranges are
//! ordered and its offsets within what the walk accepts.
#![no_main]

use firn_enricher::cpython::{analyze, Position};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for name in ["/usr/lib/libpython3.12.so.1.0", "/usr/bin/python3.10", "/bin/x"] {
        if let Ok(i) = analyze(data, name) {
            assert!(i.eval.start < i.eval.end);
            assert!(i.layout.code_size <= 8192);
            if let Position::Pointer { code_adaptive } = i.layout.position {
                assert!(u64::from(code_adaptive) < i.layout.code_size);
            }
        }
    }
});
