//! The worker, in this process (with the test's clock and failpoints) or as the `sendquota`
//! binary: the commands of this environment and the configuration file they read.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sendquota::clock::ManualClock;
use tokio::sync::oneshot;

use super::{
    amqp_url, http, private, process, redis_url, TestEnv, ADMIN_TOKEN, ADMIN_TOKEN_NAME,
    NEEDS_FAILPOINTS,
};

impl TestEnv {
    /// Starts the worker in this process with `clock`.
    pub fn start_worker(&mut self, clock: &ManualClock) {
        self.start_worker_with(clock, None);
    }

    /// Starts the worker with a failpoint armed.
    pub fn start_worker_with(
        &mut self,
        clock: &ManualClock,
        failpoint: Option<sendquota::failpoint::Failpoint>,
    ) {
        assert!(
            failpoint.is_none() || sendquota::failpoint::enabled(),
            "{NEEDS_FAILPOINTS}"
        );
        let (stop, stopped) = oneshot::channel::<()>();
        let settings = self.settings.clone();
        let clock = Arc::new(clock.clone());
        self.worker_task = Some(tokio::spawn(async move {
            sendquota::startup::run(&settings, clock, failpoint, async {
                let _ = stopped.await;
            })
            .await
            .expect("worker runs");
        }));
        self.worker_stop = Some(stop);
    }

    /// Starts the worker with `clock` and its admin API on a free port, accepting
    /// [`ADMIN_TOKEN`] (named [`ADMIN_TOKEN_NAME`]); returns the port once the API is ready.
    pub async fn start_admin_worker(&mut self, clock: &ManualClock) -> u16 {
        let port = private::free_port();
        self.settings.admin.listen = format!("127.0.0.1:{port}");
        self.settings.admin.tokens = vec![sendquota::config::AdminToken {
            name: ADMIN_TOKEN_NAME.to_owned(),
            token: ADMIN_TOKEN.to_owned(),
        }];
        self.start_worker(clock);
        http::wait_until_ready(port).await;
        port
    }

    /// Stops the in-process worker and waits for it to drain.
    pub async fn stop_worker(&mut self) {
        if let Some(stop) = self.worker_stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.worker_task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("worker stops within 10 s")
                .expect("worker task ends cleanly");
        }
    }

    /// The worker binary with this environment's services and namespace (a clean environment
    /// otherwise, see [`process::sendquota`]); the caller adds the arguments.
    pub fn worker_command(&self) -> std::process::Command {
        self.worker_command_at(env!("CARGO_BIN_EXE_sendquota"))
    }

    /// [`TestEnv::worker_command`] with the binary at `bin` (see [`process::sendquota_at`]).
    pub fn worker_command_at(&self, bin: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
        let mut cmd = process::sendquota_at(bin);
        cmd.env("SENDQUOTA_NAMESPACE", &self.namespace)
            .env("SENDQUOTA_REDIS_URL", redis_url())
            .env("SENDQUOTA_AMQP_URL", amqp_url())
            .env("SENDQUOTA_DATABASE_URL", &self.database_url);
        cmd
    }

    /// A `sendquota` command line (`args`) for this environment, as an operator runs one: its
    /// services and namespace, and a configuration file naming the queue type its queues were
    /// declared with (a declaration of another type would be refused). The file is removed with
    /// the environment.
    pub fn cli(&self, args: &[&str]) -> std::process::Command {
        self.cli_with("", args)
    }

    /// [`TestEnv::cli`] with `config` (rules, say) added to the configuration file. `config`
    /// follows the file's `[amqp]` table and its `queue_type`: it may go on with keys of that
    /// table (`prefetch = 20`), and begins any other table with its header.
    pub fn cli_with(&self, config: &str, args: &[&str]) -> std::process::Command {
        let queue_type = match self.settings.amqp.queue_type {
            sendquota::config::QueueType::Classic => "classic",
            sendquota::config::QueueType::Quorum => "quorum",
        };
        let path = cli_config_path(&self.namespace);
        // Written aside and renamed over the file: a command started a moment ago (a worker
        // still reading it) never sees it half written.
        let written = path.with_extension(super::unique("toml"));
        std::fs::write(
            &written,
            format!("[amqp]\nqueue_type = \"{queue_type}\"\n{config}"),
        )
        .expect("write the command's configuration");
        std::fs::rename(&written, &path).expect("put the command's configuration in place");
        let mut cmd = self.worker_command();
        cmd.arg("--config").arg(&path).args(args);
        cmd
    }

    /// Runs [`TestEnv::cli_with`] (`config`, `args`) to its end, off the async runtime (see
    /// [`process::run_to_end`]): what it left behind. The command is made (and its file written)
    /// at once; the future borrows nothing.
    pub fn run_cli(&self, config: &str, args: &[&str]) -> impl Future<Output = process::Run> {
        process::run_to_end(self.cli_with(config, args))
    }

    /// What `sendquota check --at <at>` prints for `message` under the rules of `config`
    /// (without committing), which must succeed.
    pub fn check(&self, config: &str, at: &str, message: &serde_json::Value) -> serde_json::Value {
        let out = self
            .cli_with(
                config,
                &["check", "--at", at, "--message", &message.to_string()],
            )
            .output()
            .expect("run check");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("check prints JSON")
    }
}

/// Where [`TestEnv::cli`] writes the configuration of `namespace`'s commands.
pub(super) fn cli_config_path(namespace: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{namespace}.toml"))
}
