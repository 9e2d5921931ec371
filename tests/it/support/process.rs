//! The `sendquota` binary as a child process: a command with a clean environment, and a run
//! to completion (or to a time limit) with its output captured.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The binary with no SENDQUOTA_* setting (nor OpenTelemetry's OTEL_*, which can turn span
/// export on) inherited from the test process, warnings-only logging and no admin API: each
/// test sets what it means to test.
pub fn sendquota() -> Command {
    sendquota_at(env!("CARGO_BIN_EXE_sendquota"))
}

/// [`sendquota`] with the binary at `bin` instead of this package's: another build of the
/// worker (an older commit's, say), run the same way, so one program can compare two builds.
pub fn sendquota_at(bin: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(bin);
    let inherited = |k: &str| k.starts_with("SENDQUOTA_") || k.starts_with("OTEL_");
    for (k, _) in std::env::vars().filter(|(k, _)| inherited(k)) {
        cmd.env_remove(k);
    }
    cmd.env("SENDQUOTA_LOG", "warn")
        .env("SENDQUOTA_ADMIN_LISTEN", "");
    cmd
}

/// Stops `child` (a worker this test started) as an orchestrator does, with SIGTERM, and
/// waits for it to drain and exit; returns what it left behind.
pub fn terminate(child: std::process::Child) -> std::process::Output {
    let signalled = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(signalled.success(), "SIGTERM sent to the worker");
    child.wait_with_output().expect("wait for the worker")
}

/// What one run of the binary left behind.
#[derive(Debug)]
pub struct Run {
    /// The exit code; `None` when the test had to kill the process.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Runs `cmd` to its end, or kills it (the process this test started, by its handle) after
/// `limit`. Output is read on threads so a chatty process cannot block on a full pipe.
pub fn run_for(mut cmd: Command, stdin: Option<&str>, limit: Duration) -> Run {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().expect("start the sendquota binary");
    let mut pipe = child.stdin.take().expect("stdin pipe");
    if let Some(text) = stdin {
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    drop(pipe);
    let mut stdout = child.stdout.take().expect("stdout pipe");
    let mut stderr = child.stderr.take().expect("stderr pipe");
    let out = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let err = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let code = loop {
        if let Some(status) = child.try_wait().expect("wait for the binary") {
            break status.code();
        }
        if started.elapsed() > limit {
            child.kill().expect("kill the binary");
            child.wait().expect("reap the binary");
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = started.elapsed();
    Run {
        code,
        stdout: String::from_utf8_lossy(&out.join().expect("stdout reader")).into_owned(),
        stderr: String::from_utf8_lossy(&err.join().expect("stderr reader")).into_owned(),
        elapsed,
    }
}

/// [`run_for`] with no input and a limit of 30 s, on a thread of the blocking pool: the services
/// a test runs on its own runtime (an in-process worker, an HTTP endpoint) answer meanwhile.
pub async fn run_to_end(cmd: Command) -> Run {
    tokio::task::spawn_blocking(move || run_for(cmd, None, Duration::from_secs(30)))
        .await
        .expect("run the binary")
}

/// A long-running `sendquota` process (a worker) whose output lines, stdout's and stderr's,
/// are collected as they come; killed (the process this test started, by its handle) when
/// dropped.
pub struct Running {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Running {
    /// Starts `cmd` with both outputs captured.
    pub fn spawn(mut cmd: Command) -> Running {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the sendquota binary");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let out = child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>);
        let err = child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>);
        let readers = [out, err]
            .into_iter()
            .flatten()
            .map(|pipe| {
                let lines = lines.clone();
                std::thread::spawn(move || {
                    for line in std::io::BufRead::lines(std::io::BufReader::new(pipe)) {
                        let Ok(line) = line else { break };
                        lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
                    }
                })
            })
            .collect();
        Running {
            child,
            lines,
            readers,
        }
    }

    /// The process id, to send the process this test started a signal.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The lines written so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits (up to `limit`) until `done` holds for the lines written so far; panics with them
    /// and `what` otherwise.
    pub async fn wait_for(&self, what: &str, limit: Duration, done: impl Fn(&[String]) -> bool) {
        let deadline = Instant::now() + limit;
        loop {
            let lines = self.lines();
            if done(&lines) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what} within {limit:?}; the process wrote:\n{}",
                lines.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the process and returns every line it wrote.
    pub fn stop(mut self) -> Vec<String> {
        self.kill();
        for reader in std::mem::take(&mut self.readers) {
            let _ = reader.join();
        }
        self.lines()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}
