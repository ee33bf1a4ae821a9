//! The YAML config file (`--config`): any setting by its flag's name with `_` for `-`,
//! plus `relabel_configs` and `external_labels`. A key is read through its flag's own
//! definition (same parser, same checks), so the two cannot drift. Precedence: flag,
//! then its `FIRN_*` variable, then the file, then the default. `SIGHUP` reloads the
//! file; what can change at run time (relabeling, external labels) does, the rest waits
//! for a restart.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches};

use super::Settings;
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

/// Settings no file may set: the file's own name, and switches of the command line.
const COMMAND_LINE_ONLY: &[&str] = &[
    "config",
    "dump",
    "allow_root",
    "protocol_version",
    "healthcheck",
    "unconfined",
];

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

/// Line (1-based) of the first line of `text` that sets `key`.
fn line_of(text: &str, key: &str) -> usize {
    text.lines()
        .position(|l| l.trim_start().starts_with(&format!("{key}:")))
        .or_else(|| text.lines().position(|l| l.contains(key)))
        .map_or(0, |i| i + 1)
}

/// What a file says: command-line arguments for the settings it gives, and labeling.
pub struct Parsed {
    /// `(key, arguments)` for each setting the file gives, in file order.
    args: Vec<(String, Vec<OsString>)>,
    pub labeling: Labeling,
}

pub(crate) fn load(path: &Path) -> Result<Parsed, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, path)
}

/// The settings as a value of `arg` takes them.
fn values(v: &serde_yaml::Value) -> Option<Vec<String>> {
    use serde_yaml::Value;
    let scalar = |v: &Value| match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    };
    match v {
        Value::Null => Some(Vec::new()),
        Value::Sequence(items) => items.iter().map(scalar).collect(),
        other => scalar(other).map(|s| vec![s]),
    }
}

/// Parses and checks a config file's text; `path` only names it in errors.
pub fn parse(text: &str, path: &Path) -> Result<Parsed, ConfigError> {
    let doc: serde_yaml::Value = if text.trim().is_empty() {
        serde_yaml::Value::Mapping(Default::default())
    } else {
        serde_yaml::from_str(text).map_err(|e| invalid(path, e.to_string()))?
    };
    let serde_yaml::Value::Mapping(map) = doc else {
        return Err(invalid(
            path,
            "the file must be a mapping of settings".into(),
        ));
    };
    let cmd = Settings::command();
    let mut args = Vec::new();
    let mut rules: Option<Vec<RuleConfig>> = None;
    let mut external = BTreeMap::new();
    for (k, v) in map {
        let Some(key) = k.as_str().map(str::to_string) else {
            return Err(invalid(path, format!("a key that is not text: {k:?}")));
        };
        let at = line_of(text, &key);
        match key.as_str() {
            "relabel_configs" => {
                rules = Some(
                    serde_yaml::from_value(v)
                        .map_err(|e| invalid(path, format!("relabel_configs: {e} (line {at})")))?,
                );
                continue;
            }
            "external_labels" => {
                external = serde_yaml::from_value(v)
                    .map_err(|e| invalid(path, format!("external_labels: {e} (line {at})")))?;
                continue;
            }
            _ => {}
        }
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == key.as_str() && a.get_long().is_some())
            .filter(|_| !COMMAND_LINE_ONLY.contains(&key.as_str()))
            .ok_or_else(|| invalid(path, format!("unknown setting `{key}` (line {at})")))?;
        let long = arg.get_long().unwrap_or_default();
        let given = values(&v).ok_or_else(|| {
            invalid(
                path,
                format!("{key}: give a value or a list of values (line {at})"),
            )
        })?;
        let flag = matches!(arg.get_action(), ArgAction::SetTrue);
        let mut argv = Vec::new();
        for value in &given {
            if flag {
                match value.as_str() {
                    "true" => argv.push(OsString::from(format!("--{long}"))),
                    "false" => {}
                    _ => {
                        return Err(invalid(
                            path,
                            format!("{key}: {value:?} is not true or false (line {at})"),
                        ))
                    }
                }
                continue;
            }
            let one = OsString::from(format!("--{long}={value}"));
            Settings::command()
                .try_get_matches_from([OsString::from("firn-enricher"), one])
                .map_err(|e| {
                    let text = e.to_string();
                    let why = text.lines().next().unwrap_or_default();
                    let why = why.strip_prefix("error: ").unwrap_or(why);
                    invalid(path, format!("{key}: {why} (line {at})"))
                })?;
            argv.push(OsString::from(format!("--{long}={value}")));
        }
        args.push((key, argv));
    }
    let labeling = labeling(rules.as_deref(), external).map_err(|e| {
        let at = match &e {
            relabel::RelabelError::Regex { regex, .. } => line_of(text, regex),
            _ => line_of(text, "relabel_configs"),
        };
        invalid(path, format!("{e} (line {at})"))
    })?;
    Ok(Parsed { args, labeling })
}

/// Relabeling of the built-in rules, or of `rules` when given.
pub(crate) fn labeling(
    rules: Option<&[RuleConfig]>,
    external: BTreeMap<String, String>,
) -> Result<Labeling, relabel::RelabelError> {
    let rules = match rules {
        Some(r) => relabel::compile(r)?,
        None => relabel::compile(&crate::labels::default_rules()?)?,
    };
    Ok(Labeling {
        rules,
        external: external.into_iter().collect(),
    })
}

/// The settings from `argv` and the environment, and from the file `--config` names for
/// every setting those left at its default.
pub(crate) fn settings(argv: Vec<OsString>) -> Result<(Settings, Labeling), SettingsError> {
    let m = Settings::command().try_get_matches_from(&argv)?;
    let Some(path) = m.get_one::<PathBuf>("config").cloned() else {
        let labeling = labeling(None, BTreeMap::new()).map_err(SettingsError::BuiltIn)?;
        return Ok((Settings::from_arg_matches(&m)?, labeling));
    };
    let parsed = load(&path)?;
    let mut all = argv;
    all.extend(from_file(&m, parsed.args));
    let m = Settings::command().try_get_matches_from(all)?;
    Ok((Settings::from_arg_matches(&m)?, parsed.labeling))
}

/// The file's arguments for the settings the command line and environment left unset.
fn from_file(m: &ArgMatches, args: Vec<(String, Vec<OsString>)>) -> Vec<OsString> {
    args.into_iter()
        .filter(|(key, _)| matches!(m.value_source(key), None | Some(ValueSource::DefaultValue)))
        .flat_map(|(_, argv)| argv)
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum SettingsError {
    #[error(transparent)]
    Args(#[from] clap::Error),
    #[error("invalid config: {0}")]
    Config(#[from] ConfigError),
    #[error("built-in relabel set: {0}")]
    BuiltIn(relabel::RelabelError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args_with(text: &str, argv: &[&str]) -> Result<Settings, ConfigError> {
        let parsed = parse(text, Path::new("test.yaml"))?;
        let argv: Vec<OsString> = std::iter::once("firn-enricher")
            .chain(argv.iter().copied())
            .map(OsString::from)
            .collect();
        let m = Settings::command().get_matches_from(&argv);
        let mut all = argv;
        all.extend(from_file(&m, parsed.args));
        let m = Settings::command().get_matches_from(all);
        Ok(Settings::from_arg_matches(&m).unwrap())
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
        assert_eq!(a.debuginfo_upload, super::super::DebuginfoMode::All);
        assert_eq!(a.upload_spool_size, 1 << 20);
        assert_eq!(a.upload_timeout, std::time::Duration::from_secs(5));
        let e = args_with("upload_timeout: 5\n", &[])
            .expect_err("a duration without a unit")
            .to_string();
        assert!(e.contains("upload_timeout") && e.contains("line 1"), "{e}");
        let e = args_with("debuginfo_upload_concurrency: 0\n", &[])
            .expect_err("out of range")
            .to_string();
        assert!(e.contains("1..=16"), "{e}");
    }

    #[test]
    fn every_setting_has_its_key_and_unknown_keys_are_named() {
        // Each flag's key is accepted (its value checked by the flag's own parser).
        for arg in Settings::command().get_arguments() {
            let id = arg.get_id().as_str();
            if arg.get_long().is_none() || COMMAND_LINE_ONLY.contains(&id) || arg.is_hide_set() {
                continue;
            }
            let e = parse(&format!("{id}: \"\x01\"\n"), Path::new("t.yaml"));
            if let Err(e) = e {
                assert!(
                    !e.to_string().contains("unknown setting"),
                    "{id} has no key: {e}"
                );
            }
        }
        let e = parse("retention_sise: 1GiB\n", Path::new("t.yaml"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("unknown setting `retention_sise` (line 1)"),
            "{e}"
        );
        let e = parse("dump: true\n", Path::new("t.yaml"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("unknown setting `dump`"), "{e}");
    }
}
