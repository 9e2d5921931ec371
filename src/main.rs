//! The `sendquota` binary: parse arguments, start logging, run the command.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = sendquota::cli::Cli::parse();
    sendquota::telemetry::init_logging();
    match sendquota::cli::run(cli).await {
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
