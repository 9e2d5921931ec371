//! Span export over OTLP/HTTP (issue 25, trace context): with an endpoint set, each message's
//! `receive`, `decide`, `dispatch` and `record denial` spans reach a collector as children of
//! the producer's trace, and the dispatched message carries the worker's span as its
//! `traceparent`; with none, no span is made and the producer's `traceparent` goes on as it
//! came. The collector is the test's own: an OTLP/HTTP endpoint on a free port that decodes
//! what it is sent.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use sendquota::clock::ManualClock;
use sendquota::internals::broker;
use sendquota::internals::traces;

use crate::support::{local, request, TestEnv, OUTCOME_TIMEOUT};

const TRACESTATE: &str = "congo=t61rcWkgMzE";

/// The producer's span of message number `n`: each message is sent in a trace of its own, so
/// a span put under the wrong message's trace is seen.
fn producer(n: u64) -> (String, String) {
    (
        format!(
            "{:032x}",
            0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_0000_u128 + u128::from(n)
        ),
        format!("{:016x}", 0x00f0_67aa_0ba9_0000_u64 + n),
    )
}

fn traceparent(n: u64) -> String {
    let (trace, span) = producer(n);
    format!("00-{trace}-{span}-01")
}

/// What a producer instrumented with OpenTelemetry sends beside message number `n`.
fn producer_properties(n: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in [
        ("traceparent", traceparent(n)),
        ("tracestate", TRACESTATE.into()),
    ] {
        headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
    }
    BasicProperties::default().with_headers(headers)
}

/// A local OTLP/HTTP endpoint: keeps every span posted to its `/v1/traces` with the
/// `service.name` of its resource, and counts the posts. Stops when dropped.
struct Collector {
    port: u16,
    received: Arc<Received>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Received {
    posts: Mutex<usize>,
    spans: Mutex<Vec<(String, Span)>>,
}

impl Collector {
    async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let port = listener.local_addr().expect("its address").port();
        let received = Arc::new(Received::default());
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(export))
            .with_state(received.clone());
        let server = tokio::spawn(async move {
            axum::serve(listener, app)
                .await
                .expect("the collector runs");
        });
        Collector {
            port,
            received,
            server,
        }
    }

    /// The endpoint as the worker's setting takes it.
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn posts(&self) -> usize {
        *self.received.posts.lock().expect("posts")
    }

    fn spans(&self) -> Vec<(String, Span)> {
        self.received.spans.lock().expect("spans").clone()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// `POST /v1/traces`: an `ExportTraceServiceRequest` in protobuf, answered with an empty
/// `ExportTraceServiceResponse` (all accepted).
async fn export(
    State(received): State<Arc<Received>>,
    body: Bytes,
) -> Result<([(header::HeaderName, &'static str); 1], Vec<u8>), StatusCode> {
    *received.posts.lock().expect("posts") += 1;
    let request = ExportTraceServiceRequest::decode(body).map_err(|_| StatusCode::BAD_REQUEST)?;
    let mut spans = received.spans.lock().expect("spans");
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(value)
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            spans.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
        }
    }
    Ok((
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        Vec::new(),
    ))
}

/// An attribute's value as text.
fn value(kv: &KeyValue) -> Option<String> {
    Some(match kv.value.as_ref()?.value.as_ref()? {
        any_value::Value::StringValue(s) => s.clone(),
        any_value::Value::BoolValue(b) => b.to_string(),
        any_value::Value::IntValue(i) => i.to_string(),
        other => format!("{other:?}"),
    })
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(value)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Waits until `dispatches` messages were dispatched (taken from the test's queue, by id) and
/// `denials` denial rows written.
async fn outcomes(
    env: &TestEnv,
    dispatches: usize,
    denials: i64,
) -> HashMap<String, BasicProperties> {
    let mut dispatched = HashMap::new();
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    loop {
        for m in env.drain(&env.dispatched_queue).await {
            let body: serde_json::Value =
                serde_json::from_slice(&m.delivery.data).expect("a JSON body");
            let id = body["id"].as_str().expect("an id").to_owned();
            dispatched.insert(id, m.delivery.properties.clone());
        }
        if dispatched.len() >= dispatches && env.denial_rows().await >= denials {
            return dispatched;
        }
        assert!(
            Instant::now() < deadline,
            "{dispatches} dispatched and {denials} denied within {OUTCOME_TIMEOUT:?}; dispatched \
             {dispatched:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes, all at once, two requests to each of `recipients` recipients: `allowed-<i>` and
/// then `denied-<i>` (the headline rule's one a day), message `2i` and `2i + 1` of
/// [`producer`].
async fn publish_pairs(env: &TestEnv, recipients: u64) {
    for i in 0..recipients {
        for (n, id) in [
            (2 * i, format!("allowed-{i}")),
            (2 * i + 1, format!("denied-{i}")),
        ] {
            let body = request(&id, &format!("r{i}"), "UTC").to_string();
            env.publisher
                .publish(
                    &env.names.requests,
                    "",
                    body.as_bytes(),
                    producer_properties(n),
                )
                .await
                .expect("publish request");
        }
    }
}

/// Every span of one message, found by its `messaging.message.id`.
struct MessageSpans<'a> {
    id: String,
    spans: Vec<&'a Span>,
}

impl<'a> MessageSpans<'a> {
    fn of(all: &'a [(String, Span)], id: &str) -> MessageSpans<'a> {
        let spans = all
            .iter()
            .map(|(_, s)| s)
            .filter(|s| attribute(s, traces::MESSAGE_ID).as_deref() == Some(id))
            .collect();
        MessageSpans {
            id: id.to_owned(),
            spans,
        }
    }

    /// The one span named `name`.
    fn one(&self, name: &str) -> &'a Span {
        let named: Vec<_> = self.spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(
            named.len(),
            1,
            "{}: one {name} span in {:#?}",
            self.id,
            self.spans
        );
        named[0]
    }

    fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.spans.iter().map(|s| s.name.as_str()).collect();
        names.sort();
        names
    }
}

/// Up to the sender: five recipients, each sent an allowed and a denied message at once, at
/// the default concurrency, each message in a trace of its own.
#[tokio::test]
async fn each_messages_spans_reach_the_collector_as_children_of_the_producers_span() {
    const RECIPIENTS: u64 = 5;
    let collector = Collector::start().await;
    let mut env = TestEnv::new().await;
    env.settings.telemetry.otlp_endpoint = collector.endpoint();
    env.start_worker(&ManualClock::new(local("UTC", "2026-02-02 09:00")));
    publish_pairs(&env, RECIPIENTS).await;
    let dispatched = outcomes(&env, RECIPIENTS as usize, RECIPIENTS as i64).await;
    // A graceful stop exports the last batch before the worker returns.
    env.stop_worker().await;

    let all = collector.spans();
    assert!(
        all.iter()
            .all(|(service, _)| service == traces::SERVICE_NAME),
        "every span's resource is service.name = sendquota"
    );
    assert_eq!(all.len(), 3 * 2 * RECIPIENTS as usize, "{all:#?}");
    for i in 0..RECIPIENTS {
        for (n, id, outcome) in [
            (2 * i, format!("allowed-{i}"), "allow"),
            (2 * i + 1, format!("denied-{i}"), "deny"),
        ] {
            let (trace, parent) = producer(n);
            let message = MessageSpans::of(&all, &id);
            let last = if outcome == "allow" {
                traces::DISPATCH
            } else {
                traces::RECORD_DENIAL
            };
            let mut expected = vec![traces::DECIDE, traces::RECEIVE, last];
            expected.sort();
            assert_eq!(message.names(), expected, "{id}");
            for span in &message.spans {
                assert_eq!(
                    hex(&span.trace_id),
                    trace,
                    "{id}: {} in the producer's trace",
                    span.name
                );
            }
            let receive = message.one(traces::RECEIVE);
            assert_eq!(
                hex(&receive.parent_span_id),
                parent,
                "{id}: receive under the producer's span"
            );
            assert_eq!(receive.kind, SpanKind::Consumer as i32);
            for (key, value) in [
                (traces::OUTCOME, outcome),
                (traces::CHANNEL, "sms"),
                (traces::CATEGORY, "default"),
                (traces::MESSAGING_SYSTEM, "rabbitmq"),
                (traces::DESTINATION, env.names.requests.as_str()),
            ] {
                assert_eq!(
                    attribute(receive, key).as_deref(),
                    Some(value),
                    "{id}: receive {key}"
                );
            }
            let rule = (outcome == "deny").then_some("headline");
            assert_eq!(
                attribute(receive, traces::RULE).as_deref(),
                rule,
                "{id}: receive rule"
            );
            for name in [traces::DECIDE, last] {
                let span = message.one(name);
                assert_eq!(
                    span.parent_span_id, receive.span_id,
                    "{id}: {name} under receive"
                );
            }
            let decide = message.one(traces::DECIDE);
            assert_eq!(
                attribute(decide, traces::OUTCOME).as_deref(),
                Some(outcome),
                "{id}"
            );
            assert_eq!(
                attribute(decide, traces::RULE).as_deref(),
                rule,
                "{id}: decide rule"
            );
            if outcome == "deny" {
                let record = message.one(traces::RECORD_DENIAL);
                assert_eq!(attribute(record, traces::RULE).as_deref(), Some("headline"));
                assert_eq!(attribute(record, traces::SHADOW).as_deref(), Some("false"));
                continue;
            }
            let dispatch = message.one(traces::DISPATCH);
            assert_eq!(dispatch.kind, SpanKind::Producer as i32);
            assert_eq!(
                attribute(dispatch, traces::DESTINATION).as_deref(),
                Some(env.names.dispatch.as_str())
            );
            assert_eq!(
                attribute(dispatch, traces::ROUTING_KEY).as_deref(),
                Some("sms")
            );
            // The sender continues the trace from the worker's dispatch span.
            let sent = &dispatched[&id];
            assert_eq!(
                broker::header(sent, "traceparent"),
                Some(format!("00-{trace}-{}-01", hex(&dispatch.span_id))),
                "{id}: the dispatch's traceparent"
            );
            assert_eq!(
                broker::header(sent, "tracestate").as_deref(),
                Some(TRACESTATE)
            );
        }
    }
}

/// The default: no endpoint, so no span is made, even with the variable OpenTelemetry's own
/// exporter reads pointing at a collector; the dispatched message carries the producer's
/// `traceparent` and `tracestate` exactly as they came. The worker binary as deployed, stopped
/// with SIGTERM so that anything batched would have been exported.
#[tokio::test]
async fn without_an_endpoint_no_span_is_exported_and_the_producers_traceparent_goes_on() {
    let collector = Collector::start().await;
    let env = TestEnv::new().await;
    let mut cmd = env.cli(&["worker", "--now", "2026-02-02T09:00:00Z"]);
    cmd.env(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        format!("{}/v1/traces", collector.endpoint()),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let worker = cmd.spawn().expect("start the worker");
    publish_pairs(&env, 1).await;
    let dispatched = outcomes(&env, 1, 1).await;
    // Waited for off this thread: the collector answers on this test's runtime meanwhile.
    let out = tokio::task::spawn_blocking(move || crate::support::process::terminate(worker))
        .await
        .expect("the worker stops");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    assert_eq!(
        collector.posts(),
        0,
        "no span is exported: {:#?}",
        collector.spans()
    );
    let sent = &dispatched["allowed-0"];
    assert_eq!(broker::header(sent, "traceparent"), Some(traceparent(0)));
    assert_eq!(
        broker::header(sent, "tracestate").as_deref(),
        Some(TRACESTATE)
    );
}

/// A collector that is away (nothing listens on its port) costs spans, never messages: both
/// messages get their outcome as without export, the dispatch still carries the worker's span,
/// and the worker stops in its usual time.
#[tokio::test]
async fn a_collector_that_is_away_costs_spans_not_messages() {
    let mut env = TestEnv::new().await;
    env.settings.telemetry.otlp_endpoint =
        format!("http://127.0.0.1:{}", crate::support::private::free_port());
    env.start_worker(&ManualClock::new(local("UTC", "2026-02-02 09:00")));
    publish_pairs(&env, 1).await;
    let dispatched = outcomes(&env, 1, 1).await;
    let sent = broker::header(&dispatched["allowed-0"], "traceparent").expect("a traceparent");
    let (trace, parent) = producer(0);
    assert!(
        sent.starts_with(&format!("00-{trace}-")) && !sent.contains(&parent),
        "the worker's span in the producer's trace: {sent}"
    );
    let stopping = Instant::now();
    env.stop_worker().await;
    assert!(
        stopping.elapsed() < Duration::from_secs(8),
        "stopped in {:?}",
        stopping.elapsed()
    );
}
