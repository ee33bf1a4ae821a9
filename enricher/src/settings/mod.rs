//! Every setting of `firn-enricher`, each defined once: its flag, environment variable,
//! default and help here; its key in the YAML file (`--config`, see [`file`]) is the
//! flag's name with `_` for `-`, read through the same parser.

pub(crate) mod file;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// What one profile covers (`--profile-by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ProfileBy {
    /// One profile per process.
    #[default]
    Process,
    /// One per container: processes of a container merge (labels naming a process —
    /// pid, comm, executable — are left out).
    Container,
    /// One per final label set: processes with equal labels merge.
    Labels,
}

/// How OTLP requests travel (`--otlp-compression`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, clap::ValueEnum)]
pub(crate) enum Compression {
    /// gRPC gzip: a round's request shrinks several times (its dictionary is text).
    #[default]
    Gzip,
    None,
}

/// Who may read the HTTP endpoints (`--http-auth`).
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug, clap::ValueEnum)]
pub enum HttpAuth {
    /// The token of --http-token-file, as a bearer header, the page's cookie or
    /// `?token=` (every endpoint but /healthz and /symbolz, whose answers are constant).
    #[default]
    Token,
    /// No token: any local user (or, off loopback, anyone who reaches the port) reads
    /// every profile. Only behind an authenticating proxy.
    None,
}

/// Which binaries go to Parca's debuginfo service (`--debuginfo-upload`).
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug, clap::ValueEnum)]
pub(crate) enum DebuginfoMode {
    /// No upload.
    Off,
    /// Binaries whose frames firn could not name.
    #[default]
    On,
    /// Every binary with a build id that the server lacks.
    All,
}

/// firn's unprivileged half: subscribes to firn-sampler over its Unix socket, obtains
/// the binaries it needs through the sampler's broker, symbolizes every stack, and
/// writes one pprof per process per round to a local directory, served on HTTP too.
///
/// Every flag can also be set through the environment variable shown, or in the YAML
/// file of --config by its name with `_` for `-` (flags and variables win over it).
#[derive(Debug, Parser)]
#[command(name = "firn-enricher", version, about, long_about)]
pub(crate) struct Settings {
    /// The sampler's socket.
    #[arg(long, env = "FIRN_SOCKET", default_value = "/run/firn/sampler.sock")]
    pub(crate) socket: PathBuf,

    /// Where profiles are written: one folder per round, gzip pprof files and an
    /// index.jsonl mapping each file to its labels.
    #[arg(long, env = "FIRN_OUTPUT_DIR", default_value = "profiles")]
    pub(crate) output_dir: PathBuf,

    /// Total size kept under --output-dir; the oldest rounds go first (e.g. 1GiB, 200MiB).
    #[arg(long, env = "FIRN_RETENTION_SIZE", default_value = "1GiB", value_parser = parse_bytes)]
    pub(crate) retention_size: u64,

    /// Age after which rounds are removed (e.g. 24h, 90m, 7d).
    #[arg(long, env = "FIRN_RETENTION_AGE", default_value = "24h", value_parser = parse_duration)]
    pub(crate) retention_age: Duration,

    /// Free space to leave on the output filesystem; rounds are skipped (and counted)
    /// below it.
    #[arg(long, env = "FIRN_MIN_FREE", default_value = "64MiB", value_parser = parse_bytes)]
    pub(crate) min_free: u64,

    /// Address of the HTTP server (the web view, metrics, health, profiles, pprof
    /// endpoints). Loopback by default: profiles show what runs on the node.
    #[arg(long, env = "FIRN_HTTP_ADDRESS", default_value = "127.0.0.1:7071")]
    pub(crate) http_address: SocketAddr,

    /// Who may read the HTTP endpoints: `token` (the default) wants the token of
    /// --http-token-file on every endpoint but /healthz and /symbolz; `none` serves anyone who
    /// reaches the port (only behind an authenticating proxy).
    #[arg(long, env = "FIRN_HTTP_AUTH", value_enum, default_value_t = HttpAuth::Token)]
    pub(crate) http_auth: HttpAuth,

    /// File holding the HTTP token; created (32 random bytes, mode 0600) when missing.
    /// Default: .http-token under --output-dir. Open /?token=<it> once in a browser,
    /// send it as a bearer token (Prometheus, Parca: credentials_file), or add
    /// &token=<it> to a `go tool pprof` URL.
    #[arg(long, env = "FIRN_HTTP_TOKEN_FILE")]
    pub(crate) http_token_file: Option<PathBuf>,

    /// Host names a request may name besides loopback and the listening address (e.g.
    /// a Service's DNS name); any other Host is answered 421 (DNS rebinding).
    #[arg(
        long = "http-allowed-host",
        env = "FIRN_HTTP_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    pub(crate) http_allowed_hosts: Vec<String>,

    /// HTTP connections at once; more are closed at once (counted).
    #[arg(long, env = "FIRN_HTTP_MAX_CONNECTIONS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) http_max_connections: u32,

    /// Serve the enricher's own CPU profile at /debug/pprof/profile (off: it costs a
    /// thread and a timer for its duration).
    #[arg(long, env = "FIRN_HTTP_SELF_PROFILE")]
    pub(crate) http_self_profile: bool,

    /// Binaries kept in the symbol cache (LRU; each holds one open file, two with a
    /// separate debug file).
    #[arg(long, env = "FIRN_SYMBOL_CACHE", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub(crate) symbol_cache: u32,

    /// Symbols held parsed at once, in bytes of symbol tables and DWARF (uncompressed
    /// debug sections, a binary's own or its separate debug file's). Parsed symbols
    /// are most of the enricher's memory: its RSS grows by about 1.5 times this. Past
    /// it parses are dropped, those cheapest to make again per byte and longest unneeded
    /// (not asked for frames) first (frames already named stay cached), and a parse worth
    /// less than those it would push out (one never made priced at what the others cost
    /// a byte) is made for the round only, from its symbol tables: those frames
    /// lack file:line until its parse is kept. A binary whose DWARF does not fit, such
    /// as firn's own, is named from its symbol tables: function names without file:line
    /// or inline frames. One whose symbol tables are larger than the budget is parsed
    /// for its round only; over 4 times the budget (at least 96 MiB), not at all: its
    /// frames stay addresses. 0 keeps nothing parsed between rounds.
    #[arg(long, env = "FIRN_SYMBOL_BUDGET", default_value = "24MiB", value_parser = parse_bytes)]
    pub(crate) symbol_budget: u64,

    /// Named frames remembered over all binaries (LRU), so that a frame is symbolized
    /// once, not every round.
    #[arg(long, env = "FIRN_SYMBOL_FRAMES", default_value_t = 32_768,
          value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub(crate) symbol_frames: u32,

    /// Folder where unwind tables are kept between runs, so that a restart or a binary
    /// seen before costs a file read, not a CFI parse (default: `.unwind-cache` under
    /// --output-dir). Entries are checked when read; a damaged one is built again.
    #[arg(long, env = "FIRN_UNWIND_CACHE_DIR")]
    pub(crate) unwind_cache_dir: Option<PathBuf>,

    /// Bytes the unwind table cache keeps at most (least recently used go first), and
    /// never over a quarter of the disk the profiles leave free; 0 keeps none (every
    /// table is built from the binary's CFI, after each restart too).
    #[arg(long, env = "FIRN_UNWIND_CACHE_SIZE", default_value = "128MiB", value_parser = parse_bytes)]
    pub(crate) unwind_cache_size: u64,

    /// No longer used (accepted so that old settings still start): tables are built and
    /// sent from a process's first sample, within a budget of work per second.
    #[arg(long, env = "FIRN_UNWIND_MIN_SAMPLES", default_value_t = 1, hide = true,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) unwind_min_samples: u64,

    /// Send every round to an OTLP profiles backend over gRPC
    /// (`ProfilesService/Export`, proto v1development): the OpenTelemetry Collector,
    /// Grafana Pyroscope, Parca. http://host:port is plain, https://host:port is TLS
    /// with the system's roots (or --otlp-ca-file).
    #[arg(long, env = "FIRN_OTLP_ENDPOINT")]
    pub(crate) otlp_endpoint: Option<String>,

    /// A header for every OTLP request, as KEY=VALUE; repeatable. Values are never
    /// logged, but a command line is readable by every local user: put credentials
    /// (authorization, API keys) in --otlp-headers-file instead.
    #[arg(
        long = "otlp-header",
        env = "FIRN_OTLP_HEADERS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub(crate) otlp_headers: Vec<String>,

    /// File of headers for every OTLP request, one KEY=VALUE a line (e.g.
    /// `authorization=Bearer …`); read at start and on SIGHUP, never logged. It must
    /// not be readable by group or others (systemd: LoadCredential=).
    #[arg(long, env = "FIRN_OTLP_HEADERS_FILE")]
    pub(crate) otlp_headers_file: Option<PathBuf>,

    /// Compression of OTLP requests on the wire: gzip (what the OpenTelemetry
    /// Collector and other receivers accept) or none.
    #[arg(long, env = "FIRN_OTLP_COMPRESSION", value_enum,
          default_value_t = Compression::Gzip)]
    pub(crate) otlp_compression: Compression,

    /// PEM CA certificate(s) to verify an https:// OTLP endpoint with, instead of the
    /// system's roots.
    #[arg(long, env = "FIRN_OTLP_CA_FILE")]
    pub(crate) otlp_ca_file: Option<PathBuf>,

    /// Send every round to a Parca server (`ProfileStoreService/WriteRaw`), as
    /// host:port. TLS unless --parca-insecure.
    #[arg(long, env = "FIRN_PARCA_ADDRESS")]
    pub(crate) parca_address: Option<String>,

    /// Plain gRPC to Parca (no TLS).
    #[arg(long, env = "FIRN_PARCA_INSECURE")]
    pub(crate) parca_insecure: bool,

    /// File holding the bearer token for Parca (e.g. Polar Signals Cloud). Read at
    /// start and on SIGHUP; never logged. It must not be readable by group or others.
    #[arg(long, env = "FIRN_PARCA_BEARER_TOKEN_FILE")]
    pub(crate) parca_bearer_token_file: Option<PathBuf>,

    /// PEM CA certificate(s) to verify Parca's TLS certificate with, instead of the
    /// system's roots.
    #[arg(long, env = "FIRN_PARCA_CA_FILE")]
    pub(crate) parca_ca_file: Option<PathBuf>,

    /// Upload binaries to Parca's debuginfo service: `on` those whose frames firn
    /// could not name (stripped), `all` every binary with a build id the server lacks,
    /// `off` none.
    #[arg(long, env = "FIRN_DEBUGINFO_UPLOAD", value_enum,
          default_value_t = DebuginfoMode::On)]
    pub(crate) debuginfo_upload: DebuginfoMode,

    /// Debuginfo uploads at once.
    #[arg(long, env = "FIRN_DEBUGINFO_UPLOAD_CONCURRENCY", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    pub(crate) debuginfo_upload_concurrency: u32,

    /// Bytes per second of debuginfo upload, over all uploads (e.g. 4MiB).
    #[arg(long, env = "FIRN_DEBUGINFO_UPLOAD_RATE", default_value = "4MiB", value_parser = parse_bytes)]
    pub(crate) debuginfo_upload_rate: u64,

    /// Where upload sinks keep requests their backend has not taken yet (one folder
    /// per sink); default: .spool under --output-dir.
    #[arg(long, env = "FIRN_UPLOAD_SPOOL_DIR")]
    pub(crate) upload_spool_dir: Option<PathBuf>,

    /// Bytes of unsent requests each upload sink keeps on disk; past it the oldest are
    /// dropped (and counted). 0 keeps nothing on disk.
    #[arg(long, env = "FIRN_UPLOAD_SPOOL_SIZE", default_value = "256MiB", value_parser = parse_bytes)]
    pub(crate) upload_spool_size: u64,

    /// Send every round to OpenSearch as documents (`_bulk`): one per profile (labels,
    /// samples, CPU, top functions, a link to the pprof) and one per distinct stack
    /// (frames leaf first), into daily indices `<prefix>-YYYY.MM.DD`, with an index
    /// template installed when absent. http:// is plain, https:// is TLS with the
    /// system's roots (or --opensearch-ca-file).
    #[arg(long, env = "FIRN_OPENSEARCH_URL")]
    pub(crate) opensearch_url: Option<String>,

    /// User for OpenSearch's basic authentication; the password comes from
    /// --opensearch-password-file or the FIRN_OPENSEARCH_PASSWORD environment variable,
    /// never from a flag.
    #[arg(long, env = "FIRN_OPENSEARCH_USERNAME")]
    pub(crate) opensearch_username: Option<String>,

    /// File holding the OpenSearch password. Read at start and on SIGHUP; never logged.
    /// It must not be readable by group or others.
    #[arg(long, env = "FIRN_OPENSEARCH_PASSWORD_FILE")]
    pub(crate) opensearch_password_file: Option<PathBuf>,

    /// PEM CA certificate(s) to verify an https:// OpenSearch with, instead of the
    /// system's roots.
    #[arg(long, env = "FIRN_OPENSEARCH_CA_FILE")]
    pub(crate) opensearch_ca_file: Option<PathBuf>,

    /// Index names: `<prefix>-YYYY.MM.DD` (UTC), and the index template `<prefix>`.
    #[arg(long, env = "FIRN_OPENSEARCH_INDEX_PREFIX", default_value = "firn-profiles",
          value_parser = index_prefix)]
    pub(crate) opensearch_index_prefix: String,

    /// Stack documents per round at most: the stacks with the most samples are kept,
    /// the rest are counted in their profile documents only. Bounds the bytes a round
    /// sends.
    #[arg(long, env = "FIRN_OPENSEARCH_MAX_STACKS", default_value_t = 2_000,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub(crate) opensearch_max_stacks: u32,

    /// Bytes of one round's `_bulk` request past which no more stack documents are
    /// added (the heaviest stacks go first; profile documents always go).
    #[arg(long, env = "FIRN_OPENSEARCH_MAX_BYTES", default_value = "4MiB", value_parser = parse_bytes)]
    pub(crate) opensearch_max_bytes: u64,

    /// Base of the pprof links in profile documents (the enricher's HTTP address as
    /// others reach it); default: http://<--http-address>.
    #[arg(long, env = "FIRN_OPENSEARCH_PPROF_BASE_URL")]
    pub(crate) opensearch_pprof_base_url: Option<String>,

    /// Bytes of unsent requests each upload sink keeps in memory before spooling the
    /// oldest to disk.
    #[arg(long, env = "FIRN_UPLOAD_MEMORY", default_value = "4MiB", value_parser = parse_bytes)]
    pub(crate) upload_memory: u64,

    /// Longest wait for a backend's answer to one request (e.g. 30s).
    #[arg(long, env = "FIRN_UPLOAD_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub(crate) upload_timeout: Duration,

    /// Longest wait between retries while a backend fails (backoff doubles from 1s,
    /// with jitter).
    #[arg(long, env = "FIRN_UPLOAD_BACKOFF_MAX", default_value = "60s", value_parser = parse_duration)]
    pub(crate) upload_backoff_max: Duration,

    /// Value of the `node` label; default: the sampler's host name.
    #[arg(long, env = "FIRN_NODE")]
    pub(crate) node: Option<String>,

    /// What one profile covers: each process, each container, or each distinct final
    /// label set (processes whose labels are equal after relabeling merge).
    #[arg(long, env = "FIRN_PROFILE_BY", value_enum, default_value_t = ProfileBy::Process)]
    pub(crate) profile_by: ProfileBy,

    /// YAML config: any setting below by its name (`output_dir`, `retention_size`, …),
    /// plus `relabel_configs` (Prometheus semantics over the `__meta_*` labels; replaces
    /// the built-in set) and `external_labels`. Flags and FIRN_* variables win over it.
    /// SIGHUP reloads relabeling and external labels; an invalid file is refused at
    /// start and ignored (with a log line) on reload.
    #[arg(long, env = "FIRN_CONFIG")]
    pub(crate) config: Option<PathBuf>,

    /// Label processes with Kubernetes metadata (namespace, pod, container, pod labels
    /// and annotations) by watching the pods of this node (`--node`, default the host
    /// name). On by default inside a cluster (KUBERNETES_SERVICE_HOST set).
    #[arg(long, env = "FIRN_KUBERNETES")]
    pub(crate) kubernetes: bool,

    /// kubeconfig to reach the API server; default: the in-cluster service account,
    /// else KUBECONFIG or ~/.kube/config.
    #[arg(long, env = "FIRN_KUBECONFIG")]
    pub(crate) kubeconfig: Option<PathBuf>,

    /// Print every batch as one JSON line on stdout instead of writing profiles
    /// (debugging the stream).
    #[arg(long, env = "FIRN_DUMP")]
    pub(crate) dump: bool,

    /// Check /healthz of --http-address and exit 0 if it answers 200, else 1 (a
    /// container's health probe, where the server listens on loopback).
    #[arg(long)]
    pub(crate) healthcheck: bool,

    /// Run without the enricher's own confinement (Landlock: writes only to its
    /// directories, no exec, TCP only to its backends and HTTP port, no access to other
    /// processes' /proc; seccomp: no ptrace, mounts, exec, namespaces). For debugging,
    /// or a kubeconfig whose credentials come from an exec plugin. Command line only.
    #[arg(long)]
    pub(crate) unconfined: bool,

    /// Allow running as uid 0. The enricher parses untrusted input (binaries, metadata,
    /// server replies) and needs no privilege, so root is refused by default.
    #[arg(long, env = "FIRN_ALLOW_ROOT")]
    pub(crate) allow_root: bool,

    /// Protocol version to announce (tests of the mismatch path only).
    #[arg(long, hide = true, default_value_t = firn_schema::PROTOCOL_VERSION)]
    pub(crate) protocol_version: u32,

    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "FIRN_LOG", default_value = "info")]
    pub(crate) log: String,
}

impl Settings {
    /// The unwind table cache's folder, unless it is off (`--unwind-cache-size 0`, or
    /// `--dump`).
    pub(crate) fn unwind_cache(&self) -> Option<PathBuf> {
        (self.unwind_cache_size > 0 && !self.dump).then(|| {
            self.unwind_cache_dir
                .clone()
                .unwrap_or_else(|| self.output_dir.join(".unwind-cache"))
        })
    }
}

/// `1GiB`, `200MiB`, `64KiB`, `1G`, `5MB`, or plain bytes.
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 1GiB, 200MiB or 4096"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "kb" => 1_000,
        "m" | "mib" => 1 << 20,
        "mb" => 1_000_000,
        "g" | "gib" => 1 << 30,
        "gb" => 1_000_000_000,
        "t" | "tib" => 1 << 40,
        "tb" => 1_000_000_000_000,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// `90s`, `30m`, `24h`, `7d`.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 90s, 30m, 24h or 7d"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{s:?}: give a unit: s, m, h or d")),
    };
    Ok(Duration::from_secs(n.saturating_mul(secs)))
}

/// OpenSearch index names: lowercase, no `\\/*?"<>| ,#:`, not starting with `-_+`.
pub(crate) fn index_prefix(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 200
        && !s.starts_with(['-', '_', '+'])
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c));
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?} is not a valid OpenSearch index prefix: use lowercase letters, digits, \
             '-', '_' and '.', not starting with '-', '_' or '+'"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("200MiB"), Ok(200 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("1XB").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("90m"), Ok(Duration::from_secs(5_400)));
        assert!(parse_duration("10").is_err());
    }
}
