//! What the tests send the broker over HTTP and how they read its answer: the submission body,
//! and a reply as status, headers and body (JSON where it is JSON, else the text as a string),
//! whether the broker runs in-process or as the `admission serve` process.

use serde_json::{Value, json};

/// A quota file with room for hundreds of operations per client.
pub const LARGE: &str = r#"{"requests_per_window": 10000, "window_seconds": 60,
  "client_active": 1000, "client_pending": 100, "global_active": 2000, "global_executing": 100}"#;

/// The Agent V1 path of operation `id`.
pub fn op_path(id: &str) -> String {
    format!("/api/agent/v1/operations/{id}")
}

/// An Agent V1 operation's revision.
pub fn revision(body: &Value) -> u64 {
    body["revision"].as_u64().expect("a revision")
}

/// An Agent V1 submission of `operation` under idempotency key `key`.
pub fn request(key: &str, operation: &str, duration_ms: u64) -> Value {
    json!({
        "idempotency_key": key,
        "operation": operation,
        "target": {"repo": "unyolo/test", "branch": "main"},
        "arguments": {"duration_ms": duration_ms},
        "reason": "end-to-end test",
    })
}

/// One answer of the broker.
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Reply {
    /// Reads the whole answer.
    pub async fn read(response: reqwest::Response) -> Result<Reply, reqwest::Error> {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("-")
    }
    /// An Agent V1 operation's `state`, or an Operator V1 request's `status`.
    pub fn state(&self) -> &str {
        self.body["state"]
            .as_str()
            .or_else(|| self.body["status"].as_str())
            .unwrap_or("-")
    }
    pub fn id(&self) -> String {
        self.body["id"].as_str().unwrap_or_default().to_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn retry_after(&self) -> Option<u64> {
        self.header("retry-after").and_then(|v| v.parse().ok())
    }
}

/// Reads one answer from `read`: its head and as much body as arrives before the server closes
/// the connection or the JSON ends.
pub async fn read_answer(read: &mut tokio::net::tcp::OwnedReadHalf) -> String {
    use tokio::io::AsyncReadExt;
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    while !(received.windows(4).any(|w| w == b"\r\n\r\n") && received.ends_with(b"}")) {
        match read.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => received.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&received).into_owned()
}
