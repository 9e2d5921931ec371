//! Trust run: the worker under real traffic, with injected duplicates and poison
//! messages, through a restart of each service, reconciled message by message at the end.
//!
//! Why it exists: docs/guarantees.md promises that every request ends up dispatched, denied,
//! invalid or quarantined, that a (recipient, id) is dispatched at most once outside the crash
//! window (a lost connection between the broker's confirm and the dispatch mark), and that poison
//! messages leave the flow instead of wedging it. The unit and fault tests check each promise on a
//! few messages; this run checks them together, at volume, with two worker processes at their
//! default settings while Redis, RabbitMQ and Postgres are each stopped for a few seconds and
//! started again. It takes minutes, so it is a bench, not part of `cargo test`.
//!
//! What it does:
//! - starts private Redis (append-only file, fsync always: quota and dispatch marks survive a
//!   restart, as docs/operations.md requires of production), RabbitMQ and PostgreSQL servers on
//!   free ports (`tests/it/support/private.rs`); the machine's shared services are never touched;
//! - starts two `sendquota worker` processes at their defaults (headline rule only);
//! - publishes `--messages` requests (default 50,000) at `--rate` a second to recipients drawn
//!   from `messages * 2 / 5` (about 2.5 each, in several zones, so both dispatches and denials
//!   happen); 2% of the ids are published twice back to back (same body); interleaved, `--poison`
//!   (default messages / 1000) of each poison kind: bodies the worker routes to `<ns>.invalid`
//!   (malformed JSON, an id over 255 bytes, a channel that is not a name, a body over
//!   `max_body_bytes`, a NUL in the payload, an unknown zone) and denied requests whose denial
//!   row Postgres refuses (a trigger refuses the rows of the quarantine recipients with
//!   SQLSTATE 22003, as numeric refuses a number it cannot hold: the worker refuses such
//!   payloads up front), each sent to a recipient already dispatched to today, which the worker
//!   quarantines after three refusals;
//! - restarts Redis, then RabbitMQ, then Postgres at 20%, 45% and 70% of the publishing: stop,
//!   `--down-secs` while publishing goes on (the producer retries while the broker is away),
//!   start on the same port;
//! - waits until the requests and delay queues hold nothing, ready or unacked (`--settle-secs`
//!   at most), stops the workers, and counts from the services themselves: the dispatch sink (a
//!   queue bound to the dispatch exchange before the first publish), the denial rows, the
//!   invalid and quarantine queues.
//!
//! It asserts lost = 0 (each published (recipient, id) has exactly one kind of outcome, the
//! right one for what was published), stuck = 0, quarantined = quarantine poison published,
//! no quota breach, and no duplicate dispatch outside the crash window; each duplicate dispatch
//! is listed with when its copies reached the sink and the restart it straddles. It exits 1
//! when an assertion fails. Worker logs are kept in the directory the report names.
//!
//! ```sh
//! cargo bench --bench trust                              # 50,000 messages, release build
//! cargo bench --bench trust --profile dev -- --messages 3000 --rate 300   # a quick look
//! ```
//!
//! Options: `--messages N`; `--rate N`, requests a second, default 2000: more than two release
//! workers decide on a 2-core machine beside the three servers, so a backlog builds and each
//! restart finds every worker's prefetch of deliveries in flight (at 500 a second the workers
//! kept up and the RabbitMQ restart found none); `--down-secs N`, how long each service stays
//! down, default 5; `--poison N` of each poison kind; `--settle-secs N`, default 300; `--seed
//! N` for the recipient draw, default 1; `--self-check`: one request is not published and one
//! dispatch is counted twice, and the run must report both and fail.
//!
//! Needs what the fault suite needs: redis-server, rabbitmq-server and PostgreSQL 15
//! installed, and root (the private servers run as their own users).

#[allow(dead_code)]
mod common;
#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use sendquota::config::{AmqpSettings, QueueType};
use sendquota::internals::broker::{self, Names, Publisher, DELAY_TIERS_MS};
use support::private::{free_port, PrivatePostgres, PrivateRabbit, PrivateRedis};
use support::TestEnv;

/// Zones of the recipients (each recipient keeps one).
const ZONES: [&str; 7] = [
    "UTC",
    "Europe/London",
    "America/New_York",
    "Asia/Shanghai",
    "Australia/Sydney",
    "Asia/Kolkata",
    "America/Santiago",
];
/// One id in this many is published twice, back to back: 2%.
const DUPLICATE_EVERY: usize = 50;
/// The recipients whose denial rows Postgres refuses (a `LIKE` pattern): the quarantine
/// poison's.
const REFUSED_RECIPIENTS: &str = "qp%";
/// Marks every invalid body, followed by its kind and number: how it is found in the invalid
/// queue, whatever the body's shape.
const INVALID_TOKEN: &str = "trust-inv-";
/// When each service is restarted: the share of the plan published by then.
const RESTARTS: [(Service, f64); 3] = [
    (Service::Redis, 0.20),
    (Service::Rabbit, 0.45),
    (Service::Postgres, 0.70),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Service {
    Redis,
    Rabbit,
    Postgres,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Service::Redis => "redis",
            Service::Rabbit => "rabbitmq",
            Service::Postgres => "postgres",
        }
    }
}

/// What was published, and so which outcome it must have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    /// An ordinary request: dispatched or denied.
    Request,
    /// The first request of a quarantine recipient: dispatched.
    Primer,
    /// Denied, its row refused by Postgres: quarantined.
    Quarantine,
    /// Invalid: not JSON.
    Malformed,
    /// Invalid: an id of 80 characters, over 255 bytes.
    LongId,
    /// Invalid: a channel of 64 emoji, not a name.
    LongChannel,
    /// Invalid: a body over `max_body_bytes`.
    Oversize,
    /// Invalid: a NUL character in the payload.
    NulPayload,
    /// Invalid: an unknown time zone.
    UnknownZone,
}

impl Kind {
    const INVALID: [Kind; 6] = [
        Kind::Malformed,
        Kind::LongId,
        Kind::LongChannel,
        Kind::Oversize,
        Kind::NulPayload,
        Kind::UnknownZone,
    ];

    fn label(self) -> &'static str {
        match self {
            Kind::Request => "request",
            Kind::Primer => "primer",
            Kind::Quarantine => "quarantine poison",
            Kind::Malformed => "invalid: malformed JSON",
            Kind::LongId => "invalid: id over 255 bytes",
            Kind::LongChannel => "invalid: channel not a name",
            Kind::Oversize => "invalid: body over 64 KiB",
            Kind::NulPayload => "invalid: NUL in payload",
            Kind::UnknownZone => "invalid: unknown zone",
        }
    }

    fn token(self) -> &'static str {
        match self {
            Kind::Malformed => "malformed",
            Kind::LongId => "longid",
            Kind::LongChannel => "longchannel",
            Kind::Oversize => "oversize",
            Kind::NulPayload => "nul",
            Kind::UnknownZone => "zone",
            _ => "",
        }
    }
}

/// What a message is reconciled by: (recipient, id) for a valid request, ("", token) for an
/// invalid body.
type Key = (String, String);

/// The outcomes a key can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Outcome {
    Dispatched,
    Denied,
    Invalid,
    Quarantined,
}

struct Item {
    key: Key,
    kind: Kind,
    body: Vec<u8>,
}

struct Args {
    messages: usize,
    rate: u64,
    down_secs: u64,
    poison: usize,
    settle_secs: u64,
    seed: u64,
    /// Hide one request from the producer and count one dispatch twice: the run must fail.
    self_check: bool,
}

impl Args {
    fn parse() -> Args {
        let messages = common::flag("--messages", 50_000usize).max(1);
        Args {
            messages,
            rate: common::flag("--rate", 2_000u64).max(1),
            down_secs: common::flag("--down-secs", 5u64),
            poison: common::flag("--poison", (messages / 1_000).max(3)),
            settle_secs: common::flag("--settle-secs", 300u64),
            seed: common::flag("--seed", 1u64),
            self_check: std::env::args().any(|a| a == "--self-check"),
        }
    }

    /// The command that runs this bench again with the same plan.
    fn command(&self) -> String {
        let profile = if cfg!(debug_assertions) {
            " --profile dev"
        } else {
            ""
        };
        format!(
            "cargo bench --bench trust{profile} -- --messages {} --rate {} --down-secs {} \
             --poison {} --settle-secs {} --seed {}{}",
            self.messages,
            self.rate,
            self.down_secs,
            self.poison,
            self.settle_secs,
            self.seed,
            if self.self_check { " --self-check" } else { "" }
        )
    }
}

/// splitmix64: the recipient of message `i`, reproducible from the seed.
fn mix(seed: u64, i: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_add(1).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The invalid-body token in `body` (`trust-inv-<kind>-<n>`), if any.
fn invalid_token(body: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    let at = text.find(INVALID_TOKEN)?;
    let token: String = text[at..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    Some(token.trim_end_matches('-').to_owned())
}

fn invalid_body(kind: Kind, n: usize) -> Vec<u8> {
    let id = format!("{INVALID_TOKEN}{}-{n}", kind.token());
    let value = match kind {
        Kind::Malformed => {
            return format!(r#"{{"id":"{id}","recipient":"x","channel":"sms""#).into_bytes()
        }
        Kind::LongId => support::request(&format!("{id}-{}", "😀".repeat(60)), "x", "UTC"),
        Kind::LongChannel => serde_json::json!({
            "id": id, "recipient": "x", "channel": "😀".repeat(64),
        }),
        Kind::Oversize => serde_json::json!({
            "id": id, "recipient": "x", "channel": "sms",
            "payload": {"pad": "x".repeat(70_000)},
        }),
        Kind::NulPayload => serde_json::json!({
            "id": id, "recipient": "x", "channel": "sms", "payload": {"t": "a\u{0}b"},
        }),
        Kind::UnknownZone => support::request(&id, "x", "Nowhere/Atlantis"),
        _ => unreachable!("not an invalid kind"),
    };
    value.to_string().into_bytes()
}

/// Everything to publish, in order, and what each key must become.
struct Plan {
    items: Vec<Item>,
    expected: HashMap<Key, Kind>,
    duplicated: usize,
    recipients: usize,
    /// Per quarantine recipient, its primer's id.
    primers: HashMap<String, String>,
}

fn plan(args: &Args) -> Plan {
    let n = args.messages;
    let recipients = (n * 2 / 5).max(1);
    let mut expected = HashMap::new();
    let mut base = Vec::with_capacity(n + n / DUPLICATE_EVERY + 1);
    let mut duplicated = 0;
    for i in 0..n {
        let r = (mix(args.seed, i as u64) % recipients as u64) as usize;
        let recipient = format!("r{r}");
        let id = format!("m{i}");
        let body = support::request(&id, &recipient, ZONES[r % ZONES.len()])
            .to_string()
            .into_bytes();
        let key = (recipient, id);
        expected.insert(key.clone(), Kind::Request);
        let copies = if i % DUPLICATE_EVERY == DUPLICATE_EVERY / 2 {
            duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            base.push(Item {
                key: key.clone(),
                kind: Kind::Request,
                body: body.clone(),
            });
        }
    }
    // Quarantine recipients each get a primer first, dispatched; every later request of theirs
    // today is denied, and its row refused.
    let quarantine_recipients = args.poison.clamp(1, 10);
    let mut items = Vec::new();
    let mut primers = HashMap::new();
    for q in 0..quarantine_recipients {
        let recipient = format!("qp{q}");
        let id = format!("qp{q}-primer");
        let body = support::request(&id, &recipient, "UTC")
            .to_string()
            .into_bytes();
        let key = (recipient.clone(), id.clone());
        expected.insert(key.clone(), Kind::Primer);
        primers.insert(recipient, id);
        items.push(Item {
            key,
            kind: Kind::Primer,
            body,
        });
    }
    let mut poison = Vec::new();
    for j in 0..args.poison {
        for kind in Kind::INVALID {
            let body = invalid_body(kind, j);
            let token = invalid_token(&body).expect("an invalid body carries its token");
            let key = (String::new(), token);
            expected.insert(key.clone(), kind);
            poison.push(Item { key, kind, body });
        }
        let recipient = format!("qp{}", j % quarantine_recipients);
        let id = format!("q{j}");
        let body = format!(
            r#"{{"id":"{id}","recipient":"{recipient}","channel":"sms","payload":{{"x":{j}}}}}"#
        )
        .into_bytes();
        let key = (recipient, id);
        expected.insert(key.clone(), Kind::Quarantine);
        poison.push(Item {
            key,
            kind: Kind::Quarantine,
            body,
        });
    }
    // Poison spread evenly through the requests.
    let slots = poison.len() + 1;
    let total = base.len();
    let mut poison = poison.into_iter().enumerate().peekable();
    for (at, item) in base.into_iter().enumerate() {
        items.push(item);
        while let Some((k, _)) = poison.peek() {
            if (k + 1) * total / slots > at {
                break;
            }
            let (_, p) = poison.next().expect("peeked");
            items.push(p);
        }
    }
    items.extend(poison.map(|(_, p)| p));
    Plan {
        items,
        expected,
        duplicated,
        recipients,
        primers,
    }
}

/// A service outage, in seconds since the start.
#[derive(Clone, Debug)]
struct Restart {
    service: Service,
    stopped: f64,
    back: f64,
}

/// State shared by the producer, the restarts and the progress monitor.
struct Shared {
    started: Instant,
    total: u64,
    published: AtomicU64,
    republished: AtomicU64,
    republished_keys: Mutex<HashSet<Key>>,
    outages_seen_by_producer: AtomicU64,
    phase: Mutex<String>,
    /// (seconds since start, messages in the dispatch sink): when each sink position arrived.
    timeline: Mutex<Vec<(f64, u32)>>,
    restarts: Mutex<Vec<Restart>>,
    stop_monitor: AtomicBool,
}

impl Shared {
    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn set_phase(&self, phase: &str) {
        *self.phase.lock().expect("phase") = phase.to_owned();
    }
}

/// The producer's broker session, opened again whenever the broker is away.
struct Producer {
    settings: AmqpSettings,
    exchange: String,
    session: Option<(lapin::Connection, Publisher)>,
}

impl Producer {
    async fn publisher(&mut self, shared: &Shared) -> Publisher {
        let mut waiting_since: Option<Instant> = None;
        loop {
            if let Some((conn, publisher)) = &self.session {
                if conn.status().connected() && publisher.channel().status().connected() {
                    return publisher.clone();
                }
                self.session = None;
            }
            let opened = async {
                let conn = broker::connect(&self.settings, "sendquota-trust-producer").await?;
                let publisher = Publisher::open(&conn).await?;
                Ok::<_, broker::BrokerError>((conn, publisher))
            };
            match tokio::time::timeout(Duration::from_secs(5), opened).await {
                Ok(Ok(session)) => {
                    if let Some(since) = waiting_since {
                        eprintln!(
                            "[{:>5.0}s] producer: connected again after {:.1} s",
                            shared.now(),
                            since.elapsed().as_secs_f64()
                        );
                    }
                    self.session = Some(session);
                }
                Ok(Err(_)) | Err(_) => {
                    if waiting_since.is_none() {
                        shared
                            .outages_seen_by_producer
                            .fetch_add(1, Ordering::Relaxed);
                        eprintln!(
                            "[{:>5.0}s] producer: rabbitmq unreachable, retrying",
                            shared.now()
                        );
                        waiting_since = Some(Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    }

    /// Publishes every item, publisher-confirmed, in order; an item whose confirm did not come
    /// (the broker went away) is published again on a new session: it may then be in the queue
    /// twice, which the worker must treat as any duplicate.
    async fn publish(&mut self, items: &[Item], shared: &Shared) {
        let mut pending: Vec<usize> = (0..items.len()).collect();
        while !pending.is_empty() {
            let publisher = self.publisher(shared).await;
            let results = futures_util::future::join_all(pending.iter().map(|&i| {
                publisher.publish(
                    &self.exchange,
                    "",
                    &items[i].body,
                    BasicProperties::default(),
                )
            }))
            .await;
            let failed: Vec<usize> = pending
                .iter()
                .zip(results)
                .filter(|(_, r)| r.is_err())
                .map(|(&i, _)| i)
                .collect();
            if !failed.is_empty() {
                shared
                    .republished
                    .fetch_add(failed.len() as u64, Ordering::Relaxed);
                shared
                    .republished_keys
                    .lock()
                    .expect("keys")
                    .extend(failed.iter().map(|&i| items[i].key.clone()));
                if let Some((conn, _)) = self.session.take() {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(2),
                        conn.close(200, "trust: publish failed".into()),
                    )
                    .await;
                }
            }
            pending = failed;
        }
    }
}

/// Publishes the plan at `rate` a second (bursts of at most a second's worth after a wait).
/// A quarantine poison goes out only once its recipient's primer carries its dispatch mark, so
/// it is denied (and its row refused) rather than dispatched.
async fn produce(
    items: Vec<Item>,
    rate: u64,
    mut producer: Producer,
    env_redis: sendquota::internals::store::RedisConn,
    namespace: String,
    primers: HashMap<String, String>,
    shared: Arc<Shared>,
) {
    let mut queue: VecDeque<Item> = items.into();
    let mut marked: HashSet<String> = HashSet::new();
    let mut tokens = 0.0f64;
    let mut last = Instant::now();
    let mut redis = env_redis;
    while !queue.is_empty() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = Instant::now();
        tokens = (tokens + rate as f64 * (now - last).as_secs_f64()).min(rate.max(20) as f64);
        last = now;
        let mut chunk = Vec::new();
        let mut deferred = 0;
        while (chunk.len() as f64) < tokens.floor() && !queue.is_empty() && deferred < 20 {
            let front = queue.front().expect("not empty");
            if front.kind == Kind::Quarantine && !marked.contains(&front.key.0) {
                let recipient = front.key.0.clone();
                let key = sendquota::internals::keys::recipient_sent_key(&namespace, &recipient);
                let score = tokio::time::timeout(
                    Duration::from_millis(300),
                    redis::cmd("ZSCORE")
                        .arg(&key)
                        .arg(&primers[&recipient])
                        .query_async::<Option<f64>>(&mut redis),
                )
                .await;
                if let Ok(Ok(Some(_))) = score {
                    marked.insert(recipient);
                } else {
                    // Not yet: let other messages go first.
                    deferred += 1;
                    let item = queue.pop_front().expect("not empty");
                    let at = queue.len().min(100);
                    queue.insert(at, item);
                    if at == 0 {
                        break;
                    }
                    continue;
                }
            }
            chunk.push(queue.pop_front().expect("not empty"));
        }
        if chunk.is_empty() {
            continue;
        }
        producer.publish(&chunk, &shared).await;
        tokens -= chunk.len() as f64;
        shared
            .published
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
    }
    if let Some((conn, _)) = producer.session.take() {
        let _ = conn.close(200, "trust: published".into()).await;
    }
}

/// Restarts each service in turn once its share of the plan is published.
async fn restart_services(
    redis: Arc<PrivateRedis>,
    rabbit: Arc<PrivateRabbit>,
    postgres: Arc<PrivatePostgres>,
    down: Duration,
    shared: Arc<Shared>,
) {
    for (service, share) in RESTARTS {
        while (shared.published.load(Ordering::Relaxed) as f64) < share * shared.total as f64 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let stop_at = shared.now();
        eprintln!(
            "[{stop_at:>5.0}s] restart: stopping {} ({:.0}% published)",
            service.name(),
            share * 100.0
        );
        shared.set_phase(&format!("{} down", service.name()));
        let (r, m, p) = (redis.clone(), rabbit.clone(), postgres.clone());
        tokio::task::spawn_blocking(move || match service {
            Service::Redis => r.stop(),
            Service::Rabbit => m.stop(),
            Service::Postgres => p.stop(),
        })
        .await
        .expect("stop the service");
        let stopped = shared.now();
        tokio::time::sleep(down).await;
        shared.set_phase(&format!("{} starting", service.name()));
        let (r, m, p) = (redis.clone(), rabbit.clone(), postgres.clone());
        tokio::task::spawn_blocking(move || match service {
            Service::Redis => r.start_again(),
            Service::Rabbit => m.start_again(),
            Service::Postgres => p.start_again(),
        })
        .await
        .expect("start the service again");
        let back = shared.now();
        shared.set_phase("");
        eprintln!(
            "[{back:>5.0}s] restart: {} is back (stopped at {stopped:.0} s, down {:.1} s)",
            service.name(),
            back - stopped
        );
        shared.restarts.lock().expect("restarts").push(Restart {
            service,
            stopped,
            back,
        });
    }
}

/// Ready messages in `queue` (a passive declare), or None when the broker does not answer.
async fn depth(channel: &lapin::Channel, queue: &str) -> Option<u32> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = tokio::time::timeout(
        Duration::from_secs(2),
        channel.queue_declare(queue.into(), passive, FieldTable::default()),
    )
    .await;
    match declared {
        Ok(Ok(q)) => Some(q.message_count()),
        _ => None,
    }
}

/// Every second: how many messages the dispatch sink holds (the timeline that dates each
/// dispatch); every five: a progress line.
async fn monitor(env_pool: sqlx::PgPool, names: Names, sink: String, shared: Arc<Shared>) {
    let mut probe: Option<(lapin::Connection, lapin::Channel)> = None;
    let mut tick = 0u64;
    while !shared.stop_monitor.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tick += 1;
        if probe
            .as_ref()
            .is_none_or(|(c, ch)| !c.status().connected() || !ch.status().connected())
        {
            probe = None;
            let opened = tokio::time::timeout(Duration::from_secs(2), async {
                let conn = support::lapin_connect("sendquota-trust-probe").await?;
                let ch = conn.create_channel().await?;
                Ok::<_, lapin::Error>((conn, ch))
            })
            .await;
            if let Ok(Ok(p)) = opened {
                probe = Some(p);
            }
        }
        let dispatched = match &probe {
            Some((_, ch)) => depth(ch, &sink).await,
            None => None,
        };
        if let Some(d) = dispatched {
            shared
                .timeline
                .lock()
                .expect("timeline")
                .push((shared.now(), d));
        }
        if !tick.is_multiple_of(5) {
            continue;
        }
        let mut line = format!(
            "[{:>5.0}s] published {}/{}",
            shared.now(),
            shared.published.load(Ordering::Relaxed),
            shared.total
        );
        let shown = |v: Option<u32>| v.map_or("?".to_owned(), |v| v.to_string());
        let denied: Option<i64> = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::query_scalar("SELECT count(*) FROM denials").fetch_one(&env_pool),
        )
        .await
        .ok()
        .and_then(Result::ok);
        let (waiting, invalid, quarantined) = match &probe {
            Some((_, ch)) => (
                depth(ch, &names.requests).await,
                depth(ch, &names.invalid).await,
                depth(ch, &names.quarantine).await,
            ),
            None => (None, None, None),
        };
        let _ = write!(
            line,
            ", dispatched {}, denied {}, invalid {}, quarantined {}, ready in requests {}",
            shown(dispatched),
            denied.map_or("?".to_owned(), |d| d.to_string()),
            shown(invalid),
            shown(quarantined),
            shown(waiting)
        );
        let phase = shared.phase.lock().expect("phase").clone();
        if !phase.is_empty() {
            let _ = write!(line, " | {phase}");
        }
        eprintln!("{line}");
    }
    if let Some((conn, _)) = probe {
        let _ = conn.close(200, "trust: done".into()).await;
    }
}

/// Messages ready and unacked in each queue of the private broker, from `rabbitmqctl`.
fn queue_counts(rabbit: &PrivateRabbit) -> Option<HashMap<String, (u64, u64)>> {
    let out = rabbit
        .ctl_output(&[
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .map_err(|e| eprintln!("trust: {e}"))
        .ok()?;
    let mut counts = HashMap::new();
    for line in out.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let [name, ready, unacked] = fields.as_slice() {
            if let (Ok(r), Ok(u)) = (ready.parse(), unacked.parse()) {
                counts.insert((*name).to_owned(), (r, u));
            }
        }
    }
    Some(counts)
}

/// Ready and unacked messages in the requests and delay queues: what is not settled yet.
fn unsettled(counts: &HashMap<String, (u64, u64)>, names: &Names) -> (u64, u64) {
    let mut queues = vec![names.requests.clone()];
    queues.extend(DELAY_TIERS_MS.iter().map(|t| names.delay_queue(*t)));
    queues.iter().fold((0, 0), |(r, u), q| {
        let (qr, qu) = counts.get(q).copied().unwrap_or((0, 0));
        (r + qr, u + qu)
    })
}

/// Takes every message in `queue`, in order.
async fn drain(conn: &lapin::Connection, queue: &str) -> Vec<lapin::message::Delivery> {
    let channel = conn.create_channel().await.expect("channel");
    let count = depth(&channel, queue).await.expect("queue depth") as usize;
    let mut out = Vec::with_capacity(count);
    if count == 0 {
        return out;
    }
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "sendquota-trust-count".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");
    while out.len() < count {
        match tokio::time::timeout(Duration::from_secs(30), consumer.next()).await {
            Ok(Some(Ok(delivery))) => out.push(delivery),
            other => panic!(
                "draining {queue}: {} of {count} taken, then {:?}",
                out.len(),
                other.map(|o| o.map(|r| r.map(|_| ())))
            ),
        }
    }
    let _ = channel.close(200, "trust: drained".into()).await;
    out
}

/// (recipient, id) of a request body.
fn request_key(body: &[u8]) -> Option<Key> {
    #[derive(serde::Deserialize)]
    struct Ids {
        id: String,
        recipient: String,
    }
    let ids: Ids = serde_json::from_slice(body).ok()?;
    Some((ids.recipient, ids.id))
}

/// The sum of each metric line over the workers' `/metrics` pages.
fn sum_metrics(pages: &[String]) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for page in pages {
        for line in page.lines().filter(|l| !l.starts_with('#')) {
            if let Some((name, value)) = line.rsplit_once(' ') {
                if let Ok(v) = value.parse::<f64>() {
                    *sums.entry(name.to_owned()).or_insert(0.0) += v;
                }
            }
        }
    }
    sums
}

/// Lines of the worker logs that name `id`.
fn log_lines(logs: &[PathBuf], id: &str, limit: usize) -> Vec<String> {
    let needles = [
        format!("={id} "),
        format!("\"{id}\""),
        format!("message_id={id}\n"),
    ];
    let mut out = Vec::new();
    for (n, path) in logs.iter().enumerate() {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for line in text.lines() {
            let padded = format!("{line}\n");
            if needles.iter().any(|s| padded.contains(s.as_str())) {
                out.push(format!("worker-{}: {line}", n + 1));
                if out.len() >= limit {
                    return out;
                }
            }
        }
    }
    out
}

/// When the sink's message at `position` arrived: between the two timeline samples around it.
fn dated(timeline: &[(f64, u32)], position: usize) -> (f64, f64) {
    let mut before = 0.0;
    for &(t, count) in timeline {
        if count as usize > position {
            return (before, t);
        }
        before = t;
    }
    (before, f64::INFINITY)
}

fn start_worker(
    n: usize,
    env: &TestEnv,
    admin_port: u16,
    log: &Path,
    redis_url: &str,
    amqp_url: &str,
) -> Child {
    let file = std::fs::File::create(log).expect("worker log file");
    let mut cmd = support::process::sendquota();
    cmd.arg("worker")
        .env_remove("SENDQUOTA_LOG")
        .env("SENDQUOTA_NAMESPACE", &env.namespace)
        .env("SENDQUOTA_REDIS_URL", redis_url)
        .env("SENDQUOTA_AMQP_URL", amqp_url)
        .env("SENDQUOTA_DATABASE_URL", &env.database_url)
        .env("SENDQUOTA_ADMIN_LISTEN", format!("127.0.0.1:{admin_port}"))
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("log file"))
        .stderr(file);
    let child = cmd.spawn().expect("start the worker");
    eprintln!(
        "worker-{n}: pid {}, admin 127.0.0.1:{admin_port}, log {}",
        child.id(),
        log.display()
    );
    child
}

/// The worker processes this run started; any still running when it ends early (a panic) are
/// killed, by their own handles.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for worker in &mut self.0 {
            if worker.try_wait().ok().flatten().is_none() {
                let _ = worker.kill();
                let _ = worker.wait();
            }
        }
    }
}

/// One row of the report table.
fn row(out: &mut String, what: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "| {what} | {value} |");
}

struct Check {
    what: String,
    ok: bool,
}

fn main() {
    let args = Args::parse();
    let began = Instant::now();
    eprintln!("trust: starting private redis, postgres and rabbitmq");
    let redis = Arc::new(PrivateRedis::start());
    let postgres = Arc::new(PrivatePostgres::start());
    let rabbit = Arc::new(PrivateRabbit::start());
    // The support helpers (TestEnv, lapin_connect) read the services' URLs from these.
    std::env::set_var("SENDQUOTA_REDIS_URL", redis.url());
    std::env::set_var("SENDQUOTA_AMQP_URL", rabbit.url());
    std::env::set_var("SENDQUOTA_DATABASE_URL", postgres.url("postgres"));
    eprintln!(
        "trust: private services up in {:.1} s: {}, {}, {}",
        began.elapsed().as_secs_f64(),
        redis.url(),
        rabbit.url(),
        postgres.url("postgres")
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let passed = runtime.block_on(run(&args, redis.clone(), rabbit.clone(), postgres.clone()));
    drop(runtime);
    // Stop the private servers before exiting (exit runs no destructors).
    drop(redis);
    drop(rabbit);
    drop(postgres);
    std::process::exit(if passed { 0 } else { 1 });
}

async fn run(
    args: &Args,
    redis: Arc<PrivateRedis>,
    rabbit: Arc<PrivateRabbit>,
    postgres: Arc<PrivatePostgres>,
) -> bool {
    let start_utc = chrono::Utc::now();
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    support::refuse_denials_of(
        &env.pool,
        REFUSED_RECIPIENTS,
        "22003",
        "value overflows numeric format",
    )
    .await;
    let names = env.names.clone();
    let plan = plan(args);
    let Plan {
        mut items,
        expected,
        duplicated,
        recipients,
        primers,
    } = plan;
    if args.self_check {
        // The check of the checks: one request never published must be reported lost.
        let at = items
            .iter()
            .position(|i| i.kind == Kind::Request)
            .expect("a request");
        let skipped = items.remove(at);
        eprintln!("trust: self-check: {:?} is not published", skipped.key);
    }
    let mut published_by_kind: BTreeMap<Kind, usize> = BTreeMap::new();
    for item in &items {
        *published_by_kind.entry(item.kind).or_default() += 1;
    }
    let shared = Arc::new(Shared {
        started: Instant::now(),
        total: items.len() as u64,
        published: AtomicU64::new(0),
        republished: AtomicU64::new(0),
        republished_keys: Mutex::new(HashSet::new()),
        outages_seen_by_producer: AtomicU64::new(0),
        phase: Mutex::new(String::new()),
        timeline: Mutex::new(Vec::new()),
        restarts: Mutex::new(Vec::new()),
        stop_monitor: AtomicBool::new(false),
    });
    eprintln!(
        "trust: namespace {}, {} publishes planned ({} requests to {recipients} recipients, \
         {duplicated} of them twice, {} poison of each kind), {} a second",
        env.namespace,
        items.len(),
        args.messages,
        args.poison,
        args.rate
    );

    // Two workers at their defaults.
    let log_dir = std::env::temp_dir().join(format!("sendquota-trust-{}", env.namespace));
    std::fs::create_dir_all(&log_dir).expect("log dir");
    let logs: Vec<PathBuf> = (1..=2)
        .map(|n| log_dir.join(format!("worker-{n}.log")))
        .collect();
    let ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
    let mut workers = Workers(
        (0..2)
            .map(|i| start_worker(i + 1, &env, ports[i], &logs[i], &redis.url(), &rabbit.url()))
            .collect(),
    );
    for &port in &ports {
        support::http::wait_until_ready(port).await;
    }
    eprintln!("trust: both workers ready; publishing");

    let monitor_task = tokio::spawn(monitor(
        env.pool.clone(),
        names.clone(),
        env.dispatched_queue.clone(),
        shared.clone(),
    ));
    let restarts_task = tokio::spawn(restart_services(
        redis.clone(),
        rabbit.clone(),
        postgres.clone(),
        Duration::from_secs(args.down_secs),
        shared.clone(),
    ));
    let producer = Producer {
        settings: AmqpSettings {
            url: rabbit.url(),
            ..AmqpSettings::default()
        },
        exchange: names.requests.clone(),
        session: None,
    };
    produce(
        items,
        args.rate,
        producer,
        env.redis.clone(),
        env.namespace.clone(),
        primers,
        shared.clone(),
    )
    .await;
    let published_at = shared.now();
    eprintln!("[{published_at:>5.0}s] trust: everything published");
    restarts_task.await.expect("restarts");

    // Settle: nothing ready or unacked in the requests and delay queues, three checks running.
    let settle_deadline = Instant::now() + Duration::from_secs(args.settle_secs);
    let mut quiet = 0;
    let mut last_unsettled = (u64::MAX, u64::MAX);
    let settled = loop {
        let r = rabbit.clone();
        let counts = tokio::task::spawn_blocking(move || queue_counts(&r))
            .await
            .expect("rabbitmqctl");
        if let Some(counts) = counts {
            last_unsettled = unsettled(&counts, &names);
            quiet = if last_unsettled == (0, 0) {
                quiet + 1
            } else {
                0
            };
        }
        if quiet >= 3 {
            break true;
        }
        if Instant::now() > settle_deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let settled_at = shared.now();
    eprintln!(
        "[{settled_at:>5.0}s] trust: {} (requests and delay queues: {} ready, {} unacked)",
        if settled {
            "settled"
        } else {
            "NOT settled within --settle-secs"
        },
        last_unsettled.0,
        last_unsettled.1
    );
    shared.stop_monitor.store(true, Ordering::Relaxed);
    let _ = monitor_task.await;

    // The workers' own counts, then a graceful stop.
    let mut pages = Vec::new();
    let mut exits = Vec::new();
    for (worker, &port) in workers.0.iter_mut().zip(&ports) {
        if worker.try_wait().ok().flatten().is_none() {
            pages.push(
                support::http::http(port, "GET", "/metrics", None, "")
                    .await
                    .body,
            );
        }
    }
    for worker in &workers.0 {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &worker.id().to_string()])
            .status();
    }
    for worker in &mut workers.0 {
        let deadline = Instant::now() + Duration::from_secs(45);
        let status = loop {
            if let Some(status) = worker.try_wait().expect("wait for the worker") {
                break status
                    .code()
                    .map_or("killed by a signal".to_owned(), |c| c.to_string());
            }
            if Instant::now() > deadline {
                let _ = worker.kill();
                let _ = worker.wait();
                break "did not stop within 45 s; killed".to_owned();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        exits.push(status);
    }
    let r = rabbit.clone();
    let final_counts = tokio::task::spawn_blocking(move || queue_counts(&r))
        .await
        .expect("rabbitmqctl")
        .unwrap_or_default();
    let stuck = unsettled(&final_counts, &names);

    // Count from the services.
    let conn = support::lapin_connect("sendquota-trust-count")
        .await
        .expect("rabbitmq");
    let mut sink: Vec<Vec<u8>> = drain(&conn, &env.dispatched_queue)
        .await
        .into_iter()
        .map(|d| d.data)
        .collect();
    if args.self_check {
        // ... and a dispatch seen twice long after every restart, a duplicate outside the window.
        if let Some(first) = sink.first().cloned() {
            eprintln!("trust: self-check: the first dispatch is counted twice");
            sink.push(first);
        }
    }
    let invalid = drain(&conn, &names.invalid).await;
    let quarantine = drain(&conn, &names.quarantine).await;
    let _ = conn.close(200, "trust: counted".into()).await;
    let denial_rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT recipient, message_id, count(*) FROM denials GROUP BY recipient, message_id",
    )
    .fetch_all(&env.pool)
    .await
    .expect("denials");

    let mut outcomes: HashMap<Key, BTreeMap<Outcome, usize>> = HashMap::new();
    let mut unexpected: Vec<String> = Vec::new();
    let mut dispatch_positions: HashMap<Key, Vec<usize>> = HashMap::new();
    for (position, body) in sink.iter().enumerate() {
        match request_key(body) {
            Some(key) => {
                dispatch_positions
                    .entry(key.clone())
                    .or_default()
                    .push(position);
                *outcomes
                    .entry(key)
                    .or_default()
                    .entry(Outcome::Dispatched)
                    .or_default() += 1;
            }
            None => unexpected.push(format!(
                "dispatched, unreadable: {}",
                String::from_utf8_lossy(body)
            )),
        }
    }
    let mut denial_row_count = 0i64;
    let mut extra_denial_rows = 0i64;
    for (recipient, id, count) in &denial_rows {
        denial_row_count += count;
        extra_denial_rows += count - 1;
        *outcomes
            .entry((recipient.clone(), id.clone()))
            .or_default()
            .entry(Outcome::Denied)
            .or_default() += *count as usize;
    }
    // Per kind of invalid body: how many, and the first reason the worker gave.
    let mut invalid_reasons: BTreeMap<Kind, (usize, String)> = BTreeMap::new();
    for d in &invalid {
        match invalid_token(&d.data) {
            Some(token) => {
                let kind = expected
                    .get(&(String::new(), token.clone()))
                    .copied()
                    .unwrap_or(Kind::Request);
                let reason =
                    broker::header(&d.properties, broker::REASON_HEADER).unwrap_or_default();
                let entry = invalid_reasons.entry(kind).or_insert((0, reason));
                entry.0 += 1;
                *outcomes
                    .entry((String::new(), token))
                    .or_default()
                    .entry(Outcome::Invalid)
                    .or_default() += 1
            }
            None => unexpected.push(format!(
                "invalid, without a token: {}",
                String::from_utf8_lossy(&d.data[..d.data.len().min(200)])
            )),
        }
    }
    let mut quarantine_reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut quarantine_attempts: BTreeMap<String, usize> = BTreeMap::new();
    for d in &quarantine {
        let reason =
            broker::header(&d.properties, broker::QUARANTINE_REASON_HEADER).unwrap_or_default();
        let sqlstate = reason
            .find("SQLSTATE ")
            .map(|at| reason[at..].chars().take(14).collect::<String>())
            .unwrap_or(reason);
        *quarantine_reasons.entry(sqlstate).or_default() += 1;
        let attempts = broker::header(&d.properties, broker::QUARANTINE_ATTEMPTS_HEADER)
            .unwrap_or_else(|| "?".to_owned());
        *quarantine_attempts.entry(attempts).or_default() += 1;
        match request_key(&d.data) {
            Some(key) => {
                *outcomes
                    .entry(key)
                    .or_default()
                    .entry(Outcome::Quarantined)
                    .or_default() += 1
            }
            None => unexpected.push(format!(
                "quarantined, unreadable: {}",
                String::from_utf8_lossy(&d.data)
            )),
        }
    }

    // Reconcile every published key.
    let allowed = |kind: Kind| -> &'static [Outcome] {
        match kind {
            Kind::Request => &[Outcome::Dispatched, Outcome::Denied],
            Kind::Primer => &[Outcome::Dispatched],
            Kind::Quarantine => &[Outcome::Quarantined],
            _ => &[Outcome::Invalid],
        }
    };
    let mut lost: Vec<Key> = Vec::new();
    let mut wrong: Vec<(Key, Kind, Vec<Outcome>)> = Vec::new();
    let mut mixed: Vec<(Key, Vec<Outcome>)> = Vec::new();
    for (key, kind) in &expected {
        match outcomes.get(key) {
            None => lost.push(key.clone()),
            Some(got) => {
                let kinds: Vec<Outcome> = got.keys().copied().collect();
                if kinds.len() > 1 {
                    mixed.push((key.clone(), kinds.clone()));
                }
                if kinds.iter().any(|o| !allowed(*kind).contains(o)) {
                    wrong.push((key.clone(), *kind, kinds));
                }
            }
        }
    }
    for key in outcomes.keys() {
        if !expected.contains_key(key) {
            unexpected.push(format!("an outcome for {key:?}, never published"));
        }
    }
    lost.sort();

    // Duplicate dispatches, dated by the sink's timeline, against the restarts.
    let timeline = shared.timeline.lock().expect("timeline").clone();
    let restarts = shared.restarts.lock().expect("restarts").clone();
    let republished_keys = shared.republished_keys.lock().expect("keys").clone();
    let mut duplicate_report = Vec::new();
    let (mut in_window, mut outside_window) = (0usize, 0usize);
    let mut duplicates: Vec<(&Key, &Vec<usize>)> = dispatch_positions
        .iter()
        .filter(|(_, p)| p.len() > 1)
        .collect();
    duplicates.sort_by_key(|(_, p)| p[0]);
    for (key, positions) in duplicates {
        let copies: Vec<(f64, f64)> = positions.iter().map(|&p| dated(&timeline, p)).collect();
        // The crash window: the connection to the broker (or to Redis, for longer than the
        // mark's retries) was lost between the first copy reaching the broker and its dispatch
        // mark, so the message went back to the queue and was dispatched again once the
        // service was back. So the first copy reached the sink at most a few seconds before
        // the outage (or during it), and the later one during it or soon after.
        let meets =
            |(from, to): (f64, f64), lo: f64, hi: f64| to.is_finite() && from <= hi && to >= lo;
        let straddled: Vec<&Restart> = restarts
            .iter()
            .filter(|r| {
                meets(copies[0], r.stopped - 5.0, r.back)
                    && copies[1..]
                        .iter()
                        .all(|&c| meets(c, r.stopped, r.back + 30.0))
            })
            .collect();
        let window = straddled
            .iter()
            .any(|r| matches!(r.service, Service::Rabbit | Service::Redis));
        if window {
            in_window += positions.len() - 1;
        } else {
            outside_window += positions.len() - 1;
        }
        let mut text = format!(
            "{key:?}: {} dispatches, at (s) {}; {}{}",
            positions.len(),
            copies
                .iter()
                .map(|(a, b)| if b.is_finite() {
                    format!("{a:.0}-{b:.0}")
                } else {
                    "after the run".to_owned()
                })
                .collect::<Vec<_>>()
                .join(", "),
            if straddled.is_empty() {
                "coincides with no restart".to_owned()
            } else {
                format!(
                    "straddles the {} restart",
                    straddled
                        .iter()
                        .map(|r| r.service.name())
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
            },
            if window {
                " (crash window)"
            } else {
                " (OUTSIDE the crash window)"
            }
        );
        if republished_keys.contains(key) {
            text.push_str("; the producer published it again after an unconfirmed publish");
        }
        for line in log_lines(&logs, &key.1, 4) {
            let _ = write!(text, "\n      {line}");
        }
        duplicate_report.push(text);
    }

    // Quota: at most one dispatched id per recipient and local day (where the run stayed
    // within one local day).
    let end_utc = chrono::Utc::now();
    let zone_of = |recipient: &str| -> &'static str {
        recipient
            .strip_prefix('r')
            .and_then(|r| r.parse::<usize>().ok())
            .map_or("UTC", |r| ZONES[r % ZONES.len()])
    };
    let same_day = |zone: &str| {
        let tz: chrono_tz::Tz = zone.parse().expect("zone");
        start_utc.with_timezone(&tz).date_naive() == end_utc.with_timezone(&tz).date_naive()
    };
    let mut per_recipient: HashMap<&str, usize> = HashMap::new();
    for (recipient, _) in dispatch_positions.keys() {
        *per_recipient.entry(recipient.as_str()).or_default() += 1;
    }
    let breaches: Vec<(&str, usize)> = per_recipient
        .iter()
        .filter(|(r, n)| **n > 1 && same_day(zone_of(r)))
        .map(|(r, n)| (*r, *n))
        .collect();
    let zones_crossing_midnight: Vec<&str> =
        ZONES.iter().copied().filter(|z| !same_day(z)).collect();

    // Outcome totals by kind.
    let mut by_kind: BTreeMap<Kind, BTreeMap<Outcome, usize>> = BTreeMap::new();
    for (key, kind) in &expected {
        if let Some(got) = outcomes.get(key) {
            for o in got.keys() {
                *by_kind.entry(*kind).or_default().entry(*o).or_default() += 1;
            }
        }
    }
    let distinct = |o: Outcome| outcomes.values().filter(|g| g.contains_key(&o)).count();
    let quarantine_published = expected
        .values()
        .filter(|k| **k == Kind::Quarantine)
        .count();
    let quarantined_distinct = distinct(Outcome::Quarantined);
    let metrics = sum_metrics(&pages);

    // The report.
    let mut out = String::new();
    let _ = writeln!(out, "\n## sendquota trust run\n");
    let _ = writeln!(out, "rerun: `{}`", args.command());
    let _ = writeln!(
        out,
        "binary: {} (worker: {})",
        std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        env!("CARGO_BIN_EXE_sendquota")
    );
    let _ = writeln!(
        out,
        "started {start_utc}, {:.0} s in all ({published_at:.0} s publishing, settled at \
         {settled_at:.0} s); namespace {}; worker logs in {}\n",
        shared.now(),
        env.namespace,
        log_dir.display()
    );
    let _ = writeln!(out, "| what | count |\n|---|---|");
    row(
        &mut out,
        "publishes confirmed (plan)",
        format!("{}", shared.total),
    );
    row(
        &mut out,
        "requests (distinct ids) / recipients",
        format!("{} / {recipients}", args.messages),
    );
    row(
        &mut out,
        "ids published twice back to back (2%)",
        duplicated,
    );
    row(
        &mut out,
        "publishes repeated after an unconfirmed publish (broker away)",
        shared.republished.load(Ordering::Relaxed),
    );
    for kind in [Kind::Primer, Kind::Quarantine]
        .into_iter()
        .chain(Kind::INVALID)
    {
        row(
            &mut out,
            &format!("published: {}", kind.label()),
            published_by_kind.get(&kind).copied().unwrap_or(0),
        );
    }
    row(
        &mut out,
        "dispatched: deliveries in the sink / distinct (recipient, id)",
        format!("{} / {}", sink.len(), distinct(Outcome::Dispatched)),
    );
    row(
        &mut out,
        "denied: rows / distinct (recipient, id)",
        format!("{denial_row_count} / {}", distinct(Outcome::Denied)),
    );
    row(
        &mut out,
        "invalid queue: messages / distinct",
        format!("{} / {}", invalid.len(), distinct(Outcome::Invalid)),
    );
    row(
        &mut out,
        "quarantine queue: messages / distinct",
        format!("{} / {quarantined_distinct}", quarantine.len()),
    );
    for (kind, got) in &by_kind {
        row(
            &mut out,
            &format!("outcomes of {}", kind.label()),
            got.iter()
                .map(|(o, n)| format!("{o:?} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    for (kind, (n, reason)) in &invalid_reasons {
        row(
            &mut out,
            &format!("reason header of {}", kind.label()),
            format!("{n} x `{reason}`"),
        );
    }
    row(
        &mut out,
        "quarantine reasons / attempts",
        format!(
            "{} / {}",
            quarantine_reasons
                .iter()
                .map(|(r, n)| format!("{r}: {n}"))
                .collect::<Vec<_>>()
                .join("; "),
            quarantine_attempts
                .iter()
                .map(|(a, n)| format!("{a} attempts: {n}"))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    );
    row(&mut out, "**lost**", lost.len());
    row(
        &mut out,
        "**stuck** (requests + delay queues, ready / unacked, after settling)",
        format!("{} / {}", stuck.0, stuck.1),
    );
    row(
        &mut out,
        "wrong outcome for what was published",
        wrong.len(),
    );
    row(&mut out, "more than one kind of outcome", mixed.len());
    row(&mut out, "outcomes of nothing published", unexpected.len());
    row(
        &mut out,
        "denial rows beyond one per (recipient, id)",
        extra_denial_rows,
    );
    row(
        &mut out,
        "**duplicate dispatches**: in the crash window / outside it",
        format!("{in_window} / {outside_window}"),
    );
    row(
        &mut out,
        "invalid routings repeated (at-least-once, lost ack)",
        invalid.len() - distinct(Outcome::Invalid),
    );
    row(
        &mut out,
        "quarantine routings repeated",
        quarantine.len() - quarantined_distinct,
    );
    row(
        &mut out,
        "recipients with two dispatches on one local day",
        format!(
            "{}{}",
            breaches.len(),
            if zones_crossing_midnight.is_empty() {
                String::new()
            } else {
                format!(
                    " (not checked in {}: the run crossed local midnight)",
                    zones_crossing_midnight.join(", ")
                )
            }
        ),
    );
    for r in &restarts {
        row(
            &mut out,
            &format!("restart: {}", r.service.name()),
            format!(
                "stopped at {:.0} s, back at {:.0} s ({:.1} s down)",
                r.stopped,
                r.back,
                r.back - r.stopped
            ),
        );
    }
    row(
        &mut out,
        "producer: outages seen",
        shared.outages_seen_by_producer.load(Ordering::Relaxed),
    );
    for name in [
        "sendquota_decisions_total",
        "sendquota_invalid_messages_total",
        "sendquota_quarantined_messages_total",
        "sendquota_redeliveries_total",
        "sendquota_delayed_messages_total",
    ] {
        let found: Vec<String> = metrics
            .iter()
            .filter(|(k, _)| k.starts_with(name))
            .map(|(k, v)| {
                let label = k.strip_prefix(name).unwrap_or(k);
                if label.is_empty() {
                    format!("{v}")
                } else {
                    format!("{label} {v}")
                }
            })
            .collect();
        if !pages.is_empty() {
            // A counter never incremented is not exported: 0.
            let value = if found.is_empty() {
                "0".to_owned()
            } else {
                found.join(", ")
            };
            row(&mut out, &format!("workers' {name} (both)"), value);
        }
    }
    row(&mut out, "worker exit codes", exits.join(", "));
    for (n, path) in logs.iter().enumerate() {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let count = |s: &str| text.lines().filter(|l| l.contains(s)).count();
        row(
            &mut out,
            &format!("worker-{} log", n + 1),
            format!(
                "{} ERROR, {} WARN lines; {} broker sessions lost, {} quarantined, {} dispatch \
                 marks retried",
                count(" ERROR "),
                count(" WARN "),
                count("broker session lost"),
                count("message quarantined"),
                count("dispatch mark not written")
            ),
        );
    }
    if !duplicate_report.is_empty() {
        let _ = writeln!(out, "\nduplicate dispatches:");
        for d in &duplicate_report {
            let _ = writeln!(out, "  - {d}");
        }
    }
    let sample = |v: &[String]| {
        v.iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n    ")
    };
    if !lost.is_empty() {
        let shown: Vec<String> = lost
            .iter()
            .map(|k| {
                let mut s = format!("{k:?} ({})", expected[k].label());
                for line in log_lines(&logs, &k.1, 3) {
                    let _ = write!(s, "\n      {line}");
                }
                s
            })
            .collect();
        let _ = writeln!(out, "\nlost (first 10):\n    {}", sample(&shown));
    }
    if !wrong.is_empty() {
        let shown: Vec<String> = wrong
            .iter()
            .map(|(k, kind, got)| format!("{k:?}: {} became {got:?}", kind.label()))
            .collect();
        let _ = writeln!(out, "\nwrong outcomes (first 10):\n    {}", sample(&shown));
    }
    if !mixed.is_empty() {
        let shown: Vec<String> = mixed.iter().map(|(k, o)| format!("{k:?}: {o:?}")).collect();
        let _ = writeln!(
            out,
            "\nmore than one outcome (first 10):\n    {}",
            sample(&shown)
        );
    }
    if !unexpected.is_empty() {
        let _ = writeln!(out, "\nunexpected (first 10):\n    {}", sample(&unexpected));
    }
    if !breaches.is_empty() {
        let shown: Vec<String> = breaches
            .iter()
            .map(|(r, n)| format!("{r}: {n} dispatched ids"))
            .collect();
        let _ = writeln!(out, "\nquota breaches (first 10):\n    {}", sample(&shown));
    }

    let published = shared.published.load(Ordering::Relaxed);
    let mut checks = vec![
        Check {
            what: "lost = 0".to_owned(),
            ok: lost.is_empty(),
        },
        Check {
            what: "stuck = 0 (settled, nothing ready or unacked)".to_owned(),
            ok: settled && stuck == (0, 0),
        },
        Check {
            what: "each (recipient, id) has one kind of outcome, the right one, and one denial \
                   row at most; nothing unpublished has one"
                .to_owned(),
            ok: wrong.is_empty()
                && mixed.is_empty()
                && unexpected.is_empty()
                && extra_denial_rows == 0,
        },
        Check {
            what: format!(
                "quarantined = quarantine poison published ({quarantined_distinct} = \
                 {quarantine_published})"
            ),
            ok: quarantined_distinct == quarantine_published,
        },
        Check {
            what: "duplicate dispatches outside the crash window = 0".to_owned(),
            ok: outside_window == 0,
        },
        Check {
            what: "no recipient dispatched to twice on one local day".to_owned(),
            ok: breaches.is_empty(),
        },
        Check {
            what: "every service restarted once".to_owned(),
            ok: restarts.len() == RESTARTS.len(),
        },
    ];
    if args.messages >= 50_000 {
        checks.insert(
            0,
            Check {
                what: format!("at least 50,000 messages published ({published})"),
                ok: published >= 50_000,
            },
        );
    }
    let _ = writeln!(out, "\nassertions:");
    for c in &checks {
        let _ = writeln!(out, "  [{}] {}", if c.ok { "pass" } else { "FAIL" }, c.what);
    }
    let passed = checks.iter().all(|c| c.ok);
    let _ = writeln!(
        out,
        "\nresult: {}{}",
        if passed { "PASS" } else { "FAIL" },
        if args.messages < 50_000 {
            " (a short run: the promise is checked at --messages 50000 or more)"
        } else {
            ""
        }
    );
    println!("{out}");
    passed
}
