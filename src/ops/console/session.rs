//! Console sessions: logging in with an admin token, the session cookie, CSRF tokens, logging
//! out.
//!
//! A token is typed once, into the login form (a POST body: never in a URL, never logged), and
//! traded for a session: a random id in an HttpOnly, SameSite=Strict cookie scoped to `/ui`,
//! kept in memory with the token's name (what audit rows record) and a CSRF token of its own.
//! Every state change is a POST carrying that CSRF token in a hidden field, compared in
//! constant time; a missing or wrong one is refused with 403. Sessions live in one worker's
//! memory and end with it, or after [`SESSION_TTL`].
//!
//! Guessing tokens through the form is slowed per client address ([`LoginThrottle`]): past a
//! few attempts without a login, each waits twice as long as the one before, up to
//! [`MAX_LOGIN_DELAY`].

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use askama::Template;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::ConsoleState;
use super::{render, ConsoleError};

/// How long a session lasts after login: a working day, so a console left open overnight
/// asks for the token again.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

/// Most sessions held at once; past it the oldest goes. Only a valid token makes a session,
/// so this bounds memory against a script logging in in a loop, not against strangers.
const MAX_SESSIONS: usize = 1000;

/// The session cookie's name.
const SESSION_COOKIE: &str = "sendquota_session";

/// The login form's double-submit cookie: the form carries the same random value, so a page of
/// another site cannot post a login of its own choosing.
const LOGIN_COOKIE: &str = "sendquota_login";

/// A logged-in operator, as the pages and the audit see them.
#[derive(Debug, Clone)]
pub struct Session {
    /// The admin token's name: audit rows record it.
    pub actor: String,
    /// The session's CSRF token, in every form that changes something.
    pub csrf: String,
    expires: Instant,
}

impl Session {
    /// Whether `presented` is this session's CSRF token, compared in constant time.
    pub fn csrf_ok(&self, presented: &str) -> bool {
        bool::from(self.csrf.as_bytes().ct_eq(presented.as_bytes()))
    }

    /// Refuses a state change whose form does not carry this session's CSRF token.
    pub fn check_csrf(&self, presented: &str) -> Result<(), ConsoleError> {
        if self.csrf_ok(presented) {
            Ok(())
        } else {
            Err(ConsoleError::Csrf)
        }
    }
}

/// The sessions of one worker's console, by id.
#[derive(Debug, Default)]
pub struct Sessions {
    by_id: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// A new session for `actor`; returns its id.
    fn open(&self, actor: String) -> Result<String, ConsoleError> {
        let id = random_token()?;
        let session = Session {
            actor,
            csrf: random_token()?,
            expires: Instant::now() + SESSION_TTL,
        };
        let mut by_id = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        by_id.retain(|_, s| s.expires > now);
        if by_id.len() >= MAX_SESSIONS {
            let oldest = by_id
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                by_id.remove(&oldest);
            }
        }
        by_id.insert(id.clone(), session);
        Ok(id)
    }

    /// The live session with id `id`.
    fn get(&self, id: &str) -> Option<Session> {
        let mut by_id = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
        match by_id.get(id) {
            Some(s) if s.expires > Instant::now() => Some(s.clone()),
            Some(_) => {
                by_id.remove(id);
                None
            }
            None => None,
        }
    }

    fn close(&self, id: &str) {
        self.by_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

/// Login attempts from one address answered without delay since its last login: a typo or
/// two costs nothing.
const FREE_LOGIN_ATTEMPTS: u32 = 3;

/// The wait after the first attempt past [`FREE_LOGIN_ATTEMPTS`]; each further one doubles
/// it.
const FIRST_LOGIN_DELAY: Duration = Duration::from_millis(125);

/// The longest wait between two login attempts from one address: 8 s makes 200 guesses take
/// about 25 minutes instead of an instant. An attempt that would wait longer (attempts sent
/// at once, queued behind each other) is refused at once with 429, unchecked, so one address
/// cannot pile up waiting requests.
pub const MAX_LOGIN_DELAY: Duration = Duration::from_secs(8);

/// How long an address's attempts are remembered after its last one.
const LOGIN_MEMORY: Duration = Duration::from_secs(15 * 60);

/// Most addresses remembered at once. Past it, attempts from addresses not in the table share
/// one entry: an attacker spread over many addresses is slowed as one client, and the table
/// stays at a few hundred kilobytes whatever arrives.
const MAX_LOGIN_CLIENTS: usize = 10_000;

/// Who a login attempt is counted against: an IPv4 address, or an IPv6 address's /64 (one
/// host usually holds a whole /64); `None` for the shared entry (no peer address known, or
/// the table full).
type ClientKey = Option<IpAddr>;

/// The key of the client at `peer`.
fn client_key(peer: Option<SocketAddr>) -> ClientKey {
    peer.map(|p| match p.ip() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    })
}

/// One client's login attempts since its last login.
#[derive(Debug, Clone, Copy)]
struct Attempts {
    /// Attempts counted, the ones still being answered among them.
    count: u32,
    /// When the next attempt may be checked.
    next: Instant,
    /// When the last attempt came.
    last: Instant,
}

/// The wait an address's next attempt owes after its `count`-th attempt without a login.
fn login_delay(count: u32) -> Duration {
    if count < FREE_LOGIN_ATTEMPTS {
        return Duration::ZERO;
    }
    let doublings = (count - FREE_LOGIN_ATTEMPTS).min(16);
    FIRST_LOGIN_DELAY
        .saturating_mul(1 << doublings)
        .min(MAX_LOGIN_DELAY)
}

/// A growing delay between login attempts, per client: the form compares a token in
/// constant time, but nothing else kept a script from trying thousands a minute. Every
/// attempt counts until a login succeeds (an attempt being answered counts already, so
/// attempts sent at once are spaced as if sent one after another); a login forgets the
/// address.
#[derive(Debug, Default)]
pub struct LoginThrottle {
    by_client: Mutex<HashMap<ClientKey, Attempts>>,
}

impl LoginThrottle {
    /// Counts an attempt from `client` at `now`: how long it must wait before its token is
    /// checked, or `Err` with how long until it may try again when that wait would pass
    /// [`MAX_LOGIN_DELAY`] (the attempt is then not counted).
    fn admit(&self, client: ClientKey, now: Instant) -> Result<Duration, Duration> {
        let mut by_client = self.by_client.lock().unwrap_or_else(|p| p.into_inner());
        if by_client.len() >= MAX_LOGIN_CLIENTS && !by_client.contains_key(&client) {
            by_client.retain(|_, a| now.saturating_duration_since(a.last) < LOGIN_MEMORY);
        }
        let key = if by_client.len() >= MAX_LOGIN_CLIENTS && !by_client.contains_key(&client) {
            None
        } else {
            client
        };
        let fresh = Attempts {
            count: 0,
            next: now,
            last: now,
        };
        let attempts = by_client.entry(key).or_insert(fresh);
        if now.saturating_duration_since(attempts.last) >= LOGIN_MEMORY {
            *attempts = fresh;
        }
        let start = attempts.next.max(now);
        let wait = start - now;
        if wait > MAX_LOGIN_DELAY {
            return Err(wait);
        }
        attempts.count += 1;
        attempts.next = start + login_delay(attempts.count);
        attempts.last = now;
        Ok(wait)
    }

    /// `client` logged in: its attempts are forgotten.
    fn forget(&self, client: ClientKey) {
        self.by_client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&client);
    }
}

/// 32 bytes from the OS's CSPRNG, in hex: unguessable session ids and CSRF tokens.
fn random_token() -> Result<String, ConsoleError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| ConsoleError::Random(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

/// A `Set-Cookie` value scoped to the console: HttpOnly (no script reads it), SameSite=Strict
/// (no other site's page sends it), Path=/ui. Not `Secure`: the admin server speaks plain HTTP
/// (docs/operations.md, "Operator console", says how to serve it behind TLS).
fn set_cookie(name: &str, value: &str, max_age: Option<Duration>) -> HeaderValue {
    let age = max_age.map_or(String::new(), |a| format!("; Max-Age={}", a.as_secs()));
    let text = format!("{name}={value}; HttpOnly; SameSite=Strict; Path=/ui{age}");
    // Made of hex and fixed ASCII: always a valid header value.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The login page.
#[derive(Template)]
#[template(path = "login.html")]
struct Login<'a> {
    /// The double-submit value, also set as [`LOGIN_COOKIE`].
    nonce: &'a str,
    /// Why the last attempt was refused.
    refused: Option<&'a str>,
}

fn login_page(status: StatusCode, refused: Option<&str>) -> Response {
    let nonce = match random_token() {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let page = render(&Login {
        nonce: &nonce,
        refused,
    });
    let mut response = (status, page).into_response();
    response.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(LOGIN_COOKIE, &nonce, Some(Duration::from_secs(3600))),
    );
    response
}

/// `GET /ui/login`.
pub async fn login_form() -> Response {
    login_page(StatusCode::OK, None)
}

/// The login form's fields.
#[derive(Deserialize)]
pub struct LoginForm {
    #[serde(default)]
    token: String,
    #[serde(default)]
    nonce: String,
}

/// `POST /ui/login`: the token traded for a session cookie, or the form again with why not.
/// The token is taken exactly as typed, as the API takes a bearer token: spaces around it make
/// another token. Each attempt first waits what its address owes ([`LoginThrottle`]).
pub async fn login(
    State(state): State<ConsoleState>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    let nonce_ok = cookie(&headers, LOGIN_COOKIE)
        .is_some_and(|c| !c.is_empty() && bool::from(c.as_bytes().ct_eq(form.nonce.as_bytes())));
    if !nonce_ok {
        return login_page(
            StatusCode::FORBIDDEN,
            Some("The login form expired or came from another page: please try again."),
        );
    }
    let client = client_key(peer.map(|Extension(ConnectInfo(addr))| addr));
    let throttle = &state.console.login_throttle;
    match throttle.admit(client, Instant::now()) {
        Ok(wait) => tokio::time::sleep(wait).await,
        Err(wait) => {
            let refused = format!(
                "Too many login attempts from your address: try again in {} s.",
                wait.as_secs() + 1
            );
            let mut response = login_page(StatusCode::TOO_MANY_REQUESTS, Some(&refused));
            if let Ok(after) = HeaderValue::from_str(&(wait.as_secs() + 1).to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, after);
            }
            return response;
        }
    }
    let Some(actor) = crate::ops::service::token_actor(&state.tokens, &form.token) else {
        return login_page(
            StatusCode::UNAUTHORIZED,
            Some(
                "That token is not accepted: use one of the admin tokens of [admin] tokens. \
                 Each wrong token makes the next attempt from your address wait longer.",
            ),
        );
    };
    throttle.forget(client);
    let id = match state.console.sessions.open(actor) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let mut response = Redirect::to("/ui").into_response();
    let headers = response.headers_mut();
    headers.append(header::SET_COOKIE, set_cookie(SESSION_COOKIE, &id, None));
    headers.append(
        header::SET_COOKIE,
        set_cookie(LOGIN_COOKIE, "", Some(Duration::ZERO)),
    );
    response
}

/// A form that carries only the CSRF token.
#[derive(Deserialize)]
pub struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// `POST /ui/logout`: the session ends and its cookie is cleared.
pub async fn logout(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Response {
    if let Err(e) = session.check_csrf(&form.csrf) {
        return e.into_response();
    }
    if let Some(id) = cookie(&headers, SESSION_COOKIE) {
        state.console.sessions.close(id);
    }
    let mut response = Redirect::to("/ui/login").into_response();
    response.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(SESSION_COOKIE, "", Some(Duration::ZERO)),
    );
    response
}

/// Lets a request through only with a live session, which the handlers then find as an
/// extension: a page asks for the login form instead, a state change is refused.
pub async fn require(
    State(state): State<ConsoleState>,
    mut request: Request,
    next: Next,
) -> Response {
    let session =
        cookie(request.headers(), SESSION_COOKIE).and_then(|id| state.console.sessions.get(id));
    match session {
        Some(session) => {
            request.extensions_mut().insert(session);
            next.run(request).await
        }
        None if request.method() == axum::http::Method::GET => {
            Redirect::to("/ui/login").into_response()
        }
        None => ConsoleError::NoSession.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_is_found_among_others_and_in_any_cookie_header() {
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("a=1; b=2"));
        headers.append(
            header::COOKIE,
            HeaderValue::from_static("x_sendquota_session=no; sendquota_session=abc"),
        );
        assert_eq!(cookie(&headers, SESSION_COOKIE), Some("abc"));
        assert_eq!(cookie(&headers, "b"), Some("2"));
        assert_eq!(cookie(&headers, "missing"), None);
    }

    #[test]
    fn a_session_checks_its_own_csrf_token_only() {
        let sessions = Sessions::default();
        let id = sessions.open("ops".to_owned()).expect("random numbers");
        let session = sessions.get(&id).expect("a live session");
        assert_eq!(session.actor, "ops");
        assert_eq!(session.csrf.len(), 64, "32 random bytes in hex");
        assert!(session.csrf_ok(&session.csrf.clone()));
        assert!(!session.csrf_ok(""));
        assert!(!session.csrf_ok(&session.csrf[..63]));
        let other = sessions.open("ops".to_owned()).expect("random numbers");
        assert_ne!(id, other, "each login gets its own id");
        sessions.close(&id);
        assert!(sessions.get(&id).is_none(), "closed");
        assert!(sessions.get(&other).is_some());
    }

    #[test]
    fn an_expired_session_is_gone() {
        let sessions = Sessions::default();
        let id = sessions.open("ops".to_owned()).expect("random numbers");
        if let Some(s) = sessions.by_id.lock().expect("lock").get_mut(&id) {
            s.expires = Instant::now() - Duration::from_secs(1);
        }
        assert!(sessions.get(&id).is_none());
        assert!(
            sessions.by_id.lock().expect("lock").is_empty(),
            "and forgotten"
        );
    }

    #[test]
    fn login_attempts_wait_longer_each_time_past_the_free_ones_up_to_the_cap() {
        let waits: Vec<u64> = (1..=12)
            .map(|n| login_delay(n).as_millis() as u64)
            .collect();
        assert_eq!(
            waits,
            [0, 0, 125, 250, 500, 1000, 2000, 4000, 8000, 8000, 8000, 8000]
        );
        assert_eq!(login_delay(u32::MAX), MAX_LOGIN_DELAY);
    }

    #[test]
    fn attempts_sent_at_once_are_spaced_and_the_queue_is_bounded() {
        let throttle = LoginThrottle::default();
        let client = client_key(Some(SocketAddr::from(([192, 0, 2, 1], 4000))));
        let now = Instant::now();
        let waits: Vec<Result<u64, u64>> = (0..9)
            .map(|_| {
                throttle
                    .admit(client, now)
                    .map(|w| w.as_millis() as u64)
                    .map_err(|w| w.as_millis() as u64)
            })
            .collect();
        assert_eq!(
            waits,
            [
                Ok(0),
                Ok(0),
                Ok(0),
                Ok(125),
                Ok(375),
                Ok(875),
                Ok(1875),
                Ok(3875),
                Ok(7875)
            ]
        );
        assert_eq!(
            throttle.admit(client, now),
            Err(Duration::from_millis(15875))
        );
        let other = client_key(Some(SocketAddr::from(([192, 0, 2, 2], 4000))));
        assert_eq!(
            throttle.admit(other, now),
            Ok(Duration::ZERO),
            "another client"
        );
        throttle.forget(client);
        assert_eq!(
            throttle.admit(client, now),
            Ok(Duration::ZERO),
            "after a login"
        );
        let later = now + LOGIN_MEMORY;
        assert_eq!(throttle.admit(other, later), Ok(Duration::ZERO));
    }

    #[test]
    fn an_ipv6_host_is_one_client_across_its_slash_64() {
        let a: SocketAddr = "[2001:db8:1:2::1]:1".parse().expect("address");
        let b: SocketAddr = "[2001:db8:1:2:ffff::9]:2".parse().expect("address");
        let c: SocketAddr = "[2001:db8:1:3::1]:1".parse().expect("address");
        let mapped: SocketAddr = "[::ffff:192.0.2.1]:1".parse().expect("address");
        assert_eq!(client_key(Some(a)), client_key(Some(b)));
        assert_ne!(client_key(Some(a)), client_key(Some(c)));
        assert_eq!(
            client_key(Some(mapped)),
            client_key(Some(SocketAddr::from(([192, 0, 2, 1], 9))))
        );
    }

    #[test]
    fn the_table_of_clients_is_capped_and_newcomers_past_it_share_one_entry() {
        let throttle = LoginThrottle::default();
        let now = Instant::now();
        let address = |i: u32| Some(IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i)));
        for i in 0..MAX_LOGIN_CLIENTS as u32 {
            assert_eq!(throttle.admit(address(i), now), Ok(Duration::ZERO));
        }
        let newcomers: Vec<bool> = (0..20)
            .map(|i| {
                throttle.admit(address(MAX_LOGIN_CLIENTS as u32 + i), now) == Ok(Duration::ZERO)
            })
            .collect();
        let len = throttle.by_client.lock().expect("lock").len();
        assert_eq!(len, MAX_LOGIN_CLIENTS + 1, "the cap and the shared entry");
        assert_eq!(
            newcomers.iter().filter(|free| **free).count(),
            FREE_LOGIN_ATTEMPTS as usize,
            "the newcomers are slowed as one client: {newcomers:?}"
        );
        let later = now + LOGIN_MEMORY;
        let newcomer = Some(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 7)));
        assert_eq!(throttle.admit(newcomer, later), Ok(Duration::ZERO));
        assert!(
            throttle.by_client.lock().expect("lock").len() <= 2,
            "forgotten once old"
        );
    }

    #[test]
    fn the_cookie_is_http_only_strict_and_scoped_to_the_console() {
        let value = set_cookie(SESSION_COOKIE, "abc", None);
        assert_eq!(
            value.to_str().expect("ascii"),
            "sendquota_session=abc; HttpOnly; SameSite=Strict; Path=/ui"
        );
    }
}
