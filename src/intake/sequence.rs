//! The first published wins: messages to one recipient that a worker holds at once are decided
//! in the order the broker delivered them, which is the order they were published.
//!
//! Without it every delivery is decided on its own task and two messages to one recipient
//! race to Redis: under a rule of one a day the second published could take the day's slot and
//! the first be denied. Each recipient with messages in flight has a line here; a delivery
//! joins its recipient's line when the worker takes it from the channel (in delivery order)
//! and waits for its turn only until the earlier messages of that line are *decided* (the
//! limiter call returned), not until their dispatch or denial is durable, so a recipient's
//! messages still overlap in everything but the decision. Other recipients' lines do not wait
//! on each other: there is no global lock, only a map guarded for the few instructions that
//! join or leave a line.
//!
//! A line is removed when its last holder leaves, so memory follows the deliveries in flight
//! (at most the prefetch). Per message it costs a hash of the recipient of the request the
//! worker decoded anyway (once, for the line and the decision), one map entry and one map
//! lookup to leave; a channel for the turn is made only for a message that actually has to
//! wait.

use std::collections::hash_map::{Entry, HashMap};
use std::collections::VecDeque;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// The lines of one broker session's deliveries, by recipient.
#[derive(Default)]
pub struct Sequence {
    /// Keyed by a hash of the recipient, so joining a line allocates no copy of it. Two
    /// recipients whose hashes collide (keyed by `hasher`, so no producer can aim for it)
    /// share a line: their messages are decided one after another, which costs some
    /// concurrency but never correctness.
    lines: Mutex<HashMap<u64, Line, BuildHasherDefault<Prehashed>>>,
    hasher: RandomState,
}

/// One recipient's messages in flight.
struct Line {
    /// Places alive in this line: the one whose turn it is and those waiting.
    holders: u32,
    /// The turns of the waiting places, in delivery order. A place that gave up while waiting
    /// leaves its sender here, closed; passing the turn skips it.
    waiting: VecDeque<oneshot::Sender<()>>,
}

impl Sequence {
    /// An empty sequence, for one broker session: delivery order is a channel's.
    pub fn new() -> Arc<Sequence> {
        Arc::new(Sequence::default())
    }

    /// Puts a delivery to `recipient` in its line, behind the ones already there. Called in
    /// delivery order. A delivery that is not a valid request (`None`) joins no line: it is
    /// decided nothing, so it can take no other message's slot.
    pub fn join(self: &Arc<Sequence>, recipient: Option<&str>) -> Place {
        let Some(recipient) = recipient else {
            return Place::outside();
        };
        let key = self.hasher.hash_one(recipient);
        let turn = match self.lock().entry(key) {
            Entry::Vacant(vacant) => {
                vacant.insert(Line {
                    holders: 1,
                    waiting: VecDeque::new(),
                });
                Turn::Mine
            }
            Entry::Occupied(occupied) => {
                let line = occupied.into_mut();
                line.holders += 1;
                let (tx, rx) = oneshot::channel();
                line.waiting.push_back(tx);
                Turn::Waiting(rx)
            }
        };
        Place {
            line: Some((self.clone(), key)),
            turn,
        }
    }

    /// Recipients with messages in flight, for tests.
    pub fn lines(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Line, BuildHasherDefault<Prehashed>>> {
        // Nothing panics while the map is held, so a poisoned map is still consistent.
        self.lines.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A delivery's place in its recipient's line: [`Place::turn`] waits until the messages
/// delivered before it to that recipient are decided, [`Place::leave`] (or dropping it) lets
/// the next one go.
pub struct Place {
    line: Option<(Arc<Sequence>, u64)>,
    turn: Turn,
}

enum Turn {
    /// The earlier messages of the line are decided: this one may be.
    Mine,
    /// Sent `()` when the turn comes.
    Waiting(oneshot::Receiver<()>),
    /// Left the line (or never joined one).
    Left,
}

impl Place {
    /// The place of a message that is in no line: its turn is always now.
    pub fn outside() -> Place {
        Place {
            line: None,
            turn: Turn::Left,
        }
    }

    /// Waits until the messages delivered before this one to its recipient are decided.
    pub async fn turn(&mut self) {
        if let Turn::Waiting(rx) = &mut self.turn {
            // An error would mean the turn's sender is gone unsent, which the line's holder
            // count rules out while this place is alive; go ahead rather than wait forever.
            let _ = rx.await;
            self.turn = Turn::Mine;
        }
    }

    /// Leaves the line: once the message is decided, or given up. The next message waiting in
    /// the line gets its turn when this one had it; the line goes when this was its last holder.
    pub fn leave(&mut self) {
        let turn = std::mem::replace(&mut self.turn, Turn::Left);
        let Some((sequence, key)) = &self.line else {
            return;
        };
        let mut lines = sequence.lock();
        let had_turn = match turn {
            Turn::Left => return,
            Turn::Mine => true,
            // Read under the lock, where turns are passed: a turn passed to this place but not
            // yet taken is passed on.
            Turn::Waiting(mut rx) => rx.try_recv().is_ok(),
        };
        let Entry::Occupied(mut occupied) = lines.entry(*key) else {
            return;
        };
        let line = occupied.get_mut();
        line.holders -= 1;
        if line.holders == 0 {
            occupied.remove();
            return;
        }
        if had_turn {
            while let Some(next) = line.waiting.pop_front() {
                if next.send(()).is_ok() {
                    break;
                }
            }
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.leave();
    }
}

/// The map's hasher for keys that are already hashes: passes them through instead of hashing
/// them a second time.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed here; fold anything else rather than lose it.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Whether `place`'s turn has come, without waiting for it.
    async fn has_turn(place: &mut Place) -> bool {
        tokio::time::timeout(Duration::from_millis(20), place.turn())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_recipients_messages_take_turns_in_the_order_they_joined() {
        let sequence = Sequence::new();
        let mut first = sequence.join(Some("alice"));
        let mut second = sequence.join(Some("alice"));
        let mut third = sequence.join(Some("alice"));
        assert!(has_turn(&mut first).await);
        assert!(!has_turn(&mut second).await);
        first.leave();
        assert!(
            !has_turn(&mut third).await,
            "the third waits for the second"
        );
        assert!(has_turn(&mut second).await);
        second.leave();
        assert!(has_turn(&mut third).await);
        third.leave();
        assert_eq!(sequence.lines(), 0, "the line is gone with its last holder");
    }

    #[tokio::test]
    async fn other_recipients_do_not_wait_on_each_other() {
        let sequence = Sequence::new();
        let _alice = sequence.join(Some("alice"));
        let mut bob = sequence.join(Some("bob"));
        assert!(has_turn(&mut bob).await);
        assert_eq!(sequence.lines(), 2);
    }

    #[tokio::test]
    async fn a_place_given_up_while_waiting_is_skipped_and_one_dropped_passes_its_turn() {
        let sequence = Sequence::new();
        let first = sequence.join(Some("alice"));
        let second = sequence.join(Some("alice"));
        let mut third = sequence.join(Some("alice"));
        drop(second);
        assert!(!has_turn(&mut third).await);
        drop(first);
        assert!(has_turn(&mut third).await, "the dropped second is skipped");
        drop(third);
        assert_eq!(sequence.lines(), 0);
    }

    #[tokio::test]
    async fn a_turn_passed_but_not_yet_taken_is_passed_on() {
        let sequence = Sequence::new();
        let mut first = sequence.join(Some("alice"));
        let second = sequence.join(Some("alice"));
        let mut third = sequence.join(Some("alice"));
        first.leave();
        drop(second);
        assert!(has_turn(&mut third).await);
    }

    #[tokio::test]
    async fn an_invalid_delivery_joins_no_line() {
        let sequence = Sequence::new();
        let _alice = sequence.join(Some("alice"));
        let mut invalid = sequence.join(None);
        assert!(has_turn(&mut invalid).await);
        assert_eq!(sequence.lines(), 1);
    }
}
