//! A scope's script call: the rules of one hash tag, their keys and arguments, and the call
//! itself. Every way the limiter reaches Redis (deciding, refunding, claims) builds one.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use super::script::{self, KindSet, Mode};
use super::Limiter;
use crate::base::store::RedisConn;
use crate::decide::claim::Claim;
use crate::decide::keys;
use crate::request::message::SendRequest;
use crate::rules::policy::{OnDeny, Policy, Rule, Scope};

/// A scope's rules with the keys and arguments of its script call.
pub(super) struct ScopeCall<'r> {
    pub(super) rules: Vec<(usize, &'r Rule)>,
    /// Two per rule, then the recipient's dispatch marks when `reads_marks`, then the
    /// message's in-flight claim when `claims`.
    pub(super) keys: Vec<String>,
    /// Whether the script first looks the message id up in the recipient's dispatch marks.
    pub(super) reads_marks: bool,
    /// Whether the script takes the message id's in-flight claim with the decision.
    pub(super) claims: bool,
    /// ARGV after NOW_MS, MESSAGE_ID and MODE (see lua/decide.lua): COST, RULE_COUNT, rules.
    pub(super) rule_args: Vec<ScriptArg>,
    /// The script carrying the kinds of these rules.
    pub(super) script: &'static redis::Script,
}

/// One script argument after the keys: every one is a kind's name or a number, so none is
/// formatted into a string of its own before it is written into the command.
#[derive(Debug, Clone, Copy)]
pub(super) enum ScriptArg {
    Text(&'static str),
    Int(i64),
}

impl ScopeCall<'_> {
    pub(super) async fn invoke<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        now: DateTime<Utc>,
        message_id: &str,
        mode: Mode,
        claim: Option<&Claim>,
    ) -> redis::RedisResult<T> {
        let cmd = self.command(now, message_id, mode, claim);
        script::call(self.script, &cmd, mode, conn).await
    }

    /// The EVALSHA this scope's call sends: its keys, then NOW_MS, MESSAGE_ID, MODE, the
    /// rules' arguments and, when the call takes the claim, its token and lease.
    fn command(
        &self,
        now: DateTime<Utc>,
        message_id: &str,
        mode: Mode,
        claim: Option<&Claim>,
    ) -> redis::Cmd {
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
        cmd
    }
}

impl Limiter {
    /// The script calls [`Limiter::evaluate_claimed`] sends for `message` at `now` when no
    /// deny-cache answer and no earlier scope stops it: one EVALSHA per scope, recipient first,
    /// byte for byte the worker's. For the benches' floors, which pipeline the worker's own
    /// calls with nothing of the worker around them.
    pub fn claimed_commands(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        claim: &Claim,
    ) -> Vec<redis::Cmd> {
        let rules = policy.rules_for(message);
        let zone = message.zone(policy.default_zone);
        self.scope_calls(&rules, message, now, zone, true, true)
            .iter()
            .map(|call| call.command(now, &message.id, Mode::Commit, Some(claim)))
            .collect()
    }

    /// Groups rules by scope (recipient first: it refuses most often, so later scopes are
    /// rarely committed and refunded) and builds each scope's script arguments. With `marks`,
    /// the recipient scope's call also reads the recipient's dispatch marks.
    pub(super) fn scope_calls<'r>(
        &self,
        rules: &[&'r Rule],
        message: &SendRequest,
        now: DateTime<Utc>,
        zone: Tz,
        marks: bool,
        claims: bool,
    ) -> Vec<ScopeCall<'r>> {
        TagGroup::group(rules)
            .into_iter()
            .map(|(TagGroup(scope, per_attributes), rules)| {
                let tag = match rules.first() {
                    Some((_, rule)) if !per_attributes.is_empty() => {
                        keys::attributes_tag(rule.attribute_values(message))
                    }
                    _ => keys::scope_tag(&scope.of(message)),
                };
                let (mut rule_keys, rule_args) =
                    self.keys_and_args(&tag, per_attributes, &rules, message, now, zone);
                let reads_marks = marks && scope == Scope::Recipient;
                if reads_marks {
                    rule_keys.push(keys::sent_key(&self.namespace, &tag));
                }
                let claims = reads_marks && claims;
                if claims {
                    rule_keys.push(keys::claim_key(&self.namespace, &tag, &message.id));
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

    /// The keys of one tag group's `rules` (two per rule, with room for the marks and claims
    /// keys) and their arguments (COST, RULE_COUNT, then each rule's kind, whether it
    /// enforces, and its kind's numbers).
    fn keys_and_args(
        &self,
        tag: &str,
        per_attributes: &[String],
        rules: &[(usize, &Rule)],
        message: &SendRequest,
        now: DateTime<Utc>,
        zone: Tz,
    ) -> (Vec<String>, Vec<ScriptArg>) {
        let mut rule_keys = Vec::with_capacity(2 * rules.len() + 2);
        let mut rule_args = Vec::with_capacity(2 + 8 * rules.len());
        rule_args.push(ScriptArg::Int(i64::from(message.cost)));
        rule_args.push(ScriptArg::Int(rules.len() as i64));
        for (_, rule) in rules {
            let name = rule.kind.name();
            let key = if rule.per_attributes.is_empty() || !per_attributes.is_empty() {
                keys::rule_key(&self.namespace, tag, &rule.name, name)
            } else {
                let values = rule.attribute_values(message);
                keys::rule_key_per(&self.namespace, tag, &rule.name, name, values)
            };
            let ids = keys::ids_key(&key);
            rule_keys.push(key);
            rule_keys.push(ids);
            let treatment = rule.priority.treatment(message.priority, now, zone);
            let args = treatment.args(&rule.kind, now, zone);
            // An exempt message that counts is decided as by a shadow rule: taken when there
            // is room, never held back.
            let enforce = rule.on_deny != OnDeny::Shadow && treatment.enforced();
            rule_args.push(ScriptArg::Text(name));
            rule_args.push(ScriptArg::Int(i64::from(enforce)));
            rule_args.push(ScriptArg::Int(args.len() as i64));
            rule_args.extend(args.into_iter().map(ScriptArg::Int));
        }
        (rule_keys, rule_args)
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

    /// `rules` grouped by the call that decides them, each with its index in `rules`, in call
    /// order (recipient first). A message has rules of one or two hash tags: searching a
    /// vector that short costs less than building a map, which allocates a node for every
    /// message.
    fn group(rules: &[&'r Rule]) -> Vec<(TagGroup<'r>, Vec<(usize, &'r Rule)>)> {
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
    }
}
