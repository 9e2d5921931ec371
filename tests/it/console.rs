//! The operator console (`/ui`) in a real browser (Debian's headless Chromium): logging in,
//! the denial history filtered, paged through and opened, a quota reset and a quarantine replay
//! after their confirmations (each audited under the token's name), the charts drawn from the
//! rollup a real worker wrote, the pages at 1280 and 390 px, and no console error anywhere.
//! Also the rollup behind the charts: several writers adding to the same rows. The screenshots
//! in docs/screenshots/ are the ones these tests take.

use crate::support;

use std::time::{Duration, Instant};

use chrono::Utc;
use sendquota::clock::ManualClock;
use support::browser::Chromium;
use support::fixtures::policy;
use support::{request, TestEnv, ADMIN_TOKEN, ADMIN_TOKEN_NAME};

/// The headline rule, and a global shadow rule that would refuse all but two messages an
/// hour: real denials and shadow refusals for the pages to show.
const CONFIG: &str = policy!("headline_and_a_global_shadow_burst");

/// A recipient id that is HTML: the pages must show it as text.
const HOSTILE: &str = "<b id=\"xss\">x</b>";

/// Recipients `u0`..`u5` get two messages each (in Tokyo): the second of each is denied.
const RECIPIENTS: usize = 6;

/// Waits until the rollup holds `n` decisions (the writer flushes every second).
async fn rollup_holds(env: &TestEnv, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let counted: Option<i64> =
            sqlx::query_scalar("SELECT sum(decisions)::bigint FROM decision_rollup")
                .fetch_one(&env.pool)
                .await
                .expect("read the rollup");
        if counted == Some(n) {
            return;
        }
        if Instant::now() >= deadline {
            let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
                "SELECT outcome, rule, decisions, verdicts FROM decision_rollup ORDER BY 1, 2",
            )
            .fetch_all(&env.pool)
            .await
            .expect("read the rollup");
            let denials: Vec<(String, String, bool)> =
                sqlx::query_as("SELECT message_id, rule, shadow FROM denials ORDER BY id")
                    .fetch_all(&env.pool)
                    .await
                    .expect("read the denials");
            panic!(
                "the rollup holds {counted:?} decisions, not {n}: {rows:?}; denials {denials:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The ids of the denials the page lists.
async fn denial_ids(browser: &Chromium) -> Vec<i64> {
    browser
        .eval("[...document.querySelectorAll('tr.denial a.open')].map(a => +a.textContent)")
        .await
}

/// Logs in with `token` on the login page.
async fn log_in(browser: &Chromium, port: u16, token: &str) {
    browser.open(&format!("http://127.0.0.1:{port}/ui")).await;
    assert_eq!(
        browser.path().await,
        "/ui/login",
        "no session: the login page"
    );
    browser.type_into("#token", token).await;
    browser.click_through("#login").await;
}

#[tokio::test]
async fn an_operator_looks_filters_resets_and_replays_in_the_browser() {
    let mut env = TestEnv::with_config(CONFIG).await;
    // Picky's denial rows are refused: their second message is quarantined.
    env.refuse_denials_to("picky").await;
    let clock = ManualClock::new(Utc::now());
    let port = env.start_admin_worker(&clock).await;
    let base = format!("http://127.0.0.1:{port}");
    for i in 0..RECIPIENTS {
        for m in ["a", "b"] {
            env.publish(&request(&format!("{m}{i}"), &format!("u{i}"), "Asia/Tokyo"))
                .await;
        }
    }
    env.publish(&request("x1", HOSTILE, "UTC")).await;
    env.publish(&request("x2", HOSTILE, "UTC")).await;
    env.publish(&request("p1", "picky", "UTC")).await;
    env.publish(&request("p2", "picky", "UTC")).await;
    // Every message but picky's is decided and counted by the real worker: p1's shadow row
    // (burst) is refused as p2's denial row is, and both are quarantined.
    let decided = (RECIPIENTS * 2 + 2) as i64;
    rollup_holds(&env, decided).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while env.ready(&env.names.quarantine).await < 2 {
        assert!(Instant::now() < deadline, "p1 and p2 were quarantined");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let by_outcome: Vec<(String, i64)> = sqlx::query_as(
        "SELECT outcome, sum(decisions)::bigint FROM decision_rollup GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&env.pool)
    .await
    .expect("read the rollup");
    let denied = (RECIPIENTS + 1) as i64;
    let count = |o: &str| by_outcome.iter().find(|r| r.0 == o).map_or(0, |r| r.1);
    assert_eq!(count("deny"), denied, "{by_outcome:?}");
    assert_eq!(
        count("allow") + count("shadow"),
        decided - denied,
        "{by_outcome:?}"
    );
    assert!(
        count("shadow") > 0,
        "burst refused in shadow: {by_outcome:?}"
    );

    let browser = Chromium::start().await;
    browser.set_width(1280).await;
    log_in(&browser, port, ADMIN_TOKEN).await;
    assert_eq!(browser.path().await, "/ui");
    assert!(browser.text().await.contains(ADMIN_TOKEN_NAME));

    // Overview: both charts drawn from the rollup, with points and pixels.
    browser
        .wait_for("(window.sendquotaCharts || []).length === 2")
        .await;
    let charts: Vec<(String, i64, i64)> = browser
        .eval(
            "window.sendquotaCharts.map(c => { \
               const u = c.chart; \
               const points = u.data.slice(1).reduce((n, s) => n + s.filter(v => v > 0).length, 0); \
               const cv = u.ctx.canvas; \
               const px = u.ctx.getImageData(0, 0, cv.width, cv.height).data; \
               let inked = 0; for (let i = 3; i < px.length; i += 4) if (px[i] > 0) inked++; \
               return [c.id, points, inked]; })",
        )
        .await;
    for (id, points, inked) in &charts {
        assert!(*points > 0, "chart {id} has data points: {charts:?}");
        assert!(*inked > 500, "chart {id} drew its lines: {charts:?}");
    }
    let series: Vec<String> = browser
        .eval("window.sendquotaCharts[1].chart.series.slice(1).map(s => s.label)")
        .await;
    assert_eq!(series, vec!["headline".to_owned()], "denials by rule");
    browser.screenshot("overview").await;

    // Denials: filtered by rule, two a page, paged through, then one opened.
    browser.open(&format!("{base}/ui/denials")).await;
    browser.screenshot("denials").await;
    browser
        .eval::<String>("document.querySelector('select[name=rule]').value = 'headline'")
        .await;
    browser.type_into("input[name=limit]", "2").await;
    browser.click_through("#apply").await;
    let path = browser.path().await;
    assert!(
        path.contains("rule=headline") && path.contains("limit=2"),
        "{path}"
    );
    let first = denial_ids(&browser).await;
    assert_eq!(first.len(), 2, "a page of two");
    let mut seen = first.clone();
    while browser
        .eval::<bool>("document.getElementById('next-page') !== null")
        .await
    {
        browser.click_through("#next-page").await;
        let page = denial_ids(&browser).await;
        assert!(
            page.iter().all(|id| seen.iter().all(|s| id < s)),
            "each page goes on below the last: {page:?} after {seen:?}"
        );
        seen.extend(page);
    }
    assert_eq!(seen.len() as i64, denied, "every headline denial, once");
    assert!(
        browser
            .eval::<bool>("document.getElementById('first-page') !== null")
            .await
    );

    browser
        .open(&format!("{base}/ui/denials?recipient=u3&rule=headline"))
        .await;
    assert_eq!(
        denial_ids(&browser).await.len(),
        1,
        "u3's one headline denial"
    );
    browser.click_through("tr.denial a.open").await;
    assert!(browser.path().await.starts_with("/ui/denials/"));
    let reason: String = browser
        .eval("document.getElementById('reason').textContent")
        .await;
    assert!(!reason.trim().is_empty(), "the rule's reason");
    let utc: String = browser
        .eval("document.getElementById('retry-utc').textContent")
        .await;
    let tokyo: String = browser
        .eval("document.getElementById('retry-local').textContent")
        .await;
    assert!(utc.ends_with('Z'), "retry_after in UTC: {utc}");
    assert!(
        tokyo.contains("JST") && tokyo.contains("+09:00"),
        "in Tokyo: {tokyo}"
    );
    let request: String = browser
        .eval("document.getElementById('request').textContent")
        .await;
    browser.screenshot("denial").await;
    assert!(
        request.contains("\"b3\"") && request.contains("Asia/Tokyo"),
        "{request}"
    );

    // A recipient id that is HTML is shown as text, nowhere as markup.
    browser
        .open(&format!(
            "{base}/ui/denials?recipient=%3Cb%20id%3D%22xss%22%3Ex%3C%2Fb%3E"
        ))
        .await;
    assert!(browser.text().await.contains(HOSTILE));
    assert!(
        browser
            .eval::<bool>("document.getElementById('xss') === null")
            .await
    );

    // Recipient: usage now, recent denials, a reset after confirming, audited.
    browser
        .open(&format!("{base}/ui/recipient?id=u0&timezone=Asia%2FTokyo"))
        .await;
    let usage = browser
        .eval::<String>("document.getElementById('usage').innerText")
        .await;
    assert!(
        usage.contains("headline") && usage.contains("refused"),
        "{usage}"
    );
    assert!(
        browser
            .eval::<bool>("document.getElementById('recent') !== null")
            .await
    );
    browser.screenshot("recipient").await;
    browser.click_through("#reset").await;
    assert_eq!(
        browser
            .eval::<String>("document.getElementById('who').textContent")
            .await,
        "u0"
    );
    let resets: i64 = sqlx::query_scalar("SELECT count(*) FROM quota_resets")
        .fetch_one(&env.pool)
        .await
        .expect("count resets");
    assert_eq!(resets, 0, "nothing is reset before the confirmation");
    browser.click_through("#confirm").await;
    assert!(browser.text().await.contains("Reset u0"));
    let (recipient, actor, status): (String, String, String) =
        sqlx::query_as("SELECT recipient, actor, status FROM quota_resets")
            .fetch_one(&env.pool)
            .await
            .expect("the reset's audit row");
    assert_eq!(
        (recipient.as_str(), actor.as_str(), status.as_str()),
        ("u0", ADMIN_TOKEN_NAME, "done")
    );
    browser.open(&format!("{base}/ui/recipient?id=u0")).await;
    let usage = browser
        .eval::<String>("document.getElementById('usage').innerText")
        .await;
    assert!(
        usage.contains("allowed") && !usage.contains("refused"),
        "u0 may be sent to again: {usage}"
    );

    // Quarantine: p1 and p2 are held; once the cause is fixed p2 alone is replayed after
    // confirming.
    env.accept_denials().await;
    browser.open(&format!("{base}/ui/quarantine")).await;
    let held = browser
        .eval::<String>("document.getElementById('held').innerText")
        .await;
    assert!(
        held.contains("p1") && held.contains("p2") && held.contains("picky refuses"),
        "{held}"
    );
    browser.screenshot("quarantine").await;
    let replay_p2: String = browser
        .eval(
            "[...document.querySelectorAll('tr.held')] \
               .find(r => r.cells[0].textContent === 'p2').querySelector('a.replay').href",
        )
        .await;
    assert!(replay_p2.ends_with("message_id=p2"), "{replay_p2}");
    browser.open(&replay_p2).await;
    assert_eq!(
        browser
            .eval::<String>("document.getElementById('which').textContent")
            .await,
        "p2"
    );
    browser.click_through("#confirm").await;
    assert!(browser.text().await.contains("Replayed 1 message"));
    let replays: Vec<(Option<String>, Option<String>)> =
        sqlx::query_as("SELECT message_id, actor FROM quarantine_replays")
            .fetch_all(&env.pool)
            .await
            .expect("the replay's audit row");
    assert_eq!(
        replays,
        vec![(Some("p2".to_owned()), Some(ADMIN_TOKEN_NAME.to_owned()))]
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while env.denial_count("p2").await == 0 {
        assert!(
            Instant::now() < deadline,
            "the replayed p2 was decided again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        env.quarantined().await,
        vec![Some("p1".to_owned())],
        "p1 stays held, alone"
    );

    // Rules: the running policy, and each rule's verdicts and shadow refusals.
    browser.open(&format!("{base}/ui/rules")).await;
    let cell = |rule: &str, column: &str| {
        format!(
            "(() => {{ const head = [...document.querySelectorAll('#rule-counts th')] \
               .map(th => th.textContent); \
             const row = document.querySelector('tr.rule[data-rule=\"{rule}\"]'); \
             return +row.children[head.indexOf('{column}')].textContent; }})()"
        )
    };
    assert!(browser.eval::<i64>(&cell("headline", "deny")).await >= denied);
    assert!(browser.eval::<i64>(&cell("headline", "refused")).await >= denied);
    assert!(browser.eval::<i64>(&cell("headline", "allowed")).await > 0);
    assert!(browser.eval::<i64>(&cell("burst", "refused")).await > 0);
    assert!(browser.eval::<i64>(&cell("burst", "shadow")).await > 0);
    assert!(browser.text().await.contains("name = \"burst\""));
    browser.screenshot("rules").await;

    // At 390 px the pages fit the screen: wide tables scroll inside their box.
    browser.set_width(390).await;
    for page in ["/ui/denials", "/ui", "/ui/recipient?id=u1", "/ui/rules"] {
        browser.open(&format!("{base}{page}")).await;
        let fits: bool = browser
            .eval("document.documentElement.scrollWidth <= window.innerWidth")
            .await;
        assert!(fits, "{page} fits 390 px");
        if page == "/ui/denials" {
            browser.screenshot("denials-390").await;
        }
    }

    assert_eq!(browser.errors(), Vec::<String>::new(), "no console errors");

    // Logging out ends the session.
    browser.set_width(1280).await;
    browser.click_through("header button[type=submit]").await;
    assert_eq!(browser.path().await, "/ui/login");
    browser.open(&format!("{base}/ui/denials")).await;
    assert_eq!(browser.path().await, "/ui/login", "the session is gone");
    browser.close().await;
}

#[tokio::test]
async fn a_wrong_token_is_refused_and_state_changes_need_the_csrf_token() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(Utc::now());
    let port = env.start_admin_worker(&clock).await;
    let browser = Chromium::start().await;

    log_in(&browser, port, "not-the-token-0123456789").await;
    assert_eq!(browser.path().await, "/ui/login");
    browser
        .wait_for("document.body.innerText.includes('That token is not accepted')")
        .await;
    let cookies = browser.page.get_cookies().await.expect("cookies");
    assert!(
        cookies.iter().all(|c| c.name != "sendquota_session"),
        "no session for a wrong token"
    );

    log_in(&browser, port, ADMIN_TOKEN).await;
    assert_eq!(browser.path().await, "/ui");
    let cookies = browser.page.get_cookies().await.expect("cookies");
    let session = cookies
        .iter()
        .find(|c| c.name == "sendquota_session")
        .expect("a session cookie");
    assert!(session.http_only, "HttpOnly");
    assert_eq!(session.path, "/ui");
    assert_eq!(
        format!("{:?}", session.same_site),
        "Some(Strict)",
        "SameSite=Strict"
    );
    let visible: String = browser.eval("document.cookie").await;
    assert!(!visible.contains("sendquota_session"), "no script reads it");
    assert!(
        !browser.path().await.contains(ADMIN_TOKEN),
        "the token is never in a URL"
    );

    // A reset posted without the CSRF token, or with a wrong one, is refused.
    let post = |csrf: Option<&str>| {
        let field = csrf.map_or(String::new(), |c| format!("&csrf={c}"));
        format!(
            "async () => (await fetch('/ui/recipient/reset', {{ method: 'POST', \
               headers: {{ 'Content-Type': 'application/x-www-form-urlencoded' }}, \
               body: 'id=u0{field}' }})).status"
        )
    };
    for csrf in [None, Some("0000"), Some("")] {
        let status: i64 = browser
            .page
            .evaluate_function(post(csrf))
            .await
            .expect("post a reset")
            .into_value()
            .expect("a status");
        assert_eq!(status, 403, "csrf {csrf:?}");
    }
    let resets: i64 = sqlx::query_scalar("SELECT count(*) FROM quota_resets")
        .fetch_one(&env.pool)
        .await
        .expect("count resets");
    assert_eq!(resets, 0, "nothing was reset");
    browser.close().await;
    env.stop_worker().await;
}

/// The rollup's writers add to the rows they share: two workers' counts of the same minute,
/// flushed one after the other, sum in one row (the upsert's conflict path), and a flush with
/// nothing counted writes nothing.
#[tokio::test]
async fn rollup_writers_add_their_counts_to_the_same_rows() {
    use sendquota::internals::outcome::Handled;
    use sendquota::internals::rollup::{DecisionCounts, RollupWriter};
    use std::sync::Arc;

    let env = TestEnv::new().await;
    let at = Utc::now();
    let clock: Arc<dyn sendquota::clock::Clock> = Arc::new(ManualClock::new(at));
    let denied = Handled::Denied {
        rule: "headline".to_owned(),
    };
    for (worker, n) in [("a", 3), ("b", 2)] {
        let counts = Arc::new(DecisionCounts::default());
        for _ in 0..n {
            counts.count(at, &denied);
        }
        let writer = RollupWriter::new(counts, env.pool.clone(), clock.clone());
        writer
            .flush()
            .await
            .unwrap_or_else(|e| panic!("worker {worker}: {e}"));
        writer.flush().await.expect("an empty flush");
    }
    let rows: Vec<(String, String, i64, i64)> =
        sqlx::query_as("SELECT outcome, rule, decisions, verdicts FROM decision_rollup")
            .fetch_all(&env.pool)
            .await
            .expect("read the rollup");
    assert_eq!(rows, vec![("deny".to_owned(), "headline".to_owned(), 5, 5)]);
}
