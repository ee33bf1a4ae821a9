//! The index template: installed when absent, and replaced when it is firn's own of an
//! older mapping, with the new fields added to the indices already made from it (a
//! `strict` mapping refuses a document with a field it lacks, and an index keeps the
//! mapping it was made with).

use bytes::Bytes;
use hyper::{Method, StatusCode};
use serde_json::Value;

use super::documents::MAPPING_VERSION;
use super::OpenSearchTransport;
use crate::metrics::Metrics;
use crate::output::delivery::SendError;

/// What OpenSearch holds under firn's template name.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Installed {
    /// firn's, with this mapping version or a later one: nothing to do.
    Current,
    /// firn's, of an older mapping version.
    Older(u64),
    /// Made by someone else, or unreadable: left alone (a person's own template).
    NotOurs,
}

/// Reads a `GET /_index_template/<name>` answer.
pub(crate) fn installed(body: &[u8], name: &str) -> Installed {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Installed::NotOurs;
    };
    let Some(t) = v["index_templates"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["name"] == name))
    else {
        return Installed::NotOurs;
    };
    let meta = &t["index_template"]["_meta"];
    if meta["created_by"] != "firn-enricher" {
        return Installed::NotOurs;
    }
    // Templates from before off-CPU time carry no mapping version.
    match meta["mapping"].as_u64().unwrap_or(1) {
        v if v >= MAPPING_VERSION => Installed::Current,
        v => Installed::Older(v),
    }
}

/// The body of `PUT /<indices>/_mapping` that gives existing indices the template's
/// fields (adding fields is allowed; the ones they have are unchanged).
pub(crate) fn mapping_update(template: &Value) -> Value {
    serde_json::json!({"properties": template["template"]["mappings"]["properties"]})
}

impl OpenSearchTransport {
    /// Installs the index template when absent, upgrades firn's own older one.
    pub(super) async fn ensure_template(&self) -> Result<(), SendError> {
        let path = format!("/_index_template/{}", self.prefix);
        let (status, body) = self
            .call(Method::GET, &path, "application/json", Bytes::new())
            .await?;
        let older = if status.is_success() {
            match installed(&body, &self.prefix) {
                Installed::Current => None,
                Installed::Older(v) => Some(v),
                Installed::NotOurs => {
                    Metrics::inc(&self.global.opensearch_template_kept);
                    tracing::warn!(
                        template = %self.prefix,
                        "an index template of firn's name that firn did not make is left \
                         as it is: documents with fields it does not map may be refused"
                    );
                    None
                }
            }
        } else if status == StatusCode::NOT_FOUND {
            Some(0)
        } else {
            return Err(Self::failed("looking up the index template", status, &body));
        };
        let Some(older) = older else {
            self.template_ok.set(true);
            return Ok(());
        };
        let (status, body) = self
            .call(
                Method::PUT,
                &path,
                "application/json",
                self.template.clone(),
            )
            .await?;
        if !status.is_success() {
            // A refused template is a firn bug or a cluster policy: say it, and keep the
            // documents (they would be mapped by guesswork without it).
            let e = Self::failed("installing the index template", status, &body);
            return Err(SendError::Retry(e.to_string()));
        }
        if older == 0 {
            Metrics::inc(&self.global.opensearch_template_installs);
            tracing::info!(template = %self.prefix, "OpenSearch index template installed");
        } else {
            self.update_mappings().await?;
            Metrics::inc(&self.global.opensearch_template_upgrades);
            tracing::info!(template = %self.prefix, from = older, to = MAPPING_VERSION,
                "OpenSearch index template and its indices' mappings upgraded");
        }
        self.template_ok.set(true);
        Ok(())
    }

    /// Adds the template's fields to the indices made from an older one.
    async fn update_mappings(&self) -> Result<(), SendError> {
        let template: Value = serde_json::from_slice(&self.template)
            .map_err(|e| SendError::Reject(format!("firn's own template: {e}")))?;
        let path = format!("/{}-*/_mapping", self.prefix);
        let body = Bytes::from(mapping_update(&template).to_string());
        let (status, answer) = self
            .call(Method::PUT, &path, "application/json", body)
            .await?;
        // 404: no index matches yet, nothing to update.
        if status.is_success() || status == StatusCode::NOT_FOUND {
            return Ok(());
        }
        let e = Self::failed("adding the new fields to the indices", status, &answer);
        // Until the indices have the fields, documents would be refused: keep them.
        Err(SendError::Retry(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(meta: Value) -> Vec<u8> {
        serde_json::json!({"index_templates": [
            {"name": "other", "index_template": {"_meta": {}}},
            {"name": "p", "index_template": {"_meta": meta}}
        ]})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn an_older_firn_template_is_upgraded_and_no_other() {
        use serde_json::json;
        let v1 = json!({"created_by": "firn-enricher", "version": "0.1.0"});
        assert_eq!(installed(&answer(v1), "p"), Installed::Older(1));
        let now = json!({"created_by": "firn-enricher", "mapping": MAPPING_VERSION});
        assert_eq!(installed(&answer(now), "p"), Installed::Current);
        let newer = json!({"created_by": "firn-enricher", "mapping": MAPPING_VERSION + 1});
        assert_eq!(installed(&answer(newer), "p"), Installed::Current);
        assert_eq!(
            installed(&answer(json!({"by": "me"})), "p"),
            Installed::NotOurs
        );
        assert_eq!(installed(b"<html>", "p"), Installed::NotOurs);
        assert_eq!(installed(&answer(json!({})), "q"), Installed::NotOurs);
        let t = super::super::documents::template("p");
        let m = mapping_update(&t);
        assert_eq!(m["properties"]["off_cpu_ns"]["type"], "long");
        assert!(m["properties"]["off_cpu_top_functions"]["properties"].is_object());
    }
}
