//! Every failure mode and drop has a counter here; `info` and every batch carry them.

use std::cell::Cell;

macro_rules! counters {
    ($($name:ident: $doc:literal,)*) => {
        /// Cumulative since start. The sampler is single-threaded after setup, so plain
        /// cells suffice.
        #[derive(Default)]
        pub struct Counters {
            $(#[doc = $doc] pub $name: Cell<u64>,)*
        }

        impl Counters {
            pub fn list(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name.get()),)*]
            }
        }
    };
}

counters! {
    rounds: "rounds completed",
    bpf_samples: "samples the BPF program counted (idle excluded)",
    bpf_idle_samples: "samples of the idle task, skipped on purpose",
    bpf_user_stack_lost: "user stacks not stored: stack map full or bucket taken",
    bpf_kernel_stack_lost: "kernel stacks not stored: stack map full or bucket taken",
    bpf_user_stack_errors: "user stack reads failed unexpectedly",
    bpf_kernel_stack_errors: "kernel stack reads failed unexpectedly",
    bpf_counts_map_full: "samples lost: counts map full",
    drain_errors: "rounds whose map drain failed",
    stack_lookup_failures: "stacks referenced by a sample but missing from the stack map",
    samples_sent: "sample entries put into batches",
    kernel_frames_unresolved: "kernel frames with no symbol (sent as [unknown])",
    processes_read: "process records read from /proc",
    processes_gone: "processes gone before /proc could be read (sent with BPF facts only)",
    process_read_errors: "process records that failed for another reason",
    mapping_refreshes: "mapping lists read again after a frame fell outside them",
    processes_forgotten: "processes dropped from the table after they exited",
    connections_accepted: "client connections accepted",
    connections_refused_peer: "connections refused: peer uid/gid not allowed",
    connections_refused_limit: "connections refused: too many connections",
    connections_peer_unknown: "connections refused: peer credentials unreadable",
    protocol_mismatches: "requests with another protocol version",
    bad_requests: "malformed or unexpected requests (connection closed)",
    subscriptions: "subscriptions started",
    batches_queued: "batches put into subscriber queues",
    batches_sent: "batches delivered to subscribers",
    batches_dropped: "batches dropped from full subscriber queues",
    send_errors: "pushes that failed (subscriber gone)",
}
