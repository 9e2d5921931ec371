//! What every layer stands on: settings, the one clock, the Redis store, telemetry, traces, TLS,
//! failpoints and health.

pub mod clock;
pub mod config;
pub mod failpoint;
pub mod health;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod traces;
