//! The listening socket: created by the sampler (`--socket`) or passed by systemd
//! (LISTEN_FDS/LISTEN_PID), and the peer check on every accepted connection.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use nix::fcntl::{open, AtFlags, OFlag};
use nix::sys::socket::{getsockopt, sockopt};
use nix::sys::stat::{fstatat, umask, Mode, SFlag};
use nix::unistd::{fchownat, getegid, setegid, unlinkat, Gid, Group, UnlinkatFlags};

#[derive(Debug, thiserror::Error)]
pub(crate) enum ListenError {
    #[error("socket directory {0} does not exist; create it first (e.g. mkdir -p {0})")]
    NoDirectory(String),
    #[error("socket path {0} is in use: another sampler is listening on it")]
    Busy(String),
    #[error("socket path {0} exists and is not a socket; refusing to replace it")]
    NotASocket(String),
    #[error("socket path {0} has no file name")]
    NoFileName(String),
    #[error("unknown group {0} (in --socket-group or --allow-gid)")]
    UnknownGroup(String),
    #[error("unknown user {0} (in --allow-uid)")]
    UnknownUser(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("LISTEN_FDS passed fd 3, but it is not a listening Unix stream socket: {0}")]
    BadActivationFd(String),
}

pub(crate) struct Listening {
    pub(crate) listener: UnixListener,
}

/// The socket systemd passed, if the environment says it is for us.
pub(crate) fn from_systemd() -> Result<Option<UnixListener>, ListenError> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|p| p == std::process::id());
    let fds = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(0);
    if !pid_ok || fds == 0 {
        return Ok(None);
    }
    // SAFETY: removing variables before any other thread exists.
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
    }
    const FIRST: RawFd = 3;
    // SAFETY: systemd's protocol hands us fd 3 to own.
    let fd = unsafe { OwnedFd::from_raw_fd(FIRST) };
    let ok = getsockopt(&fd, sockopt::SockType)
        .map(|t| t == nix::sys::socket::SockType::Stream)
        .unwrap_or(false)
        && getsockopt(&fd, sockopt::AcceptConn).unwrap_or(false);
    if !ok {
        return Err(ListenError::BadActivationFd(
            "wrong socket type or not listening".into(),
        ));
    }
    let _ = nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    );
    Ok(Some(UnixListener::from(fd)))
}

/// Creates the socket at `path`, mode 0660, group `group`.
///
/// The directory may be writable by others (a Kubernetes emptyDir is 0777), so nothing
/// here changes a file by path after `bind`: the socket is born with its mode (umask
/// around `bind`) and its group (effective gid around `bind`); only when the directory
/// imposes another group (setgid bit) is it changed, through the held directory fd and
/// without following a symlink that may have been swapped in. The file is not removed
/// at exit (the confined sampler may not unlink); the next start replaces it.
pub(crate) fn create(path: &Path, group: Option<&str>) -> Result<Listening, ListenError> {
    let shown = path.display().to_string();
    let dir_path = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| ListenError::NoFileName(shown.clone()))?
        .to_os_string();
    let gid = group.map(resolve_group).transpose()?;
    let dir = open(
        dir_path.as_os_str().as_bytes(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|_| ListenError::NoDirectory(dir_path.display().to_string()))?;
    match fstatat(&dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFSOCK => {
            if UnixStream::connect(path).is_ok() {
                return Err(ListenError::Busy(shown));
            }
            // Stale socket of a sampler that died: nobody listens, replace it.
            unlinkat(&dir, name.as_os_str(), UnlinkatFlags::NoRemoveDir).map_err(|e| {
                ListenError::Io {
                    what: "removing stale socket",
                    path: shown.clone(),
                    source: e.into(),
                }
            })?;
        }
        Ok(_) => return Err(ListenError::NotASocket(shown)),
        Err(_) => {}
    }
    let listener = bind_as(path, gid).map_err(|source| ListenError::Io {
        what: "binding",
        path: shown.clone(),
        source,
    })?;
    if let Some(gid) = gid {
        let st = fstatat(&dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(|e| {
            ListenError::Io {
                what: "checking the new socket",
                path: shown.clone(),
                source: e.into(),
            }
        })?;
        if st.st_gid != gid.as_raw() {
            fchownat(
                &dir,
                name.as_os_str(),
                None,
                Some(gid),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|e| ListenError::Io {
                what: "chown",
                path: shown.clone(),
                source: e.into(),
            })?;
        }
    }
    Ok(Listening { listener })
}

/// Binds `path` with mode 0660 and, if given (and allowed), group `gid` from birth.
fn bind_as(path: &Path, gid: Option<Gid>) -> std::io::Result<UnixListener> {
    let old_mask = umask(Mode::from_bits_truncate(0o117));
    let old_egid = getegid();
    // Without CAP_SETGID (or membership) this fails; the caller then changes the group
    // after the fact, through the directory fd.
    let switched = gid.is_some_and(|g| setegid(g).is_ok());
    let bound = UnixListener::bind(path);
    if switched {
        let _ = setegid(old_egid);
    }
    umask(old_mask);
    bound
}

/// Resolves `--allow-uid` / `--allow-gid` values (names or numbers) before confinement.
pub(crate) fn resolve_allow(users: &[String], groups: &[String]) -> Result<Allow, ListenError> {
    let uids = users
        .iter()
        .map(|u| match u.parse::<u32>() {
            Ok(n) => Ok(n),
            Err(_) => match nix::unistd::User::from_name(u) {
                Ok(Some(user)) => Ok(user.uid.as_raw()),
                _ => Err(ListenError::UnknownUser(u.clone())),
            },
        })
        .collect::<Result<_, _>>()?;
    let gids = groups
        .iter()
        .map(|g| resolve_group(g).map(Gid::as_raw))
        .collect::<Result<_, _>>()?;
    Ok(Allow { uids, gids })
}

fn resolve_group(g: &str) -> Result<Gid, ListenError> {
    if let Ok(n) = g.parse::<u32>() {
        return Ok(Gid::from_raw(n));
    }
    match Group::from_name(g) {
        Ok(Some(grp)) => Ok(grp.gid),
        _ => Err(ListenError::UnknownGroup(g.to_string())),
    }
}

/// Who may connect: uid 0, `--allow-uid`, or a peer with a group in `--allow-gid`, be it
/// its primary group or a supplementary one.
pub(crate) struct Allow {
    pub(crate) uids: Vec<u32>,
    pub(crate) gids: Vec<u32>,
}

pub(crate) enum Peer {
    Allowed { uid: u32, pid: i32 },
    Refused { uid: u32, gid: u32, pid: i32 },
    Unknown(nix::errno::Errno),
}

pub(crate) fn check_peer(stream: &impl std::os::fd::AsFd, allow: &Allow) -> Peer {
    match getsockopt(stream, sockopt::PeerCredentials) {
        Ok(cred) => {
            let (uid, gid, pid) = (cred.uid(), cred.gid(), cred.pid());
            if uid == 0 || allow.uids.contains(&uid) || allow.gids.contains(&gid) {
                return Peer::Allowed { uid, pid };
            }
            if !allow.gids.is_empty() {
                match peer_groups(stream) {
                    Ok(groups) if groups.iter().any(|g| allow.gids.contains(g)) => {
                        return Peer::Allowed { uid, pid }
                    }
                    Ok(_) => {}
                    Err(e) => return Peer::Unknown(e),
                }
            }
            Peer::Refused { uid, gid, pid }
        }
        Err(e) => Peer::Unknown(e),
    }
}

/// The kernel's limit on supplementary groups (NGROUPS_MAX).
const MAX_GROUPS: usize = 65_536;

/// The peer's supplementary groups as of its `connect` (SO_PEERGROUPS, Linux ≥ 4.13).
pub(crate) fn peer_groups(stream: &impl std::os::fd::AsFd) -> Result<Vec<u32>, nix::errno::Errno> {
    use std::os::fd::AsRawFd;
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: the kernel writes at most `len` bytes into `groups`, which has them.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_fd().as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        // ERANGE: `len` now holds the size needed.
        let e = nix::errno::Errno::last();
        if e != nix::errno::Errno::ERANGE || n <= groups.len() || n > MAX_GROUPS {
            return Err(e);
        }
        groups.resize(n, 0);
    }
}
