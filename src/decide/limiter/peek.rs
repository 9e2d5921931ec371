//! What operators ask of a recipient's quota: its usage, read without consuming (`peek`), and
//! its state cleared (`reset`).

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use super::{Limiter, LimiterError};
use crate::decide::keys;
use crate::decide::outcome::Verdict;
use crate::request::attributes::Attributes;
use crate::request::message::SendRequest;
use crate::request::priority::Priority;
use crate::rules::policy::{Policy, Rule, Scope};

impl Limiter {
    /// Every recipient-scope rule's usage for `recipient` at `now`, consuming nothing: what a
    /// new message (of `channel` and `category`, when given, else any; with `attributes`)
    /// would meet. Rules counting per attributes not given are left out.
    #[allow(clippy::too_many_arguments)]
    pub async fn peek(
        &self,
        policy: &Policy,
        recipient: &str,
        zone: Option<Tz>,
        channel: Option<&str>,
        category: Option<&str>,
        attributes: &Attributes,
        now: DateTime<Utc>,
    ) -> Result<Vec<Verdict>, LimiterError> {
        let probe = SendRequest {
            // Control characters are refused in real ids, so this id was never admitted.
            id: "\u{0}peek".to_owned(),
            recipient: recipient.to_owned(),
            channel: channel.unwrap_or("*").to_owned(),
            category: category.unwrap_or("*").to_owned(),
            timezone: zone,
            cost: 1,
            payload: None,
            attributes: attributes.clone(),
            expires_at: None,
            priority: Priority::default(),
        };
        // The probe's channel and category may be "*": the peeked rules match it whatever
        // their filters, having been chosen by them already.
        let rules = policy
            .rules_that_may_match(Scope::Recipient, channel, category, attributes)
            .into_iter()
            .map(|r| Rule {
                matcher: Default::default(),
                ..r.clone()
            })
            .collect();
        let view = Policy {
            default_zone: policy.default_zone,
            rules,
        };
        Ok(self
            .evaluate(&view, &probe, now, false)
            .await?
            .into_verdicts())
    }

    /// The rules a reset of one recipient clears: every recipient-scope rule but those
    /// counting per attributes, whose keys (one per tuple of values) cannot be named without
    /// the values, nor found by a scan that would cost each reset a walk of the keyspace.
    pub fn reset_rules(policy: &Policy) -> Vec<String> {
        Limiter::reset_scope(policy)
            .map(|r| r.name.clone())
            .collect()
    }

    fn reset_scope(policy: &Policy) -> impl Iterator<Item = &Rule> {
        policy
            .rules
            .iter()
            .filter(|r| r.scope == Scope::Recipient && r.per_attributes.is_empty())
    }

    /// Deletes `recipient`'s state for every rule of [`Limiter::reset_rules`] (both keys of
    /// each rule, in one command: they share the recipient's hash tag). Returns how many keys
    /// existed.
    pub async fn reset(&self, policy: &Policy, recipient: &str) -> Result<i64, LimiterError> {
        let tag = keys::scope_tag(&crate::rules::policy::ScopeValue::Recipient(recipient));
        let mut cmd = redis::cmd("DEL");
        let mut any = false;
        for rule in Limiter::reset_scope(policy) {
            let key = keys::rule_key(&self.namespace, &tag, &rule.name, rule.kind.name());
            cmd.arg(keys::ids_key(&key)).arg(key);
            any = true;
        }
        if !any {
            return Ok(0);
        }
        let removed: i64 = cmd.query_async(&mut self.conn.clone()).await?;
        self.announce_changed(recipient).await?;
        Ok(removed)
    }
}
