//! One AMQP connection: the handshake, the reader task that routes incoming frames, and the
//! writer task that sends what the channels queued.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use amq_protocol::frame::{AMQPFrame, ProtocolVersion};
use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::uri::AMQPScheme;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify};
use tokio::task::AbortHandle;
use tracing::{info, warn};

use super::channel::{ChannelShared, Incoming};
use super::{wire, AMQPUri, AMQPValue, AmqpError, Channel, FieldTable, LongString};

/// Frame size this client proposes; the broker may lower it.
const FRAME_MAX: u32 = 131_072;
/// Channel count this client proposes when the broker sets no limit.
const CHANNEL_MAX: u16 = 2_047;
/// Heartbeat this client proposes when the URL sets none and the broker proposes none.
const HEARTBEAT_SECS: u16 = 60;
/// Bytes read from the socket at a time; many deliveries' frames arrive in one read.
const READ_CHUNK: usize = 64 * 1024;

/// A connection to the broker. Cheap to clone; the socket closes when the last clone and every
/// channel opened on it are dropped, or on [`Connection::close`].
#[derive(Clone)]
pub struct Connection {
    shared: Arc<Shared>,
    _tasks: Arc<Tasks>,
}

/// The reader and writer tasks, stopped when the last handle goes.
pub(super) struct Tasks(Vec<AbortHandle>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// State shared by the connection, its channels and its two tasks.
pub(super) struct Shared {
    out: Mutex<Outbox>,
    writer: Notify,
    channels: Mutex<HashMap<u16, Arc<ChannelShared>>>,
    /// Largest frame either side may send, as negotiated.
    pub(super) frame_max: usize,
    channel_max: u16,
    /// Becomes true once the connection has failed or closed.
    dead: watch::Sender<bool>,
}

/// Bytes waiting for the writer, and why the connection is gone, once it is.
struct Outbox {
    buf: Vec<u8>,
    error: Option<AmqpError>,
}

impl Shared {
    /// Queues frames written by `write` for the writer, unless the connection is gone.
    pub(super) fn send<T>(
        &self,
        write: impl FnOnce(&mut Vec<u8>) -> Result<T, AmqpError>,
    ) -> Result<T, AmqpError> {
        let mut out = self.outbox();
        if let Some(e) = &out.error {
            return Err(e.clone());
        }
        let was_empty = out.buf.is_empty();
        let written = write(&mut out.buf)?;
        drop(out);
        // A non-empty outbox means the writer is already due to run.
        if was_empty {
            self.writer.notify_one();
        }
        Ok(written)
    }

    /// Queues one method frame.
    pub(super) fn send_method(&self, channel: u16, method: AMQPClass) -> Result<(), AmqpError> {
        self.send(|buf| wire::method(buf, channel, method))
    }

    /// Locks the outbox; a panic elsewhere while holding it leaves bytes that are still valid.
    fn outbox(&self) -> MutexGuard<'_, Outbox> {
        self.out.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn channels(&self) -> MutexGuard<'_, HashMap<u16, Arc<ChannelShared>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the connection is gone, if it is.
    pub(super) fn error(&self) -> Option<AmqpError> {
        self.outbox().error.clone()
    }

    /// Ends the connection: every waiting operation and every channel fails with `error`.
    /// Frames already queued are still written (a close-ok the broker waits for).
    fn fail(&self, error: AmqpError) {
        {
            let mut out = self.outbox();
            if out.error.is_some() {
                return;
            }
            out.error = Some(error.clone());
        }
        self.writer.notify_one();
        let channels: Vec<_> = self.channels().drain().map(|(_, c)| c).collect();
        for channel in channels {
            channel.fail(error.clone());
        }
        self.dead.send_replace(true);
    }

    /// Forgets a closed channel, freeing its id.
    pub(super) fn remove_channel(&self, id: u16) {
        self.channels().remove(&id);
    }
}

impl Connection {
    /// Connects and logs in; `name` is shown in the broker's connection list.
    pub async fn connect(url: &str, name: &str) -> Result<Connection, AmqpError> {
        let uri: AMQPUri = url.parse().map_err(AmqpError::Url)?;
        if uri.scheme != AMQPScheme::AMQP {
            return Err(AmqpError::Url("only amqp:// is supported".into()));
        }
        let mut stream = TcpStream::connect((uri.authority.host.as_str(), uri.authority.port))
            .await
            .map_err(|e| AmqpError::Io(e.to_string()))?;
        stream
            .set_nodelay(true)
            .map_err(|e| AmqpError::Io(e.to_string()))?;
        let mut buf = Vec::with_capacity(READ_CHUNK);
        let tuned = handshake(&mut stream, &mut buf, &uri, name).await?;
        let (reader, writer) = stream.into_split();
        let shared = Arc::new(Shared {
            out: Mutex::new(Outbox {
                buf: Vec::with_capacity(READ_CHUNK),
                error: None,
            }),
            writer: Notify::new(),
            channels: Mutex::new(HashMap::new()),
            frame_max: tuned.frame_max as usize,
            channel_max: tuned.channel_max,
            dead: watch::channel(false).0,
        });
        let heartbeat = Duration::from_secs(u64::from(tuned.heartbeat));
        let read = tokio::spawn(read_loop(shared.clone(), reader, buf, heartbeat));
        let write = tokio::spawn(write_loop(shared.clone(), writer, heartbeat));
        Ok(Connection {
            shared,
            _tasks: Arc::new(Tasks(vec![read.abort_handle(), write.abort_handle()])),
        })
    }

    /// Opens a new channel.
    pub async fn create_channel(&self) -> Result<Channel, AmqpError> {
        let channel = {
            let mut channels = self.shared.channels();
            if let Some(e) = self.shared.error() {
                return Err(e);
            }
            let id = (1..=self.shared.channel_max)
                .find(|id| !channels.contains_key(id))
                .ok_or_else(|| AmqpError::Protocol("every channel id is in use".into()))?;
            let channel = Arc::new(ChannelShared::new(id));
            channels.insert(id, channel.clone());
            channel
        };
        let channel = Channel::new(self.shared.clone(), self._tasks.clone(), channel);
        channel.open().await?;
        Ok(channel)
    }

    /// Whether the connection is still up.
    pub fn is_connected(&self) -> bool {
        self.shared.error().is_none()
    }

    /// Closes the connection cleanly: the broker requeues whatever is unacked at once.
    pub async fn close(&self, code: u16, text: &str) -> Result<(), AmqpError> {
        let mut dead = self.shared.dead.subscribe();
        let close = connection::Close {
            reply_code: code,
            reply_text: super::short(text)?,
            class_id: 0,
            method_id: 0,
        };
        self.shared.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(close)),
        )?;
        let _ = dead.wait_for(|d| *d).await;
        match self.shared.error() {
            Some(AmqpError::Closed(_)) | None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// What the handshake agreed on.
struct Tuned {
    frame_max: u32,
    channel_max: u16,
    heartbeat: u16,
}

async fn handshake(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    uri: &AMQPUri,
    name: &str,
) -> Result<Tuned, AmqpError> {
    let io = |e: std::io::Error| AmqpError::Io(e.to_string());
    let version = ProtocolVersion::amqp_0_9_1();
    stream
        .write_all(&[
            b'A',
            b'M',
            b'Q',
            b'P',
            0,
            version.major,
            version.minor,
            version.revision,
        ])
        .await
        .map_err(io)?;
    match next_method(stream, buf).await? {
        connection::AMQPMethod::Start(start) => {
            let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).into_owned();
            if !mechanisms.split(' ').any(|m| m == "PLAIN") {
                return Err(AmqpError::Protocol(format!(
                    "the broker offers no PLAIN login (it offers {mechanisms})"
                )));
            }
        }
        other => return Err(unexpected("connection.start", &other)),
    }
    let user = &uri.authority.userinfo;
    let start_ok = connection::StartOk {
        client_properties: client_properties(name),
        mechanism: "PLAIN".into(),
        response: LongString::from(format!("\0{}\0{}", user.username, user.password)),
        locale: "en_US".into(),
    };
    let mut out = Vec::new();
    wire::method(
        &mut out,
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
    )?;
    stream.write_all(&out).await.map_err(io)?;
    let tune = match next_method(stream, buf).await? {
        connection::AMQPMethod::Tune(tune) => tune,
        other => return Err(unexpected("connection.tune", &other)),
    };
    let frame_max = match (tune.frame_max, uri.query.frame_max.unwrap_or(FRAME_MAX)) {
        (0, ours) => ours,
        (theirs, ours) => theirs.min(ours),
    };
    let channel_max = match (
        tune.channel_max,
        uri.query.channel_max.unwrap_or(CHANNEL_MAX),
    ) {
        (0, ours) => ours,
        (theirs, ours) => theirs.min(ours),
    };
    let heartbeat = uri.query.heartbeat.unwrap_or(match tune.heartbeat {
        0 => HEARTBEAT_SECS,
        theirs => theirs,
    });
    let tuned = Tuned {
        frame_max,
        channel_max: channel_max.max(1),
        heartbeat,
    };
    let mut out = Vec::new();
    let tune_ok = connection::TuneOk {
        channel_max: tuned.channel_max,
        frame_max,
        heartbeat,
    };
    wire::method(
        &mut out,
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
    )?;
    let open = connection::Open {
        virtual_host: super::short(&uri.vhost)?,
    };
    wire::method(
        &mut out,
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(open)),
    )?;
    stream.write_all(&out).await.map_err(io)?;
    match next_method(stream, buf).await? {
        connection::AMQPMethod::OpenOk(_) => Ok(tuned),
        other => Err(unexpected("connection.open-ok", &other)),
    }
}

fn client_properties(name: &str) -> FieldTable {
    let mut capabilities = FieldTable::default();
    for capability in [
        "publisher_confirms",
        "consumer_cancel_notify",
        "basic.nack",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        capabilities.insert(capability.into(), AMQPValue::Boolean(true));
    }
    let mut properties = FieldTable::default();
    properties.insert("product".into(), AMQPValue::LongString("sendquota".into()));
    properties.insert(
        "version".into(),
        AMQPValue::LongString(env!("CARGO_PKG_VERSION").into()),
    );
    properties.insert("connection_name".into(), AMQPValue::LongString(name.into()));
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties
}

fn unexpected(wanted: &str, got: &connection::AMQPMethod) -> AmqpError {
    match got {
        connection::AMQPMethod::Close(close) => AmqpError::ConnectionClosed {
            code: close.reply_code,
            text: close.reply_text.as_str().to_owned(),
        },
        other => AmqpError::Protocol(format!("expected {wanted}, got {other:?}")),
    }
}

/// The next connection method during the handshake, reading as much as it takes.
async fn next_method(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> Result<connection::AMQPMethod, AmqpError> {
    loop {
        if buf.starts_with(b"AMQP") && buf.len() >= 8 {
            return Err(AmqpError::Protocol(
                "the broker does not speak AMQP 0-9-1".into(),
            ));
        }
        if let Some((frame, len)) = wire::next_frame(buf, FRAME_MAX as usize)? {
            buf.drain(..len);
            match frame {
                AMQPFrame::Method(0, AMQPClass::Connection(method)) => return Ok(method),
                AMQPFrame::Heartbeat => continue,
                other => {
                    return Err(AmqpError::Protocol(format!(
                        "unexpected frame during the handshake: {other:?}"
                    )))
                }
            }
        }
        buf.reserve(READ_CHUNK);
        let read = stream
            .read_buf(buf)
            .await
            .map_err(|e| AmqpError::Io(e.to_string()))?;
        if read == 0 {
            return Err(AmqpError::Io(
                "the broker closed the socket during the handshake (wrong credentials or vhost?)"
                    .into(),
            ));
        }
    }
}

async fn read_loop(
    shared: Arc<Shared>,
    mut reader: OwnedReadHalf,
    mut buf: Vec<u8>,
    heartbeat: Duration,
) {
    let mut router = Router {
        shared: shared.clone(),
        channels: HashMap::new(),
    };
    let error = loop {
        let mut at = 0;
        let parsed = loop {
            match wire::next_frame(&buf[at..], shared.frame_max) {
                Ok(Some((frame, len))) => {
                    at += len;
                    if let Err(e) = router.route(frame) {
                        break Err(e);
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        if let Err(e) = parsed {
            break e;
        }
        buf.drain(..at);
        buf.reserve(READ_CHUNK);
        // The broker sends a heartbeat at least every interval; two missed ones mean it is gone.
        let read = if heartbeat.is_zero() {
            reader.read_buf(&mut buf).await
        } else {
            match tokio::time::timeout(heartbeat * 2, reader.read_buf(&mut buf)).await {
                Ok(read) => read,
                Err(_) => break AmqpError::Io("missed two heartbeats from the broker".into()),
            }
        };
        match read {
            Ok(0) => break AmqpError::Io("the broker closed the socket".into()),
            Ok(_) => {}
            Err(e) => break AmqpError::Io(e.to_string()),
        }
    };
    shared.fail(error);
}

/// Routes each incoming frame to its channel; owns the messages being assembled.
struct Router {
    shared: Arc<Shared>,
    channels: HashMap<u16, (Arc<ChannelShared>, Incoming)>,
}

impl Router {
    fn route(&mut self, frame: AMQPFrame) -> Result<(), AmqpError> {
        let id = match &frame {
            AMQPFrame::Heartbeat => return Ok(()),
            AMQPFrame::Method(0, AMQPClass::Connection(method)) => return self.connection(method),
            AMQPFrame::Method(id, _) | AMQPFrame::Header(id, _) | AMQPFrame::Body(id, _) => *id,
            other => {
                return Err(AmqpError::Protocol(format!("unexpected frame {other:?}")));
            }
        };
        if !self.channels.contains_key(&id) {
            let Some(channel) = self.shared.channels().get(&id).cloned() else {
                // A channel this side closed: the broker may still send until its close-ok.
                return Ok(());
            };
            self.channels.insert(id, (channel, Incoming::default()));
        }
        let Some((channel, incoming)) = self.channels.get_mut(&id) else {
            return Ok(());
        };
        let open = channel.receive(&self.shared, incoming, frame)?;
        if !open {
            self.channels.remove(&id);
            self.shared.remove_channel(id);
        }
        Ok(())
    }

    fn connection(&mut self, method: &connection::AMQPMethod) -> Result<(), AmqpError> {
        match method {
            connection::AMQPMethod::Close(close) => {
                let close_ok = connection::AMQPMethod::CloseOk(connection::CloseOk {});
                let _ = self.shared.send_method(0, AMQPClass::Connection(close_ok));
                Err(AmqpError::ConnectionClosed {
                    code: close.reply_code,
                    text: close.reply_text.as_str().to_owned(),
                })
            }
            connection::AMQPMethod::CloseOk(_) => Err(AmqpError::Closed("connection closed")),
            connection::AMQPMethod::Blocked(blocked) => {
                warn!(reason = %blocked.reason.as_str(), "the broker blocked publishing");
                Ok(())
            }
            connection::AMQPMethod::Unblocked(_) => {
                info!("the broker unblocked publishing");
                Ok(())
            }
            other => Err(AmqpError::Protocol(format!(
                "unexpected connection method {other:?}"
            ))),
        }
    }
}

async fn write_loop(shared: Arc<Shared>, mut writer: OwnedWriteHalf, heartbeat: Duration) {
    let mut pending = Vec::with_capacity(READ_CHUNK);
    let mut beat = (!heartbeat.is_zero()).then(|| tokio::time::interval(heartbeat / 2));
    loop {
        // Let the tasks woken together with this one queue their frames first: the broker
        // pays per TCP segment it reads, so one fuller write costs it far less than many small.
        tokio::task::yield_now().await;
        let failed = {
            let mut out = shared.outbox();
            std::mem::swap(&mut out.buf, &mut pending);
            out.error.is_some()
        };
        if !pending.is_empty() {
            if let Err(e) = writer.write_all(&pending).await {
                shared.fail(AmqpError::Io(e.to_string()));
                return;
            }
            pending.clear();
            continue;
        }
        if failed {
            let _ = writer.shutdown().await;
            return;
        }
        match &mut beat {
            Some(beat) => tokio::select! {
                _ = shared.writer.notified() => {}
                _ = beat.tick() => {
                    let _ = shared.send(|buf| {
                        wire::heartbeat(buf);
                        Ok(())
                    });
                }
            },
            None => shared.writer.notified().await,
        }
    }
}
