//! The `sendquota` binary: parse arguments, start logging, run the command.

use std::process::ExitCode;

use clap::Parser;

/// The worker allocates for every message (deliveries, Redis replies, rows): glibc's malloc
/// took about a fifth of its CPU (perf, `cargo bench --bench perf`); mimalloc is cheaper.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = sendquota::cli::Cli::parse();
    sendquota::telemetry::init_logging();
    match sendquota::cli::start(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "sendquota: {}",
                sendquota::message::one_line(&e.to_string())
            );
            ExitCode::from(e.exit_code())
        }
    }
}
