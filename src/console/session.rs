//! Console sessions: logging in with an admin token, the session cookie, CSRF tokens, logging
//! out.
//!
//! A token is typed once, into the login form (a POST body: never in a URL, never logged), and
//! traded for a session: a random id in an HttpOnly, SameSite=Strict cookie scoped to `/ui`,
//! kept in memory with the token's name (what audit rows record) and a CSRF token of its own.
//! Every state change is a POST carrying that CSRF token in a hidden field, compared in
//! constant time; a missing or wrong one is refused with 403. Sessions live in one worker's
//! memory and end with it, or after [`SESSION_TTL`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use askama::Template;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::{render, ConsoleError};
use crate::admin::AdminState;

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
pub async fn login(
    State(state): State<AdminState>,
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
    let Some(actor) = crate::admin::token_actor(&state.tokens, form.token.trim()) else {
        return login_page(
            StatusCode::UNAUTHORIZED,
            Some("That token is not accepted: use one of the admin tokens of [admin] tokens."),
        );
    };
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
    State(state): State<AdminState>,
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
    State(state): State<AdminState>,
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
    fn the_cookie_is_http_only_strict_and_scoped_to_the_console() {
        let value = set_cookie(SESSION_COOKIE, "abc", None);
        assert_eq!(
            value.to_str().expect("ascii"),
            "sendquota_session=abc; HttpOnly; SameSite=Strict; Path=/ui"
        );
    }
}
