//! sendquota: a worker that enforces message-send quotas.
//!
//! Producers publish send requests to RabbitMQ; the worker decides each one against every
//! frequency cap and rate limit that applies, atomically in Redis, and dispatches, delays or
//! denies it. A message flows one way through these modules:
//!
//! ```text
//! intake   worker      a broker session's deliveries, slots, retries (broker: lapin
//!                      connections, topology, confirmed publishes, the receipt read from
//!                      the headers once; acks: coalesced acks; sequence: a recipient's
//!                      messages decided in delivery order; confirms; health)
//!   -> request   message   decode and validate the request (names: the name grammar and
//!                          the text rules; attributes; schema)
//!   -> rules     policy    which rules apply (kinds: each limiter kind, beside
//!                          lua/kinds/<kind>.lua; priority; reload)
//!   -> decide    limiter   one Lua script call per scope, all-or-nothing: every rule's
//!                          verdict (keys, claim, dedup, deny_cache)
//!                decision  pure: policy + request + receipt + verdicts -> one outcome and
//!                          its deadline (outcome: Verdict, Outcome, Handled; deadline)
//!   -> act       act::pipeline  the flow of one delivery; act::steps one step per outcome
//!                          (dispatch, deny, delay, expire, unchecked, hold, invalid,
//!                          quarantine), shared with act::digest (the flusher) and
//!                          act::held (the messages digest rules hold)
//!   -> record    denials (the history), rollup (per-minute counts)
//!   -> worker    ack only after that
//! ops      service (what operators ask, once) beneath admin (JSON API), console (HTML)
//!          and cli; replay, quarantine, tail
//! base     config, clock (the one clock), store (Redis), telemetry, traces, tls, failpoint
//! ```
//!
//! Around it: `startup` builds the application and runs it until stopped.
//!
//! The library's API is the command (`cli`), its settings (`config`), and running the worker
//! in a process of one's own (`startup`, with a `clock` and a `failpoint`). Everything else is
//! reachable through `internals` for the project's tests and benches only.

pub mod cli;
pub mod clock;
pub mod config;
pub mod failpoint;
pub mod startup;

mod acks;
mod act;
mod admin;
mod attributes;
mod broker;
mod claim;
mod confirms;
mod console;
mod deadline;
mod decision;
mod dedup;
mod denials;
mod deny_cache;
mod health;
mod keys;
mod kinds;
mod limiter;
mod message;
mod names;
mod outcome;
mod policy;
mod priority;
mod quarantine;
mod reload;
mod replay;
mod rollup;
mod schema;
mod sequence;
mod service;
mod store;
mod tail;
mod telemetry;
mod tls;
mod traces;
mod worker;

/// The modules behind the API, for the project's integration tests and benches: they drive the
/// limiter, the policy and the stores directly against the real services. Not a stable
/// interface.
#[doc(hidden)]
pub mod internals {
    /// The crate's `acks` module.
    pub mod acks {
        pub use crate::acks::*;
    }
    /// The crate's `admin` module.
    pub mod admin {
        pub use crate::admin::*;
    }
    /// The crate's `attributes` module.
    pub mod attributes {
        pub use crate::attributes::*;
    }
    /// The crate's `broker` module.
    pub mod broker {
        pub use crate::broker::*;
    }
    /// The crate's `claim` module.
    pub mod claim {
        pub use crate::claim::*;
    }
    /// The crate's `console` module.
    pub mod console {
        pub use crate::console::*;
    }
    /// The crate's `deadline` module.
    pub mod deadline {
        pub use crate::deadline::*;
    }
    /// The crate's `decision` module.
    pub mod decision {
        pub use crate::decision::*;
    }
    /// The crate's `dedup` module.
    pub mod dedup {
        pub use crate::dedup::*;
    }
    /// The crate's `digest` module.
    pub mod digest {
        pub use crate::act::digest::*;
        pub use crate::act::held::*;
    }
    /// The crate's `denials` module.
    pub mod denials {
        pub use crate::denials::*;
    }
    /// The crate's `deny_cache` module.
    pub mod deny_cache {
        pub use crate::deny_cache::*;
    }
    /// The crate's `keys` module.
    pub mod keys {
        pub use crate::keys::*;
    }
    /// The crate's `kinds` module.
    pub mod kinds {
        pub use crate::kinds::*;
    }
    /// The crate's `limiter` module.
    pub mod limiter {
        pub use crate::limiter::*;
    }
    /// The crate's `message` module.
    pub mod message {
        pub use crate::message::*;
    }
    /// The crate's `names` module.
    pub mod names {
        pub use crate::names::*;
    }
    /// The crate's `outcome` module.
    pub mod outcome {
        pub use crate::outcome::*;
    }
    /// The crate's `pipeline` module.
    pub mod pipeline {
        pub use crate::act::pipeline::*;
        pub use crate::act::steps::*;
    }
    /// The crate's `policy` module.
    pub mod policy {
        pub use crate::policy::*;
    }
    /// The crate's `priority` module.
    pub mod priority {
        pub use crate::priority::*;
    }
    /// The crate's `quarantine` module.
    pub mod quarantine {
        pub use crate::quarantine::*;
    }
    /// The crate's `reload` module.
    pub mod reload {
        pub use crate::reload::*;
    }
    /// The crate's `replay` module.
    pub mod replay {
        pub use crate::replay::*;
    }
    /// The crate's `rollup` module.
    pub mod rollup {
        pub use crate::rollup::*;
    }
    /// The crate's `service` module.
    pub mod service {
        pub use crate::service::*;
    }
    /// The crate's `sequence` module.
    pub mod sequence {
        pub use crate::sequence::*;
    }
    /// The crate's `store` module.
    pub mod store {
        pub use crate::store::*;
    }
    /// The crate's `tail` module.
    pub mod tail {
        pub use crate::tail::*;
    }
    /// The crate's `telemetry` module.
    pub mod telemetry {
        pub use crate::telemetry::*;
    }
    /// The crate's `tls` module.
    pub mod tls {
        pub use crate::tls::*;
    }
    /// The crate's `traces` module.
    pub mod traces {
        pub use crate::traces::*;
    }
    /// The crate's `worker` module.
    pub mod worker {
        pub use crate::worker::*;
    }
}
