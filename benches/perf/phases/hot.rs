//! (f): hot recipients and the in-process deny cache. New messages to recipients whose whole
//! window is full, so every one is denied, decided by the decision path without the cache and
//! with it (target: over 1.5x), and by the bare pipelined EVALSHA loop on the same denials (the
//! Redis ceiling for denials, which the cache should exceed), in alternating slices.
//!
//! The phase measures throughput only. That a cached verdict equals Redis' own, and that a
//! redelivery is answered by Redis and not by the cache, is tests/it/deny_cache.rs's job; here
//! it is checked only that every measured decision was a denial and that every one with the
//! cache was answered from it, so the figures are about what they say.

use std::sync::Arc;

use sendquota::internals::deny_cache::DenyCache;
use sendquota::internals::limiter::Limiter;
use sendquota::internals::message::SendRequest;

use super::{Bench, SLICES};
use crate::decision_path::{decode, evaluate_all};
use crate::keyspace::purge;
use crate::procs::Tally;
use crate::progress::Progress;
use crate::report::Report;

const DENY_CACHE_MIN_SPEEDUP: f64 = 1.5;

/// The hot recipient of decision `i`, round robin over `hot` of them.
fn hot_recipient(hot: usize, i: usize) -> String {
    format!("h{}", i % hot)
}

/// (f): prime the hot recipients, fill the cache, measure the three sides; the keys removed
/// after.
pub async fn run(bench: &mut Bench, report: &mut Report) {
    prime(bench).await;
    let (cached, cache) = fill_cache(bench).await;
    measure(bench, report, &cached, &cache).await;
    let removed = purge(&mut bench.plain, &bench.pattern, "f cleanup").await;
    eprintln!("[f cleanup] unlinked {removed} keys");
}

/// Makes the hot recipients full for the whole window: the headline rule (one send a day,
/// three in seven days) holds one send on each of the last three days, so no zone has room for
/// them until the oldest leaves the window, and the cache may answer for them. (One send today
/// is not enough: a zone already on tomorrow could still admit one, so such a recipient is
/// never cached.)
async fn prime(bench: &Bench) {
    let hot = bench.args.hot_recipients;
    for days_before in (0..3).rev() {
        let day = bench.base - chrono::Duration::days(days_before);
        let primes: Vec<SendRequest> = (0..hot)
            .map(|r| decode(&format!("hp{days_before}r{r}"), &hot_recipient(hot, r)))
            .collect();
        let mut progress = Progress::new(&format!("f prime, {days_before} days before"), hot);
        let (allowed, _) = evaluate_all(
            &mut progress,
            &bench.limiter,
            &bench.headline,
            &primes,
            0..hot,
            |_| day,
            bench.args.concurrency,
        )
        .await;
        assert_eq!(
            allowed, hot,
            "priming {days_before} days before admitted {allowed}"
        );
    }
}

/// A limiter with a deny cache, the cache filled with one denial per hot recipient (each one a
/// miss: its recipient is not cached yet), outside the measurement; every measured decision
/// with the cache is then a hit.
async fn fill_cache(bench: &Bench) -> (Limiter, Arc<DenyCache>) {
    let hot = bench.args.hot_recipients;
    // A worker enables its cache once its pub/sub invalidation subscription listens. Here
    // nothing else writes these recipients' keys (no resets, refunds or partial
    // re-admissions, so nothing would be announced): enabling it directly is exact.
    let cache = Arc::new(DenyCache::new());
    cache.enable(true);
    let cached =
        Limiter::new(bench.env.redis.clone(), &bench.env.namespace).with_deny_cache(cache.clone());
    let fills: Vec<SendRequest> = (0..hot)
        .map(|r| decode(&format!("hf{r}"), &hot_recipient(hot, r)))
        .collect();
    let mut progress = Progress::new("f fill the deny cache", hot);
    let (allowed, _) = evaluate_all(
        &mut progress,
        &cached,
        &bench.headline,
        &fills,
        0..hot,
        bench.at(),
        bench.args.concurrency,
    )
    .await;
    assert_eq!(
        (allowed, cache.hits()),
        (0, 0),
        "filling the cache: (admitted, cache hits)"
    );
    (cached, cache)
}

/// New ids to the hot recipients round robin, distinct per side, at base + i ms (one day):
/// without the cache, with it, and the bare loop (ids hm<i>), in alternating slices.
async fn measure(bench: &Bench, report: &mut Report, cached: &Limiter, cache: &DenyCache) {
    let (hot, hot_n) = (bench.args.hot_recipients, bench.args.hot_decisions);
    let (procs, concurrency) = (&bench.procs, bench.args.concurrency);
    let hot_slice = hot_n / SLICES;
    let uncached_messages: Vec<SendRequest> = (0..hot_n)
        .map(|i| decode(&format!("hn{i}"), &hot_recipient(hot, i)))
        .collect();
    let cached_messages: Vec<SendRequest> = (0..hot_n)
        .map(|i| decode(&format!("hc{i}"), &hot_recipient(hot, i)))
        .collect();
    let mut progress_plain = Progress::new("f hot recipients, no cache", hot_n);
    let mut progress_cached = Progress::new("f hot recipients, deny cache", hot_n);
    let mut progress_ceiling = Progress::new("f bare pipelined EVALSHA, hot denials", hot_n);
    let (mut f_plain, mut f_cached, mut f_ceiling) =
        (Tally::default(), Tally::default(), Tally::default());
    for k in 0..SLICES {
        let range = k * hot_slice..(k + 1) * hot_slice;
        let before = procs.snap(None).await;
        let (allowed, took) = evaluate_all(
            &mut progress_plain,
            &bench.limiter,
            &bench.headline,
            &uncached_messages,
            range.clone(),
            bench.at(),
            concurrency,
        )
        .await;
        let middle = procs.snap(None).await;
        f_plain.add(before, middle, hot_slice, allowed, took);
        let (allowed, took) = evaluate_all(
            &mut progress_cached,
            cached,
            &bench.headline,
            &cached_messages,
            range.clone(),
            bench.at(),
            concurrency,
        )
        .await;
        let after = procs.snap(None).await;
        f_cached.add(middle, after, hot_slice, allowed, took);
        let (allowed, took) = bench
            .lua
            .run(&mut progress_ceiling, range, "h", bench.base, |i| i % hot)
            .await;
        f_ceiling.add(after, procs.snap(None).await, hot_slice, allowed, took);
    }
    drop(uncached_messages);
    drop(cached_messages);
    assert_eq!(
        (f_plain.allowed, f_cached.allowed, f_ceiling.allowed),
        (0, 0, 0),
        "new ids to full recipients admitted (no cache, deny cache, bare loop)"
    );
    let measured_hits = cache.hits();
    assert_eq!(
        measured_hits, hot_n as u64,
        "the cache answered {measured_hits} of {hot_n} decisions after it was filled (more \
         hot recipients than it holds?)"
    );
    report.cpu(procs, "f evaluate, hot recipients, no cache", &f_plain);
    report.cpu(procs, "f evaluate, hot recipients, deny cache", &f_cached);
    report.cpu(procs, "f bare pipelined EVALSHA, hot denials", &f_ceiling);
    figures(
        bench,
        report,
        [&f_plain, &f_cached, &f_ceiling],
        measured_hits,
    );
}

/// The three sides' rates against each other, and the note on how the cache was filled.
fn figures(bench: &Bench, report: &mut Report, [plain, cached, ceiling]: [&Tally; 3], hits: u64) {
    let (hot, hot_n) = (bench.args.hot_recipients, bench.args.hot_decisions);
    let concurrency = bench.args.concurrency;
    let (plain_rate, cached_rate, ceiling_rate) = (plain.rate(), cached.rate(), ceiling.rate());
    report.figure(
        "(f) hot recipients, no cache",
        format!("{plain_rate:.0} dec/s"),
        "(f) ceil",
        Some(plain_rate / ceiling_rate),
        &format!(
            "info ({:.0}% allowed, {hot} full recipients, {concurrency} concurrent)",
            plain.allowed_pct()
        ),
        None,
    );
    report.figure(
        "(f) hot recipients, deny cache",
        format!("{cached_rate:.0} dec/s"),
        "no cache",
        Some(cached_rate / plain_rate),
        &format!(
            "> {:.0}% ({:.0}% allowed, {hits} of {hot_n} from the cache)",
            DENY_CACHE_MIN_SPEEDUP * 100.0,
            cached.allowed_pct()
        ),
        Some(cached_rate / plain_rate > DENY_CACHE_MIN_SPEEDUP),
    );
    report.figure(
        "(f) ceiling: pipelined EVALSHA, denials",
        format!("{ceiling_rate:.0} dec/s"),
        "",
        None,
        &format!(
            "info: the deny cache at {:.0}% of it ({})",
            cached_rate / ceiling_rate * 100.0,
            if cached_rate > ceiling_rate {
                "exceeds the Redis ceiling for denials"
            } else {
                "below the Redis ceiling for denials"
            }
        ),
        None,
    );
    report.note(format!(
        "(f) {hot} hot recipients primed with a send on each of the last 3 days (full for the \
         7-day window); {hot} denials filled the cache before the measured slices, then it \
         answered {hits} of {hot_n} measured decisions"
    ));
}
