//! `vdev` command: parse the command line, open what must be opened, put
//! the sandbox up, serve.
//!
//! The start-up order is fixed and visible here, one step per line below:
//! every thread vdev ever runs starts after the last step, so each one
//! inherits all the walls (docs/security.md).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use vrdma_vdev::config::{Args, Config};
use vrdma_vdev::control::error_chain;
use vrdma_vdev::sandbox::{self, Plan};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VRDMA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // 1. Configuration: flags and file, validated (users resolved by name).
    let config = match Config::try_from(Args::parse()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("vdev: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    match start(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(tenant = %config.tenant, "{e}");
            ExitCode::FAILURE
        }
    }
}

fn start(config: &Config) -> Result<(), String> {
    let chain = |e: &dyn std::error::Error| error_chain(e);
    // 2. What the sandbox will be, decided before anything changes.
    let plan = Plan::new(config).map_err(|e| chain(&e))?;
    // 3. Open what needs the file system or privileges: the vhost-user
    //    listener (and the first hostd registration if hostd's socket is
    //    out of reach of vdev's final uid).
    let opened = vrdma_vdev::open(config, plan.register_early).map_err(|e| chain(&e))?;
    // 4. The sandbox, single-threaded: namespaces, landlock, privileges.
    sandbox::enter_namespaces(&plan).map_err(|e| chain(&e))?;
    sandbox::restrict_filesystem(&plan).map_err(|e| chain(&e))?;
    sandbox::drop_privileges(&plan).map_err(|e| chain(&e))?;
    // 5. seccomp, on every thread, last: it forbids what the steps above do.
    sandbox::install_seccomp(&plan).map_err(|e| chain(&e))?;
    #[cfg(feature = "test-hooks")]
    vrdma_isolation::test_hooks::after_sandbox();
    // 6. Threads and service.
    vrdma_vdev::run(config, opened).map_err(|e| chain(&e))
}
