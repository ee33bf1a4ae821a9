//! Test-only (feature `forbidden-probe`): after confinement, attempts each syscall the
//! design forbids and logs how it was refused. Release builds never contain this.

use std::ffi::CString;

/// Reads errno at once, before any other call can overwrite it.
fn outcome(ret: libc::c_long) -> String {
    if ret < 0 {
        format!("{:?}", nix::errno::Errno::last())
    } else {
        // SAFETY: closing a descriptor this probe just received.
        unsafe { libc::close(ret as libc::c_int) };
        "ALLOWED".to_string()
    }
}

/// A root-owned file the tests create (tests/tests/sampler.rs); the probe tries to unlink it.
pub(crate) const VICTIM: &str = "/tmp/firn-forbidden-probe-victim";

pub(crate) fn run() {
    let path = CString::new("/bin/true").unwrap_or_default();
    let argv = [path.as_ptr(), std::ptr::null()];
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let target = CString::new("/tmp/firn-forbidden-probe").unwrap_or_default();
    let mut attr = [0u8; 128];
    let mut buf = [0u8; 8];
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 8,
    };
    // SAFETY: every call gets valid pointers to live buffers; all are expected to fail.
    let results: Vec<(&str, String)> = unsafe {
        vec![
            (
                "execve",
                outcome(libc::syscall(
                    libc::SYS_execve,
                    path.as_ptr(),
                    argv.as_ptr(),
                    envp.as_ptr(),
                )),
            ),
            (
                "socket_inet",
                outcome(libc::syscall(
                    libc::SYS_socket,
                    libc::AF_INET,
                    libc::SOCK_STREAM,
                    0,
                )),
            ),
            (
                "ptrace",
                outcome(libc::syscall(
                    libc::SYS_ptrace,
                    libc::PTRACE_ATTACH,
                    1,
                    0,
                    0,
                )),
            ),
            (
                "process_vm_readv",
                outcome(libc::syscall(
                    libc::SYS_process_vm_readv,
                    1,
                    &local,
                    1,
                    &remote,
                    1,
                    0,
                )),
            ),
            (
                "bpf_prog_load",
                outcome(libc::syscall(
                    libc::SYS_bpf,
                    5,
                    attr.as_mut_ptr(),
                    attr.len(),
                )),
            ),
            (
                "bpf_map_create",
                outcome(libc::syscall(
                    libc::SYS_bpf,
                    0,
                    attr.as_mut_ptr(),
                    attr.len(),
                )),
            ),
            // Map commands beyond the drain and table writes: getting an fd of another
            // map (or program) by id, or pinning objects, stays refused.
            (
                "bpf_map_get_fd_by_id",
                outcome(libc::syscall(
                    libc::SYS_bpf,
                    14,
                    attr.as_mut_ptr(),
                    attr.len(),
                )),
            ),
            (
                "bpf_obj_get",
                outcome(libc::syscall(
                    libc::SYS_bpf,
                    7,
                    attr.as_mut_ptr(),
                    attr.len(),
                )),
            ),
            (
                "bpf_link_create",
                outcome(libc::syscall(
                    libc::SYS_bpf,
                    28,
                    attr.as_mut_ptr(),
                    attr.len(),
                )),
            ),
            (
                "perf_event_open",
                outcome(libc::syscall(
                    libc::SYS_perf_event_open,
                    attr.as_mut_ptr(),
                    -1,
                    0,
                    -1,
                    0,
                )),
            ),
            (
                "openat_write",
                outcome(libc::syscall(
                    libc::SYS_openat,
                    libc::AT_FDCWD,
                    target.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT,
                    0o600,
                )),
            ),
        ]
    };
    let mut results = results;
    // unlinkat with an absolute path ignores its dirfd: try every plausible fd, so that a
    // filter that checks only the dirfd (the one of the socket directory) lets one through.
    let victim = CString::new(VICTIM).unwrap_or_default();
    let mut unlink = "EBADF".to_string();
    for fd in 0..64 {
        // SAFETY: a valid NUL-terminated path; expected to fail.
        let ret = unsafe { libc::syscall(libc::SYS_unlinkat, fd, victim.as_ptr(), 0) };
        if ret == 0 {
            unlink = "ALLOWED".to_string();
            break;
        }
        unlink = format!("{:?}", nix::errno::Errno::last());
    }
    results.push(("unlinkat_absolute", unlink));
    // pread64 is allowed at offset 0 only (the online CPU list, read again each round):
    // offset 1, and 2^32, whose low 32 bits are 0, so that a filter comparing only them
    // lets it through.
    let stat = CString::new("/proc/self/stat").unwrap_or_default();
    for (name, offset) in [("pread64_offset", 1i64), ("pread64_offset_high", 1 << 32)] {
        // SAFETY: a valid NUL-terminated path.
        let fd = unsafe { libc::open(stat.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        let pread = if fd < 0 {
            format!("open: {:?}", nix::errno::Errno::last())
        } else {
            // SAFETY: a buffer of `buf.len()` bytes; the fd was just opened.
            let ret = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), offset) };
            // A read past the end returns 0, not an error: allowed all the same.
            let out = if ret < 0 {
                format!("{:?}", nix::errno::Errno::last())
            } else {
                "ALLOWED".to_string()
            };
            // SAFETY: the fd opened above.
            unsafe { libc::close(fd) };
            out
        };
        results.push((name, pread));
    }
    // Not a syscall the filter refuses: a root-only file, readable while the sampler is
    // uid 0, unreadable once it runs as --user.
    let shadow = CString::new("/etc/shadow").unwrap_or_default();
    // SAFETY: a valid NUL-terminated path.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            shadow.as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    results.push(("open_root_only", outcome(ret)));
    for (name, ret) in results {
        tracing::warn!(syscall = name, outcome = %ret, "forbidden syscall probe");
    }
}
