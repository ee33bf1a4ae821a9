//! The round's steps against a fake sampler link: binaries are opened once and named,
//! tables are built and sent once, refusals leave addresses and are asked again later.

use std::cell::{Cell, RefCell};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::*;
use crate::batch::{Mapping, Process, Sample, Stack};
use crate::labels::System;
use crate::model::Frame;
use crate::symbolize::Limits;

/// Serves this test binary for every mapping, or refuses; counts what it was asked.
#[derive(Default)]
struct FakeLink {
    refuse: bool,
    opens: Cell<u32>,
    tables: RefCell<crate::unwind::Sent>,
    loaded_rows: Cell<usize>,
    /// The (process id, mapping index, version) of the last table loaded.
    last_load: Cell<(u64, u32, u32)>,
    interpreters: RefCell<std::collections::HashMap<u64, u32>>,
    /// Records older than these versions are unknown to opens and to table loads, as
    /// to a sampler that read the process's mappings again since.
    stale_opens: u32,
    stale_loads: u32,
}

impl SamplerLink for FakeLink {
    async fn open(&self, _: u64, _: u32, version: u32) -> Result<OwnedFd, BrokerError> {
        self.opens.set(self.opens.get() + 1);
        if version < self.stale_opens {
            return Err(BrokerError::Refused(
                firn_schema::firn_capnp::Refusal::UnknownProcess,
            ));
        }
        if self.refuse {
            return Err(BrokerError::Refused(
                firn_schema::firn_capnp::Refusal::ProcessGone,
            ));
        }
        Ok(std::fs::File::open("/proc/self/exe")
            .expect("own binary")
            .into())
    }

    async fn load_table(
        &self,
        id: u64,
        index: u32,
        version: u32,
        rows: &[u8],
    ) -> Result<(), TableSendError> {
        if version < self.stale_loads {
            return Err(TableSendError::Refused(
                firn_schema::firn_capnp::TableRefusal::UnknownProcess,
            ));
        }
        self.last_load.set((id, index, version));
        self.loaded_rows
            .set(self.loaded_rows.get() + rows.len() / 8);
        Ok(())
    }

    fn tables(&self) -> &RefCell<crate::unwind::Sent> {
        &self.tables
    }

    async fn load_interpreter(
        &self,
        _: u64,
        _: u32,
        _: u32,
        _: &[u8],
    ) -> Result<(), crate::broker::InterpreterSendError> {
        Ok(())
    }

    fn interpreters(&self) -> &RefCell<std::collections::HashMap<u64, u32>> {
        &self.interpreters
    }
}

#[inline(never)]
fn marker_function() -> u64 {
    std::hint::black_box(marker_function as *const () as usize as u64)
}

/// This process's mapping of its own executable that holds `addr`.
fn own_mapping(addr: u64) -> Mapping {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("own maps");
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (a, b) = f[0].split_once('-').expect("range");
        let (start, end) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        if addr >= start && addr < end {
            let (maj, min) = f[3].split_once(':').unwrap();
            return Mapping {
                start,
                end,
                file_offset: u64::from_str_radix(f[2], 16).unwrap(),
                dev_major: u32::from_str_radix(maj, 16).unwrap(),
                dev_minor: u32::from_str_radix(min, 16).unwrap(),
                inode: f[4].parse().unwrap(),
                path: f[5].to_string(),
            };
        }
    }
    panic!("no mapping holds {addr:#x}");
}

fn batch(round: u64, addr: u64, with_record: bool) -> Batch {
    let m = own_mapping(addr);
    let process = Process {
        process_id: 1,
        pid: std::process::id(),
        start_time_ns: 1,
        ppid: 1,
        uid: 0,
        comm: "self".into(),
        exe: m.path.clone(),
        cmdline: Vec::new(),
        cgroup: String::new(),
        mappings: vec![m],
        mappings_version: 1,
        complete: true,
        first_sample_ns: 0,
    };
    Batch {
        session_id: 7,
        round,
        start_time_ns: round * 10,
        end_time_ns: round * 10 + 10,
        frequency_hz: 99,
        dropped_batches: 0,
        python_code: Vec::new(),
        processes: if with_record {
            vec![process]
        } else {
            Vec::new()
        },
        samples: vec![Sample {
            process_id: 1,
            pid: std::process::id(),
            tid: std::process::id(),
            comm: "self".into(),
            count: 3,
            user_frames: vec![addr],
            kernel_frames: Vec::new(),
            user_stack: Stack::Ok,
            kernel_stack: Stack::Absent,
            user_end: None,
            cgroup_id: 0,
            off_cpu_ns: 0,
        }],
        kernel_symbols: Vec::new(),
        counters: Vec::new(),
        forgotten_processes: Vec::new(),
        tables_evicted: 0,
        cgroups: Vec::new(),
        off_cpu: false,
    }
}

fn enricher() -> Enricher {
    let metrics = Arc::new(Metrics::default());
    let system = System {
        node: "test".into(),
        kernel_release: "6.18".into(),
        machine: "x86_64".into(),
    };
    Enricher::new(
        Symbolizer::new(Limits::default(), metrics.clone()),
        Labeler::new(Vec::new(), Vec::new(), system),
        metrics,
    )
}

fn leaf_name(r: &Round) -> Option<String> {
    match r.stacks.first()?.frames.first()? {
        Frame::User {
            lines: Some(lines), ..
        } => lines.last().map(|l| l.function.to_string()),
        _ => None,
    }
}

fn run<F: std::future::Future>(f: F) -> F::Output {
    futures::executor::block_on(f)
}

#[test]
fn binaries_are_opened_once_named_and_tabled() {
    let addr = marker_function();
    let mut e = enricher();
    let link = FakeLink::default();
    let r = run(e.handle(batch(1, addr, true), Some(&link)));
    let name = leaf_name(&r).expect("the frame is named");
    assert!(name.contains("marker_function"), "{name}");
    assert_eq!(
        link.opens.get(),
        2,
        "one open to symbolize, one to build the table"
    );
    assert!(link.loaded_rows.get() > 100, "the table was sent");
    // The next round: the cache names the frame, the table is not sent again.
    let before = link.loaded_rows.get();
    let r = run(e.handle(batch(2, addr, false), Some(&link)));
    assert!(leaf_name(&r).is_some());
    assert_eq!(link.opens.get(), 2);
    assert_eq!(link.loaded_rows.get(), before);
    // The sampler evicted tables: this one is sent again.
    let mut b = batch(3, addr, false);
    b.tables_evicted = 1;
    run(e.handle(b, Some(&link)));
    assert!(link.loaded_rows.get() > before);
}

#[test]
fn without_a_link_or_with_refusals_frames_stay_addresses() {
    let addr = marker_function();
    let mut e = enricher();
    let r = e.handle_offline(batch(1, addr, true));
    assert_eq!(leaf_name(&r), None);
    assert_eq!(r.stacks[0].count, 3, "the sample keeps its weight");
    let link = FakeLink {
        refuse: true,
        ..Default::default()
    };
    let r = run(e.handle(batch(2, addr, false), Some(&link)));
    assert_eq!(leaf_name(&r), None);
    let asked = link.opens.get();
    assert!(asked >= 1);
    // Refused binaries are not asked for again until their retry round.
    run(e.handle(batch(3, addr, false), Some(&link)));
    assert_eq!(link.opens.get(), asked);
    run(e.handle(batch(2 + RETRY_ROUNDS, addr, false), Some(&link)));
    assert!(link.opens.get() > asked, "asked again once due");
}

#[test]
fn python_frames_are_named_from_the_batch_blobs() {
    use firn_schema::python_code::{frame, CodeBlob};
    let mut e = enricher();
    let addr = marker_function();
    let mut b = batch(1, addr, true);
    let blob = CodeBlob {
        id: 77,
        first_line: 3,
        minor: 12,
        flags: 0,
        name: b"K.method",
        file: b"/srv/app.py",
        table: &[],
    };
    b.python_code = vec![blob.to_bytes(), vec![0; 5]];
    let entry = frame::TAG | 77 << frame::INDEX_BITS | 4;
    let unknown = frame::TAG | 78 << frame::INDEX_BITS;
    b.samples[0].user_frames = vec![entry, unknown, addr];
    let r = e.handle_offline(b);
    let frames = &r.stacks[0].frames;
    assert_eq!(frames[0].kind(), crate::model::FrameKind::Python);
    let mut names = Vec::new();
    crate::model::frame_names(&frames[0], &mut names);
    crate::model::frame_names(&frames[1], &mut names);
    assert_eq!(&*names[0], "K.method");
    assert_eq!(&*names[1], "[python: unknown code]");
    assert_eq!(frames[2].kind(), crate::model::FrameKind::Native);
    let m = &e.metrics;
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(m.python_code_received.load(Relaxed), 1);
    assert_eq!(m.python_code_malformed.load(Relaxed), 1);
    assert_eq!(m.python_frames_named.load(Relaxed), 1);
    assert_eq!(m.python_frames_unnamed.load(Relaxed), 1);
}

#[test]
fn an_announced_process_gets_its_tables_before_any_round_within_the_budget() {
    let addr = marker_function();
    let mut e = enricher();
    let link = FakeLink::default();
    let mut record = batch(1, addr, true).processes;
    record[0].first_sample_ns = firn_schema::boot_ns();
    run(e.announced(record.clone(), Some(&link)));
    assert!(link.loaded_rows.get() > 100, "sent at once");
    assert_eq!(e.early.waiting(), 0);
    assert!(e.early_wait().is_none());
    let m = &e.metrics;
    assert_eq!(m.unwind_tables_early.load(Ordering::Relaxed), 1);
    // Its round sends nothing again; a process announced while the budget is spent
    // waits for it to come back.
    let rows = link.loaded_rows.get();
    run(e.handle(batch(1, addr, false), Some(&link)));
    assert_eq!(link.loaded_rows.get(), rows);
    let other = FakeLink::default();
    e.early.spend(10.0);
    run(e.announced(record, Some(&other)));
    assert_eq!(other.loaded_rows.get(), 0, "over budget: waits");
    let wait = e.early_wait().expect("work waits");
    assert!(wait > std::time::Duration::from_secs(30), "{wait:?}");
    e.early.spend(-20.0);
    run(e.early_work(&other));
    assert!(
        other.loaded_rows.get() > 100,
        "sent once the budget is back"
    );
}

#[test]
fn a_table_refused_for_a_stale_record_goes_with_the_next_announcement_not_a_round_later() {
    let addr = marker_function();
    // Refused by the broker, or (the binary opened with the first reading) by the
    // table load: either way the sampler has read the mappings again.
    for (stale_opens, stale_loads) in [(2, 0), (0, 2)] {
        let mut e = enricher();
        let link = FakeLink {
            stale_opens,
            stale_loads,
            ..Default::default()
        };
        let mut v1 = batch(1, addr, true).processes;
        v1[0].first_sample_ns = firn_schema::boot_ns();
        run(e.announced(v1.clone(), Some(&link)));
        assert_eq!(link.loaded_rows.get(), 0, "refused: a stale record");
        let mut v2 = v1;
        v2[0].mappings_version = 2;
        run(e.announced(v2, Some(&link)));
        assert!(link.loaded_rows.get() > 100, "sent with the new reading");
        assert_eq!(link.last_load.get(), (1, 0, 2));
    }
}

/// Runs `f` on a current-thread runtime, as the enricher does (builds aside need one).
fn on_runtime<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(f)
}

#[test]
fn a_large_files_table_is_built_aside_and_a_small_one_announced_meanwhile_is_not_held_up() {
    on_runtime(async {
        let addr = marker_function();
        let mut e = enricher();
        let link = FakeLink::default();
        let (mut big, big_file) = large_announcement(addr, 1);
        big[0].first_sample_ns = firn_schema::boot_ns();
        e.announced(big, Some(&link)).await;
        assert!(e.early.building(big_file));
        assert_eq!(link.loaded_rows.get(), 0, "built aside, not sent yet");
        assert!(e.early_wait().is_none(), "nothing else waits");
        let mut small = batch(1, addr, true).processes;
        small[0].process_id = 2;
        let m = &mut small[0].mappings[0];
        m.inode += 1;
        m.end = m.start + 4096;
        e.announced(small, Some(&link)).await;
        let rows = link.loaded_rows.get();
        assert!(rows > 100, "the small file's table at once");
        let built = e.built_aside().await;
        e.finish_aside(built, Some(&link)).await;
        assert_eq!(link.loaded_rows.get(), 2 * rows, "then the large one's");
        assert!(!e.early.building(big_file));
        let m = &e.metrics;
        assert_eq!(m.unwind_tables_built_aside.load(Ordering::Relaxed), 1);
        assert_eq!(m.unwind_tables_early.load(Ordering::Relaxed), 2);
        // Its round does not build it again.
        run(e.handle(batch(1, addr, false), Some(&link)));
        assert_eq!(link.loaded_rows.get(), 2 * rows);
    });
}

/// A process announced with a mapping made large (64 MiB), and its file. The fake link
/// serves this binary for every file; only the mapping's size makes it large.
fn large_announcement(addr: u64, version: u32) -> (Vec<Process>, (u64, u64)) {
    let mut big = batch(1, addr, true).processes;
    let m = &mut big[0].mappings[0];
    m.end = m.start + (64 << 20);
    let file = (dev_of(m), m.inode);
    big[0].mappings_version = version;
    (big, file)
}

#[test]
fn a_table_built_aside_goes_to_the_record_as_it_is_when_done_and_not_to_another_session() {
    on_runtime(async {
        let addr = marker_function();
        let mut e = enricher();
        let link = FakeLink::default();
        let (v1, file) = large_announcement(addr, 1);
        e.announced(v1, Some(&link)).await;
        assert!(e.early.building(file));
        // Its mappings are read again while the build runs: the table goes with the
        // version the sampler holds now.
        let (v2, _) = large_announcement(addr, 2);
        e.announced(v2, Some(&link)).await;
        let built = e.built_aside().await;
        e.finish_aside(built, Some(&link)).await;
        assert_eq!(link.last_load.get(), (1, 0, 2));
        // A build that ends in another session is not sent, and counted.
        let mut e = enricher();
        let other = FakeLink::default();
        let (v1, file) = large_announcement(addr, 1);
        e.announced(v1, Some(&other)).await;
        e.set_session(8);
        assert!(
            e.early.building(file),
            "a build under way outlives the session"
        );
        let built = e.built_aside().await;
        e.finish_aside(built, Some(&other)).await;
        assert_eq!(other.loaded_rows.get(), 0);
        let m = &e.metrics;
        assert_eq!(m.unwind_tables_aside_unsent.load(Ordering::Relaxed), 1);
        assert!(!e.early.building(file));
    });
}

#[test]
fn a_round_leaves_a_large_files_table_to_the_build_aside() {
    on_runtime(async {
        let addr = marker_function();
        let mut e = enricher();
        let link = FakeLink::default();
        // A process the round meets first (not announced), mapping a large file.
        let mut b = batch(1, addr, true);
        let m = &mut b.processes[0].mappings[0];
        m.end = m.start + (64 << 20);
        let file = (dev_of(m), m.inode);
        e.handle(b, Some(&link)).await;
        assert_eq!(link.loaded_rows.get(), 0, "not built inside the round");
        let m = &e.metrics;
        assert_eq!(m.unwind_tables_deferred.load(Ordering::Relaxed), 1);
        e.early_work(&link).await;
        assert!(e.early.building(file));
        // The next round neither builds it nor queues it again.
        e.handle(batch(2, addr, false), Some(&link)).await;
        assert_eq!(link.loaded_rows.get(), 0);
        assert_eq!(e.metrics.unwind_tables_deferred.load(Ordering::Relaxed), 1);
        let built = e.built_aside().await;
        e.finish_aside(built, Some(&link)).await;
        assert!(link.loaded_rows.get() > 100, "sent once built");
    });
    // Without a runtime (the fuzz target) the round builds it itself.
    let mut e = enricher();
    let link = FakeLink::default();
    let mut b = batch(1, marker_function(), true);
    b.processes[0].mappings[0].end += 64 << 20;
    run(e.handle(b, Some(&link)));
    assert!(link.loaded_rows.get() > 100);
}

#[test]
fn tables_kept_on_disk_are_read_back_without_a_build() {
    let addr = marker_function();
    let dir = std::env::temp_dir().join(format!("firn-enrich-uwc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut rows = Vec::new();
    for round in 0..2 {
        let mut e = enricher();
        e.table_cache = Some(crate::unwind::cache::Cache::open(&dir, 1 << 30, 0).unwrap());
        let link = FakeLink::default();
        run(e.handle(batch(1, addr, true), Some(&link)));
        rows.push(link.loaded_rows.get());
        let m = &e.metrics;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let (built, hits) = (get(&m.unwind_tables_built), get(&m.unwind_table_cache_hits));
        assert_eq!((built, hits), if round == 0 { (1, 0) } else { (0, 1) });
    }
    assert!(rows[0] > 100 && rows[0] == rows[1], "{rows:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn samples_after_a_move_carry_the_new_cgroups_labels() {
    let addr = marker_function();
    let rules = crate::labels::relabel::compile(&crate::labels::default_rules().unwrap()).unwrap();
    let mut e = enricher();
    e.labeler.reconfigure(rules, Vec::new());
    let unit = |r: &Round, i: usize| {
        r.stacks[i]
            .labels
            .iter()
            .find(|(k, _)| k == "systemd_unit")
            .map(|(_, v)| v.clone())
    };
    let mut b = batch(1, addr, true);
    b.processes[0].cgroup = "0::/user.slice/user-0.slice/session-3.scope\n".into();
    b.cgroups = vec![(9, "0::/system.slice/moved.service\n".into())];
    let mut after = b.samples[0].clone();
    after.cgroup_id = 9;
    after.user_frames = vec![addr + 1];
    b.samples.push(after);
    let r = e.handle_offline(b);
    assert_eq!(r.stacks.len(), 2);
    let units: Vec<Option<String>> = (0..2).map(|i| unit(&r, i)).collect();
    assert!(
        units.contains(&Some("session-3.scope".into())),
        "the sample before the move keeps the old labels: {units:?}"
    );
    assert!(units.contains(&Some("moved.service".into())), "{units:?}");
    // Each batch names its samples' paths; a main thread that renamed itself names its
    // process from then on.
    let mut b = batch(2, addr, false);
    b.samples[0].cgroup_id = 9;
    b.cgroups = vec![(9, "0::/system.slice/moved.service\n".into())];
    b.samples[0].comm = "renamed".into();
    let r = e.handle_offline(b);
    assert_eq!(unit(&r, 0).as_deref(), Some("moved.service"));
    let comm = r.stacks[0].labels.iter().find(|(k, _)| k == "comm");
    assert_eq!(comm.map(|c| c.1.as_str()), Some("renamed"));
}
