//! The `sendquota` binary as a child process: a command with a clean environment, and a run
//! to completion (or to a time limit) with its output captured.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The binary with no SENDQUOTA_* setting inherited from the test process, warnings-only
/// logging and no admin API: each test sets what it means to test.
pub fn sendquota() -> Command {
    sendquota_at(env!("CARGO_BIN_EXE_sendquota"))
}

/// [`sendquota`] with the binary at `bin` instead of this package's: another build of the
/// worker (an older commit's, say), run the same way, so one program can compare two builds.
pub fn sendquota_at(bin: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(bin);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SENDQUOTA_")) {
        cmd.env_remove(k);
    }
    cmd.env("SENDQUOTA_LOG", "warn")
        .env("SENDQUOTA_ADMIN_LISTEN", "");
    cmd
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
