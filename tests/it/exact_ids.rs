//! A recipient id is used exactly as the producer wrote it on every face: `" alice"` (a
//! valid id, spaces and all) and `alice` are two recipients in the worker, the API, the CLI
//! and the console, whose links, forms and filters never trim one into the other.
//!
//! The console is driven over HTTP as a browser drives it (support::http::Console): links
//! followed as the pages write them, forms submitted with the values the pages hold, encoded
//! as a browser encodes them.

use crate::support;

use std::collections::HashMap;

use chrono::Utc;
use sendquota::clock::ManualClock;
use support::fixtures::policy;
use support::http::{field, http, link, links, text_of, Console, LOCALHOST};
use support::{request, TestEnv, ADMIN_TOKEN, ADMIN_TOKEN_NAME};

const HEADLINE: &str = policy!("headline");

/// A recipient id with a space in front: valid, and not `alice`.
const PADDED: &str = " alice";

/// The recipient of every denial a console page links to, in the page's order.
fn linked_recipients(html: &str) -> Vec<String> {
    links(html)
        .into_iter()
        .filter(|(_, href, _)| href.starts_with("/ui/recipient?id="))
        .map(|(_, _, text)| text)
        .collect()
}

/// Whether the quota peek of `recipient` (its path segment, percent-encoded) says the
/// headline rule admits a message now.
async fn headline_admits(port: u16, encoded: &str) -> bool {
    let reply = http(
        port,
        "GET",
        &format!("/v1/recipients/{encoded}/quota"),
        Some(ADMIN_TOKEN),
        "",
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let rules = reply.json()["rules"].clone();
    rules
        .as_array()
        .and_then(|r| r.iter().find(|r| r["rule"] == "headline"))
        .and_then(|r| r["allowed"].as_bool())
        .unwrap_or_else(|| panic!("the headline rule in {rules}"))
}

/// Both recipients get two messages; the second of each is denied. From the denial of
/// `" alice"` the console leads to `" alice"`'s page and resets `" alice"`'s quota, audited
/// as `" alice"`, while `alice` stays refused; the denial filters, the pager and the
/// "all denials" link keep the space; the API and the CLI filter the same.
#[tokio::test]
async fn a_recipient_id_with_spaces_is_used_exactly_as_given_by_the_console_api_and_cli() {
    let mut env = TestEnv::with_config(HEADLINE).await;
    let clock = ManualClock::new(Utc::now());
    let port = env.start_admin_worker(&clock).await;
    let mut seen = HashMap::new();
    for (id, recipient, sent) in [
        ("p1", PADDED, true),
        ("p2", PADDED, false),
        ("b1", "alice", true),
        ("b2", "alice", false),
    ] {
        env.publish(&request(id, recipient, "UTC")).await;
        assert_eq!(env.outcome(id, &mut seen).await, sent, "{id}");
    }
    let padded_denial = env
        .denials()
        .await
        .into_iter()
        .find(|d| d.message_id == "p2")
        .expect("p2's denial");
    assert_eq!(padded_denial.recipient, PADDED, "the worker keeps the id");

    let mut console = Console::new(port, LOCALHOST);
    assert_eq!(console.log_in(ADMIN_TOKEN).await.status, 303);

    // From the denial list to the recipient's page, by its link.
    let list = console.get("/ui/denials").await;
    assert_eq!(list.status, 200);
    let mut listed = linked_recipients(&list.body);
    listed.sort();
    assert_eq!(listed, [PADDED, "alice"], "both denials, each id as it is");
    let (_, href, _) = links(&list.body)
        .into_iter()
        .find(|(_, href, text)| href.starts_with("/ui/recipient?id=") && text == PADDED)
        .expect("the link of the padded id's denial");
    let page = console.get(&href).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(
        text_of(&page.body, "who").as_deref(),
        Some(PADDED),
        "{href} leads to the page of the id in the denial"
    );
    assert_eq!(
        field(&page.body, "id").as_deref(),
        Some(PADDED),
        "the look-up form holds the id"
    );
    let recent: Vec<String> = links(&page.body)
        .into_iter()
        .filter(|(_, h, _)| h.starts_with("/ui/denials/"))
        .map(|(_, _, text)| text)
        .collect();
    assert_eq!(
        recent,
        [padded_denial.id.to_string()],
        "the recent denials are this recipient's only"
    );

    // "all of its denials" keeps the id.
    let (_, all, _) = links(&page.body)
        .into_iter()
        .find(|(_, h, _)| h.starts_with("/ui/denials?recipient="))
        .expect("the link to all the recipient's denials");
    let theirs = console.get(&all).await;
    assert_eq!(linked_recipients(&theirs.body), [PADDED], "{all}");

    // The filter form, submitted with the id typed as it is (a browser sends the space as
    // `+`), and the pager's links.
    let filtered = console.get("/ui/denials?recipient=+alice&limit=1").await;
    assert_eq!(linked_recipients(&filtered.body), [PADDED]);
    assert_eq!(
        field(&filtered.body, "recipient").as_deref(),
        Some(PADDED),
        "the form shows the filter as given"
    );
    let next = link(&filtered.body, "next-page").expect("a next page (a full page of one)");
    assert!(next.contains("recipient=%20alice"), "{next}");
    let beyond = console.get(&next).await;
    let first = link(&beyond.body, "first-page")
        .unwrap_or_else(|| panic!("a link back from {next}: {}", beyond.body));
    assert!(first.contains("recipient=%20alice"), "{first}");
    assert_eq!(linked_recipients(&console.get(&first).await.body), [PADDED]);
    let plain = console.get("/ui/denials?recipient=alice").await;
    assert_eq!(linked_recipients(&plain.body), ["alice"]);

    // The reset: its link, its confirmation, its form; audited under the id as it is.
    let reset = link(&page.body, "reset").expect("the reset link");
    let confirm = console.get(&reset).await;
    assert_eq!(confirm.status, 200, "{}", confirm.body);
    assert_eq!(text_of(&confirm.body, "who").as_deref(), Some(PADDED));
    let id = field(&confirm.body, "id").expect("the form's id");
    let csrf = field(&confirm.body, "csrf").expect("the form's CSRF token");
    assert_eq!(id, PADDED, "the form resets the id it shows");
    let done = console
        .post("/ui/recipient/reset", &[("csrf", &csrf), ("id", &id)])
        .await;
    assert_eq!(done.status, 200, "{}", done.body);
    let audited: Vec<(String, String, String)> =
        sqlx::query_as("SELECT recipient, actor, status FROM quota_resets")
            .fetch_all(&env.pool)
            .await
            .expect("the reset's audit row");
    assert_eq!(
        audited,
        [(
            PADDED.to_owned(),
            ADMIN_TOKEN_NAME.to_owned(),
            "done".to_owned()
        )]
    );
    assert!(
        headline_admits(port, "%20alice").await,
        "the padded id's quota was reset"
    );
    assert!(
        !headline_admits(port, "alice").await,
        "alice's was not: she is still refused today"
    );

    // The API and the CLI filter the same way.
    let api = http(
        port,
        "GET",
        "/v1/denials?recipient=%20alice",
        Some(ADMIN_TOKEN),
        "",
    )
    .await;
    let rows = api.json()["denials"].clone();
    let recipients: Vec<&str> = rows
        .as_array()
        .expect("rows")
        .iter()
        .filter_map(|d| d["recipient"].as_str())
        .collect();
    assert_eq!(recipients, [PADDED], "{rows}");
    let run = env
        .run_cli("", &["denials", "--recipient", PADDED, "--format", "json"])
        .await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let recipients: Vec<String> = run
        .stdout
        .lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            row["recipient"].as_str().expect("recipient").to_owned()
        })
        .collect();
    assert_eq!(recipients, [PADDED]);
    env.stop_worker().await;
}
