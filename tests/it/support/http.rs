//! A minimal HTTP/1.1 client for the admin API tests: one request per connection, no
//! dependency beyond tokio.

use std::net::{IpAddr, Ipv4Addr};
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
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(auth) = &auth {
        headers.push(("Authorization", auth));
    }
    request(LOCALHOST, port, method, path, &headers, body).await
}

/// The address tests connect from unless they mean to be another client.
pub const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// One HTTP/1.1 request over a fresh connection from the local address `from` (any of
/// 127.0.0.0/8 reaches the server on 127.0.0.1 as another client), with `headers`.
pub async fn request(
    from: IpAddr,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind((from, 0).into())
        .expect("bind the client's address");
    let mut stream = socket
        .connect((Ipv4Addr::LOCALHOST, port).into())
        .await
        .expect("connect to the admin API");
    let headers: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{headers}\
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

/// The console driven over plain HTTP as a browser without script drives it: the login form
/// with its double-submit cookie, then the session cookie on every request; links and forms
/// read from the pages as a browser reads them ([`links`], [`field`]).
pub struct Console {
    pub port: u16,
    /// The address it connects from: another address is another client.
    pub from: IpAddr,
    session: Option<String>,
}

impl Console {
    pub fn new(port: u16, from: IpAddr) -> Console {
        Console {
            port,
            from,
            session: None,
        }
    }

    /// Opens the login form and submits `token` with it; returns the answer to the submit,
    /// keeping the session cookie when one is set.
    pub async fn log_in(&mut self, token: &str) -> Reply {
        let form = request(self.from, self.port, "GET", "/ui/login", &[], "").await;
        let nonce = cookie(&form, "sendquota_login").expect("the login form's cookie");
        let body = form_encoded(&[("nonce", &nonce), ("token", token)]);
        let cookie_header = format!("sendquota_login={nonce}");
        let headers = [
            ("Content-Type", "application/x-www-form-urlencoded"),
            ("Cookie", cookie_header.as_str()),
        ];
        let reply = request(self.from, self.port, "POST", "/ui/login", &headers, &body).await;
        if let Some(session) = cookie(&reply, "sendquota_session") {
            self.session = Some(session);
        }
        reply
    }

    fn cookie_header(&self) -> String {
        format!(
            "sendquota_session={}",
            self.session.as_deref().unwrap_or("")
        )
    }

    /// A page, `path` with its query as a link or a GET form puts it.
    pub async fn get(&self, path: &str) -> Reply {
        let cookie = self.cookie_header();
        request(
            self.from,
            self.port,
            "GET",
            path,
            &[("Cookie", &cookie)],
            "",
        )
        .await
    }

    /// Submits a POST form to `path` with `fields`, encoded as a browser encodes them.
    pub async fn post(&self, path: &str, fields: &[(&str, &str)]) -> Reply {
        let cookie = self.cookie_header();
        let headers = [
            ("Content-Type", "application/x-www-form-urlencoded"),
            ("Cookie", cookie.as_str()),
        ];
        let body = form_encoded(fields);
        request(self.from, self.port, "POST", path, &headers, &body).await
    }
}

/// The value `reply` sets for cookie `name`.
pub fn cookie(reply: &Reply, name: &str) -> Option<String> {
    reply
        .headers
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(h, _)| h.eq_ignore_ascii_case("set-cookie"))
        .filter_map(|(_, v)| v.trim().split(';').next()?.split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.to_owned())
}

/// `fields` as a browser submits a form (`application/x-www-form-urlencoded`): a space as `+`,
/// every byte but letters, digits and `*-._` percent-encoded.
pub fn form_encoded(fields: &[(&str, &str)]) -> String {
    let encode = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b' ' => "+".to_owned(),
                b if b.is_ascii_alphanumeric() || b"*-._".contains(&b) => (b as char).to_string(),
                b => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    fields
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Text of an HTML page as a browser reads it from an attribute or an element: character
/// references (`&#38;`, `&#x26;`) and the named ones askama writes, decoded.
pub fn unescape(html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    let mut rest = html;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let decoded = rest.find(';').and_then(|end| {
            let name = &rest[1..end];
            let c = match name {
                "lt" => Some('<'),
                "gt" => Some('>'),
                "amp" => Some('&'),
                "quot" => Some('"'),
                "apos" => Some('\''),
                _ => match name.strip_prefix("#x").or_else(|| name.strip_prefix("#X")) {
                    Some(hex) => u32::from_str_radix(hex, 16).ok().and_then(char::from_u32),
                    None => name
                        .strip_prefix('#')
                        .and_then(|n| n.parse().ok())
                        .and_then(char::from_u32),
                },
            }?;
            Some((c, end + 1))
        });
        match decoded {
            Some((c, len)) => {
                out.push(c);
                rest = &rest[len..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The value of attribute `name` in the tag text `tag`, decoded.
fn attribute(tag: &str, name: &str) -> Option<String> {
    let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    let len = tag[start..].find('"')?;
    Some(unescape(&tag[start..start + len]))
}

/// Every link of `html`: its `id` (empty without one), its `href` and its text, decoded.
pub fn links(html: &str) -> Vec<(String, String, String)> {
    html.match_indices("<a ")
        .filter_map(|(at, _)| {
            let tag_end = at + html[at..].find('>')?;
            let tag = &html[at..tag_end];
            let text_end = tag_end + html[tag_end..].find("</a>")?;
            Some((
                attribute(tag, "id").unwrap_or_default(),
                attribute(tag, "href")?,
                unescape(&html[tag_end + 1..text_end]),
            ))
        })
        .collect()
}

/// The `href` of the link with id `id`.
pub fn link(html: &str, id: &str) -> Option<String> {
    links(html)
        .into_iter()
        .find(|(i, _, _)| i == id)
        .map(|(_, href, _)| href)
}

/// The value of the form field (an `input`) named `name`, decoded.
pub fn field(html: &str, name: &str) -> Option<String> {
    html.match_indices("<input ").find_map(|(at, _)| {
        let tag = &html[at..at + html[at..].find('>')?];
        (attribute(tag, "name").as_deref() == Some(name))
            .then(|| attribute(tag, "value").unwrap_or_default())
    })
}

/// The text of the element with id `id` (up to its first child or its end), decoded.
pub fn text_of(html: &str, id: &str) -> Option<String> {
    let at = html.find(&format!(" id=\"{id}\""))?;
    let start = at + html[at..].find('>')? + 1;
    let len = html[start..].find('<')?;
    Some(unescape(&html[start..start + len]))
}

/// The value of the series `series` (name and labels, exactly as exported) in the worker's
/// `/metrics` on `port`; 0 when it is not exported.
pub async fn metric(port: u16, series: &str) -> u64 {
    let metrics = http(port, "GET", "/metrics", None, "").await.body;
    metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}
