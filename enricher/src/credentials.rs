//! Credentials read from files (bearer tokens, passwords, header files): read at start
//! and again on SIGHUP, never logged, and refused when any user may read them. A file
//! its group may read is taken with a warning (Kubernetes mounts secrets 0440 with the
//! pod's fsGroup); one that others may read is refused, as ssh refuses such keys.
//! Under systemd, `LoadCredential=` gives the unit a 0400 copy of its own.

use std::cell::RefCell;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Bytes of a credential file at most.
const MAX_BYTES: u64 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub(crate) enum CredentialError {
    #[error("{what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{what} {path} may be read by every user (mode {mode:04o}): refused; make it \
         readable by its owner only (chmod 0600), or use systemd's LoadCredential="
    )]
    WorldReadable {
        what: &'static str,
        path: PathBuf,
        mode: u32,
    },
    #[error("{what} {path} is not a regular file")]
    NotAFile { what: &'static str, path: PathBuf },
    #[error("{what} {path} is over {MAX_BYTES} bytes")]
    TooLarge { what: &'static str, path: PathBuf },
    #[error("{what} {path}: {message}")]
    Format {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
}

/// Reads a credential file, checking who else may read it. Trailing newlines are cut.
pub(crate) fn read(what: &'static str, path: &Path) -> Result<String, CredentialError> {
    let err = |source| CredentialError::Read {
        what,
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(err)?;
    let meta = file.metadata().map_err(err)?;
    if !meta.is_file() {
        return Err(CredentialError::NotAFile {
            what,
            path: path.to_path_buf(),
        });
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o004 != 0 {
        return Err(CredentialError::WorldReadable {
            what,
            path: path.to_path_buf(),
            mode,
        });
    }
    if mode & 0o040 != 0 {
        tracing::warn!(
            what,
            path = %path.display(),
            mode = format_args!("{mode:04o}"),
            gid = meta.gid(),
            "a credential file its group may read; make it readable by its owner only"
        );
    }
    if meta.len() > MAX_BYTES {
        return Err(CredentialError::TooLarge {
            what,
            path: path.to_path_buf(),
        });
    }
    let mut text = String::new();
    file.take(MAX_BYTES)
        .read_to_string(&mut text)
        .map_err(err)?;
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}

/// A credential file's content, kept until a reload reads a good one.
pub(crate) struct SecretFile {
    what: &'static str,
    path: PathBuf,
    value: RefCell<String>,
}

impl SecretFile {
    pub(crate) fn open(what: &'static str, path: &Path) -> Result<Rc<Self>, CredentialError> {
        let value = read(what, path)?;
        Ok(Rc::new(Self {
            what,
            path: path.to_path_buf(),
            value: RefCell::new(value),
        }))
    }

    /// Reads the file again; on failure the previous value stays.
    pub(crate) fn reload(&self) -> Result<(), CredentialError> {
        let value = read(self.what, &self.path)?;
        *self.value.borrow_mut() = value;
        Ok(())
    }

    pub(crate) fn get(&self) -> String {
        self.value.borrow().clone()
    }

    pub(crate) fn what(&self) -> &'static str {
        self.what
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_may_read_a_credential_decides() {
        let dir = std::env::temp_dir().join(format!("firn-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "s3cret\n").unwrap();
        let chmod = |m| std::fs::set_permissions(&f, std::fs::Permissions::from_mode(m)).unwrap();
        chmod(0o600);
        let s = SecretFile::open("token file", &f).unwrap();
        assert_eq!(s.get(), "s3cret");
        chmod(0o640);
        assert!(
            read("token file", &f).is_ok(),
            "group-readable: warned, taken"
        );
        chmod(0o644);
        let e = read("token file", &f).unwrap_err().to_string();
        assert!(e.contains("every user") && e.contains("0644"), "{e}");
        // A refused reload keeps the value that was good.
        std::fs::write(&f, "other").unwrap();
        assert!(s.reload().is_err());
        assert_eq!(s.get(), "s3cret");
        chmod(0o600);
        s.reload().unwrap();
        assert_eq!(s.get(), "other");
        assert!(matches!(
            read("token file", &dir),
            Err(CredentialError::NotAFile { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
