//! Denials answered without Redis, for recipients known to be full until a known instant.
//!
//! A recipient whose calendar quota is full stays full until the first day with room begins
//! in some zone (nothing can be admitted for them meanwhile, so nothing changes), and the
//! verdicts for one zone stay the same until that zone's next midnight, whichever is first. Until then every new
//! message to them gets the same verdicts, which this cache returns. It is exact:
//! - only policies whose matching rules are all recipient-scope `calendar_quota` rules with
//!   `on_deny = drop` are cached (one scope, so no cross-scope refunds; no shadow or delay);
//! - an id that was already admitted is never answered from the cache (Redis would admit it
//!   again without consuming);
//! - an answer is reused only for a message that matches the same rules (with match filters,
//!   an sms and an email to one recipient meet different caps), and when some recipient-scope
//!   rule has a match filter, every admission invalidates its recipient: a message matching
//!   other rules can be admitted while this one is refused, and changes rules they share;
//! - anything that can change a full recipient's state (an admin reset, a refund, an id
//!   re-admitted by some rules only) invalidates the recipient on every worker through Redis
//!   pub/sub; while the subscription is down the cache is off
//!   and emptied; a generation counter drops fills that raced an invalidation;
//! - a configuration change restarts the workers, which start with empty caches.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use super::{calendar, Verdict};
use crate::message::SendRequest;
use crate::policy::{CalendarQuota, Kind, OnDeny, Policy, Rule, Scope};

/// Whether a calendar quota `q` holding entries on `scores` (local day numbers) has room for
/// one more send on day `day`: the rule of `lua/calendar_quota.lua`.
fn has_room(q: &CalendarQuota, scores: &[i64], day: i64) -> bool {
    let window = i64::from(q.window_days);
    let on_day = scores.iter().filter(|&&s| s == day).count();
    let in_window = scores.iter().filter(|&&s| s > day - window).count();
    on_day < q.per_day as usize && in_window < q.per_window as usize
}

/// Until when no message to this recipient can be admitted, in any zone: the recipient's
/// calendar state is frozen until then. Messages in other zones count days differently (local
/// dates on Earth span UTC-12 to UTC+14), so the first day with room in every rule is taken
/// as soon as it begins anywhere. `None` when some zone can admit a message now.
pub fn frozen_until(
    rules: &[(CalendarQuota, Vec<i64>)],
    now: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    let westmost = calendar::day_number(now, chrono_tz::Etc::GMTPlus12);
    let eastmost = calendar::day_number(now, chrono_tz::Etc::GMTMinus14);
    let newest = rules
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .max()
        .unwrap_or(eastmost);
    let longest = rules
        .iter()
        .map(|(q, _)| i64::from(q.window_days))
        .max()
        .unwrap_or(1);
    let first_room = (westmost..=newest.max(eastmost) + longest + 1)
        .find(|&day| rules.iter().all(|(q, scores)| has_room(q, scores, day)))?;
    (first_room > eastmost).then(|| calendar::day_start(first_room, chrono_tz::Etc::GMTMinus14))
}

/// Largest number of cached recipients (each about 300 bytes). When full, expired entries go
/// first; if that frees nothing the cache starts over (hot recipients come straight back).
const MAX_ENTRIES: usize = 10_000;

struct Entry {
    until: DateTime<Utc>,
    admitted: HashSet<String>,
    /// The names of the rules the verdicts are of: the rules that matched the message.
    rules: Vec<String>,
    verdicts: Vec<Verdict>,
}

/// Whether `rules` are the rules `entry` was filled for.
fn same_rules(entry: &Entry, rules: &[&Rule]) -> bool {
    entry
        .rules
        .iter()
        .map(String::as_str)
        .eq(rules.iter().map(|r| r.name.as_str()))
}

/// The cache shared by all in-flight messages of one worker.
#[derive(Default)]
pub struct DenyCache {
    // A std Mutex: held only for map operations, never across an await.
    /// Per recipient and zone, one entry per set of matching rules (one for a policy without
    /// match filters).
    entries: Mutex<HashMap<(String, Tz), Vec<Entry>>>,
    generation: AtomicU64,
    enabled: AtomicBool,
    hits: AtomicU64,
}

impl DenyCache {
    /// An empty cache, off until [`DenyCache::enable`] (the invalidation subscription is up).
    pub fn new() -> DenyCache {
        DenyCache::default()
    }

    /// Whether `rules` (all the rules matching one message) may be answered from the cache.
    pub fn eligible(rules: &[&Rule]) -> bool {
        !rules.is_empty()
            && rules.iter().all(|r| {
                matches!(r.kind, Kind::CalendarQuota(_))
                    && r.scope == Scope::Recipient
                    && r.on_deny == OnDeny::Drop
            })
    }

    /// Whether an admission under `policy` must invalidate its recipient's cached denials: when
    /// some recipient-scope rule has a match filter, a message matching other rules than a
    /// cached one's can be admitted while that one is refused, and change rules both match.
    pub fn admission_invalidates(policy: &Policy) -> bool {
        policy.rules.iter().any(|r| {
            r.scope == Scope::Recipient
                && !(r.matcher.channels.is_empty() && r.matcher.categories.is_empty())
        })
    }

    /// Turns the cache on (the invalidation subscription is listening) or off (it is not:
    /// everything cached is dropped).
    pub fn enable(&self, on: bool) {
        if !on {
            self.clear();
        }
        self.enabled.store(on, Ordering::SeqCst);
    }

    /// The generation to pass to [`DenyCache::fill`], read before deciding in Redis.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The cached verdicts for `message` (matching `rules`) at `now`, if its recipient is
    /// known to be full for those rules.
    pub fn lookup(
        &self,
        message: &SendRequest,
        rules: &[&Rule],
        zone: Tz,
        now: DateTime<Utc>,
    ) -> Option<Vec<Verdict>> {
        if !self.enabled.load(Ordering::SeqCst) {
            return None;
        }
        let entries = self.entries.lock().ok()?;
        let entry = entries
            .get(&(message.recipient.clone(), zone))?
            .iter()
            .find(|e| same_rules(e, rules))?;
        if now >= entry.until || entry.admitted.contains(&message.id) {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(entry.verdicts.clone())
    }

    /// Remembers that the recipient is refused with `verdicts` until `until` (decided at
    /// `now`), if no invalidation happened since `generation` was read.
    #[allow(clippy::too_many_arguments)]
    pub fn fill(
        &self,
        message: &SendRequest,
        rules: &[&Rule],
        zone: Tz,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
        admitted: HashSet<String>,
        verdicts: Vec<Verdict>,
        generation: u64,
    ) {
        if !self.enabled.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        if self.generation.load(Ordering::SeqCst) != generation {
            return;
        }
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, e| {
                e.retain(|e| e.until > now);
                !e.is_empty()
            });
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        let entry = Entry {
            until,
            admitted,
            rules: rules.iter().map(|r| r.name.clone()).collect(),
            verdicts,
        };
        let kept = entries
            .entry((message.recipient.clone(), zone))
            .or_default();
        match kept.iter_mut().find(|e| same_rules(e, rules)) {
            Some(old) => *old = entry,
            None => kept.push(entry),
        }
    }

    /// Forgets everything about `recipient` (in every zone).
    pub fn invalidate(&self, recipient: &str) {
        if let Ok(mut entries) = self.entries.lock() {
            self.generation.fetch_add(1, Ordering::SeqCst);
            entries.retain(|(r, _), _| r != recipient);
        }
    }

    /// Forgets everything.
    pub fn clear(&self) {
        if let Ok(mut entries) = self.entries.lock() {
            self.generation.fetch_add(1, Ordering::SeqCst);
            entries.clear();
        }
    }

    /// Decisions answered from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}
