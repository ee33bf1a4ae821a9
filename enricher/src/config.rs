//! The YAML config file (`--config`): every flag's setting plus `relabel_configs` and
//! `external_labels`. Precedence: command-line flag, then its `FIRN_<FLAG>` environment
//! variable, then the file, then the default. `SIGHUP` reloads the file; what can
//! change at run time (relabeling, external labels) does, the rest waits for a restart.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::ArgMatches;
use serde::Deserialize;

use crate::cli::{self, Args};
use crate::encode::ProfileBy;
use crate::labels::relabel::{self, Rule, RuleConfig};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The file's schema: flag names with `_` for `-`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub socket: Option<PathBuf>,
    pub output_dir: Option<PathBuf>,
    pub retention_size: Option<String>,
    pub retention_age: Option<String>,
    pub min_free: Option<String>,
    pub http_address: Option<std::net::SocketAddr>,
    pub symbol_cache: Option<u32>,
    pub symbol_budget: Option<String>,
    pub symbol_frames: Option<u32>,
    pub unwind_min_samples: Option<u64>,
    pub node: Option<String>,
    pub profile_by: Option<ProfileBy>,
    pub kubernetes: Option<bool>,
    pub kubeconfig: Option<PathBuf>,
    pub log: Option<String>,
    pub otlp_endpoint: Option<String>,
    pub otlp_headers: Option<Vec<String>>,
    pub otlp_ca_file: Option<PathBuf>,
    pub otlp_compression: Option<crate::upload::Compression>,
    pub parca_address: Option<String>,
    pub parca_insecure: Option<bool>,
    pub parca_bearer_token_file: Option<PathBuf>,
    pub parca_ca_file: Option<PathBuf>,
    pub debuginfo_upload: Option<crate::upload::debuginfo::Mode>,
    pub opensearch_url: Option<String>,
    pub opensearch_username: Option<String>,
    pub opensearch_password_file: Option<PathBuf>,
    pub opensearch_ca_file: Option<PathBuf>,
    pub opensearch_index_prefix: Option<String>,
    pub opensearch_max_stacks: Option<u32>,
    pub opensearch_max_bytes: Option<String>,
    pub opensearch_pprof_base_url: Option<String>,
    pub debuginfo_upload_concurrency: Option<u32>,
    pub debuginfo_upload_rate: Option<String>,
    pub upload_spool_dir: Option<PathBuf>,
    pub upload_spool_size: Option<String>,
    pub upload_memory: Option<String>,
    pub upload_timeout: Option<String>,
    pub upload_backoff_max: Option<String>,
    pub relabel_configs: Option<Vec<RuleConfig>>,
    #[serde(default)]
    pub external_labels: BTreeMap<String, String>,
}

/// What relabeling runs with: compiled rules and external labels.
pub struct Labeling {
    pub rules: Vec<Rule>,
    pub external: Vec<(String, String)>,
}

fn invalid(path: &Path, message: String) -> ConfigError {
    ConfigError::Invalid {
        path: path.to_path_buf(),
        message,
    }
}

/// Line (1-based) of the first line of `text` containing `needle`.
fn line_of(text: &str, needle: &str) -> Option<usize> {
    text.lines().position(|l| l.contains(needle)).map(|i| i + 1)
}

pub fn load(path: &Path) -> Result<(FileConfig, Labeling), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, path)
}

/// Parses and checks a config file's text; `path` only names it in errors.
pub fn parse(text: &str, path: &Path) -> Result<(FileConfig, Labeling), ConfigError> {
    // serde_yaml names the unknown key or the wrong type with its line and column.
    let file: FileConfig = if text.trim().is_empty() {
        FileConfig::default()
    } else {
        serde_yaml::from_str(text).map_err(|e| invalid(path, e.to_string()))?
    };
    let labeling = labeling(&file).map_err(|e| {
        let at = match &e {
            relabel::RelabelError::Regex { regex, .. } => line_of(text, regex),
            _ => line_of(text, "relabel_configs"),
        };
        invalid(
            path,
            match at {
                Some(l) => format!("{e} (line {l})"),
                None => e.to_string(),
            },
        )
    })?;
    if let Some(p) = &file.opensearch_index_prefix {
        cli::index_prefix(p).map_err(|m| {
            invalid(
                path,
                format!(
                    "opensearch_index_prefix: {m} (line {})",
                    line_of(text, "opensearch_index_prefix").unwrap_or(0)
                ),
            )
        })?;
    }
    for (name, key) in [
        ("retention_size", &file.retention_size),
        ("min_free", &file.min_free),
        ("symbol_budget", &file.symbol_budget),
        ("debuginfo_upload_rate", &file.debuginfo_upload_rate),
        ("upload_spool_size", &file.upload_spool_size),
        ("upload_memory", &file.upload_memory),
        ("opensearch_max_bytes", &file.opensearch_max_bytes),
    ] {
        if let Some(v) = key {
            cli::parse_bytes(v).map_err(|m| {
                invalid(
                    path,
                    format!("{name}: {m} (line {})", line_of(text, name).unwrap_or(0)),
                )
            })?;
        }
    }
    for (name, key) in [
        ("retention_age", &file.retention_age),
        ("upload_timeout", &file.upload_timeout),
        ("upload_backoff_max", &file.upload_backoff_max),
    ] {
        if let Some(v) = key {
            cli::parse_duration(v).map_err(|m| {
                invalid(
                    path,
                    format!("{name}: {m} (line {})", line_of(text, name).unwrap_or(0)),
                )
            })?;
        }
    }
    if let Some(n) = file.debuginfo_upload_concurrency {
        if !(1..=16).contains(&n) {
            return Err(invalid(
                path,
                format!(
                    "debuginfo_upload_concurrency: {n} is not in 1..=16 (line {})",
                    line_of(text, "debuginfo_upload_concurrency").unwrap_or(0)
                ),
            ));
        }
    }
    Ok((file, labeling))
}

pub fn labeling(file: &FileConfig) -> Result<Labeling, relabel::RelabelError> {
    let rules = match &file.relabel_configs {
        Some(r) => relabel::compile(r)?,
        None => relabel::compile(&crate::labels::default_rules()?)?,
    };
    Ok(Labeling {
        rules,
        external: file.external_labels.clone().into_iter().collect(),
    })
}

/// Fills every setting the command line and environment left at its default from the
/// file. The values were validated by [`load`].
pub fn apply(args: &mut Args, m: &ArgMatches, file: &FileConfig) {
    let default = |id: &str| matches!(m.value_source(id), None | Some(ValueSource::DefaultValue));
    macro_rules! take {
        ($field:ident) => {
            if default(stringify!($field)) {
                if let Some(v) = file.$field.clone() {
                    args.$field = v;
                }
            }
        };
        ($field:ident, $parse:expr) => {
            if default(stringify!($field)) {
                if let Some(v) = file.$field.as_deref().and_then(|v| $parse(v).ok()) {
                    args.$field = v;
                }
            }
        };
    }
    take!(socket);
    take!(output_dir);
    take!(http_address);
    take!(symbol_cache);
    take!(symbol_frames);
    take!(unwind_min_samples);
    take!(symbol_budget, cli::parse_bytes);
    take!(profile_by);
    take!(log);
    take!(kubernetes);
    if default("kubeconfig") && file.kubeconfig.is_some() {
        args.kubeconfig = file.kubeconfig.clone();
    }
    take!(retention_size, cli::parse_bytes);
    take!(min_free, cli::parse_bytes);
    take!(retention_age, cli::parse_duration);
    if default("node") && file.node.is_some() {
        args.node = file.node.clone();
    }
    macro_rules! take_opt {
        ($field:ident) => {
            if default(stringify!($field)) && file.$field.is_some() {
                args.$field = file.$field.clone();
            }
        };
    }
    take_opt!(otlp_endpoint);
    take_opt!(otlp_ca_file);
    take_opt!(parca_address);
    take_opt!(parca_bearer_token_file);
    take_opt!(parca_ca_file);
    take_opt!(upload_spool_dir);
    take_opt!(opensearch_url);
    take_opt!(opensearch_username);
    take_opt!(opensearch_password_file);
    take_opt!(opensearch_ca_file);
    take_opt!(opensearch_pprof_base_url);
    take!(opensearch_index_prefix);
    take!(opensearch_max_stacks);
    take!(opensearch_max_bytes, cli::parse_bytes);
    take!(otlp_headers);
    take!(otlp_compression);
    take!(parca_insecure);
    take!(debuginfo_upload);
    take!(debuginfo_upload_concurrency);
    take!(debuginfo_upload_rate, cli::parse_bytes);
    take!(upload_spool_size, cli::parse_bytes);
    take!(upload_memory, cli::parse_bytes);
    take!(upload_timeout, cli::parse_duration);
    take!(upload_backoff_max, cli::parse_duration);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    fn args_with(text: &str, argv: &[&str]) -> Result<Args, ConfigError> {
        let (file, _) = parse(text, Path::new("test.yaml"))?;
        let m = Args::command()
            .get_matches_from(std::iter::once("firn-enricher").chain(argv.iter().copied()));
        let mut args = Args::from_arg_matches(&m).unwrap();
        apply(&mut args, &m, &file);
        Ok(args)
    }

    #[test]
    fn opensearch_keys_apply_and_bad_prefixes_are_named() {
        let text = "opensearch_url: http://os:9200\nopensearch_username: firn\n\
                    opensearch_index_prefix: prof\nopensearch_max_stacks: 10\n";
        let a = args_with(text, &[]).unwrap();
        assert_eq!(a.opensearch_url.as_deref(), Some("http://os:9200"));
        assert_eq!(a.opensearch_username.as_deref(), Some("firn"));
        assert_eq!(a.opensearch_index_prefix, "prof");
        assert_eq!(a.opensearch_max_stacks, 10);
        let e = args_with("opensearch_index_prefix: Bad/Name\n", &[])
            .expect_err("an invalid prefix is refused");
        assert!(e.to_string().contains("line 1"), "{e}");
    }

    #[test]
    fn upload_keys_apply_and_flags_win() {
        let text =
            "otlp_endpoint: http://c:4317\notlp_headers: [\"x-a=1\"]\nparca_address: p:7070\n\
                    parca_insecure: true\ndebuginfo_upload: all\nupload_spool_size: 1MiB\n\
                    upload_timeout: 5s\n";
        let a = args_with(text, &["--parca-address", "q:7070"]).unwrap();
        assert_eq!(a.otlp_endpoint.as_deref(), Some("http://c:4317"));
        assert_eq!(a.otlp_headers, vec!["x-a=1".to_string()]);
        assert_eq!(a.parca_address.as_deref(), Some("q:7070"), "the flag wins");
        assert!(a.parca_insecure);
        assert_eq!(a.debuginfo_upload, crate::upload::debuginfo::Mode::All);
        assert_eq!(a.upload_spool_size, 1 << 20);
        assert_eq!(a.upload_timeout, std::time::Duration::from_secs(5));
        let e = args_with("upload_timeout: 5\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("upload_timeout") && e.contains("line 1"), "{e}");
        let e = args_with("debuginfo_upload_concurrency: 0\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("1..=16"), "{e}");
    }
}
