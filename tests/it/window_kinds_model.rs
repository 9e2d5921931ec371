//! Property tests: the window kinds (`lua/kinds/fixed_window.lua`, `lua/kinds/sliding_window.lua` with hash
//! and list storage, `lua/kinds/sliding_log.lua`, `lua/kinds/zset_window.lua`) in real Redis against plain
//! Rust models written from the semantics their headers state, over random sequences of
//! (time step, message id, commit or dry run): time advances by 0 ms or more and now and then
//! goes back a few seconds (clock skew), ids repeat, parameters vary. At every step the script
//! and the model give the same decision, remaining and retry_after; a step that must write
//! nothing (a refusal, a dry run, a redelivery) leaves the keys byte for byte as they were;
//! retry_after is exact (one ms earlier is still refused, at it the send passes); and after
//! every case no key of the namespace lacks an expiry. The same again with the rule reloaded
//! now and then with other parameters of its kind (issue 38: a changed sub-window or storage
//! kept its counts in units the new rule misread). Then one test per weak spot of the seeds
//! these kinds replaced.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use proptest::prelude::*;
use sendquota::config::Settings;
use sendquota::internals::keys::{rule_key, scope_tag};
use sendquota::internals::kinds::human_ms;
use sendquota::internals::message::SendRequest;
use sendquota::internals::outcome::Verdict;
use sendquota::internals::policy::{Policy, ScopeValue};
use support::fixtures::policy;
use support::model::LimiterHarness;

// ---------------------------------------------------------------------------------------------
// The models
// ---------------------------------------------------------------------------------------------

/// A window rule as a specification. Each model only says what the rule holds (`room_at`, what
/// it remembers, what an admission records); the decision itself is the same for every kind
/// and is written once, in [`decide`]. `what_if` says the decision only asks (a dry run), which
/// only the fixed window tells apart from one that commits.
trait RuleModel: std::fmt::Debug {
    /// How many sends the rule would admit at `t` if nothing more were admitted meanwhile
    /// (negative when over). A send counts in the windows that hold it: one admitted after `t`
    /// (a clock that went back since) does not count at `t` yet.
    fn room_at(&self, t: i64, what_if: bool) -> i64;
    /// Whether `id` was admitted within the rule's memory, as seen at `now`.
    fn remembers(&self, id: &str, now: i64, what_if: bool) -> bool;
    /// Records `id` as admitted at `now`, forgetting what no longer matters at `now`.
    fn admit(&mut self, id: &str, now: i64);
    /// The 1-based policy that refuses at `now` (sliding log only).
    fn refusing_policy(&self, _now: i64) -> Option<usize> {
        None
    }
    /// Every instant at which what the rule holds may look different: where a send enters or
    /// leaves a window, where an id starts or stops being remembered. Between two of them the
    /// decision on a message stays the same.
    fn changes(&self) -> Vec<i64>;
    /// The rule is reloaded with `params` (same name and kind): it decides under them from
    /// now on, with what it holds.
    fn reconfigure(&mut self, params: &Params);
}

/// What a rule answers for one message.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Decision {
    allowed: bool,
    already: bool,
    /// Sends left after this one (0 when refused).
    remaining: i64,
    /// Epoch ms of the first instant the send would be admitted, when refused.
    retry_after: Option<i64>,
    /// Which policy refused (sliding log).
    policy: Option<usize>,
}

/// The shared semantics: an id remembered is admitted again without consuming; otherwise a
/// send is admitted when there is room, and only a committed admission changes the state. A
/// refusal names the first instant after now at which the same decision admits the send: the
/// first of the rule's changes after now at which it does (nothing differs in between).
fn decide(rule: &mut dyn RuleModel, id: &str, now: i64, commit: bool) -> Decision {
    let what_if = !commit;
    let room = rule.room_at(now, what_if);
    if rule.remembers(id, now, what_if) {
        return Decision {
            allowed: true,
            already: true,
            remaining: room.max(0),
            retry_after: None,
            policy: None,
        };
    }
    if room >= 1 {
        if commit {
            rule.admit(id, now);
        }
        return Decision {
            allowed: true,
            already: false,
            remaining: room - 1,
            retry_after: None,
            policy: None,
        };
    }
    let mut changes: Vec<i64> = rule.changes().into_iter().filter(|&t| t > now).collect();
    changes.sort_unstable();
    let admitted = changes
        .into_iter()
        .find(|&t| rule.remembers(id, t, what_if) || rule.room_at(t, what_if) >= 1)
        .unwrap_or_else(|| panic!("model: never admitted after {now}: {rule:?}"));
    Decision {
        allowed: false,
        already: false,
        remaining: 0,
        retry_after: Some(admitted),
        policy: rule.refusing_policy(now),
    }
}

/// At most `limit` sends per window of `window` ms that opens with the first send admitted
/// after the previous window ended. Its memory of ids is the current window. A decision at a
/// time before the window's start (a lagging clock) belongs to the current window; a what-if
/// there counts nothing (its window, if any, is gone).
#[derive(Debug)]
struct FixedWindowModel {
    limit: i64,
    window: i64,
    current: Option<OpenWindow>,
}

#[derive(Debug)]
struct OpenWindow {
    start: i64,
    sends: i64,
    ids: BTreeSet<String>,
}

impl FixedWindowModel {
    fn open_at(&self, t: i64, what_if: bool) -> Option<&OpenWindow> {
        self.current
            .as_ref()
            .filter(|w| t < w.start + self.window && (!what_if || t >= w.start))
    }
}

impl RuleModel for FixedWindowModel {
    fn room_at(&self, t: i64, what_if: bool) -> i64 {
        self.limit - self.open_at(t, what_if).map_or(0, |w| w.sends)
    }

    fn remembers(&self, id: &str, now: i64, what_if: bool) -> bool {
        self.open_at(now, what_if)
            .is_some_and(|w| w.ids.contains(id))
    }

    fn admit(&mut self, id: &str, now: i64) {
        if self.open_at(now, false).is_none() {
            self.current = Some(OpenWindow {
                start: now,
                sends: 0,
                ids: BTreeSet::new(),
            });
        }
        let w = self.current.as_mut().expect("a window is open");
        w.sends += 1;
        w.ids.insert(id.to_owned());
    }

    fn changes(&self) -> Vec<i64> {
        self.current
            .iter()
            .flat_map(|w| [w.start, w.start + self.window])
            .collect()
    }

    fn reconfigure(&mut self, params: &Params) {
        let Params::Fixed { limit, window } = *params else {
            panic!("not a fixed window: {params:?}")
        };
        (self.limit, self.window) = (limit.into(), window);
    }
}

/// Sends counted per sub-window, numbered in sub-windows of `sub` ms: a send at ms `at` is in
/// sub-window `floor(at / sub)`, and a sub-window with index i counts against a window of
/// `window` ms from ms `i * sub` until ms reaches `i * sub + window`. Read under another
/// sub-window length, each sub-window's sends are in the one holding its start; they are
/// numbered in that length when the next send is admitted.
#[derive(Debug)]
struct SubWindows {
    sub: i64,
    sends: BTreeMap<i64, i64>,
}

impl SubWindows {
    /// The sends numbered in sub-windows of `sub` ms.
    fn in_subs_of(&self, sub: i64) -> BTreeMap<i64, i64> {
        let mut out = BTreeMap::new();
        for (&i, &n) in &self.sends {
            *out.entry((i * self.sub).div_euclid(sub)).or_default() += n;
        }
        out
    }

    fn counted(&self, sub: i64, window: i64, t: i64) -> i64 {
        self.in_subs_of(sub)
            .iter()
            .filter(|(&i, _)| i * sub <= t && t < i * sub + window)
            .map(|(_, &n)| n)
            .sum()
    }

    fn admit(&mut self, sub: i64, window: i64, now: i64) {
        let mut sends = self.in_subs_of(sub);
        sends.retain(|&i, _| now < i * sub + window);
        *sends.entry(now.div_euclid(sub)).or_default() += 1;
        (self.sub, self.sends) = (sub, sends);
    }

    /// Where each sub-window enters and leaves windows of `windows` ms, numbered in `sub`.
    fn changes(&self, sub: i64, windows: impl Iterator<Item = i64> + Clone) -> Vec<i64> {
        self.in_subs_of(sub)
            .keys()
            .flat_map(|&i| windows.clone().map(move |w| i * sub + w).chain([i * sub]))
            .collect()
    }
}

/// Ids remembered for `memory` ms after their admission, from the sub-window of it (`sub` ms;
/// 1 for an exact window).
fn remembered(ids: &BTreeMap<String, i64>, id: &str, now: i64, memory: i64, sub: i64) -> bool {
    ids.get(id)
        .is_some_and(|&at| at > now - memory && at.div_euclid(sub) <= now.div_euclid(sub))
}

fn remember(ids: &mut BTreeMap<String, i64>, id: &str, now: i64, memory: i64) {
    ids.retain(|_, at| *at > now - memory);
    ids.insert(id.to_owned(), now);
}

/// Where remembered ids start (their sub-window's start) and stop being remembered.
fn id_changes(ids: &BTreeMap<String, i64>, memory: i64, sub: i64) -> Vec<i64> {
    ids.values()
        .flat_map(|&at| [at.div_euclid(sub) * sub, at + memory])
        .collect()
}

/// At most `limit` sends in any `window` ms, counted in sub-windows of `sub` ms (both storages
/// mean the same); ids are remembered for `window` ms.
#[derive(Debug)]
struct SlidingWindowModel {
    limit: i64,
    window: i64,
    sub: i64,
    subs: SubWindows,
    ids: BTreeMap<String, i64>,
}

impl RuleModel for SlidingWindowModel {
    fn room_at(&self, t: i64, _: bool) -> i64 {
        self.limit - self.subs.counted(self.sub, self.window, t)
    }

    fn remembers(&self, id: &str, now: i64, _: bool) -> bool {
        remembered(&self.ids, id, now, self.window, self.sub)
    }

    fn admit(&mut self, id: &str, now: i64) {
        self.subs.admit(self.sub, self.window, now);
        remember(&mut self.ids, id, now, self.window);
    }

    fn changes(&self) -> Vec<i64> {
        let mut out = self.subs.changes(self.sub, [self.window].into_iter());
        out.extend(id_changes(&self.ids, self.window, self.sub));
        out
    }

    fn reconfigure(&mut self, params: &Params) {
        let Params::Sliding {
            limit, window, sub, ..
        } = *params
        else {
            panic!("not a sliding window: {params:?}")
        };
        (self.limit, self.window, self.sub) = (limit.into(), window, sub);
    }
}

/// Every (limit, window) policy at once over one log of sub-windows of `sub` ms; the room is
/// the least room of any policy; ids are remembered for the longest window. Policies are
/// numbered in increasing window order.
#[derive(Debug)]
struct SlidingLogModel {
    sub: i64,
    policies: Vec<(i64, i64)>,
    subs: SubWindows,
    ids: BTreeMap<String, i64>,
}

impl SlidingLogModel {
    fn longest(&self) -> i64 {
        self.policies.iter().map(|p| p.1).max().expect("policies")
    }

    fn sorted(policies: &[(u32, i64)]) -> Vec<(i64, i64)> {
        let mut policies: Vec<(i64, i64)> =
            policies.iter().map(|&(l, w)| (i64::from(l), w)).collect();
        policies.sort_by_key(|p| p.1);
        policies
    }
}

impl RuleModel for SlidingLogModel {
    fn room_at(&self, t: i64, _: bool) -> i64 {
        self.policies
            .iter()
            .map(|&(limit, window)| limit - self.subs.counted(self.sub, window, t))
            .min()
            .expect("policies")
    }

    fn remembers(&self, id: &str, now: i64, _: bool) -> bool {
        remembered(&self.ids, id, now, self.longest(), self.sub)
    }

    fn admit(&mut self, id: &str, now: i64) {
        let longest = self.longest();
        self.subs.admit(self.sub, longest, now);
        remember(&mut self.ids, id, now, longest);
    }

    fn refusing_policy(&self, now: i64) -> Option<usize> {
        self.policies
            .iter()
            .position(|&(limit, window)| limit - self.subs.counted(self.sub, window, now) < 1)
            .map(|k| k + 1)
    }

    fn changes(&self) -> Vec<i64> {
        let windows = self.policies.iter().map(|p| p.1);
        let mut out = self.subs.changes(self.sub, windows);
        out.extend(id_changes(&self.ids, self.longest(), self.sub));
        out
    }

    fn reconfigure(&mut self, params: &Params) {
        let Params::Log { sub, policies } = params else {
            panic!("not a sliding log: {params:?}")
        };
        (self.sub, self.policies) = (*sub, SlidingLogModel::sorted(policies));
    }
}

/// At most `limit` sends in any `window` ms, exactly: a send admitted at `at` counts while
/// `at <= t < at + window`, and its id is remembered exactly as long.
#[derive(Debug)]
struct ZsetWindowModel {
    limit: i64,
    window: i64,
    sends: BTreeMap<String, i64>,
}

impl RuleModel for ZsetWindowModel {
    fn room_at(&self, t: i64, _: bool) -> i64 {
        let counted = self
            .sends
            .values()
            .filter(|&&at| at <= t && t < at + self.window)
            .count();
        self.limit - counted as i64
    }

    fn remembers(&self, id: &str, now: i64, _: bool) -> bool {
        remembered(&self.sends, id, now, self.window, 1)
    }

    fn admit(&mut self, id: &str, now: i64) {
        remember(&mut self.sends, id, now, self.window);
    }

    fn changes(&self) -> Vec<i64> {
        id_changes(&self.sends, self.window, 1)
    }

    fn reconfigure(&mut self, params: &Params) {
        let Params::Zset { limit, window } = *params else {
            panic!("not a zset window: {params:?}")
        };
        (self.limit, self.window) = (limit.into(), window);
    }
}

// ---------------------------------------------------------------------------------------------
// Rules as configuration
// ---------------------------------------------------------------------------------------------

/// One rule's parameters; the policy is always built from TOML so that validation runs.
#[derive(Debug, Clone)]
enum Params {
    Fixed {
        limit: u32,
        window: i64,
    },
    Sliding {
        limit: u32,
        window: i64,
        sub: i64,
        list: bool,
    },
    /// Policies as (limit, window ms), written to the configuration in the given order.
    Log {
        sub: i64,
        policies: Vec<(u32, i64)>,
    },
    Zset {
        limit: u32,
        window: i64,
    },
}

impl Params {
    fn kind(&self) -> &'static str {
        match self {
            Params::Fixed { .. } => "fixed_window",
            Params::Sliding { .. } => "sliding_window",
            Params::Log { .. } => "sliding_log",
            Params::Zset { .. } => "zset_window",
        }
    }

    fn toml(&self) -> String {
        let head = format!("[[rules]]\nname = \"w\"\nkind = \"{}\"\n", self.kind());
        let body = match self {
            Params::Fixed { limit, window } | Params::Zset { limit, window } => {
                format!("limit = {limit}\nwindow = \"{window}ms\"\n")
            }
            Params::Sliding {
                limit,
                window,
                sub,
                list,
            } => format!(
                "limit = {limit}\nwindow = \"{window}ms\"\nsub_window = \"{sub}ms\"\n\
                 storage = \"{}\"\n",
                if *list { "list" } else { "hash" }
            ),
            Params::Log { sub, policies } => {
                let items: Vec<String> = policies
                    .iter()
                    .map(|(limit, window)| {
                        format!("{{ limit = {limit}, window = \"{window}ms\" }}")
                    })
                    .collect();
                format!(
                    "sub_window = \"{sub}ms\"\npolicies = [{}]\n",
                    items.join(", ")
                )
            }
        };
        head + &body
    }

    fn policy(&self) -> Policy {
        Settings::from_toml(&self.toml(), |_| None)
            .unwrap_or_else(|e| panic!("{self:?} is a valid rule: {e}"))
            .policy
    }

    fn model(&self) -> Box<dyn RuleModel> {
        match self.clone() {
            Params::Fixed { limit, window } => Box::new(FixedWindowModel {
                limit: limit.into(),
                window,
                current: None,
            }),
            Params::Sliding {
                limit, window, sub, ..
            } => Box::new(SlidingWindowModel {
                limit: limit.into(),
                window,
                sub,
                subs: SubWindows {
                    sub,
                    sends: BTreeMap::new(),
                },
                ids: BTreeMap::new(),
            }),
            Params::Log { sub, policies } => Box::new(SlidingLogModel {
                sub,
                policies: SlidingLogModel::sorted(&policies),
                subs: SubWindows {
                    sub,
                    sends: BTreeMap::new(),
                },
                ids: BTreeMap::new(),
            }),
            Params::Zset { limit, window } => Box::new(ZsetWindowModel {
                limit: limit.into(),
                window,
                sends: BTreeMap::new(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Redis
// ---------------------------------------------------------------------------------------------

/// The model tests' limiter harness, with what these tests read of the window kinds' keys.
struct Store(LimiterHarness);

impl Store {
    fn open() -> Store {
        Store(LimiterHarness::single("sqtwin"))
    }

    /// A store on `settings` (the single server or the cluster).
    fn on(settings: &sendquota::config::RedisSettings) -> Store {
        Store(LimiterHarness::on("sqtwin", settings))
    }

    /// Decides message `id` of `recipient` at epoch ms `now`: the rule's verdict and whether
    /// the evaluation committed.
    fn eval(&self, policy: &Policy, recipient: &str, id: &str, now: i64, commit: bool) -> Verdict {
        let body = support::request(id, recipient, "UTC").to_string();
        let message = SendRequest::decode(body.as_bytes(), 1 << 16).expect("valid request");
        let eval = self.0.evaluate(policy, &message, at(now), commit);
        assert_eq!(eval.verdicts().len(), 1, "one rule, one verdict");
        let verdict = eval.verdicts()[0].clone();
        assert_eq!(
            eval.committed(),
            commit && verdict.allowed,
            "committed flag at {now} for {id}: {verdict:?}"
        );
        verdict
    }

    /// The state key of rule "w" for `recipient`; the ids key is this plus ":ids".
    fn state_key(&self, recipient: &str, kind: &str) -> String {
        rule_key(
            &self.0.namespace,
            &scope_tag(&ScopeValue::Recipient(recipient)),
            "w",
            kind,
        )
    }

    fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        self.0.query(cmd)
    }

    /// The serialised values of `keys` (None for a missing key): equal before and after a step
    /// exactly when the step wrote nothing.
    fn dump(&self, keys: &[String]) -> Vec<Option<Vec<u8>>> {
        keys.iter()
            .map(|k| self.query(redis::cmd("DUMP").arg(k)))
            .collect()
    }

    fn list(&self, key: &str) -> Vec<i64> {
        self.query(redis::cmd("LRANGE").arg(key).arg(0).arg(-1))
    }

    /// Keys of `recipient` that exist without an expiry, with their PTTL.
    fn keys_without_expiry(&self, recipient: &str) -> Vec<(String, i64)> {
        let tag = scope_tag(&ScopeValue::Recipient(recipient));
        self.0
            .keys_with_ttl(&format!(":{tag}:"))
            .into_iter()
            .filter(|&(_, ttl)| ttl != -2 && ttl <= 0)
            .collect()
    }
}

fn at(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).expect("instant in range")
}

fn retry_ms(v: &Verdict) -> Option<i64> {
    v.retry_after.map(|t| t.timestamp_millis())
}

/// The policy number a sliding log's refusal names ("... (policy 2 of 3)").
fn refusing_policy(reason: &str) -> Option<usize> {
    let rest = &reason[reason.find("(policy ")? + "(policy ".len()..];
    rest[..rest.find(' ')?].parse().ok()
}

// ---------------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------------

/// 2026-01-01T00:00:00Z; every case starts somewhere in the following quarter hour, so windows
/// and sub-windows fall on every alignment.
const BASE_MS: i64 = 1_767_225_600_000;

/// Expiries are durations from the worker's clock, counted down by Redis on its own (real)
/// clock, while the simulated clock here stands still, jumps ahead or goes back. The random
/// parameters make every expiry at least 1 s (windows of 1 s or more; sliding windows of at
/// least two sub-windows of 1 s or more, so a key lives at least a window less a sub-window),
/// and a case stops early once it has run this long, so no key can expire behind the model's
/// back. (A window of a single sub-window can get a 1 ms expiry, right for a worker whose clock
/// keeps going but not for a simulated one that stands still, so it is left out.)
const CASE_REAL_TIME: Duration = Duration::from_millis(700);

const CASES: u32 = 96;

#[derive(Debug, Clone)]
struct Step {
    /// Milliseconds the worker's clock moves before this step; negative for a clock that went
    /// back (skew between workers).
    delta_ms: i64,
    id: usize,
    commit: bool,
}

fn step() -> impl Strategy<Value = Step> {
    let delta = prop_oneof![
        3 => Just(0i64),
        4 => 1i64..=400,
        5 => 1i64..=3_000,
        1 => 3_000i64..=30_000,
        1 => -3_000i64..=-1,
    ];
    (delta, 0usize..5, prop::bool::weighted(0.8)).prop_map(|(delta_ms, id, commit)| Step {
        delta_ms,
        id,
        commit,
    })
}

/// What the cases of one property test went through, so that a test cannot pass vacuously.
#[derive(Default)]
struct Coverage {
    steps: AtomicU32,
    refused: AtomicU32,
    redelivered: AtomicU32,
    clock_back: AtomicU32,
    reloaded: AtomicU32,
    cut_short: AtomicU32,
}

fn count(counter: &AtomicU32, yes: bool) {
    if yes {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The refusal text the worker writes for sliding log policy `k` (1-based, in increasing window
/// order) of `policies`.
fn log_reason(policies: &[(u32, i64)], k: usize) -> String {
    let mut sorted = policies.to_vec();
    sorted.sort_by_key(|p| p.1);
    let (limit, window) = sorted[k - 1];
    format!(
        "at most {limit} per {} (policy {k} of {})",
        human_ms(window),
        sorted.len()
    )
}

/// Runs the script and the model side by side over random cases of `params`, on the single
/// server and on the cluster.
fn script_matches_model(params: impl Strategy<Value = Params> + Clone) {
    for (_, target) in support::redis_targets() {
        script_matches_model_on(&target, params.clone().prop_map(|p| vec![p]), false);
    }
}

/// [`script_matches_model`] with the rule reloaded now and then (one step in ten) with other
/// parameters of the same kind, every one of them drawn anew: what the rule holds is read
/// under the new ones as the model carries it over.
fn script_matches_model_across_reloads(params: impl Strategy<Value = Params> + Clone) {
    for (_, target) in support::redis_targets() {
        script_matches_model_on(&target, prop::collection::vec(params.clone(), 2..5), true);
    }
}

fn script_matches_model_on(
    target: &sendquota::config::RedisSettings,
    params: impl Strategy<Value = Vec<Params>>,
    reloads: bool,
) {
    let store = Store::on(target);
    let case = AtomicU32::new(0);
    let seen = Coverage::default();
    let strategy = (
        params,
        0i64..900_000,
        prop::collection::vec((step(), prop::option::weighted(0.1, 0usize..4)), 1..60),
    );
    let result = support::property_runner(CASES).run(&strategy, |(kinds, offset, steps)| {
        let began = Instant::now();
        let recipient = format!("p{}", case.fetch_add(1, Ordering::SeqCst));
        let policies: Vec<Policy> = kinds.iter().map(Params::policy).collect();
        let mut params = &kinds[0];
        let mut policy = &policies[0];
        let mut model = params.model();
        let state = store.state_key(&recipient, params.kind());
        let keys = [state.clone(), format!("{state}:ids")];
        let mut now = BASE_MS + offset;
        for (i, (s, reload)) in steps.iter().enumerate() {
            if began.elapsed() > CASE_REAL_TIME {
                count(&seen.cut_short, true);
                break;
            }
            if let Some(k) = reload.map(|k| k % kinds.len()).filter(|_| kinds.len() > 1) {
                (params, policy) = (&kinds[k], &policies[k]);
                model.reconfigure(params);
                count(&seen.reloaded, true);
            }
            now += s.delta_ms;
            let id = format!("m{}", s.id);
            let want = decide(model.as_mut(), &id, now, s.commit);
            let writes = s.commit && want.allowed && !want.already;
            let before = (!writes).then(|| store.dump(&keys));
            let v = store.eval(policy, &recipient, &id, now, s.commit);
            let got = Decision {
                allowed: v.allowed,
                already: v.already,
                remaining: v.remaining.expect("window kinds count"),
                retry_after: retry_ms(&v),
                policy: refusing_policy(&v.reason),
            };
            prop_assert_eq!(
                &got,
                &want,
                "step {} at {} ({:?}) under {:?}, model {:?}",
                i,
                now,
                s,
                params,
                model
            );
            if let (Params::Log { policies, .. }, Some(k)) = (params, want.policy) {
                prop_assert_eq!(&v.reason, &log_reason(policies, k), "step {}", i);
            }
            count(&seen.steps, true);
            count(&seen.refused, !want.allowed);
            count(&seen.redelivered, want.already);
            count(&seen.clock_back, s.delta_ms < 0);
            if let Some(before) = before {
                prop_assert_eq!(
                    store.dump(&keys),
                    before,
                    "step {} at {} ({:?}) must write nothing",
                    i,
                    now,
                    s
                );
            }
            if let Some(retry) = want.retry_after {
                let early = store.eval(policy, &recipient, &id, retry - 1, false);
                prop_assert!(
                    !early.allowed && retry_ms(&early) == Some(retry),
                    "step {}: 1 ms before retry_after {} still refused with the same retry: {:?}",
                    i,
                    retry,
                    early
                );
                let on_time = store.eval(policy, &recipient, &id, retry, false);
                prop_assert!(
                    on_time.allowed,
                    "step {}: allowed at retry_after {}: {:?}",
                    i,
                    retry,
                    on_time
                );
            }
        }
        let lasting = store.keys_without_expiry(&recipient);
        prop_assert!(lasting.is_empty(), "keys without expiry: {:?}", lasting);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let n = |c: &AtomicU32| c.load(Ordering::Relaxed);
    let summary = format!(
        "{} steps: {} refused, {} redelivered, {} with the clock gone back, {} reloads; {} of \
         {CASES} cases cut short after {CASE_REAL_TIME:?}",
        n(&seen.steps),
        n(&seen.refused),
        n(&seen.redelivered),
        n(&seen.clock_back),
        n(&seen.reloaded),
        n(&seen.cut_short)
    );
    eprintln!("{summary}");
    assert!(
        n(&seen.refused) > 0 && n(&seen.redelivered) > 0 && n(&seen.clock_back) > 0,
        "the cases must exercise refusals, redeliveries and a clock going back: {summary}"
    );
    assert!(
        !reloads || n(&seen.reloaded) > 0,
        "no case reloaded the rule: {summary}"
    );
}

fn fixed() -> impl Strategy<Value = Params> + Clone {
    (1u32..=4, 2i64..=12).prop_map(|(limit, halves)| Params::Fixed {
        limit,
        window: halves * 500,
    })
}

#[test]
fn fixed_window_script_matches_the_model() {
    script_matches_model(fixed());
}

fn sliding(list: bool) -> impl Strategy<Value = Params> + Clone {
    (
        1u32..=5,
        prop::sample::select(vec![1_000i64, 1_500, 2_000]),
        2i64..=4,
    )
        .prop_map(move |(limit, sub, n)| Params::Sliding {
            limit,
            window: sub * n,
            sub,
            list,
        })
}

#[test]
fn sliding_window_hash_script_matches_the_model() {
    script_matches_model(sliding(false));
}

#[test]
fn sliding_window_list_script_matches_the_model() {
    script_matches_model(sliding(true));
}

fn sliding_log() -> impl Strategy<Value = Params> + Clone {
    let policies = prop::collection::btree_set(2i64..=8, 1..=3).prop_flat_map(|subs| {
        let count = subs.len();
        (
            Just(subs),
            1u32..=3,
            prop::collection::vec(1u32..=3, count),
            any::<bool>(),
        )
    });
    (prop::sample::select(vec![1_000i64, 2_000]), policies).prop_map(
        |(sub, (subs, first, steps, reversed))| {
            let mut limit = first;
            let mut policies: Vec<(u32, i64)> = subs
                .into_iter()
                .zip(steps)
                .map(|(n, step)| {
                    limit += step;
                    (limit - step, n * sub)
                })
                .collect();
            if reversed {
                policies.reverse();
            }
            Params::Log { sub, policies }
        },
    )
}

#[test]
fn sliding_log_script_matches_the_model() {
    script_matches_model(sliding_log());
}

fn zset() -> impl Strategy<Value = Params> + Clone {
    (1u32..=4, 2i64..=12).prop_map(|(limit, halves)| Params::Zset {
        limit,
        window: halves * 500,
    })
}

#[test]
fn zset_window_script_matches_the_model() {
    script_matches_model(zset());
}

#[test]
fn fixed_window_keeps_its_window_across_reloads_that_change_every_parameter() {
    script_matches_model_across_reloads(fixed());
}

#[test]
fn sliding_window_keeps_its_counts_across_reloads_that_change_every_parameter() {
    script_matches_model_across_reloads(prop_oneof![sliding(false), sliding(true)]);
}

#[test]
fn sliding_log_keeps_its_counts_across_reloads_that_change_every_parameter() {
    script_matches_model_across_reloads(sliding_log());
}

#[test]
fn zset_window_keeps_its_sends_across_reloads_that_change_every_parameter() {
    script_matches_model_across_reloads(zset());
}

// ---------------------------------------------------------------------------------------------
// The seeds' weak spots
// ---------------------------------------------------------------------------------------------

/// A rule under test: its policy and a recipient of its own.
struct Rule<'s> {
    store: &'s Store,
    policy: Policy,
    recipient: String,
}

impl<'s> Rule<'s> {
    fn new(store: &'s Store, params: &Params, recipient: &str) -> Rule<'s> {
        Rule {
            store,
            policy: params.policy(),
            recipient: recipient.to_owned(),
        }
    }

    fn send(&self, id: &str, now: i64) -> Verdict {
        self.store
            .eval(&self.policy, &self.recipient, id, now, true)
    }

    fn key(&self) -> String {
        self.store
            .state_key(&self.recipient, self.policy.rules[0].kind.name())
    }
}

#[test]
fn fixed_window_client_retrying_while_denied_is_allowed_as_soon_as_the_window_ends() {
    let store = Store::open();
    let rule = Rule::new(
        &store,
        &Params::Fixed {
            limit: 2,
            window: 10_000,
        },
        "retrier",
    );
    let t0 = BASE_MS + 123;
    assert!(rule.send("a", t0).allowed);
    assert!(rule.send("b", t0 + 100).allowed);
    // The client retries every 250 ms for the rest of the window: each attempt is refused with
    // the same retry_after, and none of them counts.
    let mut t = t0 + 200;
    while t < t0 + 10_000 {
        let v = rule.send(&format!("retry{t}"), t);
        assert!(!v.allowed, "refused at {t}: {v:?}");
        assert_eq!(retry_ms(&v), Some(t0 + 10_000), "at {t}");
        assert_eq!(v.remaining, Some(0));
        t += 250;
    }
    let v = rule.send("c", t0 + 9_999);
    assert!(!v.allowed, "still refused 1 ms before the end: {v:?}");
    let v = rule.send("c", t0 + 10_000);
    assert!(v.allowed, "allowed when the window ends: {v:?}");
    assert_eq!(v.remaining, Some(1), "the new window holds only this send");
    assert!(rule.send("d", t0 + 10_001).allowed);
    let v = rule.send("e", t0 + 10_002);
    assert_eq!(
        retry_ms(&v),
        Some(t0 + 20_000),
        "the new window started at c"
    );
}

#[test]
fn fixed_window_recognises_an_id_admitted_while_the_clock_lagged_behind_the_window_start() {
    let store = Store::open();
    let rule = Rule::new(
        &store,
        &Params::Fixed {
            limit: 3,
            window: 10_000,
        },
        "lagging",
    );
    let t0 = BASE_MS + 5_000;
    assert_eq!(rule.send("a", t0).remaining, Some(2));
    // Another worker whose clock is 2 s behind admits b in the same window.
    assert_eq!(rule.send("b", t0 - 2_000).remaining, Some(1));
    // b redelivered: already admitted in this window, consumes nothing.
    let v = rule.send("b", t0 + 1_000);
    assert!(v.allowed && v.already, "{v:?}");
    assert_eq!(v.remaining, Some(1));
    assert_eq!(rule.send("c", t0 + 1_000).remaining, Some(0));
}

#[test]
fn sliding_window_list_drops_every_expired_sub_window_after_an_idle_gap() {
    let store = Store::open();
    let rule = Rule::new(
        &store,
        &Params::Sliding {
            limit: 3,
            window: 3_000,
            sub: 1_000,
            list: true,
        },
        "idle",
    );
    let first = (BASE_MS + 7_000) / 1_000;
    for k in 0..3 {
        let v = rule.send(&format!("m{k}"), (first + k) * 1_000 + 10);
        assert_eq!(v.remaining, Some(2 - k), "send {k}");
    }
    assert_eq!(
        store.list(&rule.key()),
        vec![3, first, 1, first + 1, 1, first + 2, 1]
    );
    // Idle for far longer than the window: all three sub-windows have expired.
    let later = (first + 20) * 1_000 + 500;
    let v = rule.send("back", later);
    assert!(v.allowed);
    assert_eq!(v.remaining, Some(2), "nothing from before the gap counts");
    assert_eq!(store.list(&rule.key()), vec![1, first + 20, 1]);
    assert_eq!(rule.send("two", later + 1).remaining, Some(1));
    assert_eq!(rule.send("three", later + 2).remaining, Some(0));
    let v = rule.send("four", later + 3);
    assert!(!v.allowed);
    assert_eq!(retry_ms(&v), Some((first + 23) * 1_000));
}

#[test]
fn sliding_window_list_removes_expired_sub_windows_by_position_never_by_value() {
    let store = Store::open();
    let rule = Rule::new(
        &store,
        &Params::Sliding {
            limit: 10,
            window: 2_000,
            sub: 1_000,
            list: true,
        },
        "values",
    );
    // Near the epoch, sub-window indices are small numbers that counts can equal.
    assert_eq!(rule.send("a", 3_000).remaining, Some(9));
    for (k, id) in ["b", "c", "d"].into_iter().enumerate() {
        rule.send(id, 4_000 + k as i64);
    }
    // Sub-window 4 holds 3 sends: its count equals the index of sub-window 3, and the total
    // (4) equals its own index.
    assert_eq!(store.list(&rule.key()), vec![4, 3, 1, 4, 3]);
    // At 5 s sub-window 3 expires; the count 3 of sub-window 4 must stay.
    let v = rule.send("e", 5_000);
    assert_eq!(v.remaining, Some(10 - 3 - 1), "sub-window 4 still counts 3");
    assert_eq!(store.list(&rule.key()), vec![4, 4, 3, 5, 1]);
    // At 6 s sub-window 4 expires, by position, whatever its values.
    let v = rule.send("f", 6_000);
    assert_eq!(v.remaining, Some(10 - 1 - 1), "only sub-window 5 counts");
    assert_eq!(store.list(&rule.key()), vec![2, 5, 1, 6, 1]);
}

#[test]
fn sliding_log_names_the_policy_that_refused() {
    let store = Store::open();
    let rule = Rule::new(
        &store,
        &Params::Log {
            sub: 1_000,
            policies: vec![(3, 10_000), (2, 2_000)],
        },
        "log",
    );
    let t0 = BASE_MS;
    assert!(rule.send("a", t0).allowed);
    assert!(rule.send("b", t0 + 5_000).allowed);
    assert_eq!(rule.send("c", t0 + 5_100).remaining, Some(0));
    // Both policies refuse: the first is named, retry_after is when both have room.
    let v = rule.send("d", t0 + 5_500);
    assert!(!v.allowed);
    assert_eq!(v.reason, "at most 2 per 2s (policy 1 of 2)");
    assert_eq!(retry_ms(&v), Some(t0 + 10_000));
    // At 7 s the 2 s policy has room again; only the 10 s one refuses.
    let v = rule.send("d", t0 + 7_000);
    assert!(!v.allowed);
    assert_eq!(v.reason, "at most 3 per 10s (policy 2 of 2)");
    assert_eq!(retry_ms(&v), Some(t0 + 10_000));
    assert!(!rule.send("d", t0 + 9_999).allowed);
    let v = rule.send("d", t0 + 10_000);
    assert!(v.allowed, "{v:?}");
    assert_eq!(v.reason, "");
}

#[test]
fn sliding_log_with_a_shorter_window_allowing_more_is_refused_at_config_load() {
    let toml = policy!("sliding_log_shorter_window_allowing_more");
    match Settings::from_toml(toml, |_| None) {
        Ok(_) => panic!("a 10s policy allowing more than the 1m policy was accepted"),
        Err(e) => assert_eq!(
            e.to_string(),
            "rule \"w\": the policy over 10s allows 5, not fewer than the policy over the longer \
             1m (3): a shorter window must have a smaller limit"
        ),
    }
}

#[test]
fn zset_window_counts_two_ids_at_the_same_millisecond_as_two_sends() {
    let store = Store::open();
    let rule = Rule::new(
        &store,
        &Params::Zset {
            limit: 2,
            window: 5_000,
        },
        "same_ms",
    );
    let t = BASE_MS + 42;
    assert_eq!(rule.send("a", t).remaining, Some(1));
    let v = rule.send("b", t);
    assert!(v.allowed && !v.already);
    assert_eq!(v.remaining, Some(0), "b is a second send");
    let v = rule.send("a", t);
    assert!(v.allowed && v.already, "a redelivered is recognised: {v:?}");
    let v = rule.send("c", t);
    assert!(!v.allowed, "a third id in the same ms is refused: {v:?}");
    assert_eq!(retry_ms(&v), Some(t + 5_000));
    let count: i64 = store.query(redis::cmd("ZCARD").arg(rule.key()));
    assert_eq!(count, 2);
}

#[test]
fn every_window_kind_allows_a_send_at_exactly_retry_after() {
    let store = Store::open();
    let kinds = [
        Params::Fixed {
            limit: 2,
            window: 7_000,
        },
        Params::Sliding {
            limit: 2,
            window: 6_000,
            sub: 1_500,
            list: false,
        },
        Params::Sliding {
            limit: 2,
            window: 6_000,
            sub: 1_500,
            list: true,
        },
        Params::Log {
            sub: 1_000,
            policies: vec![(1, 2_000), (2, 9_000)],
        },
        Params::Zset {
            limit: 2,
            window: 7_000,
        },
    ];
    for (n, params) in kinds.iter().enumerate() {
        let rule = Rule::new(&store, params, &format!("exact{n}"));
        let t0 = BASE_MS + 333;
        assert!(rule.send("a", t0).allowed, "{params:?}");
        assert!(rule.send("b", t0 + 2_777).allowed, "{params:?}");
        let v = rule.send("c", t0 + 2_901);
        assert!(!v.allowed, "{params:?}: {v:?}");
        let retry = retry_ms(&v).expect("a refusal has a retry_after");
        let expected = match params {
            Params::Fixed { window, .. } | Params::Zset { window, .. } => t0 + window,
            Params::Sliding { window, sub, .. } => t0.div_euclid(*sub) * sub + window,
            Params::Log { .. } => t0.div_euclid(1_000) * 1_000 + 9_000,
        };
        assert_eq!(retry, expected, "{params:?}");
        let early = rule.send("c", retry - 1);
        assert!(!early.allowed, "{params:?}: 1 ms early: {early:?}");
        assert_eq!(retry_ms(&early), Some(retry), "{params:?}");
        let v = rule.send("c", retry);
        assert!(v.allowed, "{params:?}: at retry_after: {v:?}");
    }
}

/// Keys live long: sub-window counters written before the sub-window length was kept beside
/// them (in the ids set) are numbered in the rule's current sub-windows, and the next admission
/// keeps the length, so that a reload after the upgrade moves the counts too.
#[test]
fn sliding_window_counters_written_before_their_sub_window_was_kept_are_read_in_the_rules() {
    let store = Store::open();
    let before = Params::Sliding {
        limit: 3,
        window: 3_000,
        sub: 1_000,
        list: false,
    };
    let rule = Rule::new(&store, &before, "legacy");
    let t0 = BASE_MS + 5_000;
    let ids = format!("{}:ids", rule.key());
    let _: i64 = store.query(redis::cmd("HSET").arg(rule.key()).arg(t0 / 1_000).arg(2));
    let _: i64 = store.query(redis::cmd("ZADD").arg(&ids).arg(t0).arg("old"));
    let v = rule.send("old", t0 + 10);
    assert!(
        v.allowed && v.already,
        "an id the old version admitted: {v:?}"
    );
    let v = rule.send("new", t0 + 10);
    assert_eq!(
        (v.allowed, v.remaining),
        (true, Some(0)),
        "two counted, one more fits"
    );
    let kept: Option<f64> = store.query(redis::cmd("ZSCORE").arg(&ids).arg("\0sub"));
    assert_eq!(
        kept,
        Some(-1_000.0),
        "the admission kept the sub-window length"
    );
    // Reloaded with half-second sub-windows: the three sends are in the one holding their
    // second's start, and count until it leaves the window.
    let after = Rule::new(
        &store,
        &Params::Sliding {
            limit: 3,
            window: 3_000,
            sub: 500,
            list: true,
        },
        "legacy",
    );
    let v = after.send("third", t0 + 20);
    assert!(!v.allowed, "{v:?}");
    assert_eq!(retry_ms(&v), Some(t0 + 3_000));
    assert!(after.send("third", t0 + 3_000).allowed);
}
