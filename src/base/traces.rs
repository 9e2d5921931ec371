//! Traces: spans of each message's work, exported over OTLP/HTTP when an endpoint is set.
//!
//! A delivery's `receive` span is the root of the worker's part of the message's trace, a child
//! of the producer's span when the request carries W3C trace context (`traceparent`,
//! `tracestate`). Under it: `decide` (the Redis decision), `dispatch` (the confirmed publish,
//! whose context replaces the producer's `traceparent` on the dispatched message, so the sender
//! continues the trace from it) and `record denial` (a denial row written). Spans are batched
//! and exported from a task on the worker's runtime, and the batch is flushed when the worker
//! stops.
//!
//! Off by default. Off, the pipeline holds no [`Traces`] and every span is a [`Step`] holding
//! nothing: no span is created, nothing is allocated, and a publish carries the producer's
//! headers as they came.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanBuilder, SpanKind, Status, TraceContextExt, TracerProvider as _};
use opentelemetry::{Context, KeyValue, StringValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, Span, SpanData, SpanExporter};
use opentelemetry_sdk::Resource;

use crate::base::config::TelemetrySettings;
use crate::request::message::SendRequest;

/// The span of a delivery, from its arrival to its outcome settled (or the delivery given up).
pub const RECEIVE: &str = "receive";
/// The span of the Redis decision.
pub const DECIDE: &str = "decide";
/// The span of the dispatch publish, until the broker confirmed it.
pub const DISPATCH: &str = "dispatch";
/// The span of one denial row written (its batch committed).
pub const RECORD_DENIAL: &str = "record denial";

/// The `service.name` of the exported resource.
pub const SERVICE_NAME: &str = "sendquota";

/// Attribute: the message's id (OpenTelemetry messaging semantic conventions).
pub const MESSAGE_ID: &str = "messaging.message.id";
/// Attribute: `rabbitmq` on the spans of a delivery and a publish.
pub const MESSAGING_SYSTEM: &str = "messaging.system";
/// Attribute: the queue a delivery came from, or the exchange a dispatch went to.
pub const DESTINATION: &str = "messaging.destination.name";
/// Attribute: the routing key of a dispatch (the message's channel).
pub const ROUTING_KEY: &str = "messaging.rabbitmq.destination.routing_key";
/// Attribute: `process` (a delivery) or `send` (a dispatch).
pub const OPERATION_TYPE: &str = "messaging.operation.type";
/// Attribute: the message's channel.
pub const CHANNEL: &str = "sendquota.channel";
/// Attribute: the message's category.
pub const CATEGORY: &str = "sendquota.category";
/// Attribute: what the message came to (an outcome name as `check` and the metrics spell it);
/// on `decide`, what the decision said.
pub const OUTCOME: &str = "sendquota.outcome";
/// Attribute: the rule that refused (a denial's, a delay's), or the rules named by the outcome
/// (the shadow rules of a dispatch), comma-separated.
pub const RULE: &str = "sendquota.rule";
/// Attribute: the reason of a denial row.
pub const REASON: &str = "sendquota.reason";
/// Attribute: whether a denial row is a shadow rule's (the message was dispatched).
pub const SHADOW: &str = "sendquota.shadow";

/// The outcome of a delivery handed back to the queue unsettled (the worker stopped, or its
/// channel was lost): the broker delivers it again.
pub const REQUEUED: &str = "requeued";
/// The outcome of a delivery moved to the quarantine queue.
pub const QUARANTINED: &str = "quarantined";
/// The outcome of a delivery that kept failing and yielded its slot: it moved to a delay queue
/// and comes back to be decided again.
pub const YIELDED: &str = "yielded";

/// Longest wait at shutdown for the last spans to be exported: a collector that does not
/// answer must not hold the worker's exit for the exporter's whole timeout.
const FLUSH_AT_SHUTDOWN: Duration = Duration::from_secs(5);

/// Why span export could not start.
#[derive(Debug, thiserror::Error)]
#[error("otlp exporter: {0}")]
pub struct TracesError(String);

/// The worker's span export: its tracer and the batch processor behind it.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// The queue deliveries come from (`messaging.destination.name` of `receive`).
    queue: StringValue,
}

impl Traces {
    /// Starts exporting spans to `settings.otlp_endpoint` (its `/v1/traces`), batched on the
    /// current tokio runtime; `None` when no endpoint is set. `queue` is the requests queue.
    pub fn start(settings: &TelemetrySettings, queue: &str) -> Result<Option<Traces>, TracesError> {
        let Some(url) = settings.traces_url() else {
            return Ok(None);
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .build()
            .map_err(|e| TracesError(e.to_string()))?;
        let exporter = Reported {
            inner: exporter,
            url,
            failing: AtomicBool::new(false),
        };
        let processor =
            BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(Resource::builder().with_service_name(SERVICE_NAME).build())
            .build();
        let tracer = provider.tracer(SERVICE_NAME);
        Ok(Some(Traces {
            provider,
            tracer,
            queue: StringValue::from(Arc::<str>::from(queue)),
        }))
    }

    /// Starts the `receive` span of a delivery with `properties`, a child of the producer's
    /// span when they carry its trace context. `request` is its body decoded, `None` when it is
    /// no request (the id is then the delivery's `message_id`).
    pub fn receive(
        self: &Arc<Traces>,
        properties: &BasicProperties,
        request: Option<&SendRequest>,
    ) -> MessageTrace {
        let producer = match properties.headers() {
            Some(headers) => {
                TraceContextPropagator::new().extract(&Headers(std::borrow::Cow::Borrowed(headers)))
            }
            None => Context::new(),
        };
        let id = match request {
            Some(r) => Some(r.id.as_str()),
            None => properties.message_id().as_ref().map(|id| id.as_str()),
        };
        let id = StringValue::from(Arc::<str>::from(id.unwrap_or_default()));
        let mut attributes = vec![
            KeyValue::new(MESSAGING_SYSTEM, "rabbitmq"),
            KeyValue::new(OPERATION_TYPE, "process"),
            KeyValue::new(DESTINATION, self.queue.clone()),
            KeyValue::new(MESSAGE_ID, id.clone()),
        ];
        if let Some(r) = request {
            attributes.push(KeyValue::new(CHANNEL, r.channel.clone()));
            attributes.push(KeyValue::new(CATEGORY, r.category.clone()));
        }
        let span = SpanBuilder::from_name(RECEIVE)
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &producer);
        MessageTrace {
            traces: self.clone(),
            receive: producer.with_span(span),
            id,
        }
    }

    /// Exports the spans still waiting and stops the export (waits at most
    /// [`FLUSH_AT_SHUTDOWN`]). Spans ended later are dropped.
    pub async fn shutdown(&self) {
        let provider = self.provider.clone();
        // The processor's shutdown blocks its thread until the batch task, which runs on this
        // runtime, has exported: off the runtime's threads, or a one-thread runtime deadlocks.
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(FLUSH_AT_SHUTDOWN, flushed).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the last spans were not exported"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the last spans were not exported"),
            Err(_) => tracing::warn!(
                "the last spans were not exported within {FLUSH_AT_SHUTDOWN:?}; they are dropped"
            ),
        }
    }
}

impl Drop for Traces {
    /// The SDK shuts its provider down when the last reference goes, blocking until the batch
    /// task answers: dropped on a runtime thread (a worker that was not stopped gracefully),
    /// that would wait for a task that thread has to run. Shut down on a thread of its own.
    fn drop(&mut self) {
        let provider = self.provider.clone();
        let _ = std::thread::Builder::new()
            .name("sendquota-traces-shutdown".to_owned())
            .spawn(move || {
                let _ = provider.shutdown();
            });
    }
}

/// The spans of one delivery: its `receive` span, ended when this is dropped, and the parent of
/// every [`Step`] of its work.
pub struct MessageTrace {
    traces: Arc<Traces>,
    /// The producer's context with the `receive` span in it.
    receive: Context,
    /// The message id, shared by every span's attribute.
    id: StringValue,
}

impl MessageTrace {
    /// Notes what the delivery came to on `receive`: the outcome and the rules it names.
    pub fn settled(&self, outcome: &'static str, rules: &[String]) {
        let span = self.receive.span();
        span.set_attribute(KeyValue::new(OUTCOME, outcome));
        if !rules.is_empty() {
            span.set_attribute(KeyValue::new(RULE, rules.join(",")));
        }
    }

    /// Notes a failed attempt on `receive` (an event; the delivery is retried).
    pub fn failed(&self, error: &dyn fmt::Display) {
        self.receive.span().add_event(
            "attempt failed",
            vec![KeyValue::new("exception.message", error.to_string())],
        );
    }

    fn child(&self, name: &'static str, kind: SpanKind, mut attributes: Vec<KeyValue>) -> Step {
        attributes.push(KeyValue::new(MESSAGE_ID, self.id.clone()));
        let span = SpanBuilder::from_name(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&self.traces.tracer, &self.receive);
        Step(Some(Box::new(span)))
    }
}

impl Drop for MessageTrace {
    fn drop(&mut self) {
        self.receive.span().end();
    }
}

/// The `decide` span of a delivery's attempt; holds nothing when `trace` is `None`.
pub fn decide(trace: Option<&MessageTrace>) -> Step {
    match trace {
        Some(t) => t.child(DECIDE, SpanKind::Internal, Vec::new()),
        None => Step(None),
    }
}

/// The `dispatch` span of a publish to `exchange` with `routing_key`; holds nothing when
/// `trace` is `None`.
pub fn dispatch(trace: Option<&MessageTrace>, exchange: &str, routing_key: &str) -> Step {
    match trace {
        Some(t) => t.child(
            DISPATCH,
            SpanKind::Producer,
            vec![
                KeyValue::new(MESSAGING_SYSTEM, "rabbitmq"),
                KeyValue::new(OPERATION_TYPE, "send"),
                KeyValue::new(DESTINATION, exchange.to_owned()),
                KeyValue::new(ROUTING_KEY, routing_key.to_owned()),
            ],
        ),
        None => Step(None),
    }
}

/// The `record denial` span of a row under `rule`; holds nothing when `trace` is `None`.
pub fn record_denial(trace: Option<&MessageTrace>, rule: &str, reason: &str, shadow: bool) -> Step {
    match trace {
        Some(t) => t.child(
            RECORD_DENIAL,
            SpanKind::Internal,
            vec![
                KeyValue::new(RULE, rule.to_owned()),
                KeyValue::new(REASON, reason.to_owned()),
                KeyValue::new(SHADOW, shadow),
            ],
        ),
        None => Step(None),
    }
}

/// One span of a message's work, ended when dropped; holds nothing when traces are off (boxed
/// when on, so the futures that hold one stay small when off).
pub struct Step(Option<Box<Span>>);

impl Step {
    /// Notes what the decision said: the outcome, and the rule that refused when one did.
    pub fn decided(&mut self, outcome: &'static str, rule: Option<&str>) {
        use opentelemetry::trace::Span as _;
        if let Some(span) = &mut self.0 {
            span.set_attribute(KeyValue::new(OUTCOME, outcome));
            if let Some(rule) = rule {
                span.set_attribute(KeyValue::new(RULE, rule.to_owned()));
            }
        }
    }

    /// Marks the span failed with `error`.
    pub fn failed(&mut self, error: &dyn fmt::Display) {
        use opentelemetry::trace::Span as _;
        if let Some(span) = &mut self.0 {
            span.set_status(Status::error(error.to_string()));
        }
    }

    /// Marks the span failed when `result` is an error; returns it.
    pub fn result<T, E: fmt::Display>(&mut self, result: Result<T, E>) -> Result<T, E> {
        if let Err(e) = &result {
            self.failed(e);
        }
        result
    }

    /// `properties` with this span's trace context as their `traceparent` and `tracestate`,
    /// so whoever receives the publish continues the trace from this span; unchanged when
    /// traces are off (the producer's, carried, stay).
    pub fn propagated(&self, properties: BasicProperties) -> BasicProperties {
        use opentelemetry::trace::Span as _;
        let Some(span) = &self.0 else {
            return properties;
        };
        let cx = Context::new().with_remote_span_context(span.span_context().clone());
        let mut headers = Headers(std::borrow::Cow::Owned(
            properties.headers().clone().unwrap_or_default(),
        ));
        TraceContextPropagator::new().inject_context(&cx, &mut headers);
        properties.with_headers(headers.0.into_owned())
    }
}

/// AMQP headers as W3C trace context reads and writes them: string values by name.
struct Headers<'a>(std::borrow::Cow<'a, FieldTable>);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match self.0.inner().get(key)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
            AMQPValue::ShortString(s) => Some(s.as_str()),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.0.inner().keys().map(|k| k.as_str()).collect()
    }
}

impl Injector for Headers<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0
            .to_mut()
            .insert(key.into(), AMQPValue::LongString(LongString::from(value)));
    }
}

/// The OTLP exporter, saying when export starts failing and when it works again, once each:
/// a collector that is away would otherwise fill the log with a line per batch. A failed batch
/// is dropped; message handling never waits for export.
#[derive(Debug)]
struct Reported<E> {
    inner: E,
    url: String,
    failing: AtomicBool,
}

impl<E: SpanExporter> SpanExporter for Reported<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Err(e) if !self.failing.swap(true, Ordering::Relaxed) => tracing::warn!(
                error = %e, url = %self.url, spans,
                "span export failed; spans are dropped until the collector answers"
            ),
            Ok(()) if self.failing.swap(false, Ordering::Relaxed) => {
                tracing::info!(url = %self.url, "span export works again")
            }
            _ => {}
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_context_is_read_from_and_written_to_amqp_headers() {
        let mut table = FieldTable::default();
        table.insert(
            "traceparent".into(),
            AMQPValue::LongString(LongString::from(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )),
        );
        table.insert(
            "tracestate".into(),
            AMQPValue::LongString(LongString::from("congo=t61rcWkgMzE")),
        );
        let cx =
            TraceContextPropagator::new().extract(&Headers(std::borrow::Cow::Borrowed(&table)));
        let producer = cx.span().span_context().clone();
        assert!(producer.is_valid() && producer.is_remote() && producer.is_sampled());
        assert_eq!(
            producer.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let mut out = Headers(std::borrow::Cow::Owned(FieldTable::default()));
        TraceContextPropagator::new().inject_context(&cx, &mut out);
        assert_eq!(
            out.get("traceparent"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        assert_eq!(out.get("tracestate"), Some("congo=t61rcWkgMzE"));
    }

    #[test]
    fn a_step_of_a_message_without_traces_holds_nothing_and_changes_no_header() {
        let mut step = decide(None);
        step.decided("deny", Some("headline"));
        assert!(step.0.is_none());
        let properties = BasicProperties::default();
        assert_eq!(
            dispatch(None, "x", "sms").propagated(properties.clone()),
            properties
        );
        assert_eq!(std::mem::size_of::<Step>(), std::mem::size_of::<usize>());
    }
}
