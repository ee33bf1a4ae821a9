//! The binary broker: opens the file behind a mapping the sampler itself recorded and
//! passes a read-only fd to the subscriber over its broker channel (SCM_RIGHTS).
//!
//! The request names a process record and a mapping index, never a path. The path is
//! the one this sampler read from /proc/<pid>/maps; it is resolved inside the process's
//! own root, starting from a directory fd of /proc/<pid>/root, so an absolute symlink in
//! a container cannot reach a host file. Resolution ends in an `O_PATH` handle of the
//! last component, which opens nothing (no device driver, FIFO or socket is touched and
//! no inotify open event fires). Only once that handle is a regular file with the
//! mapping's device and inode is it reopened read-only, through `/proc/self/fd/N`: that
//! magic link jumps to the very inode the handle pins, not to a name, so a rename, mount
//! or swap after the check cannot put another file in its place.
//!
//! The resolution is `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` done one component
//! at a time in user space: every step is an `openat(O_PATH | O_NOFOLLOW)` relative to a
//! held directory fd, symlinks are read and re-rooted at the process's root, `..` never
//! climbs above it, and magic links are read as plain paths. Why not openat2 itself:
//! seccomp cannot see its flags (they sit behind a pointer), so allowing it would allow
//! opening for writing; Landlock could forbid that, but a Landlocked process loses
//! ptrace-read access to the /proc of every process outside its domain, which the
//! sampler needs. `openat`'s flags are a register seccomp checks.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;

use firn_schema::firn_capnp::Refusal;
use nix::fcntl::{openat, OFlag};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use nix::sys::stat::{fstat, Mode, SFlag};

use crate::handles::Handles;
use crate::procfs::{self, Mapping, ProcError, ProcessRecord};

/// Opens mapping `index` of `record`, checking that it is still the file that was mapped.
/// A handle taken while the process lived ([`Handles`]) is used first: it reaches the
/// file after the process exited. Otherwise the path is walked in the live process's
/// root.
pub(crate) fn open_mapping(
    record: &ProcessRecord,
    index: usize,
    handles: &Handles,
    c: &crate::counters::Counters,
) -> Result<OwnedFd, Refusal> {
    let m = record.mappings.get(index).ok_or(Refusal::UnknownMapping)?;
    walkable(m)?;
    if let Some(opened) = handles.open(crate::handles::file_id(m)) {
        crate::counters::bump(&c.broker_opened_from_handle);
        return opened;
    }
    let dir = procfs::open_verified(record.pid, record.start_ns).map_err(|e| match e {
        ProcError::Gone { .. } | ProcError::Reused { .. } => Refusal::ProcessGone,
        _ => Refusal::OpenFailed,
    })?;
    let mut steps = MAX_STEPS;
    reopen_read_only(&checked_handle(&open_root(&dir)?, m, &mut steps)?)
}

/// Whether `m` names a file a walk could reach: an absolute path that the kernel did
/// not mark deleted, kept whole, and of a depth real binaries have. A cut or absurdly
/// deep path is never walked: it cannot be the mapped file, and walking it would let
/// any local user spend the sampler's time.
pub(crate) fn walkable(m: &Mapping) -> Result<(), Refusal> {
    if m.path.ends_with(b" (deleted)") {
        return Err(Refusal::Deleted);
    }
    if m.path.first() != Some(&b'/') {
        return Err(Refusal::NotRegularFile);
    }
    if !shallow(m) {
        return Err(Refusal::OpenFailed);
    }
    Ok(())
}

/// Whether `m`'s path is whole and at most [`MAX_DEPTH`] components deep.
pub(crate) fn shallow(m: &Mapping) -> bool {
    !m.cut && components(&m.path).nth(MAX_DEPTH).is_none()
}

/// An `O_PATH` handle of the root directory of the process whose `/proc/<pid>`
/// directory is `proc_dir`: where its paths are resolved.
pub(crate) fn open_root(proc_dir: &OwnedFd) -> Result<OwnedFd, Refusal> {
    openat(
        proc_dir.as_fd(),
        "root",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|_| Refusal::ProcessGone)
}

/// An `O_PATH` handle of `m`'s path resolved inside `root`, once it is a regular file
/// with the mapping's device and inode. `steps` is the walk's budget of path
/// components (symlink targets included), spent as they are walked.
pub(crate) fn checked_handle(
    root: &OwnedFd,
    m: &Mapping,
    steps: &mut u32,
) -> Result<OwnedFd, Refusal> {
    let handle = resolve_in_root(root, &m.path, steps)?;
    let st = fstat(handle.as_fd()).map_err(|_| Refusal::OpenFailed)?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(Refusal::NotRegularFile);
    }
    if (st.st_dev, st.st_ino) != crate::handles::file_id(m) {
        return Err(Refusal::IdentityMismatch);
    }
    Ok(handle)
}

/// Opens the file an `O_PATH` handle pins, read-only. The caller has checked its type.
pub(crate) fn reopen_read_only(handle: &OwnedFd) -> Result<OwnedFd, Refusal> {
    let link = format!("/proc/self/fd/{}", handle.as_raw_fd());
    let fd = nix::fcntl::open(
        link.as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK,
        Mode::empty(),
    )
    .map_err(open_err)?;
    // The link cannot lead elsewhere; checked anyway, it costs one fstat.
    let (a, b) = (
        fstat(handle.as_fd()).map_err(|_| Refusal::OpenFailed)?,
        fstat(fd.as_fd()).map_err(|_| Refusal::OpenFailed)?,
    );
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
        return Err(Refusal::IdentityMismatch);
    }
    Ok(fd)
}

/// Symlinks followed at most while resolving one path (the kernel's MAXSYMLINKS).
const MAX_LINKS: u32 = 40;
/// Components walked at most for one path, symlink expansions included.
pub(crate) const MAX_STEPS: u32 = 256;
/// Components of a mapped path at most: deeper paths are not walked at all (real
/// binaries sit a few to a few tens of directories deep).
pub(crate) const MAX_DEPTH: usize = 128;

fn open_err(e: nix::errno::Errno) -> Refusal {
    match e {
        nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR => Refusal::Deleted,
        _ => Refusal::OpenFailed,
    }
}

/// Resolves `path` as if `root` were `/`, following symlinks within it, to an `O_PATH`
/// handle of its last component (never a symlink). Nothing on the way is opened for I/O.
/// Each component walked spends one of `budget`; at most [`MAX_STEPS`] are spent.
pub(crate) fn resolve_in_root(
    root: &OwnedFd,
    path: &[u8],
    budget: &mut u32,
) -> Result<OwnedFd, Refusal> {
    // Directories walked so far; empty means "at root". `..` pops, never past root.
    let mut dirs: Vec<OwnedFd> = Vec::new();
    let mut pending: std::collections::VecDeque<Vec<u8>> = components(path).collect();
    let (mut links, mut steps) = (0u32, 0u32);
    while let Some(comp) = pending.pop_front() {
        steps += 1;
        if steps > MAX_STEPS || *budget == 0 {
            return Err(Refusal::OpenFailed);
        }
        *budget -= 1;
        if comp == b".." {
            dirs.pop();
            continue;
        }
        let cur = dirs.last().unwrap_or(root);
        let name = std::ffi::OsStr::from_bytes(&comp);
        let fd = openat(
            cur.as_fd(),
            name,
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(open_err)?;
        let kind =
            SFlag::from_bits_truncate(fstat(fd.as_fd()).map_err(open_err)?.st_mode) & SFlag::S_IFMT;
        if kind == SFlag::S_IFLNK {
            links += 1;
            if links > MAX_LINKS {
                return Err(Refusal::OpenFailed);
            }
            let target = nix::fcntl::readlinkat(cur.as_fd(), name).map_err(open_err)?;
            let target = target.as_bytes();
            if target.first() == Some(&b'/') {
                dirs.clear();
            }
            for c in components(target).collect::<Vec<_>>().into_iter().rev() {
                pending.push_front(c);
            }
            continue;
        }
        if pending.is_empty() {
            return Ok(fd);
        }
        if kind != SFlag::S_IFDIR {
            return Err(Refusal::Deleted);
        }
        dirs.push(fd);
    }
    // The path named the root itself (or only `..`): not a file.
    Err(Refusal::NotRegularFile)
}

fn components(path: &[u8]) -> impl Iterator<Item = Vec<u8>> + '_ {
    path.split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .map(<[u8]>::to_vec)
}

/// Sends `fd` tagged with `ticket` without blocking. The sampler's copy closes on return.
pub(crate) fn send_fd(channel: &UnixStream, ticket: u64, fd: OwnedFd) -> Result<(), Refusal> {
    let mut msg = [0u8; 16];
    msg[..8].copy_from_slice(&ticket.to_le_bytes());
    let iov = [IoSlice::new(&msg)];
    let fds = [fd.as_raw_fd()];
    match sendmsg::<()>(
        channel.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        None,
    ) {
        Ok(n) if n == msg.len() => Ok(()),
        Ok(_) => Err(Refusal::ChannelFull),
        Err(nix::errno::Errno::EAGAIN) => Err(Refusal::ChannelFull),
        Err(_) => Err(Refusal::NoBrokerChannel),
    }
}

/// Broker opens per subscriber: sustained per second, and burst.
pub(crate) const BROKER_RATE: f64 = 200.0;
pub(crate) const BROKER_BURST: f64 = 2_000.0;

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn root_of(dir: &std::path::Path) -> OwnedFd {
        nix::fcntl::open(dir, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty()).unwrap()
    }

    fn ino(fd: &OwnedFd) -> u64 {
        fstat(fd.as_fd()).unwrap().st_ino
    }

    fn steps() -> u32 {
        MAX_STEPS
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let base = std::env::temp_dir().join(format!("firn-broker-{}", std::process::id()));
        let root = base.join("root");
        std::fs::create_dir_all(root.join("lib/sub")).unwrap();
        std::fs::write(root.join("lib/real.so"), b"inside").unwrap();
        std::fs::write(base.join("outside.so"), b"outside").unwrap();
        // Absolute symlink: means /lib/real.so of the root, not of the host.
        symlink("/lib/real.so", root.join("lib/abs.so")).unwrap();
        // Relative with too many `..`: clamps at the root.
        symlink("../../../../lib/real.so", root.join("lib/sub/up.so")).unwrap();
        // A host path that does not exist inside the root.
        symlink(base.join("outside.so"), root.join("lib/host.so")).unwrap();
        symlink("loop", root.join("lib/loop")).unwrap();
        let r = root_of(&root);
        let real = std::fs::metadata(root.join("lib/real.so")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            ino(&resolve_in_root(&r, b"/lib/real.so", &mut steps()).unwrap()),
            real.ino()
        );
        assert_eq!(
            ino(&resolve_in_root(&r, b"/lib/abs.so", &mut steps()).unwrap()),
            real.ino()
        );
        assert_eq!(
            ino(&resolve_in_root(&r, b"/lib/sub/up.so", &mut steps()).unwrap()),
            real.ino()
        );
        assert_eq!(
            ino(&resolve_in_root(&r, b"/../../lib/./real.so", &mut steps()).unwrap()),
            real.ino()
        );
        assert!(matches!(
            resolve_in_root(&r, b"/lib/host.so", &mut steps()),
            Err(Refusal::Deleted)
        ));
        assert!(matches!(
            resolve_in_root(&r, b"/lib/loop", &mut steps()),
            Err(Refusal::OpenFailed)
        ));
        assert!(matches!(
            resolve_in_root(&r, b"/", &mut steps()),
            Err(Refusal::NotRegularFile)
        ));
        assert!(matches!(
            resolve_in_root(&r, b"/lib/real.so/x", &mut steps()),
            Err(Refusal::Deleted)
        ));
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// A mapping record of this very process for `path`, with `path`'s own identity
    /// (what /proc/<pid>/maps showed before the path was covered).
    fn record_for(path: &std::path::Path, dev: u64, ino: u64) -> ProcessRecord {
        let me = std::process::id();
        ProcessRecord {
            pid: me,
            start_ns: procfs::start_ns_of(me).expect("own start time"),
            mappings: vec![procfs::Mapping {
                start: 0x1000,
                end: 0x2000,
                offset: 0,
                dev_major: libc::major(dev),
                dev_minor: libc::minor(dev),
                inode: ino,
                path: path.as_os_str().as_bytes().into(),
                cut: false,
            }],
            complete: true,
            ..Default::default()
        }
    }

    /// What the broker does when a mapped path now leads to a device, a FIFO, a socket
    /// or a directory: refuses without opening it (inotify sees no open), whatever the
    /// identity it was asked for.
    #[test]
    fn special_files_are_refused_unopened() {
        use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
        use std::os::unix::fs::MetadataExt;
        let base = std::env::temp_dir().join(format!("firn-special-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let fifo = base.join("fifo");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
        let dir = base.join("dir");
        std::fs::create_dir(&dir).unwrap();
        let sock = base.join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let mut specials = vec![fifo, dir, sock];
        // A character device like /dev/null (root only; CI runs as root).
        let dev = base.join("null");
        if nix::sys::stat::mknod(
            &dev,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o600),
            libc::makedev(1, 3),
        )
        .is_ok()
        {
            specials.push(dev);
        }
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK).unwrap();
        for path in &specials {
            inotify.add_watch(path, AddWatchFlags::IN_OPEN).unwrap();
            let meta = std::fs::symlink_metadata(path).unwrap();
            let record = record_for(path, meta.dev(), meta.ino());
            assert!(
                matches!(
                    open_mapping(&record, 0, &Handles::new(0), &Default::default()),
                    Err(Refusal::NotRegularFile)
                ),
                "{} was not refused as not a regular file",
                path.display()
            );
            // Behind a symlink, too.
            let link = base.join("link");
            let _ = std::fs::remove_file(&link);
            symlink(path, &link).unwrap();
            let record = record_for(&link, meta.dev(), meta.ino());
            assert!(matches!(
                open_mapping(&record, 0, &Handles::new(0), &Default::default()),
                Err(Refusal::NotRegularFile)
            ));
        }
        let events = inotify.read_events().unwrap_or_default();
        assert!(
            events.is_empty(),
            "the broker opened a special file: {events:?}"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// Once resolved, the handle pins the inode: swapping the name for a FIFO between
    /// the check and the reopen still opens the file that was checked.
    #[test]
    fn reopen_follows_the_handle_not_the_name() {
        use std::io::Read;
        use std::os::unix::fs::MetadataExt;
        let base = std::env::temp_dir().join(format!("firn-reopen-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let file = base.join("lib.so");
        std::fs::write(&file, b"checked").unwrap();
        let ino_before = std::fs::metadata(&file).unwrap().ino();
        let r = root_of(std::path::Path::new("/"));
        let handle = resolve_in_root(&r, file.as_os_str().as_bytes(), &mut steps()).unwrap();
        // The race a hostile process would win: the name now leads to a FIFO.
        let fifo = base.join("fifo");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::rename(&fifo, &file).unwrap();
        let fd = reopen_read_only(&handle).unwrap();
        assert_eq!(ino(&fd), ino_before);
        let mut text = String::new();
        std::fs::File::from(fd).read_to_string(&mut text).unwrap();
        assert_eq!(text, "checked");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
