//! sendquota: a worker that enforces message-send quotas.
//!
//! Producers publish send requests to RabbitMQ; the worker decides each one against every
//! frequency cap and rate limit that applies, atomically in Redis, and dispatches, delays or
//! denies it. Data flows one way through these modules:
//!
//! ```text
//! worker (delivery) -> message (decode, validate) -> policy (which rules apply)
//!   -> limiter (one Lua script call per scope, all-or-nothing; refunds across scopes)
//!   -> decision (pure: verdicts -> allow / deny / delay / shadow)
//!   -> pipeline (make the outcome durable: broker publish, denials row, delay queue)
//!   -> worker (ack only after that; retry with backoff on any service failure)
//! ```
//!
//! Supporting modules: `config` (TOML + environment), `clock` (injectable time), `store` (the Redis
//! connection, single or cluster, through redis-rs), `tls` (certificate files and the process's one
//! rustls crypto provider), `broker` (RabbitMQ through lapin: connections, topology and confirmed
//! publishing), `dedup` (dispatch marks that stop a redelivery from being sent twice), `claim`
//! (in-flight claims: one delivery of a message id at a time), `denials` (the Postgres history
//! operators query), `quarantine` (the operator's side of the quarantine queue), `acks`
//! (coalesced acks), `admin` (the admin HTTP API), `replay` (replaying denials from cron),
//! `telemetry` (logs and metrics), `cli` (the `sendquota` command).

pub mod acks;
pub mod admin;
pub mod broker;
pub mod claim;
pub mod cli;
pub mod clock;
pub mod config;
pub mod decision;
pub mod dedup;
pub mod denials;
pub mod deny_cache;
pub mod failpoint;
pub mod kinds;
pub mod limiter;
pub mod message;
pub mod outcome;
pub mod pipeline;
pub mod policy;
pub mod quarantine;
pub mod replay;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod worker;
