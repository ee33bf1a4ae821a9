//! Where the tests run: the repository, the release binaries, whether BPF may be
//! skipped, temporary directories and test users.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repository")
        .to_path_buf()
}

/// Whether a missing BPF environment must fail the test rather than skip it.
pub fn bpf_required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
        || std::env::var("FIRN_REQUIRE_BPF").is_ok_and(|v| v == "1")
}

/// Returns false (skip) when this machine cannot run the sampler, or panics when
/// BPF is required.
pub fn can_run_bpf() -> bool {
    let root = nix::unistd::geteuid().is_root();
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    let bins = bin("firn-sampler").exists() && bin("firn-enricher").exists();
    if root && btf && bins {
        return true;
    }
    let why = format!(
        "cannot run the sampler here: root={root} btf={btf} release binaries built={bins} \
         (build with `cargo build --release`)"
    );
    if bpf_required() {
        panic!("{why}; CI=true or FIRN_REQUIRE_BPF=1 forbids skipping");
    }
    eprintln!("SKIPPED: {why}");
    false
}

/// A release binary of the workspace.
pub fn bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("FIRN_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    repo_root().join("target/release").join(name)
}

/// A temporary directory readable by every user, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "firn-{tag}-{}-{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos() ^ rand_u32() as u128
        ));
        std::fs::create_dir_all(&p).expect("create temp dir");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // FIRN_KEEP_TEMP=1 keeps it, to look at a failed test's profiles and logs.
        if std::env::var_os("FIRN_KEEP_TEMP").is_some() {
            eprintln!("kept {}", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut b);
    }
    u32::from_ne_bytes(b)
}

/// A system user for tests, created when missing. Returns (uid, gid).
pub fn test_user(name: &str) -> (u32, u32) {
    if nix::unistd::User::from_name(name).ok().flatten().is_none() {
        let status = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--user-group",
                name,
            ])
            .status()
            .expect("useradd");
        assert!(status.success(), "useradd {name}");
    }
    let u = nix::unistd::User::from_name(name)
        .ok()
        .flatten()
        .expect("user exists after useradd");
    (u.uid.as_raw(), u.gid.as_raw())
}
