//! Dispatch marks: a recipient's mark set keeps every live mark, loses its expired ones within
//! `PRUNE_EVERY` marks (so a recipient who keeps receiving messages does not grow it without
//! end), and expires whole after its newest mark; on the single server and on the cluster.
//! Batched marks (the worker's: confirmed messages' marks written together) are each written,
//! and a mark the server refuses neither fails the others nor is given up: its message retries
//! it alone until it is written.

use crate::support;

use chrono::Duration;
use sendquota::internals::dedup::{DispatchMarks, PRUNE_EVERY};
use sendquota::internals::keys::recipient_sent_key;
use sendquota::internals::message::SendRequest;
use support::{local, request};

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

#[tokio::test]
async fn batched_marks_are_each_written_and_a_refused_one_harms_no_other() {
    for (target, settings) in support::redis_targets() {
        let mut redis = support::connect_redis(&settings).await;
        let ns = support::unique("sqtmarkbatch");
        let marks = DispatchMarks::new(redis.clone(), &ns, TTL_S).batched();
        let now = local("UTC", "2026-05-01 09:00");
        // Recipient r0's mark set is a string: the server refuses its mark with WRONGTYPE.
        let bad = recipient_sent_key(&ns, "r0");
        let _: () = redis::cmd("SET")
            .arg(&bad)
            .arg("not a set")
            .query_async(&mut redis)
            .await
            .expect("set");
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let marks = marks.clone();
                let body = request(&format!("m{i}"), &format!("r{i}"), "UTC").to_string();
                let message = SendRequest::decode(body.as_bytes(), 1 << 16).expect("valid");
                tokio::spawn(async move { marks.mark_dispatched(&message, now).await })
            })
            .collect();
        let mut tasks = tasks.into_iter();
        let refused = tasks.next().expect("r0's task");
        for (i, task) in tasks.enumerate() {
            let written = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
            assert!(
                matches!(written, Ok(Ok(Ok(())))),
                "{target}: mark of m{} not written in time beside a refused one",
                i + 1
            );
            let key = recipient_sent_key(&ns, &format!("r{}", i + 1));
            assert_eq!(
                support::zset_members(&mut redis, &key).await,
                vec![format!("m{}", i + 1)],
                "{target}"
            );
        }
        // r0's message keeps retrying alone; once its key can take a mark, the mark is written.
        assert!(
            !refused.is_finished(),
            "{target}: a refused mark was given up"
        );
        let _: () = redis::cmd("DEL")
            .arg(&bad)
            .query_async(&mut redis)
            .await
            .expect("del");
        let written = tokio::time::timeout(std::time::Duration::from_secs(10), refused).await;
        assert!(matches!(written, Ok(Ok(Ok(())))), "{target}: {written:?}");
        assert_eq!(
            support::zset_members(&mut redis, &bad).await,
            vec!["m0".to_owned()],
            "{target}"
        );
        support::delete_keys(&mut redis, &format!("{ns}:*")).await;
    }
}
