//! Property tests: `lua/kinds/leaky_bucket.lua`, `lua/kinds/token_bucket.lua` (with the message's cost and
//! with a fixed cost), `lua/kinds/gcra.lua` and `lua/kinds/quiet_hours.lua` in real Redis, against plain
//! Rust models written from the semantics stated in each script's header, over random
//! sequences of (clock advance, message id, cost, commit or dry run), with the clock sometimes
//! standing still and sometimes going back. Every step must give the same decision, remaining
//! and retry_after; every refusal's retry_after must be exact (a check at that instant is
//! admitted, one millisecond earlier it is not); every key left behind has an expiry. Then one
//! test per weak spot of the seed implementations these kinds were written to avoid.
//!
//! The same again with the rule reloaded now and then with other parameters (issue 38: a level
//! kept in units of `period / gcd(rate, period)` was read in the new rule's units, so raising a
//! token bucket's rate refilled it), and state written before the parameters were kept.
//!
//! Semantics every counting kind honours, and the models follow:
//! - a refused attempt changes nothing, and a dry run never changes anything;
//! - an id admitted within the rule's memory is admitted again without consuming anything;
//! - elapsed time is clamped at zero when the clock goes back, and the time of the last update
//!   never moves back, so a skewed clock never issues more than the real refill;
//! - retry_after is the first millisecond at which the same send would be admitted.
//!
//! The models use exact integer arithmetic in i128 and do not reduce rates the way the worker
//! does (`Bucket::units`, `Gcra::ticks`): one send is `period_ms` units and `rate` units flow
//! per millisecond. Whole-send counts and millisecond instants do not depend on that choice, so
//! agreeing on them checks the worker's reduction too.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

use chrono::{DateTime, Duration, NaiveTime, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use sendquota::config::{RedisSettings, Settings};
use sendquota::internals::kinds::Kind;
use sendquota::internals::limiter::Evaluation;
use sendquota::internals::message::SendRequest;
use sendquota::internals::outcome::Verdict;
use sendquota::internals::policy::Policy;

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

use support::fixtures::policy;
use support::model::LimiterHarness as Harness;

/// Decides `message` at epoch ms `now_ms`.
fn evaluate(
    h: &Harness,
    policy: &Policy,
    message: &SendRequest,
    now_ms: i64,
    commit: bool,
) -> Evaluation {
    let now = DateTime::from_timestamp_millis(now_ms).expect("instant in range");
    h.evaluate(policy, message, now, commit)
}

/// The policy of `toml`, built the way the worker builds it (so validation runs).
fn load_policy(toml: &str) -> Policy {
    Settings::from_toml(toml, |_| None)
        .unwrap_or_else(|e| panic!("config {toml:?} is valid: {e}"))
        .policy
}

fn message(id: &str, recipient: &str, zone: &str, cost: u32) -> SendRequest {
    let mut body = support::request(id, recipient, zone);
    body["cost"] = cost.into();
    SendRequest::decode(body.to_string().as_bytes(), 1 << 16).expect("valid request")
}

/// What one rule said, in the models' terms (retry_after as epoch ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Decision {
    allowed: bool,
    remaining: Option<i64>,
    retry_after_ms: Option<i64>,
}

impl Decision {
    fn of(v: &Verdict) -> Decision {
        Decision {
            allowed: v.allowed,
            remaining: v.remaining,
            retry_after_ms: v.retry_after.map(|t| t.timestamp_millis()),
        }
    }

    fn allowed(remaining: i128) -> Decision {
        Decision {
            allowed: true,
            remaining: Some(i64::try_from(remaining).expect("small")),
            retry_after_ms: None,
        }
    }

    fn refused(remaining: i128, retry_after_ms: Option<i128>) -> Decision {
        Decision {
            allowed: false,
            remaining: Some(i64::try_from(remaining).expect("small")),
            retry_after_ms: retry_after_ms.map(|t| i64::try_from(t).expect("small")),
        }
    }
}

/// Ceiling of a / b for b > 0.
fn ceil_div(a: i128, b: i128) -> i128 {
    -((-a).div_euclid(b))
}

// ---------------------------------------------------------------------------------------------
// Models of the counting kinds
// ---------------------------------------------------------------------------------------------

/// A counting kind as a specification.
trait Model {
    /// The decision on message `id` of `cost` at `now` (ms); consumes when `commit` and allowed.
    fn decide(&mut self, id: &str, now: i128, cost: u32, commit: bool) -> Decision;

    /// The rule is reloaded with `kind` (same name, same kind, any parameters): the next
    /// decisions are made under it, starting from what the old parameters left.
    fn reconfigure(&mut self, kind: &Kind);
}

/// The first instant after `now` at which `fits`, which holds from some instant on: where a
/// rule carries over state kept under other parameters, the state runs on under those until it
/// is written again, so the send fits from the first instant whose carried-over state lets it.
fn first_instant(now: i128, fits: impl Fn(i128) -> bool) -> i128 {
    let (mut refused, mut step) = (now, 1);
    while !fits(refused + step) {
        refused += step;
        step *= 2;
    }
    let mut admitted = refused + step;
    while admitted - refused > 1 {
        let mid = refused + (admitted - refused) / 2;
        if fits(mid) {
            admitted = mid;
        } else {
            refused = mid;
        }
    }
    admitted
}

/// Greatest common divisor.
fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// What a level kept in units of 1/`old_unit` send, `level`, is in units of 1/`new_unit` send,
/// for a rule of `rate` per `new_unit` ms after a reload: the same amount, rounded up to the
/// finest step the new rule's level takes (gcd(rate, period) / period of a send, as it moves by
/// `rate` units a ms and by whole sends), so a change of parameters never owes less than before.
fn carried(level: i128, old_unit: i128, new_unit: i128, rate: i128) -> i128 {
    let step = gcd(rate, new_unit);
    step * ceil_div(level * (new_unit / step), old_unit)
}

/// Ids admitted, with the ms they were admitted at, remembered for `memory` ms. Forgetting
/// happens when an id is remembered: ids older than the memory are dropped for good.
#[derive(Debug, Default)]
struct Admitted {
    memory: i128,
    at: HashMap<String, i128>,
}

impl Admitted {
    fn new(memory: i128) -> Admitted {
        Admitted {
            memory,
            at: HashMap::new(),
        }
    }

    fn contains(&self, id: &str, now: i128) -> bool {
        self.at.get(id).is_some_and(|&at| at > now - self.memory)
    }

    fn remember(&mut self, id: &str, now: i128) {
        let memory = self.memory;
        self.at.retain(|_, at| *at > now - memory);
        self.at.insert(id.to_owned(), now);
    }
}

/// A bucket's parameters in the models' units: one send = `unit` (the period in ms) units, and
/// `rate` units leak or refill per ms; `cap` = the capacity in units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BucketUnits {
    cap: i128,
    unit: i128,
    rate: i128,
}

impl BucketUnits {
    fn of(b: &sendquota::internals::kinds::Bucket) -> BucketUnits {
        let unit = i128::from(b.period_ms);
        BucketUnits {
            cap: i128::from(b.capacity) * unit,
            unit,
            rate: i128::from(b.rate),
        }
    }

    /// How long an empty bucket takes to fill (a full one to drain): the ids' memory.
    fn memory(&self) -> i128 {
        ceil_div(self.cap, self.rate)
    }
}

/// Leaky bucket: every send adds one to a level that leaks `rate` per `period`; a send that
/// would lift the level above `capacity` is refused. The level is stored as of `last`, with the
/// parameters it was counted under; nothing leaks before `last`. Under other parameters (a
/// reload) the level leaks under its own up to now, then is carried over in the new units.
struct LeakyModel {
    p: BucketUnits,
    /// (level, last, parameters) after the last admitted send; none before the first.
    state: Option<(i128, i128, BucketUnits)>,
    ids: Admitted,
}

fn leaky_units(kind: &Kind) -> BucketUnits {
    let Kind::LeakyBucket(b) = kind else {
        panic!("not a leaky bucket: {kind:?}")
    };
    BucketUnits::of(b)
}

impl LeakyModel {
    fn new(kind: &Kind) -> LeakyModel {
        let p = leaky_units(kind);
        LeakyModel {
            p,
            state: None,
            ids: Admitted::new(p.memory()),
        }
    }
}

impl LeakyModel {
    /// The level and last update as a decision at `now` sees them (carried over to the
    /// current parameters), and whether they were kept under others.
    fn level_at(&self, now: i128) -> (i128, i128, bool) {
        match self.state {
            None => (0, now, false),
            Some((level, last, kept)) => {
                let level = (level - (now - last).max(0) * kept.rate).max(0);
                let carried = carried(level, kept.unit, self.p.unit, self.p.rate);
                (carried, last.max(now), kept != self.p)
            }
        }
    }
}

impl Model for LeakyModel {
    fn decide(&mut self, id: &str, now: i128, _cost: u32, commit: bool) -> Decision {
        let p = self.p;
        let (level, last, reloaded) = self.level_at(now);
        if self.ids.contains(id, now) {
            return Decision::allowed((p.cap - level).div_euclid(p.unit).max(0));
        }
        if level + p.unit <= p.cap {
            if commit {
                self.state = Some((level + p.unit, last, p));
                self.ids.remember(id, now);
            }
            return Decision::allowed((p.cap - level - p.unit).div_euclid(p.unit));
        }
        if reloaded {
            let fits = |t| {
                let (level, _, _) = self.level_at(t);
                level + p.unit <= p.cap
            };
            return Decision::refused(0, Some(first_instant(now, fits)));
        }
        // `level` holds at every instant up to `last` and leaks after it.
        let retry = last + ceil_div(level + p.unit - p.cap, p.rate);
        Decision::refused(0, Some(retry))
    }

    fn reconfigure(&mut self, kind: &Kind) {
        self.p = leaky_units(kind);
        self.ids.memory = self.p.memory();
    }
}

/// Token bucket: `capacity` tokens refilled `rate` per `period`; a send takes its cost (the
/// rule's fixed cost or the message's) and is refused when fewer tokens are there; a cost
/// above the capacity is refused for good. One token = `period` units, `rate` units per ms.
/// Under other parameters (a reload) the bucket refills under its own up to now, and what it
/// lacks of being full is carried over in the new units and taken from the new capacity (below
/// zero when it lacks more than that).
struct TokenModel {
    p: BucketUnits,
    fixed_cost: Option<u32>,
    /// (tokens, last, parameters); a bucket never used is full.
    state: Option<(i128, i128, BucketUnits)>,
    ids: Admitted,
}

fn token_units(kind: &Kind) -> (BucketUnits, Option<u32>) {
    let Kind::TokenBucket(t) = kind else {
        panic!("not a token bucket: {kind:?}")
    };
    (BucketUnits::of(&t.bucket), t.cost)
}

impl TokenModel {
    fn new(kind: &Kind) -> TokenModel {
        let (p, fixed_cost) = token_units(kind);
        TokenModel {
            p,
            fixed_cost,
            state: None,
            ids: Admitted::new(p.memory()),
        }
    }
}

impl TokenModel {
    /// The tokens and last update as a decision at `now` sees them (carried over to the
    /// current parameters), and whether they were kept under others.
    fn tokens_at(&self, now: i128) -> (i128, i128, bool) {
        let p = self.p;
        match self.state {
            None => (p.cap, now, false),
            Some((tokens, last, kept)) => {
                let tokens = (tokens + (now - last).max(0) * kept.rate).min(kept.cap);
                let deficit = carried(kept.cap - tokens, kept.unit, p.unit, p.rate);
                (p.cap - deficit, last.max(now), kept != p)
            }
        }
    }
}

impl Model for TokenModel {
    fn decide(&mut self, id: &str, now: i128, cost: u32, commit: bool) -> Decision {
        let p = self.p;
        let need = i128::from(self.fixed_cost.unwrap_or(cost)) * p.unit;
        let (tokens, last, reloaded) = self.tokens_at(now);
        let whole = tokens.div_euclid(p.unit).max(0);
        if self.ids.contains(id, now) {
            return Decision::allowed(whole);
        }
        if tokens >= need {
            if commit {
                self.state = Some((tokens - need, last, p));
                self.ids.remember(id, now);
            }
            return Decision::allowed((tokens - need).div_euclid(p.unit));
        }
        if need > p.cap {
            return Decision::refused(whole, None);
        }
        if reloaded {
            let fits = |t| self.tokens_at(t).0 >= need;
            return Decision::refused(whole, Some(first_instant(now, fits)));
        }
        // `tokens` holds at every instant up to `last` and grows after it.
        let retry = last + ceil_div(need - tokens, p.rate);
        Decision::refused(whole, Some(retry))
    }

    fn reconfigure(&mut self, kind: &Kind) {
        (self.p, self.fixed_cost) = token_units(kind);
        self.ids.memory = self.p.memory();
    }
}

/// GCRA's parameters in the model's ticks of 1/`rate` ms: the emission interval T is `period`
/// ticks and the tolerance is T * burst.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GcraTicks {
    t: i128,
    tau: i128,
    tpm: i128,
}

fn gcra_ticks(kind: &Kind) -> GcraTicks {
    let Kind::Gcra(g) = kind else {
        panic!("not gcra: {kind:?}")
    };
    let (t, tpm) = (i128::from(g.period_ms), i128::from(g.rate));
    GcraTicks {
        t,
        tau: t * i128::from(g.burst),
        tpm,
    }
}

/// GCRA: `rate` sends per `period`, bursts of up to `burst`. A send at `now` is admitted when
/// `now >= tat + T - tau`, and moves the theoretical arrival time (never below now) on by T.
/// Under other parameters (a reload) the TAT's lead over now in its own ticks (the burst used)
/// is carried over in the new ticks, from now.
struct GcraModel {
    p: GcraTicks,
    /// The TAT and the ticks it is counted in.
    tat: Option<(i128, GcraTicks)>,
    ids: Admitted,
}

impl GcraModel {
    fn new(kind: &Kind) -> GcraModel {
        let p = gcra_ticks(kind);
        GcraModel {
            p,
            tat: None,
            ids: Admitted::new(ceil_div(p.tau + p.t, p.tpm)),
        }
    }
}

impl GcraModel {
    /// The TAT a decision at `now` sees (carried over to the current ticks), and whether it
    /// was counted in others.
    fn tat_at(&self, now: i128) -> (i128, bool) {
        let p = self.p;
        let now_t = now * p.tpm;
        match self.tat {
            None => (now_t, false),
            Some((tat, kept)) if kept == p => (tat.max(now_t), false),
            Some((tat, kept)) => {
                let lead = (tat - now * kept.tpm).max(0);
                (now_t + carried(lead, kept.t, p.t, p.tpm), true)
            }
        }
    }
}

impl Model for GcraModel {
    fn decide(&mut self, id: &str, now: i128, _cost: u32, commit: bool) -> Decision {
        let p = self.p;
        let now_t = now * p.tpm;
        let (tat, reloaded) = self.tat_at(now);
        if self.ids.contains(id, now) {
            // Sends allowed right now: the k-th needs now_t >= tat + (k - 1) T + T - tau.
            return Decision::allowed((now_t - tat + p.tau).div_euclid(p.t).max(0));
        }
        let earliest = tat + p.t - p.tau;
        if now_t >= earliest {
            if commit {
                self.tat = Some((tat + p.t, p));
                self.ids.remember(id, now);
            }
            return Decision::allowed((now_t - earliest).div_euclid(p.t));
        }
        if reloaded {
            let fits = |t| t * p.tpm >= self.tat_at(t).0 + p.t - p.tau;
            return Decision::refused(0, Some(first_instant(now, fits)));
        }
        Decision::refused(0, Some(ceil_div(earliest, p.tpm)))
    }

    fn reconfigure(&mut self, kind: &Kind) {
        self.p = gcra_ticks(kind);
        self.ids.memory = ceil_div(self.p.tau + self.p.t, self.p.tpm);
    }
}

// ---------------------------------------------------------------------------------------------
// Property tests of the counting kinds
// ---------------------------------------------------------------------------------------------

/// 2026-01-01T00:00:00Z.
const START_MS: i64 = 1_767_225_600_000;

/// Periods: with rates of at most 4, a send takes at least a second to leak or refill, so the
/// keys' expiries (durations on the simulated clock, counted by Redis in real time) outlast a
/// test case by far even on a loaded machine. Odd ones make the interval a fraction of a ms.
const PERIODS: [&str; 5] = ["4s", "7s", "10s", "4500ms", "1m"];

#[derive(Debug, Clone, Copy)]
enum Advance {
    /// Move the clock by this many ms (negative: it goes back).
    By(i64),
    /// Jump to the last refusal's retry_after plus this (0 or -1); stand still if none.
    ToRetry(i64),
}

#[derive(Debug, Clone)]
struct Step {
    advance: Advance,
    id: usize,
    cost: u32,
    commit: bool,
}

fn step() -> impl Strategy<Value = Step> {
    let advance = prop_oneof![
        3 => Just(Advance::By(0)),
        3 => (1i64..=50).prop_map(Advance::By),
        8 => (0i64..=15_000).prop_map(Advance::By),
        2 => (-5_000i64..=-1).prop_map(Advance::By),
        3 => prop_oneof![Just(0i64), Just(-1i64)].prop_map(Advance::ToRetry),
    ];
    (advance, 0usize..5, 1u32..=4, prop::bool::weighted(0.8)).prop_map(
        |(advance, id, cost, commit)| Step {
            advance,
            id,
            cost,
            commit,
        },
    )
}

fn period() -> impl Strategy<Value = &'static str> + Clone {
    prop::sample::select(&PERIODS[..])
}

fn leaky_toml() -> impl Strategy<Value = String> + Clone {
    (1u32..=4, 1u32..=4, period()).prop_map(|(capacity, rate, period)| {
        format!(
            "[[rules]]\nname = \"b\"\nkind = \"leaky_bucket\"\ncapacity = {capacity}\n\
             rate = {rate}\nperiod = \"{period}\"\n"
        )
    })
}

fn token_toml(fixed_cost: bool) -> impl Strategy<Value = String> + Clone {
    (1u32..=4, 1u32..=4, period(), 1u32..=4).prop_map(move |(capacity, rate, period, cost)| {
        let cost = if fixed_cost {
            format!("cost = {}\n", cost.min(capacity))
        } else {
            String::new()
        };
        format!(
            "[[rules]]\nname = \"b\"\nkind = \"token_bucket\"\ncapacity = {capacity}\n\
             rate = {rate}\nperiod = \"{period}\"\n{cost}"
        )
    })
}

fn gcra_toml() -> impl Strategy<Value = String> + Clone {
    (1u32..=4, period(), prop::option::of(1u32..=4)).prop_map(|(rate, period, burst)| {
        let burst = burst.map(|b| format!("burst = {b}\n")).unwrap_or_default();
        format!(
            "[[rules]]\nname = \"g\"\nkind = \"gcra\"\nrate = {rate}\nperiod = \"{period}\"\n\
             {burst}"
        )
    })
}

/// Runs `cases` random sequences of the rule in `toml` through the script and `model`, on
/// the single server and on the cluster.
fn script_matches_model<M: Model>(
    prefix: &str,
    cases: u32,
    toml: impl Strategy<Value = String> + Clone,
    model: impl Fn(&Kind) -> M,
) {
    for (_, target) in support::redis_targets() {
        script_matches_model_on(&target, prefix, cases, toml.clone(), &model);
    }
}

fn script_matches_model_on<M: Model>(
    target: &RedisSettings,
    prefix: &str,
    cases: u32,
    toml: impl Strategy<Value = String>,
    model: &impl Fn(&Kind) -> M,
) {
    let h = Harness::on(prefix, target);
    let case = AtomicU32::new(0);
    let strategy = (toml, prop::collection::vec(step(), 1..40));
    let result = support::property_runner(cases).run(&strategy, |(toml, steps)| {
        let recipient = format!("r{}", case.fetch_add(1, Ordering::SeqCst));
        let policy = load_policy(&toml);
        let mut model = model(&policy.rules[0].kind);
        let mut now = START_MS;
        let mut last_retry: Option<i64> = None;
        for (i, s) in steps.iter().enumerate() {
            now = match s.advance {
                Advance::By(ms) => now + ms,
                Advance::ToRetry(off) => last_retry.map_or(now, |r| r + off),
            };
            let id = format!("id{}", s.id);
            let msg = message(&id, &recipient, "UTC", s.cost);
            let eval = evaluate(&h, &policy, &msg, now, s.commit);
            let got = Decision::of(&eval.verdicts()[0]);
            let want = model.decide(&id, i128::from(now), s.cost, s.commit);
            prop_assert_eq!(got, want, "step {} at {} ms: {:?}", i, now - START_MS, s);
            prop_assert_eq!(eval.committed(), s.commit && got.allowed);
            if let Some(retry) = got.retry_after_ms {
                last_retry = Some(retry);
                prop_assert!(
                    retry > now,
                    "retry_after {} is not after now {}",
                    retry,
                    now
                );
                // Waiting exactly retry_after is enough, one ms less is not (dry runs).
                let at = evaluate(&h, &policy, &msg, retry, false);
                prop_assert!(at.verdicts()[0].allowed, "refused at retry_after {}", retry);
                let before = evaluate(&h, &policy, &msg, retry - 1, false);
                prop_assert!(!before.verdicts()[0].allowed, "allowed before retry_after");
            }
        }
        for (key, ttl) in h.keys_with_ttl(&format!("{{r:{recipient}}}:")) {
            prop_assert!(ttl > 0 || ttl == -2, "key {} has PTTL {}", key, ttl);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn leaky_bucket_script_matches_the_model() {
    script_matches_model("sqtleaky", 256, leaky_toml(), LeakyModel::new);
}

#[test]
fn token_bucket_with_message_cost_script_matches_the_model() {
    script_matches_model("sqttoken", 256, token_toml(false), TokenModel::new);
}

#[test]
fn token_bucket_with_fixed_cost_script_matches_the_model() {
    script_matches_model("sqttokenfix", 192, token_toml(true), TokenModel::new);
}

#[test]
fn gcra_script_matches_the_model() {
    script_matches_model("sqtgcra", 256, gcra_toml(), GcraModel::new);
}

/// Runs `cases` random sequences through the script and `model` in which the rule is reloaded
/// now and then with other parameters (every one of them drawn anew, the name and kind kept),
/// on the single server and on the cluster: at every step the same decision, remaining and
/// retry_after, so the state a rule kept is read under its new parameters as the model
/// carries it over.
fn script_matches_model_across_reloads<M: Model>(
    prefix: &str,
    cases: u32,
    toml: impl Strategy<Value = String> + Clone,
    model: impl Fn(&Kind) -> M,
) {
    for (_, target) in support::redis_targets() {
        let h = Harness::on(prefix, &target);
        let case = AtomicU32::new(0);
        let reloads = AtomicU32::new(0);
        let strategy = (
            prop::collection::vec(toml.clone(), 2..5),
            prop::collection::vec((step(), prop::option::weighted(0.2, 0usize..4)), 1..40),
        );
        let result = support::property_runner(cases).run(&strategy, |(tomls, steps)| {
            let recipient = format!("r{}", case.fetch_add(1, Ordering::SeqCst));
            let policies: Vec<Policy> = tomls.iter().map(|t| load_policy(t)).collect();
            let mut current = 0;
            let mut model = model(&policies[0].rules[0].kind);
            let mut now = START_MS;
            let mut last_retry: Option<i64> = None;
            for (i, (s, reload)) in steps.iter().enumerate() {
                if let Some(k) = reload.map(|k| k % policies.len()) {
                    current = k;
                    model.reconfigure(&policies[k].rules[0].kind);
                    reloads.fetch_add(1, Ordering::Relaxed);
                }
                let policy = &policies[current];
                now = match s.advance {
                    Advance::By(ms) => now + ms,
                    Advance::ToRetry(off) => last_retry.map_or(now, |r| r + off),
                };
                let id = format!("id{}", s.id);
                let msg = message(&id, &recipient, "UTC", s.cost);
                let eval = evaluate(&h, policy, &msg, now, s.commit);
                let got = Decision::of(&eval.verdicts()[0]);
                let want = model.decide(&id, i128::from(now), s.cost, s.commit);
                prop_assert_eq!(
                    got,
                    want,
                    "step {} at {} ms under {:?}: {:?}",
                    i,
                    now - START_MS,
                    &tomls[current],
                    s
                );
                prop_assert_eq!(eval.committed(), s.commit && got.allowed);
                if let Some(retry) = got.retry_after_ms {
                    last_retry = Some(retry);
                    let at = evaluate(&h, policy, &msg, retry, false);
                    prop_assert!(at.verdicts()[0].allowed, "refused at retry_after {}", retry);
                    let before = evaluate(&h, policy, &msg, retry - 1, false);
                    prop_assert!(!before.verdicts()[0].allowed, "allowed before retry_after");
                }
            }
            for (key, ttl) in h.keys_with_ttl(&format!("{{r:{recipient}}}:")) {
                prop_assert!(ttl > 0 || ttl == -2, "key {} has PTTL {}", key, ttl);
            }
            Ok(())
        });
        if let Err(e) = result {
            panic!("{e}");
        }
        assert!(
            reloads.load(Ordering::Relaxed) > 0,
            "no case reloaded the rule"
        );
    }
}

#[test]
fn leaky_bucket_keeps_its_level_across_reloads_that_change_every_parameter() {
    script_matches_model_across_reloads("sqtleakyre", 192, leaky_toml(), LeakyModel::new);
}

#[test]
fn token_bucket_keeps_what_it_lacks_across_reloads_that_change_every_parameter() {
    let either = prop_oneof![token_toml(false), token_toml(true)];
    script_matches_model_across_reloads("sqttokenre", 192, either, TokenModel::new);
}

#[test]
fn gcra_keeps_the_burst_used_across_reloads_that_change_every_parameter() {
    script_matches_model_across_reloads("sqtgcrare", 192, gcra_toml(), GcraModel::new);
}

// ---------------------------------------------------------------------------------------------
// Quiet hours against chrono-tz
// ---------------------------------------------------------------------------------------------

fn hm(text: &str) -> NaiveTime {
    NaiveTime::parse_from_str(text, "%H:%M").expect("HH:MM")
}

/// Whether the local wall time in `zone` at `t` lies in [start, end), wrapping midnight when
/// end < start.
fn quiet_at(start: NaiveTime, end: NaiveTime, t: DateTime<Utc>, zone: Tz) -> bool {
    let time = t.with_timezone(&zone).time();
    if start < end {
        start <= time && time < end
    } else {
        time >= start || time < end
    }
}

/// The rule's decision by definition: refused while the local time is quiet, and retry_after
/// is the first instant after `now` at which it is not. In the zones tested, offsets are whole
/// minutes and quiet bounds are whole local minutes, so quietness only changes on whole UTC
/// minutes: scanning them finds that instant exactly, whatever clock changes happen meanwhile.
fn quiet_model(start: NaiveTime, end: NaiveTime, now: DateTime<Utc>, zone: Tz) -> Decision {
    if !quiet_at(start, end, now, zone) {
        return Decision {
            allowed: true,
            remaining: None,
            retry_after_ms: None,
        };
    }
    let minute = 60_000;
    let mut t = now.timestamp_millis().div_euclid(minute) * minute + minute;
    for _ in 0..4 * 24 * 60 {
        let at = DateTime::from_timestamp_millis(t).expect("instant");
        if !quiet_at(start, end, at, zone) {
            return Decision {
                allowed: false,
                remaining: None,
                retry_after_ms: Some(t),
            };
        }
        t += minute;
    }
    panic!("quiet for four days from {now} in {zone}");
}

const QUIET_ZONES: [&str; 8] = [
    "America/New_York",
    "America/New_York",
    "America/New_York",
    "Europe/Berlin",
    "Australia/Lord_Howe",
    "America/Santiago",
    "Asia/Kathmandu",
    "UTC",
];

/// Clock changes of 2026 in those zones (UTC), around which most instants are drawn.
const CLOCK_CHANGES: [&str; 8] = [
    "2026-03-08T07:00:00Z", // New York, 02:00 EST -> 03:00 EDT
    "2026-11-01T06:00:00Z", // New York, 02:00 EDT -> 01:00 EST
    "2026-03-29T01:00:00Z", // Berlin, 02:00 -> 03:00
    "2026-10-25T01:00:00Z", // Berlin, 03:00 -> 02:00
    "2026-04-04T15:00:00Z", // Lord Howe, 02:00 -> 01:30
    "2026-10-03T15:30:00Z", // Lord Howe, 02:00 -> 02:30
    "2026-04-05T03:00:00Z", // Santiago, 24:00 -> 23:00
    "2026-09-06T04:00:00Z", // Santiago, 24:00 -> 01:00
];

/// Windows that clock changes cut, windows wrapping midnight, and a window whose open time a
/// clock change skips entirely.
const QUIET_WINDOWS: [(&str, &str); 10] = [
    ("01:30", "02:30"),
    ("22:00", "08:00"),
    ("00:30", "01:30"),
    ("01:00", "01:30"),
    ("02:00", "03:00"),
    ("23:30", "02:15"),
    ("01:59", "02:01"),
    ("23:00", "00:30"),
    ("02:30", "02:00"),
    ("00:00", "01:00"),
];

fn quiet_window() -> impl Strategy<Value = (NaiveTime, NaiveTime)> {
    let any = ((0u32..24, 0u32..4), (0u32..24, 0u32..4))
        .prop_filter("start != end", |(a, b)| a != b)
        .prop_map(|((sh, sq), (eh, eq))| {
            let t = |h, q| NaiveTime::from_hms_opt(h, q * 15, 0).expect("time");
            (t(sh, sq), t(eh, eq))
        });
    let listed = prop::sample::select(&QUIET_WINDOWS[..]).prop_map(|(s, e)| (hm(s), hm(e)));
    prop_oneof![1 => any, 1 => listed]
}

fn instant() -> impl Strategy<Value = DateTime<Utc>> {
    let near_change = (
        prop::sample::select(&CLOCK_CHANGES[..]),
        -14 * 3_600_000i64..=14 * 3_600_000,
    )
        .prop_map(|(change, off)| {
            change.parse::<DateTime<Utc>>().expect("instant") + Duration::milliseconds(off)
        });
    let any = (0i64..365 * 86_400_000)
        .prop_map(|off| DateTime::from_timestamp_millis(START_MS + off).expect("instant"));
    prop_oneof![4 => near_change, 1 => any]
}

#[test]
fn quiet_hours_match_chrono_tz() {
    let h = Harness::single("sqtquiet");
    let case = AtomicU32::new(0);
    let strategy = (
        quiet_window(),
        prop::sample::select(&QUIET_ZONES[..]),
        prop::collection::vec((instant(), prop::bool::ANY), 1..8),
    );
    let result =
        support::property_runner(512).run(&strategy, |((start, end), zone_name, instants)| {
            let n = case.fetch_add(1, Ordering::SeqCst);
            let zone: Tz = zone_name.parse().expect("zone");
            let toml = format!(
                "[[rules]]\nname = \"q\"\nkind = \"quiet_hours\"\nstart = \"{}\"\nend = \"{}\"\n",
                start.format("%H:%M"),
                end.format("%H:%M")
            );
            let policy = load_policy(&toml);
            for (i, &(now, commit)) in instants.iter().enumerate() {
                let msg = message(&format!("id{n}-{i}"), &format!("r{n}"), zone_name, 1);
                let eval = evaluate(&h, &policy, &msg, now.timestamp_millis(), commit);
                let got = Decision::of(&eval.verdicts()[0]);
                let want = quiet_model(start, end, now, zone);
                let context = format!(
                    "quiet {}-{} in {zone} at {now} (local {})",
                    start.format("%H:%M"),
                    end.format("%H:%M"),
                    now.with_timezone(&zone).format("%Y-%m-%d %H:%M:%S%.3f %Z")
                );
                prop_assert_eq!(eval.committed(), commit && got.allowed, "{}", context);
                prop_assert_eq!(got, want, "{}", context);
            }
            let keys = h.keys_with_ttl("");
            prop_assert!(keys.is_empty(), "quiet_hours left keys: {:?}", keys);
            Ok(())
        });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Decides one quiet-hours message at `now_utc` and returns (allowed, retry_after).
fn quiet_decision(
    h: &Harness,
    window: (&str, &str),
    zone: &str,
    now_utc: &str,
) -> (bool, Option<DateTime<Utc>>) {
    let toml = policy!(
        "quiet_hours_q_from_start_to_end",
        start = window.0,
        end = window.1
    );
    let now: DateTime<Utc> = now_utc.parse().expect("instant");
    let eval = evaluate(
        h,
        &load_policy(&toml),
        &message("q1", "r1", zone, 1),
        now.timestamp_millis(),
        true,
    );
    (eval.verdicts()[0].allowed, eval.verdicts()[0].retry_after)
}

fn utc(text: &str) -> DateTime<Utc> {
    text.parse().expect("instant")
}

#[test]
fn quiet_hours_end_skipped_by_a_clock_change_is_the_first_instant_after_it() {
    let h = Harness::single("sqtquietgap");
    // New York, 2026-03-08: 01:45 EST is quiet; 02:30 does not exist, 03:00 EDT comes first.
    let got = quiet_decision(
        &h,
        ("01:30", "02:30"),
        "America/New_York",
        "2026-03-08T06:45:00Z",
    );
    assert_eq!(got, (false, Some(utc("2026-03-08T07:00:00Z"))));
    // At that instant the local time is 03:00: open.
    let got = quiet_decision(
        &h,
        ("01:30", "02:30"),
        "America/New_York",
        "2026-03-08T07:00:00Z",
    );
    assert_eq!(got, (true, None));
    // A window wrapping midnight, decided the evening before.
    let got = quiet_decision(
        &h,
        ("22:00", "08:00"),
        "America/New_York",
        "2026-03-08T03:15:30Z",
    );
    assert_eq!(got, (false, Some(utc("2026-03-08T12:00:00Z"))));
    assert!(h.keys_with_ttl("").is_empty());
}

#[test]
fn quiet_hours_retry_after_in_a_repeated_hour_is_when_sends_resume() {
    let h = Harness::single("sqtquietrep");
    // New York, 2026-11-01, 01:10 EST (the second 01:10): quiet until 01:30 EST = 06:30Z,
    // not 01:30 EDT = 05:30Z, which is already past.
    let second_pass = quiet_decision(
        &h,
        ("00:30", "01:30"),
        "America/New_York",
        "2026-11-01T06:10:00Z",
    );
    // 01:45 EDT: at 06:00Z the clock falls back to 01:00 EST, outside 01:30-02:30, and sends
    // are allowed from then on (not only from 02:30 EST = 07:30Z).
    let first_pass = quiet_decision(
        &h,
        ("01:30", "02:30"),
        "America/New_York",
        "2026-11-01T05:45:00Z",
    );
    assert_eq!(
        (second_pass, first_pass),
        (
            (false, Some(utc("2026-11-01T06:30:00Z"))),
            (false, Some(utc("2026-11-01T06:00:00Z")))
        )
    );
}

#[test]
fn quiet_hours_retry_after_is_not_itself_quiet_when_a_gap_skips_the_open_time() {
    let h = Harness::single("sqtquietskip");
    // Quiet 02:30-02:00: open only 02:00-02:30, which New York skips on 2026-03-08. At 01:45
    // EST the next open instant is 2026-03-09 02:00 EDT, not 03:00 EDT (quiet) on the 8th.
    let got = quiet_decision(
        &h,
        ("02:30", "02:00"),
        "America/New_York",
        "2026-03-08T06:45:00Z",
    );
    assert_eq!(got, (false, Some(utc("2026-03-09T06:00:00Z"))));
}

// ---------------------------------------------------------------------------------------------
// The seeds' weak spots
// ---------------------------------------------------------------------------------------------

/// Decides message `id` of `cost` at `now_ms`, committing, and returns the rule's verdict.
fn send(h: &Harness, policy: &Policy, id: &str, cost: u32, now_ms: i64) -> Verdict {
    let eval = evaluate(h, policy, &message(id, "r1", "UTC", cost), now_ms, true);
    eval.verdicts()[0].clone()
}

fn at(ms: i64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_millis(ms)
}

#[test]
fn leaky_and_token_buckets_count_milliseconds_not_seconds() {
    for kind in ["leaky_bucket", "token_bucket"] {
        let h = Harness::single("sqtms");
        let policy = load_policy(&policy!(
            "bucket_b_of_one_refilled_each_second",
            kind = kind
        ));
        // Just before a whole second, so a clock read in seconds would see one pass at +1 ms.
        let t0 = START_MS + 999;
        let v = send(&h, &policy, "m1", 1, t0);
        assert!(v.allowed, "{kind}: first send");
        assert_eq!(v.remaining, Some(0), "{kind}");
        for (id, dt) in [("m2", 1), ("m3", 999)] {
            let v = send(&h, &policy, id, 1, t0 + dt);
            assert!(!v.allowed, "{kind}: allowed {dt} ms after an emptying send");
            assert_eq!(v.retry_after, at(t0 + 1_000), "{kind} at +{dt} ms");
        }
        let v = send(&h, &policy, "m4", 1, t0 + 1_000);
        assert!(v.allowed, "{kind}: refused 1000 ms after an emptying send");
    }
}

#[test]
fn token_bucket_half_a_token_is_not_enough_and_retry_after_is_exact() {
    let h = Harness::single("sqthalf");
    let policy = load_policy(policy!("token_bucket_b_of_one_refilled_every_3s"));
    let t0 = START_MS;
    assert!(send(&h, &policy, "m1", 1, t0).allowed);
    // 1.5 s later half a token has come back: not enough, and not "blocked forever" either.
    let v = send(&h, &policy, "m2", 1, t0 + 1_500);
    assert!(!v.allowed);
    assert_eq!(v.remaining, Some(0));
    assert_eq!(v.retry_after, at(t0 + 3_000), "exactly 1.5 s later");
    assert!(!send(&h, &policy, "m2", 1, t0 + 2_999).allowed);
    let v = send(&h, &policy, "m2", 1, t0 + 3_000);
    assert!(v.allowed);
    assert_eq!(v.remaining, Some(0));
}

#[test]
fn token_bucket_cost_above_capacity_is_refused_at_load_and_per_message() {
    let err = Settings::from_toml(policy!("token_bucket_b_cost_above_capacity"), |_| None)
        .expect_err("cost above capacity is refused");
    assert_eq!(
        err.to_string(),
        "rule \"b\": cost (4) is larger than capacity (3): no send could ever pass"
    );

    let h = Harness::single("sqtcost");
    let policy = load_policy(policy!("token_bucket_b_of_3_refilled_each_second"));
    let eval = evaluate(&h, &policy, &message("big", "r1", "UTC", 5), START_MS, true);
    let v = &eval.verdicts()[0];
    assert!(!eval.committed());
    assert!(!v.allowed);
    assert_eq!(v.retry_after, None, "it never fits: no retry instant");
    assert_eq!(v.remaining, Some(3), "the full bucket is untouched");
    assert_eq!(v.reason, "cost 5 is more than the bucket's capacity 3");
    // Much later it is still refused the same way, and the refusals consumed nothing.
    let v = send(&h, &policy, "big", 5, START_MS + 86_400_000);
    assert_eq!((v.allowed, v.retry_after), (false, None));
    let v = send(&h, &policy, "small", 3, START_MS + 86_400_000);
    assert!(
        v.allowed,
        "a cost of exactly the capacity fits a full bucket"
    );
}

#[test]
fn skewed_clock_never_over_issues() {
    // The exact sequence: a token bucket of 5 refilled 1 per second.
    let h = Harness::single("sqtskew");
    let policy = load_policy(policy!("token_bucket_b_of_5_refilled_each_second"));
    let t0 = START_MS;
    assert!(send(&h, &policy, "all", 5, t0).allowed);
    let t = t0 + 2_000;
    let v = send(&h, &policy, "two", 2, t);
    assert_eq!(
        (v.allowed, v.remaining),
        (true, Some(0)),
        "two tokens back at t"
    );
    // The clock goes back 10 s: no refill from "t - 10 s" to t, and the retry instant is
    // when the next token really arrives.
    let v = send(&h, &policy, "back", 1, t - 10_000);
    assert_eq!((v.allowed, v.remaining), (false, Some(0)));
    assert_eq!(v.retry_after, at(t + 1_000));
    let v = send(&h, &policy, "again", 1, t);
    assert_eq!(
        (v.allowed, v.remaining),
        (false, Some(0)),
        "no tokens at t again"
    );
    assert_eq!(v.retry_after, at(t + 1_000));
    assert!(!send(&h, &policy, "again", 1, t + 999).allowed);
    assert!(send(&h, &policy, "again", 1, t + 1_000).allowed);

    // Every counting kind, clock bouncing between t, t - 10 s and t while t creeps forward:
    // admitted sends never exceed the burst plus what real time refilled.
    for (kind, extra) in [
        ("leaky_bucket", "capacity = 3"),
        ("token_bucket", "capacity = 3"),
        ("gcra", "burst = 3"),
    ] {
        let h = Harness::single("sqtskewloop");
        let policy = load_policy(&policy!(
            "bucket_b_refilled_twice_a_second",
            kind = kind,
            extra = extra
        ));
        let mut admitted = 0i64;
        let mut n = 0;
        for round in 0..40i64 {
            let t = t0 + round * 300;
            for now in [t, t - 10_000, t] {
                n += 1;
                if send(&h, &policy, &format!("m{n}"), 1, now).allowed {
                    admitted += 1;
                }
                let refilled = (t - t0) * 2 / 1_000;
                assert!(
                    admitted <= 3 + refilled,
                    "{kind}: {admitted} sends admitted by {} ms; at most {} were due",
                    t - t0,
                    3 + refilled
                );
            }
        }
        assert_eq!(
            admitted,
            3 + 39 * 300 * 2 / 1_000,
            "{kind}: all that was due"
        );
    }
}

#[test]
fn gcra_retry_after_is_rounded_up_and_burst_admits_exactly_burst() {
    // 3 per second: the emission interval is 333.33 ms, so retry_after must round up to 334.
    let h = Harness::single("sqtgcraround");
    let policy = load_policy(policy!("gcra_g_three_a_second_burst_1"));
    let t0 = START_MS;
    assert!(send(&h, &policy, "m1", 1, t0).allowed);
    let v = send(&h, &policy, "m2", 1, t0);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, at(t0 + 334), "rounded up, not down to 333");
    assert!(!send(&h, &policy, "m2", 1, t0 + 333).allowed);
    assert!(
        send(&h, &policy, "m2", 1, t0 + 334).allowed,
        "waiting exactly retry_after is enough"
    );

    for burst in 1..=5u32 {
        let h = Harness::single("sqtgcraburst");
        let policy = load_policy(&policy!("gcra_g_three_a_second", burst = burst));
        for k in 1..=burst {
            let v = send(&h, &policy, &format!("m{k}"), 1, t0);
            assert!(v.allowed, "burst {burst}: send {k} refused");
            assert_eq!(v.remaining, Some(i64::from(burst - k)), "burst {burst}");
        }
        let v = send(&h, &policy, "over", 1, t0);
        assert!(!v.allowed, "burst {burst}: send {} admitted", burst + 1);
        assert_eq!(v.retry_after, at(t0 + 334), "burst {burst}");
    }
}

/// Every step's own retry_after must hold when the check is repeated at that instant: the
/// property tests do this against the script; this keeps the models honest on their own.
#[test]
fn models_retry_after_is_exact() {
    let kind = |toml: &str| load_policy(toml).rules[0].kind.clone();
    let mut models: Vec<Box<dyn Model>> = vec![
        Box::new(LeakyModel::new(&kind(policy!(
            "leaky_bucket_b_of_2_leaking_3_per_7s"
        )))),
        Box::new(TokenModel::new(&kind(policy!(
            "token_bucket_b_of_3_refilled_3_per_7s"
        )))),
        Box::new(GcraModel::new(&kind(policy!("gcra_g_3_per_7s_burst_2")))),
    ];
    for model in &mut models {
        let mut now = i128::from(START_MS);
        for n in 0..200 {
            now += [0, 1, 700, 2_333, -3_000][n % 5];
            let cost = 1 + (n % 3) as u32;
            let d = model.decide(&format!("m{n}"), now, cost, true);
            if let Some(retry) = d.retry_after_ms.map(i128::from) {
                assert!(model.decide("probe", retry, cost, false).allowed);
                assert!(!model.decide("probe", retry - 1, cost, false).allowed);
            }
        }
    }
}

/// The state key of rule `name` of `kind` for recipient r1, as the worker names it.
fn r1_key(h: &Harness, name: &str, kind: &str) -> String {
    use sendquota::internals::keys::{rule_key, scope_tag};
    use sendquota::internals::policy::ScopeValue;
    rule_key(
        &h.namespace,
        &scope_tag(&ScopeValue::Recipient("r1")),
        name,
        kind,
    )
}

/// Keys live long: a bucket written before its parameters were kept with it (a hash of tokens
/// or level and last; a GCRA's TAT alone) is read in the rule's current units, and its next
/// update keeps the parameters, so that a reload after the upgrade carries it over too.
#[test]
fn buckets_written_before_their_parameters_were_kept_are_read_in_the_rules_units() {
    let h = Harness::single("sqtlegacy");
    let hour = 3_600_000i64;
    let bucket = |kind: &str, rate: u32| {
        load_policy(&policy!(
            "bucket_b_of_10_per_hour",
            kind = kind,
            rate = rate
        ))
    };
    let gcra = |rate: u32| load_policy(&policy!("gcra_b_per_hour_burst_10", rate = rate));
    let write = |cmd: &mut redis::Cmd| {
        let _: redis::Value = h.query(cmd.arg("PX").arg(hour));
    };
    // 4 tokens of 10 (one token = 1 h = 3,600,000 units), a level of 6 sends, 4 of a GCRA's
    // burst of 10 used (emission interval 720,000 ms at 5 an hour, ticks of 1 ms).
    let token = r1_key(&h, "b", "token_bucket");
    let _: i64 = h.query(
        redis::cmd("HSET")
            .arg(&token)
            .arg("tokens")
            .arg(4 * hour)
            .arg("last")
            .arg(START_MS),
    );
    let leaky = r1_key(&h, "b", "leaky_bucket");
    let _: i64 = h.query(
        redis::cmd("HSET")
            .arg(&leaky)
            .arg("level")
            .arg(6 * hour)
            .arg("last")
            .arg(START_MS),
    );
    write(
        redis::cmd("SET")
            .arg(r1_key(&h, "b", "gcra"))
            .arg(START_MS + 4 * 720_000),
    );
    for (policy, left) in [
        (bucket("token_bucket", 1), 3),
        (bucket("leaky_bucket", 1), 3),
        (gcra(5), 5),
    ] {
        let v = send(&h, &policy, "after-upgrade", 1, START_MS);
        assert_eq!((v.allowed, v.remaining), (true, Some(left)), "{policy:?}");
    }
    let fields: std::collections::HashMap<String, String> =
        h.query(redis::cmd("HGETALL").arg(&token));
    assert_eq!(
        (&fields["cap"], &fields["unit"], &fields["refill"]),
        (
            &"36000000".to_owned(),
            &"3600000".to_owned(),
            &"1".to_owned()
        ),
        "the update kept the parameters"
    );
    // Reloaded at twice the rate, each carries what it holds over.
    for (policy, left) in [
        (bucket("token_bucket", 2), 2),
        (bucket("leaky_bucket", 2), 2),
        (gcra(10), 4),
    ] {
        let v = send(&h, &policy, "after-reload", 1, START_MS);
        assert_eq!((v.allowed, v.remaining), (true, Some(left)), "{policy:?}");
    }
}
