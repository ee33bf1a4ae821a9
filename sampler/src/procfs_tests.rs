//! Tests of the /proc reads (`procfs.rs`).

use super::*;

#[test]
fn stat_with_hostile_comm() {
    let s = b"42 (a) b) (c) S 7 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 12345 1 1";
    let st = parse_stat(s).unwrap();
    assert_eq!(st.comm, b"a) b) (c");
    assert_eq!(st.ppid, 7);
    assert_eq!(st.start_ticks, 12345);
    assert!(!st.exited && !st.kernel_thread);
    let z = parse_stat(b"9 (k) Z 2 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0").unwrap();
    assert!(z.exited && z.kernel_thread);
}

#[test]
fn maps_keeps_executable_file_mappings() {
    let maps = b"55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234   /usr/bin/a b\n\
55d0c0a01000-55d0c0a02000 r-xp 00001000 fd:01 1234   /usr/bin/a b\n\
7ffd1000-7ffd2000 r-xp 00000000 00:00 0   [vdso]\n\
7f0000000000-7f0000100000 r-xp 00002000 103:0a 99 /lib/x.so (deleted)\n";
    let all = parse_maps(maps);
    // The vDSO is kept as anonymous code (inode 0), apart from the files.
    assert_eq!(all.len(), 3);
    assert_eq!((all[1].start, all[1].inode), (0x7ffd1000, 0));
    let m: Vec<&Mapping> = all.iter().filter(|m| m.inode != 0).collect();
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].start, 0x55d0c0a01000);
    assert_eq!(m[0].offset, 0x1000);
    assert_eq!(
        (m[0].dev_major, m[0].dev_minor, m[0].inode),
        (0xfd, 1, 1234)
    );
    assert_eq!(&*m[0].path, b"/usr/bin/a b");
    assert_eq!((m[1].dev_major, m[1].dev_minor), (0x103, 0xa));
    assert_eq!(&*m[1].path, b"/lib/x.so (deleted)");
}

#[test]
fn records_are_trimmed_to_their_bound() {
    let mapping = |i: u64| Mapping {
        start: i << 12,
        end: (i + 1) << 12,
        offset: 0,
        dev_major: 8,
        dev_minor: 1,
        inode: i + 1,
        path: vec![b'x'; 4000].into(),
        cut: false,
    };
    let mut r = ProcessRecord {
        mappings: (0..4096).map(mapping).collect(),
        ..Default::default()
    };
    assert!(r.wire_bytes() > 15 << 20);
    assert!(r.trim_to(MAX_RECORD_BYTES));
    assert!(r.wire_bytes() <= MAX_RECORD_BYTES);
    assert!(r.mappings.len() > 50);
    // The first mappings (lowest addresses) are the ones kept.
    assert_eq!(r.mappings[0].inode, 1);
    assert!(!r.trim_to(MAX_RECORD_BYTES));
    // One file mapped thousands of times does not crowd out the libraries after it.
    let mut r = ProcessRecord {
        mappings: (0..4096)
            .map(|i| Mapping {
                inode: if i < 4000 { 7 } else { i },
                path: vec![b'x'; 1000].into(),
                ..mapping(i)
            })
            .collect(),
        ..Default::default()
    };
    assert!(r.trim_to(MAX_RECORD_BYTES));
    assert!(r.wire_bytes() <= MAX_RECORD_BYTES);
    assert_eq!(r.mappings.iter().filter(|m| m.inode != 7).count(), 96);
}

#[test]
fn reads_own_record() {
    let me = std::process::id();
    let stat = std::fs::read(format!("/proc/{me}/stat")).unwrap();
    let ticks = parse_stat(&stat).unwrap().start_ticks;
    let (rec, read, _) =
        read_process_at(me, ticks * (1_000_000_000 / clock_ticks()), 0, None).unwrap();
    assert!(read > 0);
    assert!(rec.complete);
    assert!(!rec.mappings.is_empty());
    assert!(matches!(
        read_process_at(me, (ticks + 5) * (1_000_000_000 / clock_ticks()), 0, None),
        Err(ProcError::Reused { .. })
    ));
    // BPF saw another executable: the process exec'd since; this one runs on.
    let start = ticks * (1_000_000_000 / clock_ticks());
    let exe = std::fs::metadata(format!("/proc/{me}/exe")).unwrap();
    assert!(read_process_at(me, start, std::os::unix::fs::MetadataExt::ino(&exe), None).is_ok());
    assert!(matches!(
        read_process_at(
            me,
            start,
            std::os::unix::fs::MetadataExt::ino(&exe) + 1,
            None
        ),
        Err(ProcError::Execed { .. })
    ));
}
