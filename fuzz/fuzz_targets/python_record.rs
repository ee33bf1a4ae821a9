//! The sampler's check of CPython interpreter records on arbitrary bytes, as a lying
//! enricher would send them: decoded or refused, never a panic; a record that passes
//! has one encoding (the bytes it came from) and every offset within the walk's bounds.
#![no_main]

use firn_schema::python_record::{Record, MAX_OFFSET, USER_END};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(r) = Record::from_bytes(data) else {
        return;
    };
    if r.check().is_ok() {
        assert_eq!(r.to_bytes().as_slice(), data);
        assert!(r.runtime < USER_END && r.code_type < USER_END);
        assert!(r.tstate_frame <= MAX_OFFSET && r.frame_code <= MAX_OFFSET);
        assert!(r.code_name + 8 <= r.code_size);
    }
});
