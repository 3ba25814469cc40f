//! The `tessera` binary: parses the command line and reports errors; the work is in the
//! `tessera_cli` library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = tessera_cli::Cli::parse();
    match tessera_cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (e.g. `tessera report ... | head`): nothing left to say.
        Err(e) if tessera_cli::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", tessera_cli::one_line(&e));
            ExitCode::from(tessera_cli::exit_code(&e))
        }
    }
}
