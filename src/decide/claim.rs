//! In-flight claims: one delivery of a message id at a time is decided and dispatched.
//!
//! A producer that retries a publish, or a redelivery racing its first delivery, puts several
//! copies of one message in flight, on one worker or several. The dispatch mark
//! ([`crate::decide::dedup`]) is only written once the broker confirmed the dispatch, so a copy decided
//! meanwhile would find the id "already admitted" and be dispatched again. So a delivery that
//! may go out claims its message id (recipient, id) in the same script call as the decision,
//! and a copy that finds a live claim of another delivery neither dispatches nor denies: it
//! goes back to the queue through the shortest delay queue and is decided again later, by
//! which time the first copy is marked dispatched (the copy is then a duplicate) or gone.
//!
//! A claim is a lease on real time: a key of its own holding the delivery's token
//! ([`crate::decide::keys::claim_key`]), which Redis expires on its own clock, the one every
//! worker shares whatever its own clock says. The delivery renews it while its message is in
//! flight (publishing can wait out a broker alarm), the dispatch mark removes it, and a delivery
//! given up without a dispatch (its channel lost, the worker stopping) releases it. A claim
//! whose worker crashed expires after the lease; the next copy is then decided afresh and
//! dispatched, which is the documented crash window (a crash between the broker's confirm and
//! the mark). A refused or delayed message holds no claim.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The claim one delivery holds on its message id: a token no other delivery has, and the
/// lease each take or renewal grants.
#[derive(Debug, Clone)]
pub struct Claim {
    token: String,
    lease_ms: i64,
}

impl Claim {
    /// A claim with a fresh token, leased `lease_ms` at a time.
    pub fn new(lease_ms: u64) -> Claim {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // Unique across processes (pid and start time) and deliveries (a counter).
        static PROCESS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let process = PROCESS.get_or_init(|| {
            let started = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            format!("{:x}.{started:x}", std::process::id())
        });
        Claim {
            token: format!("{process}.{:x}", NEXT.fetch_add(1, Ordering::Relaxed)),
            lease_ms: i64::try_from(lease_ms).unwrap_or(i64::MAX).max(1),
        }
    }

    /// The holder's token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// How long a take or renewal holds the claim, in ms.
    pub fn lease_ms(&self) -> i64 {
        self.lease_ms
    }

    /// Runs `work` while keeping this claim alive with `renew`, every third of the lease,
    /// until `renew` says the claim is lost. The renewals run in the caller's task, between
    /// polls of `work`: a dispatch normally ends long before the first one, so it costs no task
    /// and no copy of the message. The claim's owner in Redis (the limiter) renews it: this
    /// module holds no connection. `work` is pinned by the caller: taken by value, it would be
    /// stored twice in this future's state (the argument and the pinned local), kilobytes per
    /// delivery.
    pub async fn held_while<T, R: Future<Output = bool>>(
        &self,
        mut renew: impl FnMut() -> R,
        mut work: std::pin::Pin<&mut impl Future<Output = T>>,
    ) -> T {
        let every = Duration::from_millis((self.lease_ms / 3).max(1) as u64);
        let mut renewing = true;
        loop {
            tokio::select! {
                out = &mut work => return out,
                _ = tokio::time::sleep(every), if renewing => {
                    renewing = renew().await;
                }
            }
        }
    }
}
