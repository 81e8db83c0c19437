//! `hostd` command: parse the command line, open what must be opened, put
//! the sandbox up, serve.
//!
//! The start-up order is fixed and visible here, one step per line below:
//! every thread hostd ever runs starts after the last step, so each one
//! inherits the walls of the process and installs its own role's seccomp
//! filter before it runs (docs/security.md).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use vrdma_errors::error_chain;
use vrdma_hostd::config::{Args, Config};
use vrdma_hostd::sandbox::Sandbox;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VRDMA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // 1. Configuration: flags, config file and policy file, validated
    //    (users and groups resolved by name).
    let config = match Config::try_from(Args::parse()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("hostd: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    match start(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn start(config: &Config) -> Result<(), Box<dyn std::error::Error>> {
    // 2. What the sandbox will be, decided before anything changes.
    let sandbox = Sandbox::new(config)?;
    // 3. Open what needs the file system: SIGHUP's signalfd, the admin
    //    socket (0600) and the vdev socket (0666).
    let opened = vrdma_hostd::open(config)?;
    // 4. The sandbox, single-threaded: namespaces, landlock, privileges.
    sandbox.plan.enter_namespaces()?;
    sandbox.plan.restrict_filesystem()?;
    sandbox.plan.drop_privileges()?;
    // 5. seccomp, last (it forbids what the steps above do): the main
    //    thread's filter, and the launcher of every later thread.
    let threads = sandbox.install_seccomp()?;
    #[cfg(feature = "test-hooks")]
    vrdma_isolation::test_hooks::after_sandbox();
    // 6. Threads and service.
    vrdma_hostd::serve(config, opened, &threads)?;
    Ok(())
}
