//! Channels: request/reply methods, publisher confirms, consumers and acks.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, confirm, exchange, queue, AMQPClass};
use tokio::sync::{mpsc, oneshot};

use super::connection::{Shared, Tasks};
use super::{short, wire, AmqpError, BasicProperties, Delivery, FieldTable, ShortString};

/// How the broker answered a confirmed publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmation {
    /// The broker took responsibility for the message.
    Ack,
    /// The message was mandatory and reached no queue: the broker returned it, then acked it.
    Returned,
    /// The broker could not take the message (for example a queue's leader was lost).
    Nack,
    /// The channel is not in confirm mode, so nothing was confirmed.
    NotRequested,
}

/// A channel. Cheap to clone; every clone is the same channel.
#[derive(Clone)]
pub struct Channel {
    shared: Arc<Shared>,
    channel: Arc<ChannelShared>,
    _tasks: Arc<Tasks>,
}

/// A channel's state, shared between its handles and the connection's reader task.
pub(super) struct ChannelShared {
    id: u16,
    /// One request/reply method at a time, as AMQP requires per channel.
    rpc: tokio::sync::Mutex<()>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    error: Option<AmqpError>,
    reply: Option<oneshot::Sender<Result<AMQPClass, AmqpError>>>,
    confirms: Option<Confirms>,
    consumer: Option<mpsc::UnboundedSender<Result<Delivery, AmqpError>>>,
}

/// Publishes awaiting their confirm, by delivery tag: `pending[i]` has tag `base + i`, and is
/// `None` once it was confirmed out of order.
struct Confirms {
    base: u64,
    pending: VecDeque<Option<Pending>>,
}

struct Pending {
    tx: oneshot::Sender<Result<Confirmation, AmqpError>>,
    exchange: ShortString,
    routing_key: ShortString,
    message_id: Option<ShortString>,
    returned: bool,
}

/// A message whose frames are still arriving, kept by the reader task per channel.
#[derive(Default)]
pub(super) struct Incoming {
    content: Option<Content>,
}

struct Content {
    kind: ContentKind,
    properties: BasicProperties,
    size: u64,
    body: Vec<u8>,
    has_header: bool,
}

enum ContentKind {
    Deliver(basic::Deliver),
    Return(basic::Return),
}

impl ChannelShared {
    pub(super) fn new(id: u16) -> ChannelShared {
        ChannelShared {
            id,
            rpc: tokio::sync::Mutex::new(()),
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails everything waiting on the channel; later operations fail with the same error.
    pub(super) fn fail(&self, error: AmqpError) {
        let mut state = self.state();
        if state.error.is_none() {
            state.error = Some(error.clone());
        }
        if let Some(reply) = state.reply.take() {
            let _ = reply.send(Err(error.clone()));
        }
        if let Some(confirms) = state.confirms.take() {
            for pending in confirms.pending.into_iter().flatten() {
                let _ = pending.tx.send(Err(error.clone()));
            }
        }
        if let Some(consumer) = state.consumer.take() {
            let _ = consumer.send(Err(error));
        }
    }

    /// Handles a frame for this channel, on the reader task; returns whether the channel is
    /// still open.
    pub(super) fn receive(
        &self,
        shared: &Shared,
        incoming: &mut Incoming,
        frame: AMQPFrame,
    ) -> Result<bool, AmqpError> {
        match frame {
            AMQPFrame::Method(_, AMQPClass::Basic(method)) => {
                return self.basic(shared, incoming, method)
            }
            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                let close_ok = channel::AMQPMethod::CloseOk(channel::CloseOk {});
                let _ = shared.send_method(self.id, AMQPClass::Channel(close_ok));
                self.fail(AmqpError::ChannelClosed {
                    code: close.reply_code,
                    text: close.reply_text.as_str().to_owned(),
                });
                return Ok(false);
            }
            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) => {
                self.reply(AMQPClass::Channel(channel::AMQPMethod::CloseOk(
                    channel::CloseOk {},
                )));
                self.fail(AmqpError::Closed("channel closed"));
                return Ok(false);
            }
            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Flow(flow))) => {
                let flow_ok = channel::AMQPMethod::FlowOk(channel::FlowOk {
                    active: flow.active,
                });
                shared.send_method(self.id, AMQPClass::Channel(flow_ok))?;
            }
            AMQPFrame::Method(_, method) => self.reply(method),
            AMQPFrame::Header(_, header) => {
                let Some(content) = incoming.content.as_mut().filter(|c| !c.has_header) else {
                    return Err(AmqpError::Protocol(
                        "content header without a method".into(),
                    ));
                };
                content.has_header = true;
                content.size = header.body_size;
                content.properties = header.properties;
                content.body = Vec::with_capacity(usize::try_from(header.body_size).unwrap_or(0));
                self.complete_if_full(incoming);
            }
            AMQPFrame::Body(_, data) => {
                let Some(content) = incoming.content.as_mut().filter(|c| c.has_header) else {
                    return Err(AmqpError::Protocol("content body without a header".into()));
                };
                if content.body.is_empty() {
                    content.body = data;
                } else {
                    content.body.extend_from_slice(&data);
                }
                if content.body.len() as u64 > content.size {
                    return Err(AmqpError::Protocol(
                        "content body longer than announced".into(),
                    ));
                }
                self.complete_if_full(incoming);
            }
            _ => {}
        }
        Ok(true)
    }

    fn basic(
        &self,
        shared: &Shared,
        incoming: &mut Incoming,
        method: basic::AMQPMethod,
    ) -> Result<bool, AmqpError> {
        let kind = match method {
            basic::AMQPMethod::Deliver(deliver) => ContentKind::Deliver(deliver),
            basic::AMQPMethod::Return(returned) => ContentKind::Return(returned),
            basic::AMQPMethod::Ack(ack) => {
                self.confirm(ack.delivery_tag, ack.multiple, true);
                return Ok(true);
            }
            basic::AMQPMethod::Nack(nack) => {
                self.confirm(nack.delivery_tag, nack.multiple, false);
                return Ok(true);
            }
            basic::AMQPMethod::Cancel(cancel) => {
                if let Some(consumer) = self.state().consumer.take() {
                    let _ = consumer.send(Err(AmqpError::ConsumerCancelled));
                }
                let cancel_ok = basic::AMQPMethod::CancelOk(basic::CancelOk {
                    consumer_tag: cancel.consumer_tag,
                });
                shared.send_method(self.id, AMQPClass::Basic(cancel_ok))?;
                return Ok(true);
            }
            other => {
                self.reply(AMQPClass::Basic(other));
                return Ok(true);
            }
        };
        if incoming.content.is_some() {
            return Err(AmqpError::Protocol(
                "a new message before the last one's content".into(),
            ));
        }
        incoming.content = Some(Content {
            kind,
            properties: BasicProperties::default(),
            size: 0,
            body: Vec::new(),
            has_header: false,
        });
        Ok(true)
    }

    fn complete_if_full(&self, incoming: &mut Incoming) {
        let full = incoming
            .content
            .as_ref()
            .is_some_and(|c| c.has_header && c.body.len() as u64 == c.size);
        if !full {
            return;
        }
        let Some(content) = incoming.content.take() else {
            return;
        };
        match content.kind {
            ContentKind::Deliver(deliver) => {
                let delivery = Delivery {
                    delivery_tag: deliver.delivery_tag,
                    redelivered: deliver.redelivered,
                    exchange: deliver.exchange.as_str().to_owned(),
                    routing_key: deliver.routing_key.as_str().to_owned(),
                    properties: content.properties,
                    data: content.body,
                };
                if let Some(consumer) = &self.state().consumer {
                    let _ = consumer.send(Ok(delivery));
                }
            }
            ContentKind::Return(returned) => {
                let mut state = self.state();
                let Some(confirms) = state.confirms.as_mut() else {
                    return;
                };
                let message_id = content.properties.message_id().clone();
                // The return comes just before that message's ack; the oldest matching publish
                // not yet returned is the one (same exchange, key and id route the same way).
                let matching = confirms.pending.iter_mut().flatten().find(|p| {
                    !p.returned
                        && p.exchange == returned.exchange
                        && p.routing_key == returned.routing_key
                        && p.message_id == message_id
                });
                if let Some(pending) = matching {
                    pending.returned = true;
                }
            }
        }
    }

    fn confirm(&self, tag: u64, multiple: bool, ack: bool) {
        let mut state = self.state();
        let Some(confirms) = state.confirms.as_mut() else {
            return;
        };
        let resolve = |pending: Pending| {
            let confirmation = match (ack, pending.returned) {
                (false, _) => Confirmation::Nack,
                (true, true) => Confirmation::Returned,
                (true, false) => Confirmation::Ack,
            };
            let _ = pending.tx.send(Ok(confirmation));
        };
        let last = confirms.base + confirms.pending.len() as u64;
        let upto = if multiple && tag == 0 {
            last.saturating_sub(1)
        } else {
            tag
        };
        if multiple {
            while confirms.base <= upto {
                let Some(slot) = confirms.pending.pop_front() else {
                    break;
                };
                confirms.base += 1;
                if let Some(pending) = slot {
                    resolve(pending);
                }
            }
        } else if let Some(slot) = upto
            .checked_sub(confirms.base)
            .and_then(|i| confirms.pending.get_mut(usize::try_from(i).ok()?))
        {
            if let Some(pending) = slot.take() {
                resolve(pending);
            }
        }
        while let Some(None) = confirms.pending.front() {
            confirms.pending.pop_front();
            confirms.base += 1;
        }
    }

    fn reply(&self, method: AMQPClass) {
        if let Some(reply) = self.state().reply.take() {
            let _ = reply.send(Ok(method));
        }
    }
}

impl Channel {
    pub(super) fn new(
        shared: Arc<Shared>,
        tasks: Arc<Tasks>,
        channel: Arc<ChannelShared>,
    ) -> Channel {
        Channel {
            shared,
            channel,
            _tasks: tasks,
        }
    }

    /// Sends a method that has a reply and waits for the reply.
    async fn call(&self, method: AMQPClass) -> Result<AMQPClass, AmqpError> {
        let _one_at_a_time = self.channel.rpc.lock().await;
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.channel.state();
            if let Some(e) = &state.error {
                return Err(e.clone());
            }
            state.reply = Some(tx);
        }
        if let Err(e) = self.shared.send_method(self.channel.id, method) {
            self.channel.state().reply = None;
            return Err(e);
        }
        rx.await
            .unwrap_or(Err(AmqpError::Closed("channel dropped")))
    }

    pub(super) async fn open(&self) -> Result<(), AmqpError> {
        let open = channel::AMQPMethod::Open(channel::Open {});
        match self.call(AMQPClass::Channel(open)).await? {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => Ok(()),
            other => Err(unexpected("channel.open-ok", &other)),
        }
    }

    /// Whether the channel (and its connection) is still open.
    pub fn is_open(&self) -> bool {
        self.channel.state().error.is_none() && self.shared.error().is_none()
    }

    /// Puts the channel in confirm mode: every publish then waits for the broker's ack.
    pub async fn confirm_select(&self) -> Result<(), AmqpError> {
        let select = confirm::AMQPMethod::Select(confirm::Select { nowait: false });
        match self.call(AMQPClass::Confirm(select)).await? {
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)) => {
                self.channel.state().confirms.get_or_insert(Confirms {
                    base: 1,
                    pending: VecDeque::new(),
                });
                Ok(())
            }
            other => Err(unexpected("confirm.select-ok", &other)),
        }
    }

    /// Publishes a message; in confirm mode, resolves with the broker's answer.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        properties: &BasicProperties,
        body: &[u8],
    ) -> Result<Confirmation, AmqpError> {
        let exchange = short(exchange)?;
        let routing_key = short(routing_key)?;
        let confirmed = self.shared.send(|buf| {
            // Under the outbox lock, so delivery tags follow the order the frames are sent in.
            let mut state = self.channel.state();
            if let Some(e) = &state.error {
                return Err(e.clone());
            }
            let receiver = match state.confirms.as_mut() {
                Some(confirms) => {
                    let (tx, rx) = oneshot::channel();
                    confirms.pending.push_back(Some(Pending {
                        tx,
                        exchange: exchange.clone(),
                        routing_key: routing_key.clone(),
                        message_id: properties.message_id().clone(),
                        returned: false,
                    }));
                    Some(rx)
                }
                None => None,
            };
            drop(state);
            let publish = basic::AMQPMethod::Publish(basic::Publish {
                exchange,
                routing_key,
                mandatory,
                immediate: false,
            });
            wire::method(buf, self.channel.id, AMQPClass::Basic(publish))?;
            wire::content(
                buf,
                self.channel.id,
                properties,
                body,
                self.shared.frame_max,
            )?;
            Ok(receiver)
        })?;
        match confirmed {
            Some(rx) => rx
                .await
                .unwrap_or(Err(AmqpError::Closed("channel dropped"))),
            None => Ok(Confirmation::NotRequested),
        }
    }

    /// Limits how many unacked deliveries the broker sends this channel's consumers.
    pub async fn basic_qos(&self, prefetch_count: u16) -> Result<(), AmqpError> {
        let qos = basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count,
            global: false,
        });
        match self.call(AMQPClass::Basic(qos)).await? {
            AMQPClass::Basic(basic::AMQPMethod::QosOk(_)) => Ok(()),
            other => Err(unexpected("basic.qos-ok", &other)),
        }
    }

    /// Starts consuming `queue` with manual acks.
    pub async fn basic_consume(&self, queue: &str) -> Result<Consumer, AmqpError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.channel.state().consumer = Some(tx);
        let consume = basic::AMQPMethod::Consume(basic::Consume {
            queue: short(queue)?,
            consumer_tag: ShortString::default(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        });
        match self.call(AMQPClass::Basic(consume)).await? {
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)) => Ok(Consumer { rx }),
            other => Err(unexpected("basic.consume-ok", &other)),
        }
    }

    /// Acks `delivery_tag` (and, with `multiple`, every earlier unacked delivery).
    pub fn basic_ack(&self, delivery_tag: u64, multiple: bool) -> Result<(), AmqpError> {
        self.settle(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple,
        }))
    }

    /// Rejects `delivery_tag`; with `requeue` the broker delivers it again.
    pub fn basic_nack(
        &self,
        delivery_tag: u64,
        multiple: bool,
        requeue: bool,
    ) -> Result<(), AmqpError> {
        self.settle(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag,
            multiple,
            requeue,
        }))
    }

    fn settle(&self, method: basic::AMQPMethod) -> Result<(), AmqpError> {
        if let Some(e) = &self.channel.state().error {
            return Err(e.clone());
        }
        self.shared
            .send_method(self.channel.id, AMQPClass::Basic(method))
    }

    /// Declares a durable exchange of `kind` ("fanout", "topic", ...).
    pub async fn exchange_declare(
        &self,
        name: &str,
        kind: &str,
        arguments: FieldTable,
    ) -> Result<(), AmqpError> {
        let declare = exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: short(name)?,
            kind: short(kind)?,
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments,
        });
        match self.call(AMQPClass::Exchange(declare)).await? {
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)) => Ok(()),
            other => Err(unexpected("exchange.declare-ok", &other)),
        }
    }

    /// Declares a durable queue; with `passive`, only checks it exists. Returns how many
    /// messages are ready in it.
    pub async fn queue_declare(
        &self,
        name: &str,
        passive: bool,
        arguments: FieldTable,
    ) -> Result<u32, AmqpError> {
        let declare = queue::AMQPMethod::Declare(queue::Declare {
            queue: short(name)?,
            passive,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        });
        match self.call(AMQPClass::Queue(declare)).await? {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(ok.message_count),
            other => Err(unexpected("queue.declare-ok", &other)),
        }
    }

    /// Binds `queue` to `exchange` for `routing_key`.
    pub async fn queue_bind(
        &self,
        queue: &str,
        exchange: &str,
        routing_key: &str,
    ) -> Result<(), AmqpError> {
        let bind = queue::AMQPMethod::Bind(queue::Bind {
            queue: short(queue)?,
            exchange: short(exchange)?,
            routing_key: short(routing_key)?,
            nowait: false,
            arguments: FieldTable::default(),
        });
        match self.call(AMQPClass::Queue(bind)).await? {
            AMQPClass::Queue(queue::AMQPMethod::BindOk(_)) => Ok(()),
            other => Err(unexpected("queue.bind-ok", &other)),
        }
    }

    /// Removes every ready message from `queue`; returns how many there were.
    pub async fn queue_purge(&self, name: &str) -> Result<u32, AmqpError> {
        let purge = queue::AMQPMethod::Purge(queue::Purge {
            queue: short(name)?,
            nowait: false,
        });
        match self.call(AMQPClass::Queue(purge)).await? {
            AMQPClass::Queue(queue::AMQPMethod::PurgeOk(ok)) => Ok(ok.message_count),
            other => Err(unexpected("queue.purge-ok", &other)),
        }
    }

    /// Deletes `queue`; returns how many messages it held.
    pub async fn queue_delete(&self, name: &str) -> Result<u32, AmqpError> {
        let delete = queue::AMQPMethod::Delete(queue::Delete {
            queue: short(name)?,
            if_unused: false,
            if_empty: false,
            nowait: false,
        });
        match self.call(AMQPClass::Queue(delete)).await? {
            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => Ok(ok.message_count),
            other => Err(unexpected("queue.delete-ok", &other)),
        }
    }

    /// Deletes `exchange`.
    pub async fn exchange_delete(&self, name: &str) -> Result<(), AmqpError> {
        let delete = exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: short(name)?,
            if_unused: false,
            nowait: false,
        });
        match self.call(AMQPClass::Exchange(delete)).await? {
            AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(_)) => Ok(()),
            other => Err(unexpected("exchange.delete-ok", &other)),
        }
    }

    /// Closes the channel; its unacked deliveries go back to their queues.
    pub async fn close(&self) -> Result<(), AmqpError> {
        let close = channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        });
        match self.call(AMQPClass::Channel(close)).await {
            Ok(_) | Err(AmqpError::Closed(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn unexpected(wanted: &str, got: &AMQPClass) -> AmqpError {
    AmqpError::Protocol(format!("expected {wanted}, got {got:?}"))
}

/// Deliveries of one consumer, in the order the broker sent them.
pub struct Consumer {
    rx: mpsc::UnboundedReceiver<Result<Delivery, AmqpError>>,
}

impl Consumer {
    /// The next delivery; an error once the channel or connection is lost (then `None`).
    pub async fn next(&mut self) -> Option<Result<Delivery, AmqpError>> {
        self.rx.recv().await
    }
}
