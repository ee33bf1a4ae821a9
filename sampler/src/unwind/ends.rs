//! Why a user stack ended. The BPF program's `enum firn_unwind_end` (`profile.bpf.h`)
//! is the source; the wire's `UnwindEnd` and the sampler's counters follow it, and the
//! assertions below fail the build when they drift.

use std::cell::Cell;

use firn_sampler_bpf::types::{firn_counter, firn_unwind_end as End};
use firn_schema::firn_capnp::UnwindEnd as Wire;

use crate::counters::Counters;

macro_rules! ends {
    ($($bpf:ident => $wire:ident, $counter:ident;)*) => {
        /// Every reason in value order: the program's value, the wire's, its counter.
        pub(crate) const ALL: &[(End, Wire, fn(&Counters) -> &Cell<u64>)] = &[
            $((End::$bpf, Wire::$wire, |c: &Counters| &c.$counter),)*
        ];
        const _: () = {
            let mut n = 0u32;
            $(
                assert!(End::$bpf.0 == Wire::$wire as u32, "wire and BPF values differ");
                assert!(End::$bpf.0 == n, "listed out of order");
                n += 1;
            )*
            assert!(n == End::FIRN_END_MAX.0, "a reason is missing");
        };
    };
}

ends! {
    FIRN_END_COMPLETE => Complete, bpf_unwind_end_complete;
    FIRN_END_NO_PROCESS => NoProcess, bpf_unwind_end_no_process;
    FIRN_END_NO_MAPPING => NoMapping, bpf_unwind_end_no_mapping;
    FIRN_END_NO_TABLE => NoTable, bpf_unwind_end_no_table;
    FIRN_END_NOT_IN_TABLE => NotInTable, bpf_unwind_end_not_in_table;
    FIRN_END_UNSUPPORTED => Unsupported, bpf_unwind_end_unsupported;
    FIRN_END_READ_FAULT => ReadFault, bpf_unwind_end_read_fault;
    FIRN_END_DEPTH => DepthLimit, bpf_unwind_end_depth;
    FIRN_END_BAD_FRAME => BadFrame, bpf_unwind_end_bad_frame;
}

// The program counts each end in the slot FIRN_CTR_END_BASE + reason.
const _: () = assert!(
    firn_counter::FIRN_CTR_END_BASE.0 + End::FIRN_END_MAX.0 == firn_counter::FIRN_CTR_PY_FRAMES.0
);

/// The program's per-CPU counter slot of stacks that ended for `reason`.
pub(crate) const fn slot(reason: End) -> firn_counter {
    firn_counter(firn_counter::FIRN_CTR_END_BASE.0 + reason.0)
}

/// The wire's value of a reason the program wrote (an unknown one, which the program
/// never writes, as `unsupported`).
pub(crate) fn wire(reason: u32) -> Wire {
    ALL.get(reason as usize)
        .map_or(Wire::Unsupported, |&(_, w, _)| w)
}

/// Whether the stack ended at a frame outside the process's known code: the sampler
/// reads its mappings again (code mapped since, e.g. dlopen).
pub(crate) fn outside_mappings(reason: u32) -> bool {
    reason == End::FIRN_END_BAD_FRAME.0
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_reason_maps_to_its_wire_value() {
        for (i, &(bpf, wire, _)) in super::ALL.iter().enumerate() {
            assert_eq!(bpf.0 as usize, i);
            assert_eq!(super::wire(bpf.0), wire);
        }
        assert_eq!(super::wire(999), super::Wire::Unsupported);
    }
}
