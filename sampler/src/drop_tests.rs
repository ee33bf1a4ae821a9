//! Tests of the capability drop's and the seccomp allow-list's tables (`drop.rs`).

use super::*;

#[test]
fn at_most_forty_syscalls_each_once() {
    assert!(ALLOWED.len() <= 40, "{} syscalls allowed", ALLOWED.len());
    let mut nrs: Vec<_> = ALLOWED.iter().map(|a| a.nr).collect();
    nrs.sort_unstable();
    nrs.dedup();
    assert_eq!(nrs.len(), ALLOWED.len(), "a syscall is listed twice");
    for (name, _) in RARE {
        assert!(
            ALLOWED.iter().any(|a| a.syscall() == *name),
            "{name} is listed as rare but not allowed"
        );
    }
    build_filter().expect("the filter builds");
}

/// packaging/seccomp/firn-sampler.json is what [`container_profile`] generates.
#[cfg(target_arch = "x86_64")]
#[test]
fn container_profile_is_generated() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../packaging/seccomp/firn-sampler.json"
    );
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == container_profile(),
        "{path} differs from drop.rs; replace it with the output of \
         `firn-sampler --print-seccomp-profile`"
    );
    for s in SETUP {
        assert!(
            !ALLOWED.iter().any(|a| a.nr == s.nr),
            "{} is in SETUP and ALLOWED",
            s.syscall()
        );
    }
}

/// The README's table is this list, word for word.
#[test]
fn readme_table_is_the_list() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("sampler/README.md");
    assert!(
        readme.contains(&table()),
        "sampler/README.md's seccomp table differs from drop.rs; replace it with \
         the output of `firn-sampler --print-seccomp`:\n{}",
        table()
    );
}
