//! What a delivery holds beyond its decision: its in-flight claim on the message id (taken,
//! renewed, released), and the refund of everything it took when it will not go out.

use chrono::{DateTime, Utc};

use super::calls::{ScopeCall, ScriptArg};
use super::script::{self, KindSet, Mode, Reply};
use super::{Limiter, LimiterError};
use crate::decide::claim::Claim;
use crate::decide::keys;
use crate::request::message::SendRequest;
use crate::rules::policy::Policy;

impl Limiter {
    /// Gives back everything `message` took under `policy` (every scope, as a cross-scope
    /// refund does) and `claim`'s claim on it, for a message that will not go out after all
    /// (quarantined). Rules it took nothing from are left as they are.
    pub async fn refund(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        claim: &Claim,
    ) -> Result<(), LimiterError> {
        let rules = policy.rules_for(message);
        let zone = message.zone(policy.default_zone);
        let calls = self.scope_calls(&rules, message, now, zone, true, true);
        let mut conn = self.conn.clone();
        for call in &calls {
            let _: redis::Value = call
                .invoke(&mut conn, now, &message.id, Mode::Refund, Some(claim))
                .await?;
        }
        if !calls.first().is_some_and(|c| c.claims) {
            self.claim_op(message, now, claim, Mode::Release).await?;
        }
        self.announce_changed(&message.recipient).await?;
        Ok(())
    }

    /// Extends `claim` on `message` by a lease, at `now` on the worker's clock (the lease itself
    /// runs on Redis's, see [`crate::base::clock`]); false once it is lost (held past its lease and
    /// taken by another delivery), when renewing is pointless. For [`Claim::held_while`].
    pub async fn renew_claim(
        &self,
        message: &SendRequest,
        claim: &Claim,
        now: DateTime<Utc>,
    ) -> bool {
        match self.claim_op(message, now, claim, Mode::Renew).await {
            Ok(Reply::Ran { done: false, .. }) => {
                tracing::warn!(message_id = %message.id,
                    "in-flight claim lost (held past its lease); a copy may be decided");
                false
            }
            Ok(_) => true,
            // Redis away: the next renewal tries again, inside the lease.
            Err(e) => {
                tracing::debug!(error = %e, "in-flight claim not renewed");
                true
            }
        }
    }

    /// Drops `claim` on `message` at `now`, for a delivery given up without a dispatch; errors
    /// are left to the lease.
    pub async fn release_claim(&self, message: &SendRequest, claim: &Claim, now: DateTime<Utc>) {
        if let Err(e) = self.claim_op(message, now, claim, Mode::Release).await {
            tracing::debug!(error = %e, "in-flight claim not released; it expires with its lease");
        }
    }

    /// Runs a claim-only mode of the decision script (`claim`, `renew`, `release`: no rules)
    /// on `message`'s claim for `claim`'s delivery; the script's reply numbers.
    pub(super) async fn claim_op(
        &self,
        message: &SendRequest,
        now: DateTime<Utc>,
        claim: &Claim,
        mode: Mode,
    ) -> redis::RedisResult<Reply> {
        let tag = keys::scope_tag(&crate::rules::policy::ScopeValue::Recipient(
            &message.recipient,
        ));
        let call = ScopeCall {
            rules: Vec::new(),
            keys: vec![
                keys::sent_key(&self.namespace, &tag),
                keys::claim_key(&self.namespace, &tag, &message.id),
            ],
            reads_marks: true,
            claims: true,
            rule_args: vec![ScriptArg::Int(0), ScriptArg::Int(0)],
            script: script::script_for(KindSet::default()),
        };
        call.invoke(&mut self.conn.clone(), now, &message.id, mode, Some(claim))
            .await
    }
}
