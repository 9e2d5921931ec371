//! The integration tests: one binary, one module per area, one shared harness (`support`).
//!
//! Every test talks to the real services (Redis, RabbitMQ, PostgreSQL); `deploy/local/test.sh`
//! starts what they need and runs them. Run one area with a filter on its module, e.g.
//! `deploy/local/test.sh tls::`.

mod support;

mod admin_api;
mod attributes;
mod bench_measures;
mod bucket_kinds_model;
mod calendar_quota_model;
mod cli;
mod cluster;
mod cluster_failover;
mod config_fixtures;
mod console;
mod console_login;
mod deadlines;
mod delivery_guarantees;
mod denial_history;
mod deny_cache;
mod deploy_files;
mod digests;
mod dispatch_marks;
mod docs_links;
mod exact_ids;
mod faults;
mod headline_rule_zones;
mod input_fuzz;
mod invalid_messages;
mod leap_seconds;
mod local_windows_model;
mod observability;
mod ordering;
mod policy_outcomes;
mod priority;
mod priority_model;
mod producer_context;
mod producers;
mod rabbit_cluster;
mod read_replica;
mod reasons;
mod replay;
mod replica_wait;
mod resilience;
mod retries;
mod rule_reload;
mod scale_out;
mod security;
mod send_windows;
mod settings;
mod shards;
mod shutdown;
mod tls;
mod traces;
mod unavailable;
mod what_if;
mod window_kinds_model;
