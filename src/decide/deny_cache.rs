//! Denials answered without Redis, for recipients known to be full until a known instant.
//!
//! A recipient whose calendar window is full stays full until the first day with room begins
//! in some zone (nothing can be admitted for them meanwhile, so nothing changes), and the
//! verdicts for one zone stay the same until that zone's next midnight, whichever is first.
//! Until then every new message to them gets the same verdicts, which this cache returns. (A
//! recipient refused only because today is full is not frozen: a message in a zone whose day
//! has already turned is admitted, so such refusals are not cached.) It is exact:
//! - only policies whose matching rules are all recipient-scope `calendar_quota` rules with
//!   `on_deny = drop` are cached (one scope, so no cross-scope refunds; no shadow or delay),
//!   none counting per attributes (an entry is per recipient: a denial for one campaign would
//!   answer for another);
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
//! - a rule reload (`reload`) empties the cache and keeps it off until no message decided under
//!   the replaced rules is in flight: entries are only ever filled and read under one policy.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use futures_util::StreamExt;
use tokio::sync::watch;
use tracing::warn;

use crate::base::config::RedisSettings;
use crate::decide::outcome::Verdict;
use crate::request::message::SendRequest;
use crate::rules::kinds::Kind;
use crate::rules::policy::{OnDeny, Policy, Rule, Scope};

/// How much earlier than a refusing rule's `retry_after` (the first instant with room in the
/// message's zone) another zone can reach room in that rule: the same entry leaves that zone's
/// window when its own local days have passed, which begin up to 26 hours earlier (local dates
/// span UTC-12 to UTC+14), and a window's clock changes move it by an hour or so more.
const OTHER_ZONES_AHEAD: Duration = Duration::hours(30);

/// Until when no message to this recipient can be admitted, in any zone, given the verdicts of
/// a refusal: the recipient's calendar state is frozen until then. A message is admitted only
/// when every rule has room, so the refusing rule that opens last bounds it. A rule refusing
/// for today only (the window has room) opens in some other zone within hours, which this
/// bound, already past, says.
pub fn frozen_until(verdicts: &[Verdict]) -> Option<DateTime<Utc>> {
    verdicts
        .iter()
        .filter(|v| !v.allowed)
        .filter_map(|v| v.retry_after)
        .max()
        .map(|r| r - OTHER_ZONES_AHEAD)
}

/// Largest number of cached recipients (each about 300 bytes). When full, expired entries go
/// first; if that frees nothing the cache starts over (hot recipients come straight back).
const MAX_ENTRIES: usize = 10_000;

struct Entry {
    /// The zone of the messages the verdicts are for: zones count days differently.
    zone: Tz,
    until: DateTime<Utc>,
    admitted: HashSet<String>,
    /// The names of the rules the verdicts are of: the rules that matched the message.
    rules: Vec<String>,
    verdicts: Vec<Verdict>,
}

/// Whether `entry` was filled for messages in `zone` matching `rules`: the rules
/// [`Policy::rules_for`] matched (names are unique), so whatever a rule matches on, two
/// messages share an entry only when they meet the same rules.
fn same_question(entry: &Entry, zone: Tz, rules: &[&Rule]) -> bool {
    entry.zone == zone
        && entry
            .rules
            .iter()
            .map(String::as_str)
            .eq(rules.iter().map(|r| r.name.as_str()))
}

/// The cache shared by all in-flight messages of one worker.
#[derive(Default)]
pub struct DenyCache {
    // A std Mutex: held only for map operations, never across an await.
    /// Per recipient, one entry per zone and set of matching rules (one set for a policy
    /// without match filters). Keyed by the recipient alone, so a lookup borrows its name and
    /// an invalidation removes one key.
    entries: Mutex<HashMap<String, Vec<Entry>>>,
    generation: AtomicU64,
    enabled: AtomicBool,
    /// Rule reloads whose replaced rules may still be deciding messages; the cache is off
    /// while any is.
    suspended: AtomicUsize,
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
                    && r.per_attributes.is_empty()
                    && r.priority.is_empty()
                    && r.on_deny == OnDeny::Drop
            })
    }

    /// Whether an admission under `policy` must invalidate its recipient's cached denials: when
    /// some recipient-scope rule has a match filter, a message matching other rules than a
    /// cached one's can be admitted while that one is refused, and change rules both match.
    pub fn admission_invalidates(policy: &Policy) -> bool {
        policy
            .rules
            .iter()
            .any(|r| r.scope == Scope::Recipient && !r.matches_everything())
    }

    /// Turns the cache on (the invalidation subscription is listening) or off (it is not:
    /// everything cached is dropped).
    pub fn enable(&self, on: bool) {
        if !on {
            self.clear();
        }
        self.enabled.store(on, Ordering::SeqCst);
    }

    /// Turns the cache off and empties it while the rules change: until
    /// [`DenyCache::resume`], messages decided under the replaced rules may still be in
    /// flight. The flag goes up before the entries go, so no fill can slip in between.
    pub fn suspend(&self) {
        self.suspended.fetch_add(1, Ordering::SeqCst);
        self.clear();
    }

    /// Ends one [`DenyCache::suspend`]: no message decided under the rules it replaced is in
    /// flight any more.
    pub fn resume(&self) {
        let _ = self
            .suspended
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Whether lookups and fills are served: the subscription is up and no reload is settling.
    fn on(&self) -> bool {
        self.enabled.load(Ordering::SeqCst) && self.suspended.load(Ordering::SeqCst) == 0
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
        if !self.on() {
            return None;
        }
        let entries = self.entries.lock().ok()?;
        let entry = entries
            .get(message.recipient.as_str())?
            .iter()
            .find(|e| same_question(e, zone, rules))?;
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
        if !self.on() {
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
            zone,
            until,
            admitted,
            rules: rules.iter().map(|r| r.name.clone()).collect(),
            verdicts,
        };
        let kept = entries.entry(message.recipient.clone()).or_default();
        match kept.iter_mut().find(|e| same_question(e, zone, rules)) {
            Some(old) => *old = entry,
            None => kept.push(entry),
        }
    }

    /// Forgets everything about `recipient` (in every zone).
    pub fn invalidate(&self, recipient: &str) {
        if let Ok(mut entries) = self.entries.lock() {
            self.generation.fetch_add(1, Ordering::SeqCst);
            entries.remove(recipient);
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

/// Tells every worker's deny cache that `recipient`'s state changed in a way a cached denial
/// did not foresee (quota freed, or a partial re-admission).
pub async fn announce(
    conn: &crate::base::store::RedisConn,
    namespace: &str,
    recipient: &str,
) -> redis::RedisResult<()> {
    let _: i64 = redis::cmd("PUBLISH")
        .arg(crate::decide::keys::deny_cache_channel(namespace))
        .arg(recipient)
        .query_async(&mut conn.clone())
        .await?;
    Ok(())
}

/// Keeps `cache` subscribed to the quota-freeing events on `channel` until `stop` turns true;
/// the cache is on only while the subscription is up, so no invalidation can be missed.
///
/// On a Redis Cluster the subscription is on one node, the seeds taken in turn when one fails:
/// a cluster forwards every `PUBLISH` to all its nodes, so any node hears every worker's
/// announcements.
pub async fn listen(
    redis: RedisSettings,
    channel: String,
    cache: Arc<DenyCache>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff_ms = 100;
    let urls = if redis.cluster_urls.is_empty() {
        vec![redis.url.clone()]
    } else {
        redis.cluster_urls.clone()
    };
    for url in urls.iter().cycle() {
        let subscribed = async {
            let client = crate::base::store::client(url, &redis.tls)?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            redis::RedisResult::Ok(pubsub)
        };
        match subscribed.await {
            Ok(mut pubsub) => {
                backoff_ms = 100;
                cache.enable(true);
                let mut messages = pubsub.on_message();
                loop {
                    tokio::select! {
                        message = messages.next() => match message {
                            Some(m) => {
                                if let Ok(recipient) = m.get_payload::<String>() {
                                    cache.invalidate(&recipient);
                                }
                            }
                            None => break,
                        },
                        _ = stop.wait_for(|s| *s) => {
                            cache.enable(false);
                            return;
                        }
                    }
                }
                warn!("deny cache subscription lost; cache off until it is back");
                cache.enable(false);
            }
            Err(e) => warn!(error = %e, "deny cache cannot subscribe; cache off"),
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(backoff_ms)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        backoff_ms = (backoff_ms * 2).min(5_000);
    }
}
