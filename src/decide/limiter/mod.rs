//! Checking and consuming quota in Redis.
//!
//! The rules that apply to a message are grouped by scope. Each scope is one script call that
//! checks every rule of the scope and then commits all of them or none. Scopes are called one
//! after another; if a later scope refuses, what earlier scopes took for this message id is
//! refunded, so a message that is not dispatched leaves no quota consumed.

pub mod script;

use std::collections::HashSet;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use crate::base::failpoint::{self, Failpoint};
use crate::base::store::RedisConn;
use crate::decide::claim::Claim;
use crate::decide::dedup;
use crate::decide::deny_cache::{self, DenyCache};
use crate::decide::keys;
use crate::decide::outcome::Verdict;
use crate::request::attributes::Attributes;
use crate::request::message::SendRequest;
use crate::request::priority::Priority;
use crate::rules::kinds::calendar;
use crate::rules::policy::{OnDeny, Policy, Rule, Scope};
use crate::rules::priority::Treatment;
use script::{KindSet, Mode, RawResult, Reply};

/// Failures talking to Redis. Any of them means "decide this message again later".
#[derive(Debug, thiserror::Error)]
pub enum LimiterError {
    /// Redis was unreachable, timed out, or the script failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis failed after a script had decided the message or taken its claim (a later
    /// scope's call, the refunds of a refused message, the deny cache): Redis holds part of a
    /// decision, so the message is decided there again, never let out unchecked.
    #[error("redis, after the message was decided: {0}")]
    AfterDecision(redis::RedisError),
}

impl LimiterError {
    /// This failure, raised once part of the message's decision was made in Redis.
    fn after_decision(self) -> LimiterError {
        match self {
            LimiterError::Redis(e) => LimiterError::AfterDecision(e),
            after => after,
        }
    }

    /// Whether Redis is away rather than failing this call: unreachable, the connection
    /// refused, dropped or timed out (all I/O errors), no node to serve the slot, or a server
    /// that cannot take the call now (loading its data, cluster down, master down, a
    /// failover's TRYAGAIN, a demoted replica's READONLY). A rule with `on_unavailable =
    /// "allow"` lets a message out unchecked only then; a script error, a reply the worker
    /// cannot read, or a refusal of the call itself (permissions, configuration) are not
    /// unavailability and keep their retries and quarantine; nor is Redis going away once
    /// part of the decision was made ([`LimiterError::AfterDecision`]).
    pub fn is_unavailable(&self) -> bool {
        use redis::{ErrorKind, ServerErrorKind};
        let LimiterError::Redis(e) = self else {
            return false;
        };
        matches!(
            e.kind(),
            ErrorKind::Io
                | ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ReadOnly
                )
        )
    }
}

/// What deciding a message in Redis came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Evaluation {
    /// Every applicable rule was checked.
    Decided {
        /// Verdicts in policy order.
        verdicts: Vec<Verdict>,
        /// True when every scope committed (the message may be dispatched); always false for
        /// a dry run.
        committed: bool,
    },
    /// The message id holds an unexpired dispatch mark (see [`crate::decide::dedup`]): it went out
    /// before, and nothing was decided. Only a committing evaluation looks.
    Dispatched,
    /// Another delivery of the message id holds its in-flight claim (see [`crate::decide::claim`]):
    /// nothing was decided. Only a claimed evaluation looks.
    InFlight {
        /// How much longer that claim runs, in ms.
        wait_ms: i64,
    },
}

/// Runs policy rules against Redis state.
#[derive(Clone)]
pub struct Limiter {
    conn: RedisConn,
    namespace: String,
    cache: Option<Arc<DenyCache>>,
    /// A deliberate fault for tests; `None` in production.
    failpoint: Option<Failpoint>,
}

/// A scope's rules with the keys and arguments of its script call.
struct ScopeCall<'r> {
    rules: Vec<(usize, &'r Rule)>,
    /// Two per rule, then the recipient's dispatch marks when `reads_marks`, then the
    /// recipient's claims when `claims`.
    keys: Vec<String>,
    /// Whether the script first looks the message id up in the recipient's dispatch marks.
    reads_marks: bool,
    /// Whether the script takes the message id's in-flight claim with the decision.
    claims: bool,
    /// ARGV after NOW_MS, MESSAGE_ID and MODE (see lua/decide.lua): COST, RULE_COUNT, rules.
    rule_args: Vec<ScriptArg>,
    /// The script carrying the kinds of these rules.
    script: &'static redis::Script,
}

/// One script argument after the keys: every one is a kind's name or a number, so none is
/// formatted into a string of its own before it is written into the command.
#[derive(Debug, Clone, Copy)]
enum ScriptArg {
    Text(&'static str),
    Int(i64),
}

impl ScopeCall<'_> {
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        now: DateTime<Utc>,
        message_id: &str,
        mode: Mode,
        claim: Option<&Claim>,
    ) -> redis::RedisResult<T> {
        let claim = claim.filter(|_| self.claims);
        let bytes = self.keys.iter().map(String::len).sum::<usize>()
            + message_id.len()
            + claim.map_or(0, |c| c.token().len());
        let mut cmd = script::evalsha(
            self.script,
            self.keys.len(),
            3 + self.rule_args.len() + if claim.is_some() { 2 } else { 0 },
            bytes,
        );
        for key in &self.keys {
            cmd.arg(key.as_str());
        }
        cmd.arg(now.timestamp_millis())
            .arg(message_id)
            .arg(mode.arg());
        for arg in &self.rule_args {
            match *arg {
                ScriptArg::Text(text) => cmd.arg(text),
                ScriptArg::Int(n) => cmd.arg(n),
            };
        }
        if let Some(claim) = claim {
            cmd.arg(claim.token()).arg(claim.lease_ms());
        }
        script::call(self.script, &cmd, conn).await
    }
}

impl Limiter {
    /// A limiter keeping its keys under `namespace`.
    pub fn new(conn: RedisConn, namespace: impl Into<String>) -> Limiter {
        Limiter {
            conn,
            namespace: namespace.into(),
            cache: None,
            failpoint: None,
        }
    }

    /// This limiter with the fault `failpoint` armed (crash tests only).
    pub fn with_failpoint(mut self, failpoint: Option<Failpoint>) -> Limiter {
        self.failpoint = failpoint;
        self
    }

    /// This limiter, answering repeat denials of full recipients from `cache`.
    pub fn with_deny_cache(mut self, cache: Arc<DenyCache>) -> Limiter {
        self.cache = Some(cache);
        self
    }

    /// Tells every worker's deny cache that `recipient`'s state changed in a way a cached
    /// denial did not foresee (quota freed, or a partial re-admission).
    async fn announce_changed(&self, recipient: &str) -> Result<(), LimiterError> {
        if let Some(cache) = &self.cache {
            cache.invalidate(recipient);
        }
        deny_cache::announce(&self.conn, &self.namespace, recipient).await?;
        Ok(())
    }

    /// The connection, for callers that share it (sent marks, health checks).
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The deny cache, if the limiter has one: a rule reload turns it off while the replaced
    /// rules may still be deciding.
    pub fn deny_cache(&self) -> Option<&Arc<DenyCache>> {
        self.cache.as_ref()
    }

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
        let generation = cache.map(|c| c.generation());
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
        // What follows the scripts' decision: a refused message gives back what it took and
        // is remembered by the deny cache; an admission some cached denial did not foresee is
        // announced.
        let settled = async {
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
            if let (Some(cache), Some(generation), true) = (cache, generation, run.blocked) {
                self.remember_denial(cache, message, zone, now, &rules, &run.verdicts, generation)
                    .await?;
            }
            Ok(admitted)
        };
        let committed = settled.await.map_err(LimiterError::after_decision)?;
        Ok(Evaluation::Decided {
            verdicts: run.verdicts,
            committed,
        })
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
    async fn claim_op(
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
                keys::claims_key(&self.namespace, &tag),
            ],
            reads_marks: true,
            claims: true,
            rule_args: vec![ScriptArg::Int(0), ScriptArg::Int(0)],
            script: script::script_for(KindSet::default()),
        };
        call.invoke(&mut self.conn.clone(), now, &message.id, mode, Some(claim))
            .await
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

    /// Groups rules by scope (recipient first: it refuses most often, so later scopes are
    /// rarely committed and refunded) and builds each scope's script arguments. With `marks`,
    /// the recipient scope's call also reads the recipient's dispatch marks.
    fn scope_calls<'r>(
        &self,
        rules: &[&'r Rule],
        message: &SendRequest,
        now: DateTime<Utc>,
        zone: Tz,
        marks: bool,
        claims: bool,
    ) -> Vec<ScopeCall<'r>> {
        // A message has rules of one or two hash tags: searching a vector that short costs
        // less than building a map, which allocates a node for every message.
        let mut by_tag: Vec<(TagGroup<'r>, Vec<(usize, &'r Rule)>)> = Vec::with_capacity(2);
        for (index, rule) in rules.iter().enumerate() {
            let group = TagGroup::of(rule);
            match by_tag.iter_mut().find(|(g, _)| *g == group) {
                Some((_, rules)) => rules.push((index, rule)),
                None => by_tag.push((group, vec![(index, rule)])),
            }
        }
        by_tag.sort_unstable_by_key(|(group, _)| *group);
        by_tag
            .into_iter()
            .map(|(TagGroup(scope, per_attributes), rules)| {
                let tag = match rules.first() {
                    Some((_, rule)) if !per_attributes.is_empty() => {
                        keys::attributes_tag(rule.attribute_values(message))
                    }
                    _ => keys::scope_tag(&scope.of(message)),
                };
                // Two per rule, then the marks and claims keys.
                let mut rule_keys = Vec::with_capacity(2 * rules.len() + 2);
                let mut rule_args = Vec::with_capacity(2 + 8 * rules.len());
                rule_args.push(ScriptArg::Int(i64::from(message.cost)));
                rule_args.push(ScriptArg::Int(rules.len() as i64));
                for (_, rule) in &rules {
                    let name = rule.kind.name();
                    let key = if rule.per_attributes.is_empty() || !per_attributes.is_empty() {
                        keys::rule_key(&self.namespace, &tag, &rule.name, name)
                    } else {
                        let values = rule.attribute_values(message);
                        keys::rule_key_per(&self.namespace, &tag, &rule.name, name, values)
                    };
                    let ids = keys::ids_key(&key);
                    rule_keys.push(key);
                    rule_keys.push(ids);
                    let treatment = rule.priority.treatment(message.priority, now, zone);
                    let args = treatment.args(&rule.kind, now, zone);
                    // An exempt message that counts is decided as by a shadow rule: taken
                    // when there is room, never held back.
                    let enforce = rule.on_deny != OnDeny::Shadow && treatment.enforced();
                    rule_args.push(ScriptArg::Text(name));
                    rule_args.push(ScriptArg::Int(i64::from(enforce)));
                    rule_args.push(ScriptArg::Int(args.len() as i64));
                    rule_args.extend(args.into_iter().map(ScriptArg::Int));
                }
                let reads_marks = marks && scope == Scope::Recipient;
                if reads_marks {
                    rule_keys.push(keys::sent_key(&self.namespace, &tag));
                }
                let claims = reads_marks && claims;
                if claims {
                    rule_keys.push(keys::claims_key(&self.namespace, &tag));
                }
                let kinds = KindSet::of(rules.iter().map(|(_, r)| r.kind.name()));
                ScopeCall {
                    rules,
                    keys: rule_keys,
                    reads_marks,
                    claims,
                    rule_args,
                    script: script::script_for(kinds),
                }
            })
            .collect()
    }
}

/// The rules decided in one script call: one hash tag for a message. The scope, and for a
/// global rule counting per attributes its keys (its tag is their values, so global rules
/// counting per the same keys share a call, and others have their own); empty otherwise, for
/// a rule counting per attributes within the recipient's tag too. Ordered recipient first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct TagGroup<'r>(Scope, &'r [String]);

impl<'r> TagGroup<'r> {
    fn of(rule: &'r Rule) -> TagGroup<'r> {
        match rule.scope {
            Scope::Global => TagGroup(Scope::Global, &rule.per_attributes),
            scope => TagGroup(scope, &[]),
        }
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

impl Evaluation {
    /// Every applicable rule's verdict, in policy order; none when nothing was decided.
    pub fn verdicts(&self) -> &[Verdict] {
        match self {
            Evaluation::Decided { verdicts, .. } => verdicts,
            Evaluation::Dispatched | Evaluation::InFlight { .. } => &[],
        }
    }

    /// [`Evaluation::verdicts`], owned.
    pub fn into_verdicts(self) -> Vec<Verdict> {
        match self {
            Evaluation::Decided { verdicts, .. } => verdicts,
            Evaluation::Dispatched | Evaluation::InFlight { .. } => Vec::new(),
        }
    }

    /// Whether every scope committed: the message may be dispatched.
    pub fn committed(&self) -> bool {
        matches!(
            self,
            Evaluation::Decided {
                committed: true,
                ..
            }
        )
    }

    /// Whether the message id was dispatched before (nothing decided).
    pub fn dispatched(&self) -> bool {
        matches!(self, Evaluation::Dispatched)
    }

    /// How much longer another delivery holds the message id, when one does (nothing decided).
    pub fn in_flight(&self) -> Option<i64> {
        match self {
            Evaluation::InFlight { wait_ms } => Some(*wait_ms),
            _ => None,
        }
    }
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

#[cfg(test)]
mod tests {
    use super::LimiterError;

    /// The error redis-rs makes of a server's error reply `reply` (`-LOADING ...`).
    fn replied(reply: &str) -> LimiterError {
        let value = redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .expect("an error reply parses");
        match value.extract_error() {
            Err(e) => LimiterError::Redis(e),
            Ok(v) => panic!("{reply} is not an error: {v:?}"),
        }
    }

    fn io(kind: std::io::ErrorKind) -> LimiterError {
        LimiterError::Redis(std::io::Error::from(kind).into())
    }

    #[test]
    fn redis_away_is_unavailable() {
        for kind in [
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::UnexpectedEof,
            std::io::ErrorKind::TimedOut,
        ] {
            assert!(io(kind).is_unavailable(), "{kind:?}");
        }
        for reply in [
            "LOADING Redis is loading the dataset in memory",
            "CLUSTERDOWN The cluster is down",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "READONLY You can't write against a read only replica.",
        ] {
            assert!(replied(reply).is_unavailable(), "{reply}");
        }
        let no_node =
            redis::RedisError::from((redis::ErrorKind::ClusterConnectionNotFound, "no connection"));
        assert!(LimiterError::Redis(no_node).is_unavailable());
    }

    #[test]
    fn a_failing_call_to_a_redis_that_is_there_is_not_unavailable() {
        for reply in [
            "ERR user_script:12: attempt to compare nil with number",
            "NOSCRIPT No matching script. Please use EVAL.",
            "NOPERM User worker has no permissions to run the 'evalsha' command",
            "CROSSSLOT Keys in request don't hash to the same slot",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ] {
            assert!(!replied(reply).is_unavailable(), "{reply}");
        }
        let unreadable = redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "reply is not a decision",
        ));
        assert!(!LimiterError::Redis(unreadable).is_unavailable());
    }

    #[test]
    fn redis_going_away_once_part_of_a_decision_was_made_is_not_unavailable() {
        let away = io(std::io::ErrorKind::ConnectionReset);
        assert!(away.is_unavailable());
        let after = away.after_decision();
        assert!(!after.is_unavailable());
        assert!(
            after
                .to_string()
                .starts_with("redis, after the message was decided: "),
            "{after}"
        );
    }
}
