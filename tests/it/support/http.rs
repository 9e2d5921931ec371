//! A minimal HTTP/1.1 client for the admin API tests: one request per connection, no
//! dependency beyond tokio.

use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A response: status, raw header block, body (de-chunked).
pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// One HTTP/1.1 request over a fresh connection.
pub async fn http(port: u16, method: &str, path: &str, token: Option<&str>, body: &str) -> Reply {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the admin API");
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read response");
    let text = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("headers and body");
    let status = head[9..12].parse().expect("status code");
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Reply {
        status,
        headers: head.to_owned(),
        body,
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// Waits until the worker's admin API on `port` answers `/readyz` with 200 (at most 10 s).
pub async fn wait_until_ready(port: u16) {
    wait_until_listening(port).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while http(port, "GET", "/readyz", None, "").await.status != 200 {
        assert!(Instant::now() < deadline, "the admin API became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (up to 10 s) until the admin API accepts connections, whatever it answers.
pub async fn wait_until_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Ok(_)) = tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(("127.0.0.1", port)),
        )
        .await
        {
            return;
        }
        assert!(Instant::now() < deadline, "the admin API listens");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
