//! The listening socket: created by the sampler (`--socket`) or passed by systemd
//! (LISTEN_FDS/LISTEN_PID), and the peer check on every accepted connection.

use std::ffi::OsString;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use nix::fcntl::{open, OFlag};
use nix::sys::socket::{getsockopt, sockopt};
use nix::sys::stat::Mode;
use nix::unistd::{chown, Gid, Group};

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
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

pub struct Listening {
    pub listener: UnixListener,
    /// Set when the sampler created the socket file and must remove it at exit.
    pub created: Option<Created>,
}

pub struct Created {
    pub dir: OwnedFd,
    pub name: OsString,
    pub path: PathBuf,
}

impl Created {
    /// Removes the socket file through the held directory fd (the only unlinkat the
    /// seccomp filter allows).
    pub fn remove(&self) {
        if let Err(e) = nix::unistd::unlinkat(
            &self.dir,
            Path::new(&self.name),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        ) {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove the socket file");
        }
    }
}

/// The socket systemd passed, if the environment says it is for us.
pub fn from_systemd() -> Result<Option<UnixListener>, ListenError> {
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
pub fn create(path: &Path, group: Option<&str>) -> Result<Listening, ListenError> {
    let shown = path.display().to_string();
    let dir_path = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| ListenError::NoFileName(shown.clone()))?
        .to_os_string();
    if !dir_path.is_dir() {
        return Err(ListenError::NoDirectory(dir_path.display().to_string()));
    }
    let gid = group.map(resolve_group).transpose()?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(ListenError::Busy(shown));
            }
            // Stale socket of a sampler that died: nobody listens, replace it.
            std::fs::remove_file(path).map_err(|source| ListenError::Io {
                what: "removing stale socket",
                path: shown.clone(),
                source,
            })?;
        }
        Ok(_) => return Err(ListenError::NotASocket(shown)),
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(|source| ListenError::Io {
        what: "binding",
        path: shown.clone(),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(|source| {
        ListenError::Io {
            what: "chmod 0660",
            path: shown.clone(),
            source,
        }
    })?;
    if let Some(gid) = gid {
        chown(path, None, Some(gid)).map_err(|e| ListenError::Io {
            what: "chown",
            path: shown.clone(),
            source: e.into(),
        })?;
    }
    let dir = open(
        dir_path.as_os_str().as_bytes(),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ListenError::Io {
        what: "opening socket directory",
        path: dir_path.display().to_string(),
        source: e.into(),
    })?;
    Ok(Listening {
        listener,
        created: Some(Created {
            dir,
            name,
            path: path.to_path_buf(),
        }),
    })
}

/// Resolves `--allow-uid` / `--allow-gid` values (names or numbers) before confinement.
pub fn resolve_allow(users: &[String], groups: &[String]) -> Result<Allow, ListenError> {
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

/// Who may connect: uid 0, `--allow-uid`, or a primary gid in `--allow-gid`.
pub struct Allow {
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

pub enum Peer {
    Allowed { uid: u32, pid: i32 },
    Refused { uid: u32, gid: u32, pid: i32 },
    Unknown(nix::errno::Errno),
}

pub fn check_peer(stream: &impl std::os::fd::AsFd, allow: &Allow) -> Peer {
    match getsockopt(stream, sockopt::PeerCredentials) {
        Ok(cred) => {
            let (uid, gid, pid) = (cred.uid(), cred.gid(), cred.pid());
            if uid == 0 || allow.uids.contains(&uid) || allow.gids.contains(&gid) {
                Peer::Allowed { uid, pid }
            } else {
                Peer::Refused { uid, gid, pid }
            }
        }
        Err(e) => Peer::Unknown(e),
    }
}
