//! Code inside the enricher's confinement, for `tests/tests/confinement.rs` and the pod
//! test: it confines itself exactly as `firn-enricher ARGS` would (the same settings
//! parser and the same confine step, from the enricher's library), then tries what a
//! taken-over enricher would:
//!   firn-confined-probe VICTIM_PID OTHER_FILE CLOSED_PORT OPEN_PORT -- ARGS…
//! VICTIM_PID is a process of the same uid; OTHER_FILE a file of another user's home;
//! CLOSED_PORT a listening TCP port the settings do not name, OPEN_PORT one they do.
//! With FIRN_PROBE_UNCONFINED=1 it skips the confinement (the control run).
//! Prints one JSON object: each attempt and how it ended ("ALLOWED" or the errno).

use std::collections::BTreeMap;
use std::ffi::{CString, OsString};
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

fn errno_name(e: i32) -> String {
    format!("{:?}", nix::errno::Errno::from_raw(e))
}

fn io(r: std::io::Result<()>) -> String {
    match r {
        Ok(()) => "ALLOWED".into(),
        Err(e) => e.raw_os_error().map_or_else(|| e.to_string(), errno_name),
    }
}

/// A raw syscall's result, errno read at once.
fn sys(ret: libc::c_long) -> String {
    if ret < 0 {
        format!("{:?}", nix::errno::Errno::last())
    } else {
        "ALLOWED".into()
    }
}

fn read(path: &str) -> String {
    io(std::fs::File::open(path).and_then(|mut f| f.read(&mut [0u8; 16]).map(|_| ())))
}

fn main() {
    let args: Vec<OsString> = std::env::args_os().collect();
    let Some(sep) = args.iter().position(|a| a == "--") else {
        eprintln!(
            "usage: firn-confined-probe VICTIM_PID OTHER_FILE CLOSED_PORT OPEN_PORT -- ARGS…"
        );
        std::process::exit(2);
    };
    let own: Vec<String> = args[1..sep]
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let [victim, other_file, closed, open] = own.as_slice() else {
        eprintln!("firn-confined-probe: four arguments before --");
        std::process::exit(2);
    };
    let victim: i32 = victim.parse().unwrap_or(0);
    let closed: u16 = closed.parse().unwrap_or(0);
    let open: u16 = open.parse().unwrap_or(0);
    let enricher: Vec<OsString> = std::iter::once(OsString::from("firn-enricher"))
        .chain(args[sep + 1..].iter().cloned())
        .collect();
    let words: Vec<String> = enricher
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let out_dir = words
        .iter()
        .enumerate()
        .find_map(|(i, w)| match w.strip_prefix("--output-dir") {
            Some("") => words.get(i + 1).cloned(),
            Some(rest) => rest.strip_prefix('=').map(str::to_string),
            None => None,
        })
        .map_or_else(|| PathBuf::from("/var/lib/firn/profiles"), PathBuf::from);

    let confined = std::env::var_os("FIRN_PROBE_UNCONFINED").is_none_or(|v| v != "1");
    if confined {
        if let Err(e) = firn_enricher::confine_as_enricher(enricher) {
            println!("{}", serde_json::json!({ "error": e }));
            std::process::exit(2);
        }
    }
    let me = std::process::id();
    let mut r: BTreeMap<&str, String> = BTreeMap::new();
    r.insert("proc_environ", read(&format!("/proc/{victim}/environ")));
    r.insert(
        "proc_root",
        read(&format!("/proc/{victim}/root/etc/hostname")),
    );
    r.insert("proc_maps", read(&format!("/proc/{victim}/maps")));
    r.insert(
        "proc_mem",
        io(std::fs::File::open(format!("/proc/{victim}/mem")).map(|_| ())),
    );
    r.insert(
        "proc_fd",
        io(std::fs::read_link(format!("/proc/{victim}/fd/0")).map(|_| ())),
    );
    r.insert("proc_self_status", read("/proc/self/status"));
    r.insert("etc_shadow", read("/etc/shadow"));
    r.insert("other_home", read(other_file));
    let local = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let connect =
        |port| io(TcpStream::connect_timeout(&local(port), Duration::from_secs(2)).map(|_| ()));
    r.insert("tcp_unconfigured", connect(closed));
    r.insert("tcp_configured", connect(open));
    r.insert(
        "tcp_bind_other",
        io(TcpListener::bind(local(closed.wrapping_add(1))).map(|_| ())),
    );
    r.insert(
        "exec",
        io(std::process::Command::new("/bin/true").status().map(|_| ())),
    );
    let outside = PathBuf::from(format!("/tmp/firn-confined-probe-{me}"));
    r.insert("write_outside", io(std::fs::write(&outside, b"x")));
    let _ = std::fs::remove_file(&outside);
    let inside = out_dir.join(format!("probe-{me}"));
    r.insert("write_inside", io(std::fs::write(&inside, b"x")));
    let _ = std::fs::remove_file(&inside);
    // SAFETY: signal 0 only checks permission; the remaining calls get valid pointers
    // to live buffers or none, and are expected to fail.
    unsafe {
        r.insert("signal_victim", sys(libc::kill(victim, 0) as libc::c_long));
        r.insert(
            "ptrace",
            sys(libc::ptrace(libc::PTRACE_ATTACH, victim, 0, 0)),
        );
        let mut buf = [0u8; 8];
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: 8,
        };
        let remote = libc::iovec {
            iov_base: 0x10000 as *mut libc::c_void,
            iov_len: 8,
        };
        r.insert(
            "process_vm_readv",
            sys(libc::process_vm_readv(victim, &local, 1, &remote, 1, 0) as libc::c_long),
        );
        r.insert(
            "unshare_user",
            sys(libc::unshare(libc::CLONE_NEWUSER) as libc::c_long),
        );
        let (none, tmp, tmpfs) = (
            CString::new("none").unwrap_or_default(),
            CString::new("/tmp").unwrap_or_default(),
            CString::new("tmpfs").unwrap_or_default(),
        );
        r.insert(
            "mount",
            sys(libc::mount(
                none.as_ptr(),
                tmp.as_ptr(),
                tmpfs.as_ptr(),
                0,
                std::ptr::null(),
            ) as libc::c_long),
        );
        r.insert(
            "io_uring_setup",
            sys(libc::syscall(
                libc::SYS_io_uring_setup,
                1,
                [0u8; 120].as_mut_ptr(),
            )),
        );
        r.insert(
            "x32_getpid",
            sys(libc::syscall(libc::SYS_getpid | 0x4000_0000)),
        );
        r.insert("bpf", sys(libc::syscall(libc::SYS_bpf, 0, 0, 0)));
    }
    r.insert("confined", confined.to_string());
    println!("{}", serde_json::json!(r));
}
