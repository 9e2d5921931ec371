//! A lean connection to a single Redis server, for the worker's hot path.
//!
//! Why not redis-rs's `ConnectionManager`: in profiles of the perf bench's end-to-end run its
//! multiplexed connection took about a quarter of the worker's CPU for one EVALSHA per message:
//! a bounded channel to a driver task, a timer per request, and a combinator parser building
//! each reply (README, "Dependencies"). Here a request appends its bytes to one shared buffer
//! and queues its reply slot, under one lock; a writer task sends everything queued since its
//! last write in one system call, and a reader task finds whole replies ([`reply`]) and hands
//! them to their slots in order. A silent server is noticed by one watchdog per connection
//! (the oldest unanswered request waits longer than the response timeout), not a timer per
//! request.
//!
//! redis-rs still packs the commands, builds the [`Value`]s callers convert, and serves
//! Redis Cluster: [`Connection`] implements its `ConnectionLike`, so every command and script
//! call works on it unchanged. When the link fails, every request waiting on it fails (the
//! worker retries its message, nothing is acked), new requests fail until a new link is up,
//! and the connection reconnects by itself with backoff. It speaks RESP2 over TCP or a Unix
//! socket, with AUTH and SELECT from the URL; no TLS (the build has no TLS either).

mod reply;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, RedisError, RedisFuture, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use tracing::warn;

/// Longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// First wait before reconnecting.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// A multiplexed connection to one Redis server; cheap to clone, every clone shares the link.
#[derive(Clone)]
pub struct Connection {
    shared: Arc<Shared>,
    /// Dropped with the last clone: stops the link's tasks.
    _owner: Arc<Owner>,
}

struct Owner(Arc<Shared>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.close.notify_waiters();
        self.0.writable.notify_one();
    }
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the writer: bytes were queued.
    writable: Notify,
    closed: AtomicBool,
    close: Notify,
    db: i64,
    timeout: Duration,
}

struct State {
    /// Whether a link is up: requests made while it is down fail at once.
    up: bool,
    /// Why the last link went down, for the requests refused until the next is up.
    down_because: String,
    /// Commands queued since the writer last took them.
    out: Vec<u8>,
    /// Requests awaiting replies, in the order their commands were queued.
    waiting: VecDeque<Waiter>,
}

enum Slot {
    One(oneshot::Sender<redis::RedisResult<Value>>),
    Many {
        /// Replies before the kept ones (a transaction's MULTI and QUEUED).
        skip: usize,
        keep: usize,
        got: Vec<Value>,
        tx: oneshot::Sender<redis::RedisResult<Vec<Value>>>,
    },
}

struct Waiter {
    since: Instant,
    slot: Slot,
}

impl Waiter {
    /// Takes one reply of a pipeline; true when the request has all it waits for.
    fn take(&mut self, value: Value) -> bool {
        match &mut self.slot {
            Slot::One(_) => false,
            Slot::Many {
                skip, got, keep, ..
            } => {
                if *skip > 0 {
                    *skip -= 1;
                } else {
                    got.push(value);
                }
                *skip == 0 && got.len() == *keep
            }
        }
    }
}

fn io_error(what: &str, detail: String) -> RedisError {
    RedisError::from((
        ErrorKind::Io,
        "redis connection",
        format!("{what}: {detail}"),
    ))
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // A panic while holding the lock leaves consistent state: every critical section only
    // appends, pops or swaps whole items.
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// An open link, before it is split into the reader's and the writer's halves.
enum Stream {
    Tcp(tokio::net::TcpStream),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
}

impl Connection {
    /// Connects to the server of `url`: fails if the first link cannot be made (wrong address,
    /// refused AUTH, unknown database); after that it reconnects by itself. `timeout` bounds
    /// each connection attempt and how long a request may wait for its reply.
    pub async fn connect(url: &str, timeout: Duration) -> redis::RedisResult<Connection> {
        let info: ConnectionInfo = redis::IntoConnectionInfo::into_connection_info(url)?;
        if let ConnectionAddr::TcpTls { .. } = info.addr() {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "TLS (rediss://) is not supported by this build",
            )));
        }
        let stream = open(&info, timeout).await?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                up: true,
                down_because: String::new(),
                out: Vec::with_capacity(16 * 1024),
                waiting: VecDeque::new(),
            }),
            writable: Notify::new(),
            closed: AtomicBool::new(false),
            close: Notify::new(),
            db: info.redis_settings().db(),
            timeout,
        });
        tokio::spawn(supervise(shared.clone(), info, stream));
        Ok(Connection {
            _owner: Arc::new(Owner(shared.clone())),
            shared,
        })
    }

    /// Queues `bytes` and the slot for their replies; fails at once while no link is up.
    fn enqueue(&self, write: impl FnOnce(&mut Vec<u8>), slot: Slot) -> Result<(), RedisError> {
        {
            let mut state = lock(&self.shared);
            if !state.up {
                return Err(io_error("not connected", state.down_because.clone()));
            }
            let was_empty = state.out.is_empty();
            write(&mut state.out);
            state.waiting.push_back(Waiter {
                since: Instant::now(),
                slot,
            });
            if !was_empty {
                return Ok(());
            }
        }
        self.shared.writable.notify_one();
        Ok(())
    }
}

fn closed_error() -> RedisError {
    io_error("connection lost", "the link closed before the reply".into())
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            self.enqueue(|out| cmd.write_packed_command(out), Slot::One(tx))?;
            rx.await.map_err(|_| closed_error())?
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            // Nothing to send and no reply to wait for (a slot expecting none would take the
            // next request's reply): refused, as redis-rs's own connection refuses it.
            if offset + count == 0 {
                return Err(RedisError::from((ErrorKind::Client, "empty command")));
            }
            let (tx, rx) = oneshot::channel();
            let slot = Slot::Many {
                skip: offset,
                keep: count,
                got: Vec::with_capacity(count),
                tx,
            };
            let packed = pipeline.get_packed_pipeline();
            self.enqueue(|out| out.extend_from_slice(&packed), slot)?;
            let mut replies = rx.await.map_err(|_| closed_error())??;
            // A transaction the server discarded (a command it refused to queue) is answered
            // by EXECABORT: an error, as redis-rs's own connection reports it.
            if pipeline.is_transaction() {
                if let Some(Value::ServerError(e)) = replies.last_mut() {
                    return Err(RedisError::from(e.clone()));
                }
            }
            Ok(replies)
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.db
    }
}

/// Opens a stream and authenticates and selects the database, within `timeout`.
async fn open(info: &ConnectionInfo, timeout: Duration) -> redis::RedisResult<Stream> {
    let attempt = async {
        match info.addr() {
            ConnectionAddr::Tcp(host, port) => {
                let mut tcp = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                tcp.set_nodelay(true)?;
                handshake(&mut tcp, info).await?;
                Ok(Stream::Tcp(tcp))
            }
            #[cfg(unix)]
            ConnectionAddr::Unix(path) => {
                let mut unix = tokio::net::UnixStream::connect(path).await?;
                handshake(&mut unix, info).await?;
                Ok(Stream::Unix(unix))
            }
            _ => Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "unsupported Redis address",
            ))),
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(io_error(
            "connect",
            format!("no connection within {} ms", timeout.as_millis()),
        )),
    }
}

/// AUTH and SELECT as the URL asks, each answered before the link carries requests.
async fn handshake<S>(stream: &mut S, info: &ConnectionInfo) -> redis::RedisResult<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let settings = info.redis_settings();
    let mut cmds = Vec::new();
    if let Some(password) = settings.password() {
        let mut auth = redis::cmd("AUTH");
        if let Some(user) = settings.username() {
            auth.arg(user);
        }
        cmds.push(auth.arg(password).clone());
    }
    if settings.db() != 0 {
        cmds.push(redis::cmd("SELECT").arg(settings.db()).clone());
    }
    let mut buf = Vec::new();
    for cmd in cmds {
        stream.write_all(&cmd.get_packed_command()).await?;
        let value = loop {
            if let Some(stop) = reply::end(&buf, 0).map_err(protocol)? {
                let mut at = 0;
                let value = reply::build(&buf, &mut at).map_err(protocol)?;
                buf.drain(..stop);
                break value;
            }
            if stream.read_buf(&mut buf).await? == 0 {
                return Err(io_error("handshake", "the server closed the link".into()));
            }
        };
        value.extract_error()?;
    }
    Ok(())
}

fn protocol(e: reply::ReplyError) -> RedisError {
    RedisError::from((ErrorKind::Parse, "redis reply", e.to_string()))
}

/// Runs links one after another until the connection is dropped.
async fn supervise(shared: Arc<Shared>, info: ConnectionInfo, first: Stream) {
    let mut stream = Some(first);
    let mut backoff = FIRST_BACKOFF;
    loop {
        if let Some(s) = stream.take() {
            let why = match s {
                Stream::Tcp(tcp) => {
                    let (rd, wr) = tcp.into_split();
                    run_link(&shared, rd, wr).await
                }
                #[cfg(unix)]
                Stream::Unix(unix) => {
                    let (rd, wr) = unix.into_split();
                    run_link(&shared, rd, wr).await
                }
            };
            let failed = {
                let mut state = lock(&shared);
                state.up = false;
                state.down_because = why.clone();
                state.out.clear();
                std::mem::take(&mut state.waiting)
            };
            for waiter in failed {
                let err = || io_error("connection lost", why.clone());
                match waiter.slot {
                    Slot::One(tx) => drop(tx.send(Err(err()))),
                    Slot::Many { tx, .. } => drop(tx.send(Err(err()))),
                }
            }
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
            warn!(reason = %why, "redis link lost; reconnecting");
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shared.close.notified() => return,
        }
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        match open(&info, shared.timeout).await {
            Ok(s) => {
                backoff = FIRST_BACKOFF;
                lock(&shared).up = true;
                stream = Some(s);
            }
            Err(e) => {
                backoff = (backoff * 2).min(MAX_BACKOFF);
                let mut state = lock(&shared);
                state.down_because = e.to_string();
                warn!(error = %e, "redis reconnect failed");
            }
        }
    }
}

/// Carries requests over one stream until it fails, the server stops answering, or the
/// connection is dropped; returns why it ended.
async fn run_link<R, W>(shared: &Arc<Shared>, mut rd: R, mut wr: W) -> String
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let writer = async {
        let mut buf = Vec::with_capacity(16 * 1024);
        loop {
            shared.writable.notified().await;
            if shared.closed.load(Ordering::Acquire) {
                return "connection dropped".to_owned();
            }
            std::mem::swap(&mut buf, &mut lock(shared).out);
            if buf.is_empty() {
                continue;
            }
            if let Err(e) = wr.write_all(&buf).await {
                return format!("write failed: {e}");
            }
            buf.clear();
        }
    };
    let reader = async {
        let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
        let mut replies = Vec::new();
        let mut done = Vec::new();
        loop {
            match rd.read_buf(&mut buf).await {
                Ok(0) => return "the server closed the link".to_owned(),
                Ok(_) => {}
                Err(e) => return format!("read failed: {e}"),
            }
            let mut at = 0;
            loop {
                match reply::end(&buf, at) {
                    Ok(Some(_)) => match reply::build(&buf, &mut at) {
                        Ok(value) => replies.push(value),
                        Err(e) => return e.to_string(),
                    },
                    Ok(None) => break,
                    Err(e) => return e.to_string(),
                }
            }
            buf.drain(..at);
            if buf.capacity() - buf.len() < 4096 {
                buf.reserve(64 * 1024);
            }
            if replies.is_empty() {
                continue;
            }
            {
                let mut state = lock(shared);
                for value in replies.drain(..) {
                    let Some(front) = state.waiting.front_mut() else {
                        return "a reply nobody asked for".to_owned();
                    };
                    let (complete, value) = match front.slot {
                        Slot::One(_) => (true, Some(value)),
                        Slot::Many { .. } => (front.take(value), None),
                    };
                    if complete {
                        if let Some(waiter) = state.waiting.pop_front() {
                            done.push((waiter, value));
                        }
                    }
                }
            }
            for (waiter, value) in done.drain(..) {
                finish(waiter, value);
            }
        }
    };
    let watchdog = async {
        let period = (shared.timeout / 4).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(period).await;
            let oldest = lock(shared).waiting.front().map(|w| w.since);
            if oldest.is_some_and(|t| t.elapsed() > shared.timeout) {
                return format!("no reply within {} ms", shared.timeout.as_millis());
            }
        }
    };
    tokio::select! {
        why = writer => why,
        why = reader => why,
        why = watchdog => why,
        _ = shared.close.notified() => "connection dropped".to_owned(),
    }
}

/// Hands a request its reply: one value, or a pipeline's kept values.
fn finish(waiter: Waiter, value: Option<Value>) {
    match waiter.slot {
        Slot::One(tx) => {
            let _ = tx.send(Ok(value.unwrap_or(Value::Nil)));
        }
        Slot::Many { got, tx, .. } => {
            let _ = tx.send(Ok(got));
        }
    }
}
