//! Deciding a message: the deny cache, then one script call per scope, all or nothing (a
//! refused message gives back what earlier scopes took), then what the decision leaves for
//! the deny cache.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use super::calls::ScopeCall;
use super::script::{Mode, RawResult, Reply};
use super::{Evaluation, Limiter, LimiterError};
use crate::base::failpoint;
use crate::decide::claim::Claim;
use crate::decide::dedup;
use crate::decide::deny_cache::{self, DenyCache};
use crate::decide::keys;
use crate::decide::outcome::Verdict;
use crate::request::message::SendRequest;
use crate::rules::kinds::calendar;
use crate::rules::policy::{Policy, Rule};
use crate::rules::priority::Treatment;

impl Limiter {
    /// Decides `message` at `now` against every rule of `policy` that applies. With `commit`
    /// the quota is consumed when the message may go out, unless the message id was
    /// dispatched before (then nothing is decided: [`Evaluation::Dispatched`]); without it
    /// nothing is written and dispatch marks are not read.
    pub async fn evaluate(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        commit: bool,
    ) -> Result<Evaluation, LimiterError> {
        self.decide(policy, message, now, commit, None).await
    }

    /// Decides and commits `message` as [`Limiter::evaluate`] does, for the delivery holding
    /// `claim`: nothing is decided while another delivery of the same id holds a live claim
    /// ([`Evaluation::InFlight`]), and a message that may go out is claimed for this one, in
    /// the same script call as its recipient-scope decision (a message without recipient-scope
    /// rules is claimed by a call of its own first, and released when it is refused).
    pub async fn evaluate_claimed(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        claim: &Claim,
    ) -> Result<Evaluation, LimiterError> {
        self.decide(policy, message, now, true, Some(claim)).await
    }

    async fn decide(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        commit: bool,
        claim: Option<&Claim>,
    ) -> Result<Evaluation, LimiterError> {
        let rules = policy.rules_for(message);
        let zone = message.zone(policy.default_zone);
        let cache = self
            .cache
            .as_ref()
            .filter(|_| commit && DenyCache::eligible(&rules));
        if let Some(verdicts) = cache.and_then(|c| c.lookup(message, &rules, zone, now)) {
            metrics::counter!(crate::base::telemetry::DENY_CACHE_HITS).increment(1);
            return Ok(Evaluation::Decided {
                verdicts,
                committed: false,
            });
        }
        let remember = cache.map(|c| (c.as_ref(), c.generation()));
        let calls = self.scope_calls(&rules, message, now, zone, commit, claim.is_some());
        let marks_read = calls.first().is_some_and(|c| c.reads_marks);
        // Without a recipient scope to take it with the decision, the claim is taken first.
        let claimed_alone = claim.filter(|_| !marks_read);
        if let Some(early) = self
            .before_scopes(message, now, commit, marks_read, claimed_alone)
            .await?
        {
            return Ok(early);
        }
        let run = match self
            .run_scopes(calls, rules.len(), message, now, zone, commit, claim)
            .await
            // A claim taken on its own is part of the decision already.
            .map_err(|e| match claimed_alone {
                Some(_) => e.after_decision(),
                None => e,
            })? {
            Scopes::Ran(run) => run,
            Scopes::Stopped(early) => return Ok(early),
        };
        let claims = (claim, claimed_alone);
        let committed = self
            .settle(
                policy, message, now, zone, &rules, &run, commit, claims, remember,
            )
            .await
            .map_err(LimiterError::after_decision)?;
        Ok(Evaluation::Decided {
            verdicts: run.verdicts,
            committed,
        })
    }

    /// What follows the scripts' decision: a refused message gives back what it took (its
    /// scopes' quota, and `claims`' second, a claim taken on its own) and is remembered by the
    /// deny cache (`remember`: the cache and its generation before the scripts ran); an
    /// admission some cached denial did not foresee is announced. Whether the message was
    /// admitted.
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        zone: Tz,
        rules: &[&Rule],
        run: &ScopesRun<'_>,
        commit: bool,
        (claim, claimed_alone): (Option<&Claim>, Option<&Claim>),
        remember: Option<(&DenyCache, u64)>,
    ) -> Result<bool, LimiterError> {
        if run.blocked && failpoint::fails_after_decision(self.failpoint, &message.recipient) {
            let gone = redis::RedisError::from(failpoint::gone("fail-after-decision"));
            return Err(LimiterError::Redis(gone));
        }
        if run.blocked {
            self.give_back(&run.taken, message, now, claim, claimed_alone)
                .await?;
        }
        let admitted = commit && !run.blocked;
        if admitted && self.admission_changes_full_recipients(policy, &run.verdicts) {
            self.announce_changed(&message.recipient).await?;
        }
        if let (Some((cache, generation)), true) = (remember, run.blocked) {
            self.remember_denial(cache, message, zone, now, rules, &run.verdicts, generation)
                .await?;
        }
        Ok(admitted)
    }

    /// What is settled before any rule is read: a claim taken on its own (no recipient scope
    /// takes it with the decision) may find the message dispatched or in flight; without
    /// claims, a committing decision whose scripts cannot read the marks reads its mark first.
    async fn before_scopes(
        &self,
        message: &SendRequest,
        now: DateTime<Utc>,
        commit: bool,
        marks_read: bool,
        claimed_alone: Option<&Claim>,
    ) -> Result<Option<Evaluation>, LimiterError> {
        if let Some(claim) = claimed_alone {
            let reply = self.claim_op(message, now, claim, Mode::Claim).await?;
            return Ok(ran(reply).err());
        }
        if commit
            && !marks_read
            && dedup::is_marked(&self.conn, &self.namespace, message, now).await?
        {
            return Ok(Some(Evaluation::Dispatched));
        }
        Ok(None)
    }

    /// Runs each scope's script in turn, committing while no enforcing rule has refused and
    /// checking only after one has; stops early when the first (recipient) scope finds the
    /// message dispatched or in flight.
    #[allow(clippy::too_many_arguments)]
    async fn run_scopes<'r>(
        &self,
        calls: Vec<ScopeCall<'r>>,
        rule_count: usize,
        message: &SendRequest,
        now: DateTime<Utc>,
        zone: Tz,
        commit: bool,
        claim: Option<&Claim>,
    ) -> Result<Scopes<'r>, LimiterError> {
        let mut verdicts: Vec<Option<Verdict>> = vec![None; rule_count];
        let mut taken = Vec::new();
        let mut blocked = false;
        let mut replied = false;
        let mut conn = self.conn.clone();
        for call in calls {
            let mode = if commit && !blocked {
                Mode::Commit
            } else {
                Mode::Check
            };
            let reply: Reply = call
                .invoke(&mut conn, now, &message.id, mode, claim)
                .await
                .map_err(|e| match replied {
                    // An earlier scope decided (and may have taken) its part.
                    true => LimiterError::AfterDecision(e),
                    false => LimiterError::Redis(e),
                })?;
            replied = true;
            // Only the first call (the recipient scope) reads the marks and the claims: when
            // it stops the decision, nothing was taken yet.
            let (committed, results) = match ran(reply) {
                Ok(ran) => ran,
                Err(stopped) => return Ok(Scopes::Stopped(stopped)),
            };
            for (&(index, rule), raw) in call.rules.iter().zip(&results) {
                verdicts[index] = Some(verdict(rule, raw, now, zone, message));
            }
            if mode == Mode::Commit && committed {
                taken.push(call);
            } else {
                blocked = true;
            }
        }
        Ok(Scopes::Ran(ScopesRun {
            verdicts: verdicts.into_iter().flatten().collect(),
            taken,
            blocked,
        }))
    }

    /// Gives back what the scopes in `taken` took for a message another scope refused, and a
    /// claim taken on its own.
    async fn give_back(
        &self,
        taken: &[ScopeCall<'_>],
        message: &SendRequest,
        now: DateTime<Utc>,
        claim: Option<&Claim>,
        claimed_alone: Option<&Claim>,
    ) -> Result<(), LimiterError> {
        let mut conn = self.conn.clone();
        for call in taken {
            let _: redis::Value = call
                .invoke(&mut conn, now, &message.id, Mode::Refund, claim)
                .await?;
        }
        if !taken.is_empty() {
            self.announce_changed(&message.recipient).await?;
        }
        if let Some(claim) = claimed_alone {
            self.claim_op(message, now, claim, Mode::Release).await?;
        }
        Ok(())
    }

    /// Whether an admission with `verdicts` can change a recipient some worker caches as full:
    /// an id admitted before by some rules only (their windows differ) is admitted again and
    /// commits the others; and with filtered recipient rules, a message matching other rules
    /// is admitted (see `DenyCache::admission_invalidates`).
    fn admission_changes_full_recipients(&self, policy: &Policy, verdicts: &[Verdict]) -> bool {
        verdicts.iter().any(|v| !v.already)
            && (verdicts.iter().any(|v| v.already)
                || (self.cache.is_some() && DenyCache::admission_invalidates(policy)))
    }

    /// Caches a denial of an eligible policy: valid until the first refusing rule would allow
    /// or the local day ends, for every id not already admitted.
    #[allow(clippy::too_many_arguments)]
    async fn remember_denial(
        &self,
        cache: &DenyCache,
        message: &SendRequest,
        zone: Tz,
        now: DateTime<Utc>,
        rules: &[&Rule],
        verdicts: &[Verdict],
        generation: u64,
    ) -> Result<(), LimiterError> {
        if verdicts.iter().any(|v| v.already) {
            return Ok(());
        }
        let Some(frozen) = deny_cache::frozen_until(verdicts).filter(|&f| f > now) else {
            return Ok(());
        };
        let tomorrow = calendar::day_start(calendar::day_number(now, zone) + 1, zone);
        let until = frozen.min(tomorrow);
        let tag = keys::scope_tag(&crate::rules::policy::ScopeValue::Recipient(
            &message.recipient,
        ));
        // One round trip: each rule's entries, then the recipient's dispatch marks. A
        // redelivery of a dispatched message is a duplicate, not a denial, even once its entry
        // has left the quota's window (marks outlive it): never answered from the cache.
        // Every rule is a calendar quota (`DenyCache::eligible`), whose key holds its ids.
        let mut read = redis::pipe();
        for rule in rules {
            read.zrange(
                keys::rule_key(&self.namespace, &tag, &rule.name, rule.kind.name()),
                0,
                -1,
            );
        }
        read.zrange(keys::sent_key(&self.namespace, &tag), 0, -1);
        let replies: Vec<Vec<String>> = read.query_async(&mut self.conn.clone()).await?;
        let admitted: HashSet<String> = replies.into_iter().flatten().collect();
        cache.fill(
            message,
            rules,
            zone,
            now,
            until,
            admitted,
            verdicts.to_vec(),
            generation,
        );
        Ok(())
    }
}

/// How running the scopes' scripts ended.
enum Scopes<'r> {
    /// Every scope ran.
    Ran(ScopesRun<'r>),
    /// The message was dispatched before, or another delivery holds it: nothing decided.
    Stopped(Evaluation),
}

/// Every scope's verdicts, the scopes that took the message, and whether one refused.
struct ScopesRun<'r> {
    verdicts: Vec<Verdict>,
    taken: Vec<ScopeCall<'r>>,
    blocked: bool,
}

/// A script reply that went on to the rules: whether it was done (committed) and each rule's
/// result; or, for one that stopped first, what the evaluation came to (the message was
/// dispatched before, or another delivery holds it).
fn ran(reply: Reply) -> Result<(bool, Vec<RawResult>), Evaluation> {
    match reply {
        Reply::Ran { done, results } => Ok((done, results)),
        Reply::Dispatched => Err(Evaluation::Dispatched),
        Reply::InFlight { wait_ms } => Err(Evaluation::InFlight { wait_ms }),
    }
}

fn verdict(
    rule: &Rule,
    raw: &RawResult,
    now: DateTime<Utc>,
    zone: Tz,
    message: &SendRequest,
) -> Verdict {
    let treatment: Treatment = rule.priority.treatment(message.priority, now, zone);
    let mut retry_after = None;
    let mut reason = String::new();
    if !raw.allowed {
        retry_after = treatment.retry_after(&rule.kind, raw.retry, raw.detail, now, zone);
        reason = rule.kind.reason(raw.detail, message.cost);
        if let (Some(kept), Some(r)) = (treatment.kept(), &rule.priority.reserve) {
            if kept.lapse.is_some() {
                reason = format!(
                    "{reason}; the last {} kept for {} and above until {} local time",
                    kept.slots,
                    r.for_at_least.as_str(),
                    r.until.format("%H:%M")
                );
            }
        }
    }
    Verdict {
        rule: rule.name.clone(),
        kind: rule.kind.name(),
        on_deny: rule.on_deny,
        exempt: treatment.exempt_counted(),
        reserved_until: treatment.reserved_until(),
        allowed: raw.allowed,
        already: raw.already,
        remaining: rule.kind.remaining(raw.remaining),
        retry_after,
        reason,
    }
}
