//! An operator speaking Operator V1 to a broker's operator listener, in-process or the
//! `admission serve` process: every reply is checked against the vendored contract
//! ([`super::operator_contract`]) and the headers every operator response carries.

use serde_json::{Value, json};

use super::eventually::PATIENCE;
use super::http::Reply;
use super::operator_contract;
use super::secrets::OPERATOR_SECRET;

/// The component of the contract a reply to `method path` with `status` must be, if it has one
/// (`/metrics` and `/admission/v1/drift` are not Operator V1 objects).
pub fn component_of(method: &str, path: &str, status: u16) -> Option<&'static str> {
    if status >= 400 {
        return Some("ErrorEnvelope");
    }
    let path = path.split('?').next().unwrap_or(path);
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        ("GET", [".well-known", "unyolo-operator"]) => Some("Descriptor"),
        ("GET", ["healthz" | "readyz"]) => Some("Health"),
        ("GET", ["api", "operator", "v1", "requests"]) => Some("RequestPage"),
        ("GET", ["api", "operator", "v1", "requests", _]) => Some("BrokerRequest"),
        ("POST", ["api", "operator", "v1", "requests", _, _]) => Some("BrokerRequest"),
        _ => None,
    }
}

/// Checks an operator listener's reply: the contract's object for its route, and the headers
/// every response carries (`no-store`, `nosniff`, a 22-character `X-Correlation-ID`, equal to an
/// error's `correlation_id`; `application/json` for JSON).
#[track_caller]
pub fn check_reply(method: &str, path: &str, reply: &Reply) {
    let what = format!("{method} {path} → {}", reply.status);
    assert_eq!(reply.header("cache-control"), Some("no-store"), "{what}");
    assert_eq!(
        reply.header("x-content-type-options"),
        Some("nosniff"),
        "{what}"
    );
    let id = reply.header("x-correlation-id").unwrap_or_default();
    assert!(
        id.len() == 22
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "{what}: X-Correlation-ID {id:?}"
    );
    if let Some(component) = component_of(method, path, reply.status) {
        operator_contract::check(component, &reply.body);
        assert_eq!(
            reply.header("content-type"),
            Some("application/json"),
            "{what}"
        );
    }
    if reply.status >= 400 {
        assert_eq!(reply.body["error"]["correlation_id"], id, "{what}");
    }
}

/// An operator client of one operator listener.
#[derive(Clone)]
pub struct Operator {
    /// `http://ADDR`.
    pub base: String,
    /// The operator's secret.
    pub token: String,
    http: reqwest::Client,
}

impl Operator {
    /// The operator with [`OPERATOR_SECRET`] on the listener at `base`.
    pub fn new(base: String) -> Operator {
        Operator::with_token(base, OPERATOR_SECRET)
    }

    /// Another operator (or a stranger) with `token` on the same listener.
    pub fn with_token(base: String, token: &str) -> Operator {
        Operator {
            base,
            token: token.to_owned(),
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .timeout(PATIENCE)
                .build()
                .unwrap(),
        }
    }

    /// This listener's operator with another `token`.
    pub fn with_secret(&self, token: &str) -> Operator {
        Operator::with_token(self.base.clone(), token)
    }

    /// One request: `authorization` as the header's whole value (`None`: no header), a body
    /// with its content type. The reply is checked ([`check_reply`]).
    pub async fn send_raw(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
        body: Option<(&str, Vec<u8>)>,
    ) -> Reply {
        self.try_send_raw(method, path, authorization, body)
            .await
            .unwrap()
    }

    /// [`Operator::send_raw`], or the transport's error (the broker killed under the request,
    /// say) for a caller that outlives its broker, as the chaos run's operator does.
    pub async fn try_send_raw(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
        body: Option<(&str, Vec<u8>)>,
    ) -> Result<Reply, reqwest::Error> {
        let verb = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut request = self.http.request(verb, format!("{}{path}", self.base));
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        if let Some((content_type, bytes)) = body {
            if !content_type.is_empty() {
                request = request.header("content-type", content_type);
            }
            request = request.body(bytes);
        }
        let reply = Reply::read(request.send().await?).await?;
        check_reply(method, path, &reply);
        Ok(reply)
    }

    /// A `GET` with this operator's bearer.
    pub async fn get(&self, path: &str) -> Reply {
        let auth = format!("Bearer {}", self.token);
        self.send_raw("GET", path, Some(&auth), None).await
    }

    /// A decision with `body` as JSON.
    pub async fn decide(&self, id: &str, action: &str, body: &Value) -> Reply {
        let auth = format!("Bearer {}", self.token);
        let path = format!("/api/operator/v1/requests/{id}/{action}");
        let bytes = body.to_string().into_bytes();
        self.send_raw(
            "POST",
            &path,
            Some(&auth),
            Some(("application/json", bytes)),
        )
        .await
    }

    /// The request `id` as it is now.
    pub async fn request(&self, id: &str) -> Reply {
        self.get(&format!("/api/operator/v1/requests/{id}")).await
    }

    /// `action` on request `id` against its current revision, with a fresh idempotency key.
    pub async fn act(&self, id: &str, action: &str) -> Reply {
        let current = self.request(id).await;
        let revision = current.body["revision"].as_u64().unwrap_or(1);
        let key = format!("{action}-{id}-r{revision}");
        self.decide(
            id,
            action,
            &json!({"expected_revision": revision, "idempotency_key": key}),
        )
        .await
    }

    pub async fn approve(&self, id: &str) -> Reply {
        self.act(id, "approve").await
    }

    pub async fn deny(&self, id: &str) -> Reply {
        self.act(id, "deny").await
    }

    pub async fn revoke(&self, id: &str) -> Reply {
        self.act(id, "revoke").await
    }

    /// The ids of every pending request, newest first (every page).
    pub async fn pending(&self) -> Vec<String> {
        let mut ids = Vec::new();
        let mut cursor = String::new();
        loop {
            let page = self
                .get(&format!(
                    "/api/operator/v1/requests?status=pending&limit=100&cursor={cursor}"
                ))
                .await;
            assert_eq!(page.status, 200, "{}", page.body);
            for request in page.body["requests"].as_array().unwrap() {
                ids.push(request["id"].as_str().unwrap().to_owned());
            }
            match page.body["next_cursor"].as_str() {
                Some(next) => cursor = next.to_owned(),
                None => return ids,
            }
        }
    }

    /// The broker's `/metrics` text.
    pub async fn metrics(&self) -> String {
        let reply = self.get("/metrics").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.body.as_str().unwrap().to_owned()
    }

    /// One series of the broker's `/metrics`.
    pub async fn metric(&self, series: &str) -> Option<u64> {
        super::metrics::metric(&self.metrics().await, series)
    }

    /// `GET /admission/v1/drift`: the drift reading.
    pub async fn drift(&self) -> Value {
        let reply = self.get("/admission/v1/drift").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.body
    }
}
