//! sendquota: a worker that enforces message-send quotas.
//!
//! Producers publish send requests to RabbitMQ; the worker decides each one against every
//! frequency cap and rate limit that applies, atomically in Redis, and dispatches, delays or
//! denies it. A message flows one way through these folders, each importing only the ones
//! below it:
//!
//! ```text
//! cli, startup   the faces and the assembly (startup builds the application and runs it)
//! ops/      what operators do: service (what operators ask, once) beneath admin (JSON API),
//!           console/ (HTML) and cli; quarantine, replay, tail
//! act/      pipeline (the flow of one delivery), steps (one step per outcome: dispatch,
//!           deny, delay, expire, unchecked, hold, invalid, quarantine), shared with digest
//!           (the flusher) and held (the messages digest rules hold)
//! intake/   worker (a broker session's deliveries, slots, retries), broker (lapin
//!           connections, topology, the receipt read from the headers once), publisher
//!           (confirmed publishes), acks (coalesced), sequence (a recipient's messages in
//!           delivery order), confirms
//! record/   denials/ (the history), rollup (per-minute counts)
//! decide/   limiter/ (one Lua script call per scope, all-or-nothing: every rule's verdict;
//!           keys, claim, dedup, deny_cache), decision (pure: policy + request + receipt +
//!           verdicts -> one outcome and its deadline), outcome (Verdict, Outcome), deadline
//! rules/    policy/ (which rules apply), kinds/ (each limiter kind, beside
//!           lua/kinds/<kind>.lua), priority, reload
//! request/  message (the request type, decode and validation), names (the name grammar and
//!           the text rules), attributes, schema
//! base/     config, clock (the one clock), store (Redis), telemetry, traces, tls,
//!           failpoint, health
//! ```
//!
//! The library's API is the command (`cli`), its settings (`config`), and running the worker
//! in a process of one's own (`startup`, with a `clock` and a `failpoint`). Everything else is
//! reachable through `internals` for the project's tests and benches only.

pub mod cli;
pub mod startup;

pub use base::{clock, config, failpoint};

mod act;
mod base;
mod decide;
mod intake;
mod ops;
mod record;
mod request;
mod rules;

/// The modules behind the API, for the project's integration tests and benches: they drive the
/// limiter, the policy and the stores directly against the real services. Not a stable
/// interface; each module keeps the flat name it had before the folders.
#[doc(hidden)]
pub mod internals {
    /// The crate's `intake::acks`.
    pub mod acks {
        pub use crate::intake::acks::*;
    }
    /// The crate's `ops::admin`.
    pub mod admin {
        pub use crate::ops::admin::*;
    }
    /// The crate's `request::attributes`.
    pub mod attributes {
        pub use crate::request::attributes::*;
    }
    /// The crate's `intake::broker`.
    pub mod broker {
        pub use crate::intake::broker::*;
        pub use crate::intake::publisher::*;
        pub use crate::intake::shards::RECIPIENT_HEADER;
    }
    /// The crate's `decide::claim`.
    pub mod claim {
        pub use crate::decide::claim::*;
    }
    /// The crate's `intake::confirms`.
    pub mod confirms {
        pub use crate::intake::confirms::*;
    }
    /// The crate's `ops::console`.
    pub mod console {
        pub use crate::ops::console::*;
    }
    /// The crate's `decide::deadline`.
    pub mod deadline {
        pub use crate::decide::deadline::*;
    }
    /// The crate's `decide::decision`.
    pub mod decision {
        pub use crate::decide::decision::*;
    }
    /// The crate's `decide::dedup`.
    pub mod dedup {
        pub use crate::decide::dedup::*;
    }
    /// The crate's `record::denials`.
    pub mod denials {
        pub use crate::record::denials::*;
    }
    /// The crate's `decide::deny_cache`.
    pub mod deny_cache {
        pub use crate::decide::deny_cache::*;
    }
    /// The crate's `act::digest and act::held`.
    pub mod digest {
        pub use crate::act::digest::*;
        pub use crate::act::held::*;
    }
    /// The crate's `decide::keys`.
    pub mod keys {
        pub use crate::decide::keys::*;
    }
    /// The crate's `rules::kinds`.
    pub mod kinds {
        pub use crate::rules::kinds::*;
    }
    /// The crate's `decide::limiter`.
    pub mod limiter {
        pub use crate::decide::limiter::*;
    }
    /// The crate's `request::message`.
    pub mod message {
        pub use crate::request::message::*;
    }
    /// The crate's `request::names`.
    pub mod names {
        pub use crate::request::names::*;
    }
    /// The crate's `decide::outcome`.
    pub mod outcome {
        pub use crate::decide::outcome::*;
    }
    /// The crate's `act::pipeline and act::steps`.
    pub mod pipeline {
        pub use crate::act::pipeline::*;
        pub use crate::act::steps::*;
    }
    /// The crate's `rules::policy`.
    pub mod policy {
        pub use crate::rules::policy::*;
    }
    /// The crate's `rules::priority`.
    pub mod priority {
        pub use crate::request::priority::*;
        pub use crate::rules::priority::*;
    }
    /// The crate's `ops::quarantine`.
    pub mod quarantine {
        pub use crate::ops::quarantine::*;
    }
    /// The crate's `rules::reload`.
    pub mod reload {
        pub use crate::rules::reload::*;
    }
    /// The crate's `ops::replay`.
    pub mod replay {
        pub use crate::ops::replay::*;
    }
    /// The crate's `record::rollup`.
    pub mod rollup {
        pub use crate::record::rollup::*;
    }
    /// The crate's `request::schema`.
    pub mod schema {
        pub use crate::request::schema::*;
    }
    /// The crate's `intake::sequence`.
    pub mod sequence {
        pub use crate::intake::sequence::*;
    }
    /// The crate's `ops::service`.
    pub mod service {
        pub use crate::ops::service::*;
    }
    /// The crate's `base::store`.
    pub mod store {
        pub use crate::base::store::*;
    }
    /// The crate's `ops::tail`.
    pub mod tail {
        pub use crate::ops::tail::*;
    }
    /// The crate's `base::telemetry`.
    pub mod telemetry {
        pub use crate::base::telemetry::*;
    }
    /// The crate's `base::tls`.
    pub mod tls {
        pub use crate::base::tls::*;
    }
    /// The crate's `base::traces`.
    pub mod traces {
        pub use crate::base::traces::*;
    }
    /// The crate's `intake::worker`.
    pub mod worker {
        pub use crate::intake::worker::*;
    }
}
