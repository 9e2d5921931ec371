//! The quarantine queue: what is held and why, and a replay of one message or of all of them
//! after a confirmation step, each replay recorded in `quarantine_replays` under the session's
//! token name (the same code as `sendquota quarantine list|replay`).

use askama::Template;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Form};
use serde::Deserialize;

use super::ConsoleState;
use super::{render, ConsoleError, Layout, Params, Session, BROKER_ROLE};
use crate::ops::quarantine::{self, Quarantined, Which};

/// Messages listed: the page shows the oldest; a queue holding more says so.
const LISTED: usize = 100;

/// Most messages one "replay all" takes, as the CLI's default.
const REPLAY_ALL_LIMIT: usize = 1000;

/// The quarantine page.
#[derive(Template)]
#[template(path = "quarantine.html")]
struct Page {
    layout: Layout,
    held: Vec<Quarantined>,
    more: bool,
}

/// `GET /ui/quarantine`.
pub async fn page(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
) -> Response {
    let console = &state.console;
    let listed =
        quarantine::list_held(&console.amqp, &console.names, BROKER_ROLE, LISTED + 1).await;
    let mut held = match listed {
        Ok(held) => held,
        Err(e) => return ConsoleError::Service(e.to_string()).into_response(),
    };
    let more = held.len() > LISTED;
    held.truncate(LISTED);
    render(&Page {
        layout: Layout::new(&session, "Quarantine", "quarantine"),
        held,
        more,
    })
}

/// Which replay a confirmation or a form asks for: `message_id` for one, `all` for all.
#[derive(Debug, Default, Deserialize)]
pub struct ReplayForm {
    #[serde(default)]
    message_id: String,
    #[serde(default)]
    all: String,
    #[serde(default)]
    csrf: String,
}

impl ReplayForm {
    fn which(&self) -> Result<Which, ConsoleError> {
        // The id as given, spaces and all: the queue's `message_id` is compared exactly.
        match (self.all.as_str(), self.message_id.as_str()) {
            ("1", "") => Ok(Which::All {
                limit: REPLAY_ALL_LIMIT,
            }),
            ("", id) if !id.is_empty() => Ok(Which::One {
                message_id: id.to_owned(),
            }),
            _ => Err(ConsoleError::Input(
                "replay which? one message_id, or all=1".to_owned(),
            )),
        }
    }
}

/// The confirmation page of a replay.
#[derive(Template)]
#[template(path = "confirm_replay.html")]
struct Confirm {
    layout: Layout,
    /// The message id, or empty for all.
    message_id: String,
    limit: usize,
}

/// `GET /ui/quarantine/replay?message_id=` or `?all=1`.
pub async fn confirm_replay(
    Extension(session): Extension<Session>,
    Params(form): Params<ReplayForm>,
) -> Response {
    let message_id = match form.which() {
        Ok(Which::One { message_id }) => message_id,
        Ok(Which::All { .. }) => String::new(),
        Err(e) => return e.into_response(),
    };
    render(&Confirm {
        layout: Layout::new(&session, "Replay from quarantine", "quarantine"),
        message_id,
        limit: REPLAY_ALL_LIMIT,
    })
}

/// What a replay did.
#[derive(Template)]
#[template(path = "replay_done.html")]
struct Done {
    layout: Layout,
    replayed: usize,
    message_id: String,
}

/// `POST /ui/quarantine/replay`: publishes the message(s) back to the requests exchange.
pub async fn replay(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
    Form(form): Form<ReplayForm>,
) -> Response {
    if let Err(e) = session.check_csrf(&form.csrf) {
        return e.into_response();
    }
    let which = match form.which() {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let console = &state.console;
    let replayed = quarantine::replay_held(
        &console.amqp,
        &console.names,
        &state.denials,
        &which,
        &session.actor,
        BROKER_ROLE,
    )
    .await;
    match replayed {
        Ok(replayed) => render(&Done {
            layout: Layout::new(&session, "Replayed", "quarantine"),
            replayed,
            message_id: match which {
                Which::One { message_id } => message_id,
                Which::All { .. } => String::new(),
            },
        }),
        Err(e) => ConsoleError::Service(e.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_id_is_replayed_exactly_as_given() {
        let form = ReplayForm {
            message_id: " m1 ".to_owned(),
            ..ReplayForm::default()
        };
        assert_eq!(
            form.which().expect("one message"),
            Which::One {
                message_id: " m1 ".to_owned()
            }
        );
        assert!(ReplayForm::default().which().is_err(), "which one?");
    }
}
