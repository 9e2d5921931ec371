//! The console's login form against guessing: past three attempts without a login, each
//! attempt from one client address waits twice as long as the one before (125 ms, 250 ms, ...
//! up to 8 s); attempts sent at once are spaced the same way and those past that window are
//! refused at once (429); a login forgets the address; other addresses are not slowed. The
//! token is taken exactly as typed, as the API takes it.

use crate::support;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use chrono::Utc;
use sendquota::clock::ManualClock;
use support::http::{http, Console, LOCALHOST};
use support::{TestEnv, ADMIN_TOKEN};

/// Another client: an address of the loopback network that is not 127.0.0.1.
const ELSEWHERE: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// How long the login of `console` with `token` took to be answered, and its status.
async fn timed_log_in(console: &mut Console, token: &str) -> (Duration, u16) {
    let started = Instant::now();
    let status = console.log_in(token).await.status;
    (started.elapsed(), status)
}

/// Eight wrong tokens from one address take about 3.9 s (0, 0, 0, then 125 ms doubling to
/// 2 s), not an instant; the right token then still logs in, after its wait (4 s); a login
/// forgets the address. Meanwhile another address is answered at once. A token with a space
/// around it is another token, refused by the form as by the API.
#[tokio::test]
async fn wrong_tokens_from_one_address_wait_longer_each_time_and_no_other_address_waits() {
    let mut env = TestEnv::new().await;
    let port = env.start_admin_worker(&ManualClock::new(Utc::now())).await;

    let mut guesser = Console::new(port, LOCALHOST);
    let started = Instant::now();
    let mut each = Vec::new();
    for i in 0..8 {
        let (took, status) = timed_log_in(&mut guesser, &format!("wrong-token-{i:016}")).await;
        assert_eq!(status, 401, "wrong token {i}");
        each.push(took);
    }
    let total = started.elapsed();
    assert!(
        total >= Duration::from_millis(3_700),
        "8 wrong tokens took {total:?} ({each:?}): no delay"
    );
    assert!(
        each[..3].iter().all(|t| *t < Duration::from_millis(500)),
        "a typo or two costs nothing: {each:?}"
    );
    assert!(
        each[7] >= Duration::from_millis(1_900) && each[7] > each[6] && each[6] > each[5],
        "each wait doubles: {each:?}"
    );

    let mut other = Console::new(port, ELSEWHERE);
    let (took, status) = timed_log_in(&mut other, "wrong-token-elsewhere-0000").await;
    assert_eq!(status, 401);
    assert!(
        took < Duration::from_millis(500),
        "another address is not slowed: {took:?}"
    );

    let (took, status) = timed_log_in(&mut guesser, ADMIN_TOKEN).await;
    assert_eq!(status, 303, "the right token still logs in");
    assert!(
        took >= Duration::from_millis(3_500),
        "after the address's wait: {took:?}"
    );
    let overview = guesser.get("/ui").await;
    assert_eq!(overview.status, 200, "a live session");
    let (took, status) = timed_log_in(&mut guesser, "wrong-token-after-login-00").await;
    assert_eq!(status, 401);
    assert!(
        took < Duration::from_millis(500),
        "a login forgot the address's attempts: {took:?}"
    );

    let mut padded = Console::new(port, IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3)));
    for token in [format!(" {ADMIN_TOKEN}"), format!("{ADMIN_TOKEN} ")] {
        assert_eq!(
            padded.log_in(&token).await.status,
            401,
            "{token:?} is not the token"
        );
    }
    // A header cannot end in a space (HTTP drops it), so the API is asked with the leading one.
    let api = http(
        port,
        "GET",
        "/v1/denials",
        Some(&format!(" {ADMIN_TOKEN}")),
        "",
    )
    .await;
    assert_eq!(api.status, 401, "nor is it for the API");
    env.stop_worker().await;
}

/// Twelve attempts sent at once from one address are not answered at once: the first three
/// are, the next wait their turn (125 ms, then 375 ms, ... 7.9 s after the first), and the
/// three that would wait past 8 s are refused at once with 429 and `Retry-After`, their
/// tokens unchecked, so one address cannot pile up waiting requests.
#[tokio::test]
async fn attempts_sent_at_once_are_spaced_and_those_past_the_longest_wait_are_refused() {
    let mut env = TestEnv::new().await;
    let port = env.start_admin_worker(&ManualClock::new(Utc::now())).await;
    let attempts: Vec<_> = (0..12)
        .map(|i| {
            tokio::spawn(async move {
                let mut console = Console::new(port, LOCALHOST);
                let started = Instant::now();
                let reply = console.log_in(&format!("wrong-token-{i:016}")).await;
                let retry_after = reply
                    .headers
                    .lines()
                    .any(|l| l.to_ascii_lowercase().starts_with("retry-after:"));
                (reply.status, started.elapsed(), retry_after)
            })
        })
        .collect();
    let mut answered = Vec::new();
    for attempt in attempts {
        answered.push(attempt.await.expect("an attempt"));
    }
    let within = |limit: u64, status: u16| {
        answered
            .iter()
            .filter(|(s, took, _)| *s == status && *took < Duration::from_millis(limit))
            .count()
    };
    assert_eq!(within(600, 429), 3, "refused at once: {answered:?}");
    assert!(
        answered.iter().filter(|a| a.0 == 429).all(|a| a.2),
        "with Retry-After: {answered:?}"
    );
    assert_eq!(
        within(600, 401),
        5,
        "at once, or after 125 or 375 ms: {answered:?}"
    );
    let slowest = answered.iter().map(|a| a.1).max().unwrap_or_default();
    assert!(
        slowest >= Duration::from_millis(7_500),
        "the ninth waited its turn: {answered:?}"
    );
    assert_eq!(answered.iter().filter(|a| a.0 == 401).count(), 9);
    env.stop_worker().await;
}
