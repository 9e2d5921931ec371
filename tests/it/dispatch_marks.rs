//! Dispatch marks: a recipient's mark set keeps every live mark, loses its expired ones within
//! `PRUNE_EVERY` marks (so a recipient who keeps receiving messages does not grow it without
//! end), and expires whole after its newest mark; on the single server and on the cluster.

use crate::support;

use chrono::Duration;
use sendquota::internals::dedup::{DispatchMarks, PRUNE_EVERY};
use sendquota::internals::keys::recipient_sent_key;
use support::local;

const TTL_S: u64 = 60;

#[tokio::test]
async fn expired_marks_are_dropped_within_prune_every_marks_and_live_ones_kept() {
    for (target, settings) in support::redis_targets() {
        let mut redis = support::connect_redis(&settings).await;
        let ns = support::unique("sqtmarks");
        let marks = DispatchMarks::new(redis.clone(), &ns, TTL_S);
        let key = recipient_sent_key(&ns, "a}{b:c");
        let n = usize::try_from(PRUNE_EVERY).expect("small");
        let t0 = local("UTC", "2026-05-01 09:00");
        for i in 0..n {
            marks
                .mark("a}{b:c", &format!("old{i}"), t0)
                .await
                .expect("mark");
        }
        // An hour later every old mark has expired; the first of the next marks drops them.
        let t1 = t0 + Duration::hours(1);
        for i in 0..n {
            marks
                .mark("a}{b:c", &format!("new{i}"), t1)
                .await
                .expect("mark");
        }
        let expected: Vec<String> = (0..n).map(|i| format!("new{i}")).collect();
        assert_eq!(
            support::zset_members(&mut redis, &key).await,
            expected,
            "{target}"
        );
        let ttl_ms: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .expect("pttl");
        assert!(
            ttl_ms > 0 && ttl_ms <= 1000 * TTL_S as i64,
            "{target}: the set expires with its newest mark, PTTL {ttl_ms}"
        );
        support::delete_keys(&mut redis, &format!("{ns}:*")).await;
    }
}
