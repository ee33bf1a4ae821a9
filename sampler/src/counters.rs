//! Every failure mode and drop has a counter here; `info` and every batch carry them.

use std::cell::Cell;

/// Counts one more.
pub(crate) fn bump(c: &Cell<u64>) {
    add(c, 1);
}

/// Counts `n` more (saturating: a counter never wraps).
pub(crate) fn add(c: &Cell<u64>, n: u64) {
    c.set(c.get().saturating_add(n));
}

macro_rules! counters {
    ($($name:ident: $doc:literal,)*) => {
        /// Cumulative since start. The sampler is single-threaded after setup, so plain
        /// cells suffice.
        #[derive(Default)]
        pub struct Counters {
            $(#[doc = $doc] pub $name: Cell<u64>,)*
        }

        impl Counters {
            pub(crate) fn list(&self) -> Vec<(&'static str, u64)> {
                vec![
                    $((stringify!($name), self.$name.get()),)*
                    ("log_lines_suppressed", firn_logs::suppressed()),
                ]
            }

            #[cfg(test)]
            fn docs() -> Vec<(&'static str, &'static str)> {
                vec![$((stringify!($name), $doc),)*]
            }
        }
    };
}

counters! {
    rounds: "rounds completed",
    bpf_samples: "samples the BPF program counted (idle excluded)",
    bpf_idle_samples: "samples of the idle task, skipped on purpose",
    bpf_user_stack_lost: "user stacks not stored: stack map full",
    bpf_kernel_stack_lost: "kernel stacks not stored: stack map full",
    bpf_user_stack_errors: "user stack reads failed unexpectedly",
    bpf_kernel_stack_errors: "kernel stack reads failed unexpectedly",
    bpf_counts_map_full: "samples lost: counts map full",
    bpf_sample_log_full: "samples that found their CPU's run of the sample log full this round (counted in the counts map instead: nothing lost)",
    sample_log_failures: "rounds whose sample log could not be mapped (its samples stay for the set's next drain) or unmapped",
    drain_errors: "rounds whose map drain failed",
    counter_batch_failures: "rounds whose counters could not be read in one batch (read one by one instead)",
    stack_lookup_failures: "stacks referenced by a sample but missing from the stack map",
    samples_sent: "sample entries put into batches",
    user_stacks_truncated: "user stacks cut at a frame outside user space (unwinding garbage)",
    kernel_frames_unresolved: "kernel frames with no symbol (sent as [unknown])",
    processes_read: "process records read from /proc",
    processes_gone: "processes gone before /proc could be read (sent with BPF facts only)",
    processes_execed_before_read: "announced processes that exec'd before /proc could be read (their earlier program sent with BPF facts only)",
    processes_gone_described: "processes gone (or exec'd) before /proc could be read whose executable and its mappings came from another process of the same file",
    processes_gone_undescribed: "processes gone (or exec'd) before /proc could be read with no other process of their executable's file read before",
    process_read_errors: "process records that failed for another reason",
    mapping_refreshes: "mapping lists read again after a frame fell outside them",
    process_records_trimmed: "process records cut to the per-record byte bound (mappings past it left out)",
    process_reads_deferred: "new processes not read from /proc this round: the round's read budget was spent (read in a later round, if still alive)",
    process_records_deferred: "process records held back to the next batch: the batch's record bytes were spent",
    processes_evicted_bytes: "processes forgotten early because the table's record bytes were spent",
    processes_forgotten: "processes dropped from the table after they exited",
    bpf_events: "process events the BPF program wrote to the ring buffer",
    bpf_events_lost: "process events lost: ring buffer full (the next sample of the process tries again; see --events-buffer-kib)",
    events_new: "new-process events handled (process read from /proc right away)",
    events_exec: "exec events of sampled processes (the old program's record is closed)",
    events_exit: "exit events of sampled processes (record kept until its last round is sent)",
    cgroup_moves: "samples of a process in another cgroup than its last sample's (it moved)",
    cgroup_reads: "cgroup files read for a cgroup id first seen after a move (once per id)",
    cgroup_reads_limited: "cgroup reads held back by the rate bound (50/s, burst 100; tried again later, 1,024 waiting at most): until then those samples keep the process's earlier labels",
    cgroup_read_errors: "cgroup files of moved processes that could not be read (the process was gone)",
    cgroup_paths_stale: "cgroup paths read for an id that the cgroup filesystem says is another cgroup's (the process moved again before the read; read again at its next move)",
    cgroup_paths_unconfirmed: "cgroup paths kept without the cgroup filesystem's confirmation (not mounted in the sampler's view, or outside its cgroup namespace)",
    cgroup_paths_flushed: "times the cgroup path table passed its 1 MiB bound and started again",
    cgroup_reads_saved: "new processes whose cgroup text came from the cgroup id's known path instead of a read",
    events_malformed: "ring buffer records of an unexpected size or kind (ignored)",
    processes_read_early: "new-process events that had the process read from /proc at once, before the round's end",
    process_read_ns: "wall-clock nanoseconds spent reading process records from /proc",
    binary_handle_ns: "wall-clock nanoseconds spent taking binary handles",
    binary_handles_taken: "O_PATH handles taken of newly seen mapped files (for brokering after exit)",
    binary_handles_failed: "mapped files no handle could be taken of (not regular, identity mismatch, gone)",
    binary_handles_skipped: "new mapped files not walked to: the round's walk budget (path components) was spent, or too many records waited for their walks (brokered by path while their process lives)",
    binary_handles_unwalkable: "mapped paths never walked: cut at the kept length or deeper than 128 components",
    binary_handles_failed_recently: "mapped files not walked to again: their walk failed a few rounds ago",
    binary_handles_evicted: "handles closed early because the handle bound was reached",
    binary_handles_expired: "handles closed after rounds without use",
    broker_opened_from_handle: "broker opens served from a held handle (the process may have exited)",
    cpus_unsampled: "CPUs back from offline or new since setup (unsampled); the sampler exits to be restarted",
    online_cpus_unread: "rounds whose online CPU list could not be read: a CPU hotplug not checked that round",
    round_ticks_missed: "round ticks with no round of their own: a round ran past two ticks or more (one that runs past a single tick is followed by the next round at once)",
    round_timer_errors: "failed reads of the round timer (the round ran a second later; while reads keep failing, rounds come a second apart)",
    request_floods: "connections closed for calling faster than allowed",
    stalled_connections: "connections closed for not reading their answers",
    broker_requests_never_issued: "connections closed for asking about a process they were never sent",
    connections_accepted: "client connections accepted",
    connections_refused_peer: "connections refused: peer uid/gid not allowed",
    connections_refused_limit: "connections refused: too many connections",
    connections_peer_unknown: "connections refused: peer credentials unreadable",
    protocol_mismatches: "requests with another protocol version",
    unknown_methods: "calls to an interface or method the sampler does not have (connection closed)",
    bad_requests: "malformed or unexpected requests (connection closed)",
    protocol_errors: "connections closed for unreadable or over-limit messages",
    rpc_bootstraps_refused: "connections closed for a second Bootstrap message (one per connection)",
    rpc_messages_refused: "connections closed for a message kind the sampler never accepts (Provide, Accept, Join, Disembargo, obsolete or unknown kinds) or a question id in use",
    rpc_questions_refused: "connections closed for leaving more than 256 calls without a Finish",
    message_floods: "connections closed for sending messages faster than allowed",
    subscriptions: "subscriptions started",
    batches_queued: "batches put into subscriber queues",
    batches_sent: "batches delivered to subscribers",
    processes_announced: "process records queued for subscribers as soon as read, ahead of their round's batch",
    processes_read_from_facts: "new processes read with what their NEW event told (no stat, exe or owner lookups); a kernel thread with no read at all",
    process_facts_mismatched: "new processes whose mappings did not hold the executable where BPF saw it (exec'd, pid reused, or a filesystem naming another inode): read the stat-checked way",
    remap_events: "REMAP events: a known process ran code outside its record's mappings (mapped after the read: a loader still at work, a dlopen)",
    remap_events_skipped: "REMAP events not acted on: the process ended or was not read yet, or a read for it lately changed nothing (backing off, up to 10 s)",
    remap_reads_no_budget: "REMAP events not acted on: the round's /proc budget is down to the half kept for new processes",
    mapping_reads_other_program: "mapping reads of a known process that found another program (an exec whose event was not read yet): not taken",
    remap_reads_limited: "REMAP events not acted on: over 50 such reads a second over all processes (the round's end reads the mappings of samples outside them, as before)",
    remap_reads_changed: "mapping reads after a REMAP event that found new mappings (sent at once, their files' tables then built)",
    processes_not_announced: "process records read between rounds that a subscriber gets with the round's batch instead: every file they map was sent to it before (and none is a Python interpreter it has a record for)",
    told_files_flushed: "a subscriber's set of the files it heard of was full and started over (its processes are announced again until it fills)",
    announcements_sent: "announcements (process records between rounds) delivered to subscribers",
    records_sent_ahead: "process records sent in announcements of their own ahead of their batch or announcement, whose records were more than one message should hold",
    batches_dropped: "batches dropped from full subscriber queues",
    send_errors: "pushes that failed (subscriber gone)",
    broker_fds_sent: "file descriptors passed to subscribers",
    broker_refused_unknown: "broker requests for processes or mappings this subscription was not sent",
    broker_refused_gone: "broker requests for processes that exited or whose pid was reused",
    broker_refused_deleted: "broker requests for files deleted or replaced since mapped",
    broker_refused_not_regular: "broker requests whose path is not a regular file",
    broker_refused_identity: "broker requests whose file has another device or inode than the mapping",
    broker_refused_open: "broker requests whose open failed",
    broker_refused_rate: "broker requests over the rate limit",
    broker_refused_channel: "broker requests with no or a full broker channel",
    broker_channels: "broker channels attached",
    broker_channels_refused: "broker channels with an unknown or reused key (closed)",
    handshake_timeouts: "connections that sent nothing in time (closed)",
    bpf_unwind_table_frames: "user frames the BPF unwinder walked with a table row",
    bpf_unwind_fp_frames: "user frames the BPF unwinder walked by frame pointers (no row for the pc)",
    bpf_unwind_stack_windows: "reads of the user stack by the BPF unwinder: each copies up to 512 bytes that serve the frames within them",
    bpf_unwind_row_memo_hits: "user frames whose row the BPF unwinder took from its CPU's memo of rows found lately (no search of the table)",
    bpf_unwind_end_complete: "user stacks ended at an outermost frame (a row said so)",
    bpf_unwind_end_no_process: "user stacks cut after the leaf: the process's mappings were not in the map yet",
    bpf_unwind_end_no_mapping: "user stacks ended by frame pointers in anonymous executable code (JIT, vDSO)",
    bpf_unwind_end_no_table: "user stacks ended by frame pointers in a file without a table",
    bpf_unwind_end_not_in_table: "user stacks ended by frame pointers at a pc the table has no row for",
    bpf_unwind_end_unsupported: "user stacks ended at a CFA rule the unwinder cannot follow",
    bpf_unwind_end_read_fault: "no longer written (a failed read ends a stack as bad_frame)",
    bpf_unwind_end_depth: "user stacks cut at 127 frames",
    bpf_unwind_end_bad_frame: "user stacks ended at a caller frame that failed a check: a return address outside the process's executable mappings, a frame outside the stack window, unreadable stack (a wrong table, or code mapped since the record was read)",
    unwind_tables_loaded: "unwind tables written into the BPF maps",
    unwind_rows_loaded: "unwind rows written into the BPF maps",
    unwind_table_load_ns: "nanoseconds the sampler spent taking in unwind tables (checking, writing and publishing their rows)",
    unwind_rows_in_use: "unwind rows and page-directory entries held in the row pool now (a gauge; see --unwind-rows)",
    heap_used_bytes: "bytes the sampler's allocator has handed out now (a gauge, at each round's end)",
    heap_free_bytes: "bytes the sampler's heap holds free now, in holes or not yet trimmed (a gauge, at each round's end)",
    heap_blocks_reused: "large allocations (an unwind table chunk's message) served by the pages of one freed before instead of new ones (alloc.rs; at each round's end)",
    processes_known: "processes the sampler holds records of now, ended ones kept for their subscribers included (a gauge, at each round's end)",
    unwind_tables_evicted: "unwind tables removed to make room (their files mapped by no known process)",
    unwind_tables_refused_malformed: "unwind table chunks refused as malformed (connection closed)",
    unwind_tables_refused_budget: "unwind tables refused: over the table limit or no room in the pool",
    unwind_tables_refused_unknown: "unwind table chunks for a process or mapping this subscription was not sent",
    unwind_tables_refused_other: "unwind table chunks refused: out of order, another owner, disabled, rate or map errors",
    unwind_mappings_truncated: "processes with more executable mappings than the unwinder holds (60; frames in the rest end their stack)",
    unwind_procmaps_failed: "process mappings the sampler could not write into the BPF map",
    python_interpreters_loaded: "CPython interpreter records taken for the BPF walk",
    python_interpreters_in_use: "processes whose interpreter the BPF walk knows now (a gauge)",
    python_interpreters_refused_invalid: "interpreter records refused: malformed, or a field failed the check (another version, layout, address, range, offset)",
    python_interpreters_refused_outside: "interpreter records refused: the eval loop or an object outside the named mapping's reach",
    python_interpreters_refused_other: "interpreter records refused: unknown process or mapping, rate, another subscription's, map full or disabled",
    python_code_forwarded: "Python code objects' names forwarded to subscribers",
    python_code_drain_failures: "Python code entries that could not be read out of their map",
    python_code_reset: "copied-code marks cleared for a new subscriber (its code objects are copied again)",
    python_code_dropped: "Python code blobs lost with dropped batches past the batch's bound (their frames stay unnamed)",
    bpf_off_cpu_waits: "off-CPU waits counted (--off-cpu)",
    bpf_off_cpu_short: "off-CPU waits under --off-cpu-min-us, skipped",
    bpf_off_cpu_unsampled: "voluntary switches not drawn (one in N is, N from --off-cpu-every and --off-cpu-rate; the drawn ones carry their time)",
    bpf_off_cpu_untimed: "switch-outs not timed: the task's storage could not be allocated",
    bpf_off_cpu_ns: "off-CPU nanoseconds counted (each wait weighted by the N it was drawn one in)",
    bpf_off_cpu_weight: "voluntary switches the taken waits stand for (the sum of the N each was drawn one in): near waits + not drawn when the draw is fair",
    bpf_off_cpu_crossed: "off-CPU waits that ended in a later round than they began: counted without stacks",
    bpf_python_frames: "Python frames the BPF walk emitted",
    bpf_python_no_thread: "Python walks with no thread state or no current frame for the sampled thread (native frames kept)",
    bpf_python_read_faults: "Python walks stopped: a frame or code object could not be read",
    bpf_python_not_code: "Python walks stopped: a frame's code was not of the interpreter's code type",
    bpf_python_bad_types: "interpreters whose record's types are not CPython's code, str and bytes (no Python frames for the process)",
    bpf_python_code_copied: "code objects' names the BPF walk copied",
    bpf_python_code_full: "code objects' names not copied: the map was full until the next drain (copied when met again)",
    bpf_unwind_step_budget: "user stacks ended because the walk's step budget ran out",
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_gauges_readers_are_told_of_are_the_counters_that_say_so() {
        let said: Vec<&str> = super::Counters::docs()
            .into_iter()
            .filter(|(_, doc)| doc.contains("a gauge"))
            .map(|(name, _)| name)
            .collect();
        let mut told = firn_schema::SAMPLER_GAUGES.to_vec();
        told.sort_unstable();
        let mut said_sorted = said.clone();
        said_sorted.sort_unstable();
        assert_eq!(said_sorted, told);
    }
}
