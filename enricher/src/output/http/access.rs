//! Who may ask the HTTP endpoints, checked before any handler runs:
//!
//! - **Host**: the request must name this server: a loopback name or the address it
//!   listens on, or a name of `--http-allowed-host`, with its port. Anything else gets
//!   421, so that a DNS-rebinding page (its own name resolving to 127.0.0.1) reads
//!   nothing.
//! - **Origin**: a browser's request from another site (`Sec-Fetch-Site: cross-site` or
//!   `same-site`, or an `Origin` naming another host) is refused with 403, except on
//!   `/metrics` and `/healthz`; so no web page can start work here or read an answer.
//! - **Token** (`--http-auth token`, the default): every endpoint but `/healthz` and
//!   `/symbolz` (constant answers) wants the token of `--http-token-file` (created, 32
//!   random bytes, when missing), as `Authorization: Bearer …`, as the `firn_token`
//!   cookie the page sets, or as `?token=` (what `go tool pprof`, which sends no
//!   headers, can give). Opening
//!   `/?token=…` once sets the cookie. Profiles show what runs on the node and where its
//!   processes' code lies: a local user without the token reads none of it.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::metrics::Metrics;
use crate::settings::{HttpAuth, Settings};

const COOKIE: &str = "firn_token";

#[derive(Debug, thiserror::Error)]
pub(crate) enum AccessError {
    #[error("--http-token-file {path}: {message}")]
    TokenFile {
        path: std::path::PathBuf,
        message: String,
    },
    #[error("{0}")]
    Credential(#[from] crate::credentials::CredentialError),
}

/// What a request must satisfy.
pub(crate) struct Access {
    /// Host names a request may name, lowercase, without port.
    hosts: Vec<String>,
    port: u16,
    token: Option<String>,
    metrics: Arc<Metrics>,
}

impl Access {
    pub(crate) fn new(s: &Settings, metrics: Arc<Metrics>) -> Result<Arc<Self>, AccessError> {
        let mut hosts: Vec<String> = ["localhost", "127.0.0.1", "::1"]
            .iter()
            .map(|h| h.to_string())
            .collect();
        if !s.http_address.ip().is_unspecified() {
            hosts.push(s.http_address.ip().to_string());
        }
        hosts.extend(s.http_allowed_hosts.iter().map(|h| h.to_ascii_lowercase()));
        let token = match s.http_auth {
            HttpAuth::None => None,
            HttpAuth::Token => Some(token(&token_path(s))?),
        };
        Ok(Arc::new(Self {
            hosts,
            port: s.http_address.port(),
            token,
            metrics,
        }))
    }

    /// Whether `authority` (a Host header, or an Origin's host and port) names us.
    fn names_us(&self, authority: &str) -> bool {
        let (host, port) = split_authority(authority);
        let host = host.to_ascii_lowercase();
        self.hosts.contains(&host) && port.is_none_or(|p| p == self.port)
    }

    fn token_ok(&self, given: &str) -> bool {
        self.token.as_deref().is_some_and(|t| {
            t.len() == given.len() && constant_time_eq(t.as_bytes(), given.as_bytes())
        })
    }
}

/// The token file: `--http-token-file`, else `.http-token` under `--output-dir`.
pub(crate) fn token_path(s: &Settings) -> std::path::PathBuf {
    s.http_token_file
        .clone()
        .unwrap_or_else(|| s.output_dir.join(".http-token"))
}

/// Creates the token file if it is missing (before the enricher confines itself).
pub(crate) fn ensure_token(s: &Settings) -> Result<(), AccessError> {
    token(&token_path(s)).map(|_| ())
}

/// The token in `path`, written first (mode 0600, 32 random bytes in hex) when the file
/// does not exist.
fn token(path: &std::path::Path) -> Result<String, AccessError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let bad = |message: String| AccessError::TokenFile {
        path: path.to_path_buf(),
        message,
    };
    if !path.exists() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| bad(e.to_string()))?;
        }
        let mut bytes = [0u8; 32];
        // SAFETY: getrandom writes at most bytes.len() bytes into bytes.
        let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        if n != 32 {
            return Err(bad("no randomness for a token".into()));
        }
        let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(mut f) => {
                f.write_all(format!("{text}\n").as_bytes())
                    .map_err(|e| bad(e.to_string()))?;
                tracing::info!(path = %path.display(), "HTTP token created");
            }
            // Another enricher wrote it meanwhile: read that one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(bad(e.to_string())),
        }
    }
    let t = crate::credentials::read("the HTTP token file", path)?;
    let t = t.trim().to_string();
    if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad(
            "the token must be at least 16 printable characters".into()
        ));
    }
    Ok(t)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `host[:port]`, `[v6]:port` or a bare v6 address → (host, port).
fn split_authority(a: &str) -> (&str, Option<u16>) {
    if let Some(rest) = a.strip_prefix('[') {
        let (host, after) = rest.split_once(']').unwrap_or((rest, ""));
        return (host, after.strip_prefix(':').and_then(|p| p.parse().ok()));
    }
    if a.matches(':').count() > 1 {
        return (a, None);
    }
    match a.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().ok().or(Some(0))),
        None => (a, None),
    }
}

/// The token a request carries: bearer header, cookie, or `token` query parameter.
fn given_token<'a>(headers: &'a HeaderMap, query: Option<&'a str>) -> Option<&'a str> {
    if let Some(b) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return Some(b.trim());
    }
    for c in headers.get_all(header::COOKIE) {
        for part in c.to_str().unwrap_or_default().split(';') {
            if let Some(v) = part
                .trim()
                .strip_prefix(COOKIE)
                .and_then(|v| v.strip_prefix('='))
            {
                return Some(v);
            }
        }
    }
    query?.split('&').find_map(|kv| kv.strip_prefix("token="))
}

fn refuse(m: &std::sync::atomic::AtomicU64, status: StatusCode, why: &'static str) -> Response {
    Metrics::inc(m);
    (status, why).into_response()
}

/// The middleware.
pub(super) async fn check(State(a): State<Arc<Access>>, req: Request, next: Next) -> Response {
    let m = &a.metrics;
    let path = req.uri().path().to_string();
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))
        .unwrap_or_default();
    if !a.names_us(host) {
        return refuse(
            &m.http_refused_host,
            StatusCode::MISDIRECTED_REQUEST,
            "this server answers to its loopback names and --http-allowed-host only\n",
        );
    }
    if path != "/metrics" && path != "/healthz" {
        let site = req
            .headers()
            .get("sec-fetch-site")
            .and_then(|v| v.to_str().ok());
        let origin = req
            .headers()
            .get(header::ORIGIN)
            .and_then(|v| v.to_str().ok());
        let foreign_origin = origin.is_some_and(|o| {
            let authority = o
                .strip_prefix("http://")
                .or_else(|| o.strip_prefix("https://"));
            authority.is_none_or(|au| !a.names_us(au))
        });
        if matches!(site, Some("cross-site") | Some("same-site")) || foreign_origin {
            return refuse(
                &m.http_refused_origin,
                StatusCode::FORBIDDEN,
                "requests from other sites are refused\n",
            );
        }
    }
    // /symbolz answers the same constant to all: `go tool pprof` asks it after a
    // download, dropping the query (and so the token) from the URL.
    if a.token.is_none() || path == "/healthz" || path == "/symbolz" {
        return next.run(req).await;
    }
    let query = req.uri().query();
    let given = given_token(req.headers(), query);
    if !given.is_some_and(|t| a.token_ok(t)) {
        return refuse(
            &m.http_refused_token,
            StatusCode::UNAUTHORIZED,
            "a token is needed: open the URL the enricher printed (…/?token=…), or send \
             Authorization: Bearer <the token of --http-token-file>\n",
        );
    }
    // The page opened with ?token=: set the cookie and show the page without it.
    let from_query = req.headers().get(header::AUTHORIZATION).is_none()
        && !req.headers().contains_key(header::COOKIE);
    if path == "/" && from_query && query.is_some_and(|q| q.contains("token=")) {
        let cookie = format!(
            "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
            given.unwrap_or_default()
        );
        return (
            StatusCode::SEE_OTHER,
            [
                (header::LOCATION, "/".to_string()),
                (header::SET_COOKIE, cookie),
            ],
        )
            .into_response();
    }
    next.run(req).await
}

/// The URL to open the view with (printed at start, and by the local run script).
pub(crate) fn view_url(address: SocketAddr, token: Option<&str>) -> String {
    let host = if address.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        address.ip().to_string()
    };
    match token {
        Some(t) => format!("http://{host}:{}/?token={t}", address.port()),
        None => format!("http://{host}:{}/", address.port()),
    }
}

impl Access {
    pub(crate) fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(token: Option<&str>) -> Access {
        Access {
            hosts: vec![
                "localhost".into(),
                "127.0.0.1".into(),
                "::1".into(),
                "firn.example".into(),
            ],
            port: 7071,
            token: token.map(str::to_string),
            metrics: Arc::new(Metrics::default()),
        }
    }

    #[test]
    fn hosts_and_ports() {
        let a = access(None);
        for ok in [
            "127.0.0.1:7071",
            "localhost:7071",
            "[::1]:7071",
            "LOCALHOST",
            "firn.example:7071",
        ] {
            assert!(a.names_us(ok), "{ok}");
        }
        for no in [
            "rebind.attacker.example:7071",
            "127.0.0.1:8080",
            "",
            "127.0.0.1:",
            "[::1]:80",
        ] {
            assert!(!a.names_us(no), "{no}");
        }
    }

    #[test]
    fn tokens_from_header_cookie_or_query() {
        let a = access(Some("0123456789abcdef0123"));
        let mut h = HeaderMap::new();
        assert_eq!(given_token(&h, Some("seconds=5&token=abc")), Some("abc"));
        h.insert(
            header::COOKIE,
            "x=1; firn_token=0123456789abcdef0123".parse().unwrap(),
        );
        assert!(a.token_ok(given_token(&h, None).unwrap()));
        h.insert(header::AUTHORIZATION, "Bearer wrong".parse().unwrap());
        assert!(
            !a.token_ok(given_token(&h, None).unwrap()),
            "the header wins"
        );
        assert!(
            !a.token_ok("0123456789abcdef012"),
            "a prefix is not the token"
        );
    }

    #[test]
    fn a_token_file_is_created_once_and_kept_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("firn-token-{}", std::process::id()));
        let p = dir.join("t");
        let t = token(&p).unwrap();
        assert_eq!(t.len(), 64);
        assert_eq!(token(&p).unwrap(), t, "read again, not rewritten");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(token(&p).is_err(), "a token every user may read is refused");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
