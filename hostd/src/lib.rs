//! hostd: the per-host datapath of vrdma. It plays the RDMA NIC for every
//! tenant's vdev: it owns the physical QPs, the memory-key table and the DMA
//! engine, and executes RDMA between tenants. vdevs are not trusted.
//!
//! - [`config`]: command line and TOML file, validated into [`Config`].
//! - [`server`]: the control socket: one thread per vdev, one response per
//!   request, tenant policy (credentials, networks), teardown on disconnect.
//! - [`datapath`]: polling threads that drain submission rings, run the
//!   NIC and push completions, spinning briefly before sleeping in epoll.
//! - [`nic`]: the [`nic::Nic`] trait hostd drives, and [`nic::soft::SoftNic`],
//!   the software model of a BlueField-3-style NIC.

pub mod config;
pub mod datapath;
pub mod nic;
pub mod server;

use std::path::PathBuf;
use std::time::Duration;

use vrdma_hostd_protocol::channel::{ChannelError, Listener};

pub use config::Config;
use datapath::Datapath;
use nic::soft::SoftNic;
use server::Server;

/// Why hostd could not serve.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Cannot listen on {}", path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: ChannelError,
    },
    #[error("Cannot start the datapath")]
    Datapath(#[source] std::io::Error),
}

/// Serves vdevs on the configured socket until the process is stopped.
pub fn run(config: &Config) -> Result<(), Error> {
    let listener = Listener::bind(&config.socket).map_err(|source| Error::Listen {
        path: config.socket.clone(),
        source,
    })?;
    let datapath = Datapath::new(
        Box::new(SoftNic::new()),
        config.datapath_threads,
        Duration::from_micros(config.spin_us),
        // Back-pressure: hold at most one completion ring's worth per pQP.
        config.cq_depth as usize,
    )
    .map_err(Error::Datapath)?;
    datapath.start().map_err(Error::Datapath)?;
    tracing::info!(
        socket = %config.socket.display(),
        physical_qps = config.physical_qps,
        tenants = config.tenants.len(),
        "hostd serving"
    );
    Server::new(config.clone(), datapath).serve(&listener);
    Ok(())
}

/// Renders an error and its sources as one line: `outer: inner: ...`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
