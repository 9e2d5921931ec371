//! The worker binary that (c), (d) and (g) measure: which build (this package's, or the one
//! `SENDQUOTA_PERF_WORKER_BIN` names, so one bench binary drives both sides of an A/B), at
//! which settings, started on a namespace and stopped. It is started through the tests' harness
//! (`TestEnv::worker_command_at`: a clean SENDQUOTA_* environment, warnings-only logging, the
//! namespace's services), so the bench runs the worker exactly as the tests do; the bench adds
//! only its config file, a fixed clock and an admin port for readiness and /metrics.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::args::Args;
use crate::scrape::http_get;
use crate::support::private::free_port;
use crate::support::TestEnv;

/// The worker's fixed clock in the end-to-end phase.
const WORKER_NOW: &str = "2026-02-02T12:00:00Z";

/// How often (c) asks the starting worker whether it is ready.
const READY_POLL: Duration = Duration::from_millis(1);

/// The worker binary (c), (d) and (g) run, and its settings.
pub struct WorkerChoice {
    /// `SENDQUOTA_PERF_WORKER_BIN` when set, else this package's binary.
    pub bin: String,
    /// `--worker-prefetch`: amqp.prefetch and worker.concurrency; `None` = the worker's defaults.
    prefetch: Option<u16>,
}

impl WorkerChoice {
    pub fn new(args: &Args) -> WorkerChoice {
        WorkerChoice {
            bin: std::env::var("SENDQUOTA_PERF_WORKER_BIN")
                .ok()
                .filter(|bin| !bin.is_empty())
                .unwrap_or_else(|| env!("CARGO_BIN_EXE_sendquota").to_owned()),
            prefetch: u16::try_from(args.worker_prefetch).ok().filter(|&p| p > 0),
        }
    }

    /// The worker's prefetch and concurrency: `--worker-prefetch`, else the defaults of this
    /// build's src/base/config/sections.rs (another binary's are assumed the same).
    pub fn in_progress(&self) -> (u16, usize) {
        match self.prefetch {
            Some(p) => (p, usize::from(p)),
            None => (
                sendquota::config::AmqpSettings::default().prefetch,
                sendquota::config::WorkerSettings::default().concurrency,
            ),
        }
    }

    pub fn describe(&self) -> String {
        let (prefetch, concurrency) = self.in_progress();
        let whence = if self.prefetch.is_some() {
            "--worker-prefetch"
        } else {
            "defaults"
        };
        format!("prefetch {prefetch}, concurrency {concurrency} ({whence})")
    }

    /// Starts the worker on `env`'s namespace, its clock fixed at [`WORKER_NOW`], and waits
    /// until it is ready (consuming, with Redis and Postgres reachable: `/readyz` answers).
    /// Returns it and its admin port.
    pub async fn start(&self, env: &TestEnv) -> (WorkerProcess, u16) {
        let config = std::env::temp_dir().join(format!("{}-perf.toml", env.namespace));
        // The default queue type, said anyway: (a2) and the floor use a quorum queue.
        let mut toml = "[amqp]\nqueue_type = \"quorum\"\n".to_owned();
        if let Some(p) = self.prefetch {
            toml += &format!("prefetch = {p}\n\n[worker]\nconcurrency = {p}\n");
        }
        std::fs::write(&config, toml).expect("write config");
        let port = free_port();
        let child = env
            .worker_command_at(&self.bin)
            .args([
                "--config",
                config.to_str().expect("utf-8 path"),
                "worker",
                "--now",
                WORKER_NOW,
            ])
            .env("SENDQUOTA_ADMIN_LISTEN", format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start the worker binary {}: {e}", self.bin));
        let worker = WorkerProcess { child, config };
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_get(port, "/readyz").await.is_none() {
            assert!(
                Instant::now() < deadline,
                "the worker was not ready after 30 s"
            );
            tokio::time::sleep(READY_POLL).await;
        }
        (worker, port)
    }
}

/// Stops the child worker and removes its config file when dropped (also on panic).
pub struct WorkerProcess {
    child: Child,
    config: std::path::PathBuf,
}

impl WorkerProcess {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then wait for it to drain and exit.
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.config);
    }
}
