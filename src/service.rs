//! What operators ask of the running system, once, beneath its three faces: the admin API
//! (`admin`), the console (`console`) and the command line (`cli`) only parse input and render
//! output, and call these.

use chrono::{DateTime, Utc};

use crate::deadline::Receipt;
use crate::decision;
use crate::limiter::{Limiter, LimiterError};
use crate::message::SendRequest;
use crate::policy::Policy;

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
