//! Credential hygiene (security review, round two, finding 8), on the real binary: no
//! value from the environment in `--help`, credential files any user may read refused,
//! group-readable ones taken with a warning, an OTLP header that looks like a secret on
//! the command line warned about.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use firn_tests::*;

const SECRET: &str = "s3cret-9f8e7d6c";

#[test]
fn help_shows_no_value_from_the_environment() {
    let out = Command::new(bin("firn-enricher"))
        .arg("--help")
        .env(
            "FIRN_OTLP_HEADERS",
            format!("authorization=Bearer {SECRET}"),
        )
        .env("FIRN_OPENSEARCH_PASSWORD", SECRET)
        .env("FIRN_OTLP_ENDPOINT", "http://collector.example:4317")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("--otlp-headers-file"), "{text}");
    assert!(!text.contains(SECRET), "--help printed a secret:\n{text}");
    // Plain settings still show where they came from.
    assert!(text.contains("collector.example"), "{text}");
}

/// The enricher as the test user, with `args`; its process.
fn enricher(dir: &std::path::Path, user: (u32, u32), args: &[String]) -> Proc {
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::os::unix::fs::chown(&out, Some(user.0), Some(user.1)).unwrap();
    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={}", user.0),
        &format!("--regid={}", user.1),
        "--clear-groups",
        "--inh-caps=-all",
    ])
    .arg(bin("firn-enricher"))
    .args(["--socket", "/run/firn-test-absent.sock", "--output-dir"])
    .arg(&out)
    .args(["--http-address", &format!("127.0.0.1:{}", free_port())])
    .args(args)
    .env("FIRN_LOG", "info");
    Proc::spawn("enricher", cmd)
}

#[test]
fn credential_files_others_may_read_are_refused() {
    let dir = TempDir::new("creds");
    let user = test_user("firn-test");
    let file = secret_file(dir.path(), "password", SECRET);
    let headers = secret_file(
        dir.path(),
        "headers",
        &format!("authorization=Bearer {SECRET}\n"),
    );
    let cases: Vec<(&str, Vec<String>, &std::path::Path)> = vec![
        (
            "opensearch",
            strs(&[
                "--opensearch-url",
                "http://127.0.0.1:1",
                "--opensearch-username",
                "firn",
                "--opensearch-password-file",
                file.to_str().unwrap(),
            ]),
            &file,
        ),
        (
            "otlp",
            strs(&[
                "--otlp-endpoint",
                "http://127.0.0.1:1",
                "--otlp-headers-file",
                headers.to_str().unwrap(),
            ]),
            &headers,
        ),
        (
            "parca",
            strs(&[
                "--parca-address",
                "127.0.0.1:1",
                "--parca-insecure",
                "--parca-bearer-token-file",
                file.to_str().unwrap(),
            ]),
            &file,
        ),
    ];
    for (what, args, path) in cases {
        let chmod = |m| std::fs::set_permissions(path, std::fs::Permissions::from_mode(m)).unwrap();
        // Every user may read it: the enricher stops at start, saying why.
        chmod(0o644);
        let mut p = enricher(dir.path(), user, &args);
        let status = p.wait_exit(Duration::from_secs(20));
        let log = p.lines().join("\n");
        assert_eq!(status.and_then(|s| s.code()), Some(2), "{what}: {log}");
        assert!(log.contains("may be read by every user"), "{what}: {log}");
        assert!(!log.contains(SECRET), "{what} logged the secret: {log}");
        // Its group may read it: used, with a warning.
        chmod(0o640);
        let mut p = enricher(dir.path(), user, &args);
        assert!(
            p.wait_for("its group may read", Duration::from_secs(20))
                .is_some(),
            "{what}: no warning: {:#?}",
            p.lines()
        );
        assert!(p.running(), "{what}: a group-readable file stopped it");
        p.stop();
        assert!(
            !p.lines().join("\n").contains(SECRET),
            "{what} logged the secret"
        );
        chmod(0o600);
    }
}

#[test]
fn a_credential_on_the_command_line_is_warned_about() {
    let dir = TempDir::new("creds-argv");
    let user = test_user("firn-test");
    let header = format!("authorization=Bearer {SECRET}");
    let mut p = enricher(
        dir.path(),
        user,
        &strs(&[
            "--otlp-endpoint",
            "http://127.0.0.1:1",
            "--otlp-header",
            &header,
        ]),
    );
    assert!(
        p.wait_for("--otlp-headers-file", Duration::from_secs(20))
            .is_some(),
        "no warning: {:#?}",
        p.lines()
    );
    p.stop();
    assert!(
        !p.lines().join("\n").contains(SECRET),
        "the header's value was logged"
    );
}
