//! The `sendquota` binary: parse arguments, start logging, run the command.

use std::process::ExitCode;

use clap::Parser;

/// The worker allocates for every message (deliveries, Redis replies, rows), so the allocator's
/// speed is part of its CPU per message; mimalloc spends less of it than glibc's malloc
/// (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    sendquota::cli::main(sendquota::cli::Cli::parse())
}
