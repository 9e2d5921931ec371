//! The measured phases, one module each, and what they share: the flags, the process
//! accounting, one namespace on the services with the limiter and the bare script loop over it,
//! and the instant every decision is anchored on. `main` runs them in the order the bench's doc
//! gives (warm-up, (a1) with (b), (a2) with (c) and (d), (g), (e), (f)); each adds its figures,
//! CPU rows and notes to the report.

pub mod decision;
pub mod end_to_end;
pub mod floor;
pub mod hot;
pub mod latency;
pub mod scale;
pub mod series;
pub mod work_relay;

use std::sync::Arc;

use chrono::{DateTime, Utc};
use redis::aio::MultiplexedConnection;
use sendquota::config::QueueType;
use sendquota::internals::limiter::script::{script_for, source_for, KindSet};
use sendquota::internals::limiter::Limiter;
use sendquota::internals::policy::Policy;

use crate::args::Args;
use crate::ceilings::LuaLoop;
use crate::decision_path::policy;
use crate::keyspace::{multiplexed, purge_on_interrupt};
use crate::procs::Procs;
use crate::support::TestEnv;

/// The ceiling (a1) and the decision path (b) run in this many alternating slices, and so do
/// the two pools of (e), so that background load on a shared machine hits both sides alike.
pub const SLICES: usize = 4;

/// The instant every decision phase is anchored on. Decision `i` is simulated at `+i` ms, and
/// from noon up to 43 million decisions stay on one UTC day.
const BASE: &str = "2026-04-01T12:00:00Z";

/// What every phase works with.
pub struct Bench {
    pub args: Args,
    pub procs: Procs,
    /// The bench's own Redis connection: the bare loop, INFO, MEMORY USAGE, cleanup.
    pub plain: MultiplexedConnection,
    /// The namespace the decision phases write to ((c) and (g) take fresh ones).
    pub env: TestEnv,
    /// Every key of `env`'s namespace.
    pub pattern: String,
    /// The bare script loop of (a1), on `env`'s namespace.
    pub lua: LuaLoop,
    /// The limiter on `env`'s namespace, without a deny cache.
    pub limiter: Limiter,
    /// The default policy: the headline rule alone.
    pub headline: Arc<Policy>,
    pub base: DateTime<Utc>,
}

impl Bench {
    /// Connects, starts removing this run's keys on an interrupt, finds the processes to
    /// account, makes the namespace and loads the headline rule's script for the bare loop.
    pub async fn open(args: Args) -> Bench {
        let mut plain = multiplexed().await;
        tokio::spawn(purge_on_interrupt());
        let procs = Procs::find(&mut plain).await;
        let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
        let ns = env.namespace.clone();
        // The script the limiter sends for a scope holding the headline rule alone.
        let headline_kinds = KindSet::of(["calendar_quota"]);
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source_for(headline_kinds))
            .query_async(&mut plain)
            .await
            .expect("SCRIPT LOAD");
        assert_eq!(
            sha,
            script_for(headline_kinds).get_hash(),
            "source_for and script_for disagree"
        );
        let lua = LuaLoop {
            conn: plain.clone(),
            sha,
            namespace: ns.clone(),
            pipeline: args.pipeline,
            in_flight: args.in_flight,
        };
        Bench {
            limiter: Limiter::new(env.redis.clone(), &ns),
            headline: Arc::new(policy("")),
            pattern: format!("{ns}:*"),
            base: BASE.parse().expect("instant"),
            args,
            procs,
            plain,
            env,
            lua,
        }
    }

    /// Decision `i`'s instant: [`BASE`] plus `i` ms.
    pub fn at(&self) -> impl Fn(usize) -> DateTime<Utc> + Copy {
        let base = self.base;
        move |i| base + chrono::Duration::milliseconds(i as i64)
    }
}
