//! Prometheus `relabel_configs` semantics over a label set: replace, keep, drop,
//! labelmap, labeldrop, labelkeep, hashmod, lowercase, uppercase; regexes fully
//! anchored; `$1` / `${name}` expansion as in Go's regexp.Expand.

use std::collections::BTreeMap;

use serde::Deserialize;

pub(crate) type Labels = BTreeMap<String, String>;

#[derive(Debug, thiserror::Error)]
pub(crate) enum RelabelError {
    #[error("the built-in relabel rules do not parse (a bug in this build): {0}")]
    Builtin(String),
    #[error("relabel_configs[{index}]: invalid regex {regex:?}: {source}")]
    Regex {
        index: usize,
        regex: String,
        source: Box<regex::Error>,
    },
    #[error("relabel_configs[{index}]: action {action} needs {what}")]
    Missing {
        index: usize,
        action: &'static str,
        what: &'static str,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Action {
    #[default]
    Replace,
    Keep,
    Drop,
    Labelmap,
    Labeldrop,
    Labelkeep,
    Hashmod,
    Lowercase,
    Uppercase,
}

fn default_separator() -> String {
    ";".into()
}
fn default_regex() -> String {
    "(.*)".into()
}
fn default_replacement() -> String {
    "$1".into()
}

/// One rule, as written in YAML.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RuleConfig {
    #[serde(default)]
    pub(crate) source_labels: Vec<String>,
    #[serde(default = "default_separator")]
    pub(crate) separator: String,
    #[serde(default = "default_regex")]
    pub(crate) regex: String,
    #[serde(default)]
    pub(crate) modulus: u64,
    #[serde(default)]
    pub(crate) target_label: String,
    #[serde(default = "default_replacement")]
    pub(crate) replacement: String,
    #[serde(default)]
    pub(crate) action: Action,
}

/// A compiled rule.
#[derive(Debug, Clone)]
pub struct Rule {
    cfg: RuleConfig,
    regex: regex::Regex,
}

pub(crate) fn compile(rules: &[RuleConfig]) -> Result<Vec<Rule>, RelabelError> {
    rules
        .iter()
        .enumerate()
        .map(|(index, cfg)| {
            let regex = regex::Regex::new(&format!("^(?:{})$", cfg.regex)).map_err(|e| {
                RelabelError::Regex {
                    index,
                    regex: cfg.regex.clone(),
                    source: Box::new(e),
                }
            })?;
            let needs_target = matches!(
                cfg.action,
                Action::Replace | Action::Hashmod | Action::Lowercase | Action::Uppercase
            );
            if needs_target && cfg.target_label.is_empty() {
                return Err(RelabelError::Missing {
                    index,
                    action: action_name(cfg.action),
                    what: "target_label",
                });
            }
            if cfg.action == Action::Hashmod && cfg.modulus == 0 {
                return Err(RelabelError::Missing {
                    index,
                    action: "hashmod",
                    what: "a modulus above 0",
                });
            }
            Ok(Rule {
                cfg: cfg.clone(),
                regex,
            })
        })
        .collect()
}

fn action_name(a: Action) -> &'static str {
    match a {
        Action::Replace => "replace",
        Action::Keep => "keep",
        Action::Drop => "drop",
        Action::Labelmap => "labelmap",
        Action::Labeldrop => "labeldrop",
        Action::Labelkeep => "labelkeep",
        Action::Hashmod => "hashmod",
        Action::Lowercase => "lowercase",
        Action::Uppercase => "uppercase",
    }
}

fn expand(re: &regex::Regex, template: &str, value: &str) -> Option<String> {
    let caps = re.captures(value)?;
    let mut out = String::new();
    caps.expand(template, &mut out);
    Some(out)
}

/// Prometheus's label-name rule for targets produced by expansion.
fn valid_name(n: &str) -> bool {
    let mut b = n.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Applies `rules` in order. `None`: the label set was dropped (keep/drop).
pub fn apply(rules: &[Rule], mut labels: Labels) -> Option<Labels> {
    for r in rules {
        let c = &r.cfg;
        let value = c
            .source_labels
            .iter()
            .map(|n| labels.get(n).map_or("", String::as_str))
            .collect::<Vec<_>>()
            .join(&c.separator);
        match c.action {
            Action::Replace => {
                let Some(target) = expand(&r.regex, &c.target_label, &value) else {
                    continue;
                };
                if !valid_name(&target) {
                    continue;
                }
                let Some(res) = expand(&r.regex, &c.replacement, &value) else {
                    continue;
                };
                if res.is_empty() {
                    labels.remove(&target);
                } else {
                    labels.insert(target, res);
                }
            }
            Action::Keep => {
                if !r.regex.is_match(&value) {
                    return None;
                }
            }
            Action::Drop => {
                if r.regex.is_match(&value) {
                    return None;
                }
            }
            Action::Hashmod => {
                let d = md5::compute(value.as_bytes());
                let n = u64::from_be_bytes(d.0[8..16].try_into().unwrap_or_default());
                labels.insert(c.target_label.clone(), (n % c.modulus).to_string());
            }
            Action::Labelmap => {
                let add: Vec<(String, String)> = labels
                    .iter()
                    .filter_map(|(k, v)| {
                        expand(&r.regex, &c.replacement, k).map(|nk| (nk, v.clone()))
                    })
                    .filter(|(nk, _)| valid_name(nk))
                    .collect();
                labels.extend(add);
            }
            Action::Labeldrop => labels.retain(|k, _| !r.regex.is_match(k)),
            Action::Labelkeep => labels.retain(|k, _| r.regex.is_match(k)),
            Action::Lowercase => {
                labels.insert(c.target_label.clone(), value.to_lowercase());
            }
            Action::Uppercase => {
                labels.insert(c.target_label.clone(), value.to_uppercase());
            }
        }
    }
    Some(labels)
}

/// Drops the `__`-prefixed labels left after relabeling.
pub fn finish(mut labels: Labels) -> Labels {
    labels.retain(|k, _| !k.starts_with("__"));
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(yaml: &str) -> Vec<Rule> {
        compile(&serde_yaml::from_str::<Vec<RuleConfig>>(yaml).unwrap()).unwrap()
    }

    fn ls(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn replace_defaults_anchoring_and_expansion() {
        // Default action replace, regex (.*), replacement $1.
        let r = rules("- {source_labels: [a], target_label: b}");
        assert_eq!(
            apply(&r, ls(&[("a", "x")])).unwrap(),
            ls(&[("a", "x"), ("b", "x")])
        );
        // Anchored: "foo" does not match inside "xfoox".
        let r = rules("- {source_labels: [a], regex: foo, target_label: b, replacement: hit}");
        assert_eq!(
            apply(&r, ls(&[("a", "xfoox")])).unwrap(),
            ls(&[("a", "xfoox")])
        );
        assert_eq!(
            apply(&r, ls(&[("a", "foo")])).unwrap(),
            ls(&[("a", "foo"), ("b", "hit")])
        );
        // Separator joins sources; ${1} and named groups expand.
        let r = rules(
            "- {source_labels: [a, b], separator: '/', regex: '(?P<x>[^/]*)/(.*)', target_label: c, replacement: '${x}-$2'}",
        );
        assert_eq!(
            apply(&r, ls(&[("a", "p"), ("b", "q")])).unwrap()["c"],
            "p-q"
        );
        // An empty result removes the target; a missing source is the empty string.
        let r = rules("- {source_labels: [missing], target_label: b}");
        assert_eq!(apply(&r, ls(&[("b", "old")])).unwrap(), ls(&[]));
        // $$ is a literal dollar.
        let r = rules("- {source_labels: [a], target_label: b, replacement: '$$1'}");
        assert_eq!(apply(&r, ls(&[("a", "v")])).unwrap()["b"], "$1");
        // The target label itself expands.
        let r =
            rules("- {source_labels: [a], regex: '(.*)', target_label: 'l_$1', replacement: yes}");
        assert_eq!(apply(&r, ls(&[("a", "z")])).unwrap()["l_z"], "yes");
    }

    #[test]
    fn keep_and_drop_whole_sets() {
        let keep = rules("- {source_labels: [comm], regex: 'post.*', action: keep}");
        assert!(apply(&keep, ls(&[("comm", "postgres")])).is_some());
        assert!(apply(&keep, ls(&[("comm", "xpostgres")])).is_none());
        let drop = rules("- {source_labels: [comm], regex: 'kworker/.*', action: drop}");
        assert!(apply(&drop, ls(&[("comm", "kworker/0:1")])).is_none());
        assert!(apply(&drop, ls(&[("comm", "bash")])).is_some());
    }

    #[test]
    fn labelmap_labeldrop_labelkeep() {
        let r = rules("- {regex: '__meta_kubernetes_pod_label_(.+)', action: labelmap}");
        let out = apply(&r, ls(&[("__meta_kubernetes_pod_label_app", "web")])).unwrap();
        assert_eq!(out["app"], "web");
        let r = rules("- {regex: 'tmp_.*', action: labeldrop}");
        assert_eq!(
            apply(&r, ls(&[("tmp_a", "1"), ("b", "2")])).unwrap(),
            ls(&[("b", "2")])
        );
        let r = rules("- {regex: 'b|c', action: labelkeep}");
        assert_eq!(
            apply(&r, ls(&[("a", "1"), ("b", "2")])).unwrap(),
            ls(&[("b", "2")])
        );
    }

    #[test]
    fn hashmod_matches_prometheus() {
        // Prometheus: md5 of the joined value, last 8 bytes big-endian, mod modulus.
        let r = rules("- {source_labels: [a], target_label: h, modulus: 1000, action: hashmod}");
        let d = md5::compute(b"foo");
        let want = u64::from_be_bytes(d.0[8..16].try_into().unwrap()) % 1000;
        assert_eq!(
            apply(&r, ls(&[("a", "foo")])).unwrap()["h"],
            want.to_string()
        );
    }

    #[test]
    fn case_actions_and_errors() {
        let r = rules("- {source_labels: [a], target_label: b, action: lowercase}\n- {source_labels: [a], target_label: c, action: uppercase}");
        let out = apply(&r, ls(&[("a", "MiXed")])).unwrap();
        assert_eq!((out["b"].as_str(), out["c"].as_str()), ("mixed", "MIXED"));
        let bad: Vec<RuleConfig> =
            serde_yaml::from_str("- {source_labels: [a], regex: '(', target_label: b}").unwrap();
        let e = compile(&bad).unwrap_err().to_string();
        assert!(
            e.contains("relabel_configs[0]") && e.contains("invalid regex"),
            "{e}"
        );
        let bad: Vec<RuleConfig> =
            serde_yaml::from_str("- {action: hashmod, target_label: h}").unwrap();
        assert!(compile(&bad).unwrap_err().to_string().contains("modulus"));
        assert!(serde_yaml::from_str::<Vec<RuleConfig>>("- {action: explode}").is_err());
        assert!(serde_yaml::from_str::<Vec<RuleConfig>>("- {sources: [a]}").is_err());
        assert_eq!(finish(ls(&[("__x", "1"), ("y", "2")])), ls(&[("y", "2")]));
    }
}
