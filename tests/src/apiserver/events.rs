//! Core/v1 Events for the test API server, as a kubelet (or a runtime with the kubelet's
//! credentials) writes them: create (`POST /api/v1/namespaces/{ns}/events`), merge-patch
//! (`PATCH .../events/{name}`, `application/merge-patch+json` or the strategic form, which
//! for an Event's flat fields is the same), get and list (namespaced or all). Every write is
//! recorded ([`EventWrite`]) so tests can count the API writes a pod cost.
//!
//! What the real server refuses is refused here the same way: an object whose
//! `metadata.namespace` is not the path's (400), an `involvedObject.namespace` other than the
//! event's (422, the legacy validation `does not match event.namespace`), a name taken (409), a
//! patch of an event that does not exist (404) or that changes its name or namespace (422),
//! another patch type (415), a body that is not an object (400), more than 3 MiB (413).

use std::collections::BTreeMap;
use std::time::Instant;

use hyper::StatusCode;
use serde_json::{Value, json};

/// Largest request body the real API server reads.
pub(super) const MAX_BODY: usize = 3 << 20;

/// One event write the server answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventWrite {
    pub at: Instant,
    /// `POST` or `PATCH`.
    pub method: String,
    pub namespace: String,
    /// The event's name (for a refused create, the one asked for, if any).
    pub name: String,
    /// `involvedObject.uid` of the event as written (after the patch), if any.
    pub involved_uid: Option<String>,
    pub status: u16,
}

/// The events kept, by (namespace, name).
#[derive(Debug, Default)]
pub(super) struct Events {
    objects: BTreeMap<(String, String), Value>,
    pub(super) writes: Vec<EventWrite>,
}

/// An answer: status and body.
pub(super) type Answer = (StatusCode, Value);

fn status(code: StatusCode, reason: &str, message: &str) -> Answer {
    (code, super::status_json(code.as_u16(), reason, message))
}

impl Events {
    pub(super) fn list(&self, namespace: Option<&str>, rv: u64) -> Value {
        let items: Vec<&Value> = self
            .objects
            .iter()
            .filter(|((ns, _), _)| namespace.is_none_or(|n| n == ns))
            .map(|(_, v)| v)
            .collect();
        json!({
            "apiVersion": "v1",
            "kind": "EventList",
            "metadata": { "resourceVersion": rv.to_string() },
            "items": items,
        })
    }

    pub(super) fn get(&self, namespace: &str, name: &str) -> Answer {
        match self.objects.get(&(namespace.to_string(), name.to_string())) {
            Some(v) => (StatusCode::OK, v.clone()),
            None => not_found(name),
        }
    }

    /// Every event kept.
    pub(super) fn all(&self) -> Vec<Value> {
        self.objects.values().cloned().collect()
    }

    /// `POST /api/v1/namespaces/{namespace}/events`; `rv`: the resourceVersion to give it.
    pub(super) fn create(&mut self, namespace: &str, body: &[u8], rv: u64) -> Answer {
        let mut obj = match parse_object(body) {
            Ok(o) => o,
            Err(a) => return self.record("POST", namespace, "", None, a),
        };
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        let uid = involved_uid(&obj);
        let answer = (|| {
            // An empty namespace is filled in from the path, as the real server does.
            if let Some(ns) = obj["metadata"]["namespace"].as_str()
                && !ns.is_empty()
                && ns != namespace
            {
                return Err(status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            if name.is_empty() {
                return Err(invalid(
                    &name,
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
            check_involved(&obj, namespace, &name)?;
            let key = (namespace.to_string(), name.clone());
            if self.objects.contains_key(&key) {
                return Err(status(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("events \"{name}\" already exists"),
                ));
            }
            obj["apiVersion"] = json!("v1");
            obj["kind"] = json!("Event");
            let meta = &mut obj["metadata"];
            meta["namespace"] = json!(namespace);
            meta["resourceVersion"] = json!(rv.to_string());
            meta["uid"] = json!(format!("event-{rv}"));
            meta["creationTimestamp"] = json!(super::now());
            self.objects.insert(key, obj.clone());
            Ok((StatusCode::CREATED, obj))
        })();
        let answer = answer.unwrap_or_else(|e| e);
        self.record("POST", namespace, &name, uid, answer)
    }

    /// `PATCH /api/v1/namespaces/{namespace}/events/{name}` with a merge patch.
    pub(super) fn patch(
        &mut self,
        namespace: &str,
        name: &str,
        content_type: &str,
        body: &[u8],
        rv: u64,
    ) -> Answer {
        let key = (namespace.to_string(), name.to_string());
        let answer = (|| {
            let media = content_type.split(';').next().unwrap_or("").trim();
            if !matches!(
                media,
                "application/merge-patch+json" | "application/strategic-merge-patch+json"
            ) {
                return Err(status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    &format!(
                        "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (got {media:?})"
                    ),
                ));
            }
            let patch = parse_object(body)?;
            let Some(current) = self.objects.get(&key) else {
                return Err(not_found(name));
            };
            let mut next = current.clone();
            merge(&mut next, &patch);
            if next["metadata"]["name"] != json!(name)
                || next["metadata"]["namespace"] != json!(namespace)
            {
                return Err(invalid(
                    name,
                    "metadata: the name and namespace of an event cannot change",
                ));
            }
            check_involved(&next, namespace, name)?;
            next["metadata"]["resourceVersion"] = json!(rv.to_string());
            self.objects.insert(key.clone(), next.clone());
            Ok((StatusCode::OK, next))
        })();
        let answer = answer.unwrap_or_else(|e| e);
        let uid = self.objects.get(&key).and_then(involved_uid);
        self.record("PATCH", namespace, name, uid, answer)
    }

    fn record(
        &mut self,
        method: &str,
        namespace: &str,
        name: &str,
        involved_uid: Option<String>,
        answer: Answer,
    ) -> Answer {
        self.writes.push(EventWrite {
            at: Instant::now(),
            method: method.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            involved_uid,
            status: answer.0.as_u16(),
        });
        answer
    }
}

fn involved_uid(obj: &Value) -> Option<String> {
    obj["involvedObject"]["uid"].as_str().map(str::to_string)
}

fn not_found(name: &str) -> Answer {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("events \"{name}\" not found"),
    )
}

fn invalid(name: &str, detail: &str) -> Answer {
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!("Event \"{name}\" is invalid: {detail}"),
    )
}

/// An event without `eventTime` is checked as the legacy validation does: its involved object
/// must be in its namespace.
fn check_involved(obj: &Value, namespace: &str, name: &str) -> Result<(), Answer> {
    let involved = obj["involvedObject"]["namespace"].as_str().unwrap_or("");
    if involved != namespace {
        return Err(invalid(
            name,
            &format!(
                "involvedObject.namespace: Invalid value: \"{involved}\": does not match event.namespace"
            ),
        ));
    }
    Ok(())
}

fn parse_object(body: &[u8]) -> Result<Value, Answer> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "the request body is not a JSON object",
        )),
        Err(e) => Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!("the request body is not JSON: {e}"),
        )),
    }
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    let Some(p) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut v = json!({"a": 1, "b": {"c": 2, "d": 3}, "e": [1]});
        merge(
            &mut v,
            &json!({"a": null, "b": {"c": 5}, "e": [2], "f": "x"}),
        );
        assert_eq!(v, json!({"b": {"c": 5, "d": 3}, "e": [2], "f": "x"}));
    }
}
