//! `hostd` command: parse the command line, open what must be opened, put
//! the sandbox up, serve.
//!
//! The start-up order is fixed and visible here, one step per line below:
//! every thread hostd ever runs starts after the sandbox step, so each one
//! inherits the walls of the process and installs its own role's seccomp
//! filter before it runs (docs/security.md). The log, and the exit status
//! of a refused configuration (2) or a failed start (1), are the same as
//! vdev's (`vrdma_isolation::daemon`).

use std::process::ExitCode;

use clap::Parser;
use vrdma_hostd::config::{Args, Config};
use vrdma_hostd::sandbox::Sandbox;

fn main() -> ExitCode {
    if let Some(done) = vrdma_isolation::daemon::manpage_requested::<Args>("hostd") {
        return done;
    }
    vrdma_isolation::daemon::main(
        "hostd",
        // 1. Configuration: flags, config file and policy file, validated
        //    (users and groups resolved by name).
        || Config::try_from(Args::parse()),
        start,
        |_, error| tracing::error!("{error}"),
    )
}

fn start(config: &Config) -> Result<(), Box<dyn std::error::Error>> {
    // 2. What the sandbox will be, decided before anything changes.
    let sandbox = Sandbox::new(config)?;
    // 3. Open what needs the file system: SIGHUP's signalfd, the admin
    //    socket (0600) and the vdev socket (0666).
    let opened = vrdma_hostd::open(config)?;
    // 4. The sandbox, single-threaded: namespaces, landlock, privileges,
    //    then seccomp last (it forbids what the steps before do): the main
    //    thread's filter, and the launcher of every later thread.
    let threads = sandbox.enter()?;
    #[cfg(feature = "test-hooks")]
    vrdma_isolation::test_hooks::after_sandbox();
    // 5. Threads and service.
    vrdma_hostd::serve(config, opened, &threads)?;
    Ok(())
}
