//! What operators ask of the running system, once, beneath its three faces: the admin API
//! (`admin`), the console (`console`) and the command line (`cli`) only parse input and render
//! output, and call these.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use crate::base::clock::{in_range, parse_instant_or_age, Clock};
use crate::base::config::AdminToken;
use crate::base::health::Health;
use crate::decide::deadline::Receipt;
use crate::decide::decision;
use crate::decide::limiter::{Limiter, LimiterError};
use crate::decide::outcome::Verdict;
use crate::record::denials::{DenialFilter, DenialStore, Reads};
use crate::request::message::SendRequest;
use crate::rules::policy::Policy;
use crate::rules::reload::Reloader;

/// What the operator actions share: the running rules and their reloads, the quota state, the
/// denial history and audit, the clock, the consumer's state and the accepted tokens. The
/// admin API's and the console's state each hold one.
#[derive(Clone)]
pub struct Ops {
    /// The running rules (each request takes one snapshot) and their reloads.
    pub reloader: Arc<Reloader>,
    /// Quota state.
    pub limiter: Limiter,
    /// The denial history and audit, on the primary: what operators write (resets, replays
    /// of quarantined messages) and readiness.
    pub denials: DenialStore,
    /// Where operators' reads go (the read replica of `database.read_url`, or the primary):
    /// the denial listings, the console's counts.
    pub reads: Reads,
    /// The worker's clock.
    pub clock: Arc<dyn Clock>,
    /// The consumer's state.
    pub health: Arc<Health>,
    /// Accepted bearer tokens (and console logins).
    pub tokens: Arc<Vec<AdminToken>>,
}

/// What `check` and `POST /v1/check` print for `message` decided at `now` (committed with
/// `commit`), as the worker would decide a message it receives at `now`, through the same
/// [`decision::before_rules`] and [`decision::decide`]: one already past its deadline is not
/// evaluated (nothing is read or taken; outcome `expired`). The report carries the message's
/// `deadline` when it has one, what Redis being unavailable would do to it when a rule sets
/// `on_unavailable`, and the rules that do not apply to it and why (see
/// [`decision::explain_unmatched`]).
pub async fn check(
    limiter: &Limiter,
    policy: &Policy,
    message: &SendRequest,
    now: DateTime<Utc>,
    commit: bool,
) -> Result<serde_json::Value, LimiterError> {
    let receipt = Receipt::new(now);
    let (report, deadline) = match decision::before_rules(message, &receipt, now) {
        Some(expired) => (decision::report(&[], &expired.outcome), expired.deadline),
        None => {
            let evaluation = limiter.evaluate(policy, message, now, commit).await?;
            let verdicts = evaluation.verdicts();
            let decided = decision::decide(policy, message, &receipt, verdicts);
            let report = if evaluation.dispatched() {
                decision::duplicate_report()
            } else {
                decision::report(verdicts, &decided.outcome)
            };
            (report, decided.deadline)
        }
    };
    let report = decision::explain_deadline(report, deadline);
    let report = decision::explain_unavailable(report, policy, message);
    Ok(decision::explain_unmatched(report, policy, message))
}

/// The name of the token `presented` is, if it is one of `tokens`: the `/v1` bearer check and
/// the console's login. Compared against every token in constant time, without stopping at a
/// match, so the time taken says nothing about which token came close.
pub fn token_actor(tokens: &[AdminToken], presented: &str) -> Option<String> {
    let mut actor = None;
    for t in tokens {
        if bool::from(t.token.as_bytes().ct_eq(presented.as_bytes())) {
            actor = Some(t.name.clone());
        }
    }
    actor
}

/// Query of `GET /v1/denials`; the console's denial filters come to the same.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenialQuery {
    /// Only this recipient.
    pub recipient: Option<String>,
    /// Only this rule.
    pub rule: Option<String>,
    /// Only this channel.
    pub channel: Option<String>,
    /// Only this category.
    pub category: Option<String>,
    /// Denied at or after: RFC3339 or an age (`7d`).
    pub since: Option<String>,
    /// Denied before: RFC3339 or an age.
    pub until: Option<String>,
    /// Only shadow (true) or only real (false) rows.
    pub shadow: Option<bool>,
    /// Only unchecked dispatches (true) or only the other rows (false).
    pub unchecked: Option<bool>,
    /// Only replayed (true) or unreplayed (false) rows.
    pub replayed: Option<bool>,
    /// The previous page's last id.
    pub after: Option<i64>,
    /// Page size (default 100).
    pub limit: Option<i64>,
}

impl DenialQuery {
    /// The filter this query asks for, ages counted back from `now`; an error for people when
    /// an instant or the limit is out of range.
    pub fn filter(self, now: DateTime<Utc>) -> Result<DenialFilter, String> {
        let instant = |s: Option<String>| s.map(|s| parse_instant_or_age(&s, now)).transpose();
        let (since, until) = match (instant(self.since), instant(self.until)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        let limit = self.limit.unwrap_or(100);
        if !(1..=crate::record::denials::MAX_LIMIT).contains(&limit) {
            return Err(format!(
                "limit must be 1 to {}",
                crate::record::denials::MAX_LIMIT
            ));
        }
        Ok(DenialFilter {
            recipient: self.recipient,
            rule: self.rule,
            channel: self.channel,
            category: self.category,
            since,
            until,
            shadow: self.shadow,
            unchecked: self.unchecked,
            replayed: self.replayed,
            due_at: None,
            live_at: None,
            after: self.after,
            limit,
        })
    }
}

/// The cursor of the page after `rows` (a page of `limit` rows, newest first), if there may be
/// one: keyset pagination goes on below the last id.
pub fn next_after(rows: &[crate::record::denials::Denial], limit: i64) -> Option<i64> {
    (rows.len() as i64 == limit)
        .then(|| rows.last().map(|d| d.id))
        .flatten()
}

/// The instant a route decides at: `?at=` when it is in the supported range (400 otherwise),
/// else the worker's clock.
pub fn decision_instant(at: Option<DateTime<Utc>>, state: &Ops) -> Result<DateTime<Utc>, String> {
    match at.map(in_range).transpose() {
        Ok(at) => Ok(at.unwrap_or_else(|| state.clock.now())),
        Err(e) => Err(format!("at: {e}")),
    }
}

/// Query of `GET /v1/recipients/{id}/quota`; the console's recipient page asks the same.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeekQuery {
    /// The recipient's zone, for rules counting in local time.
    pub timezone: Option<String>,
    /// A message's channel; any without it.
    pub channel: Option<String>,
    /// A message's category; any without it.
    pub category: Option<String>,
    /// The request's `attributes` as JSON text: rules counting per them are shown.
    pub attributes: Option<String>,
    /// Peek at this instant instead of now.
    pub at: Option<DateTime<Utc>>,
}

/// Why a quota peek failed: the query's fault (an answer of 400 in the API), or Redis's.
#[derive(Debug, thiserror::Error)]
pub enum PeekError {
    /// The query named an unknown zone, an instant out of range or unreadable attributes.
    #[error("{0}")]
    Query(String),
    /// Redis failed the peek.
    #[error("{0}")]
    Unavailable(#[from] crate::decide::limiter::LimiterError),
}

/// Every recipient-scope rule's usage for `recipient` as `query` asks, at the instant it
/// names or now: the quota peek of the API and the console.
pub async fn peek(
    state: &Ops,
    recipient: &str,
    query: PeekQuery,
) -> Result<(DateTime<Utc>, Vec<Verdict>), PeekError> {
    let bad = PeekError::Query;
    let zone = match query.timezone.as_deref().map(str::parse::<Tz>).transpose() {
        Ok(z) => z,
        Err(_) => return Err(bad("unknown time zone".to_owned())),
    };
    let at = decision_instant(query.at, state).map_err(bad)?;
    let attributes = match query
        .attributes
        .as_deref()
        .map(crate::request::message::decode_attributes)
        .transpose()
    {
        Ok(a) => a.unwrap_or_default(),
        Err(e) => return Err(bad(e.to_string())),
    };
    let rules = state.reloader.rules().current();
    let peeked = state.limiter.peek(
        &rules.policy,
        recipient,
        zone,
        query.channel.as_deref(),
        query.category.as_deref(),
        &attributes,
        at,
    );
    Ok((at, peeked.await?))
}

/// A quota reset that happened, as [`reset_recipient`] reports it.
#[derive(Debug, Clone)]
pub struct Reset {
    /// The rules whose state for the recipient was removed.
    pub rules: Vec<String>,
    /// How many Redis keys existed.
    pub keys_removed: i64,
    /// When (the worker's clock).
    pub reset_at: DateTime<Utc>,
}

/// Why a quota reset failed; each says what became of the quota.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// The audit row could not be written, so nothing was reset.
    #[error("nothing was reset: the audit row could not be written: {0}")]
    NotAudited(crate::record::denials::DenialError),
    /// Redis failed the reset (the audit row says `failed`, or stays `pending`).
    #[error("{0}")]
    Redis(crate::decide::limiter::LimiterError),
    /// The quota was reset but its audit row could not be marked done.
    #[error("the quota was reset, but its audit row {audit} stays pending: {error}")]
    AuditPending {
        /// The audit row's id.
        audit: i64,
        /// Why it could not be marked.
        error: crate::record::denials::DenialError,
    },
}

/// Resets `recipient` in every recipient-scope rule for `actor` (a token's name), audited in
/// `quota_resets`: the row is written first (`pending`), so a reset that cannot be audited
/// does not happen, then marked `done` or `failed`. The API's `DELETE` and the console's reset.
pub async fn reset_recipient(
    state: &Ops,
    actor: &str,
    recipient: &str,
) -> Result<Reset, ResetError> {
    let running = state.reloader.rules().current();
    let rules = Limiter::reset_rules(&running.policy);
    let at = state.clock.now();
    let audit = state
        .denials
        .begin_reset(recipient, actor, &rules, at)
        .await
        .map_err(ResetError::NotAudited)?;
    let removed = match state.limiter.reset(&running.policy, recipient).await {
        Ok(removed) => removed,
        Err(e) => {
            // Best effort: a row left pending says the same, that the outcome is unknown.
            let _ = state.denials.finish_reset(audit, None).await;
            return Err(ResetError::Redis(e));
        }
    };
    if let Err(error) = state.denials.finish_reset(audit, Some(removed)).await {
        return Err(ResetError::AuditPending { audit, error });
    }
    Ok(Reset {
        rules,
        keys_removed: removed,
        reset_at: at,
    })
}
