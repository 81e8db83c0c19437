//! The device's link to hostd across hostd's restarts.
//!
//! When hostd goes away every context's registration ends: each context's
//! policy listener takes its port down ([`crate::verbs::RdmaDevice::port_lost`])
//! and tells the main thread, which keeps trying to register the contexts
//! again — every 50 ms at first, the pause doubling up to 1 s, for as long
//! as it takes. Once hostd answers, each context registers again (the
//! first to arrive registers the device, the others join it, as at
//! start-up), gets its objects back onto hostd
//! ([`crate::verbs::RdmaDevice::restore`]) and its port ACTIVE, and its
//! listener starts on the new notification channel. Each change of the
//! link's state is logged once, with the tenant.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::backend::VrdmaBackend;
use crate::fabric::FabricError;
use crate::seccomp::Threads;

/// The first pause before registering again.
pub const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between two tries.
pub const LONGEST_PAUSE: Duration = Duration::from_secs(1);

/// When to try something again that keeps failing: after `first`, then
/// after a pause that doubles up to [`LONGEST_PAUSE`].
#[derive(Debug)]
pub struct Backoff {
    first: Duration,
    pause: Duration,
    next_try: Option<Instant>,
}

impl Backoff {
    /// No try under way yet.
    pub fn new(first: Duration) -> Self {
        Backoff {
            first,
            pause: first,
            next_try: None,
        }
    }

    /// Tries begin: the first after `first`.
    pub fn start(&mut self) {
        self.pause = self.first;
        self.next_try = Some(Instant::now() + self.first);
    }

    /// Tries begin with one now (then as after [`Backoff::start`]).
    pub fn start_now(&mut self) {
        self.pause = self.first;
        self.next_try = Some(Instant::now());
    }

    /// A try failed: the next after twice the last pause (at most
    /// [`LONGEST_PAUSE`]).
    pub fn failed(&mut self) {
        self.pause = (self.pause * 2).min(LONGEST_PAUSE);
        self.next_try = Some(Instant::now() + self.pause);
    }

    /// A try failed: the first of a series ([`Backoff::start`]) or one more
    /// ([`Backoff::failed`]).
    pub fn retry_later(&mut self) {
        if self.next_try.is_none() {
            self.start();
        } else {
            self.failed();
        }
    }

    /// Nothing to try again.
    pub fn stop(&mut self) {
        self.next_try = None;
    }

    /// How long until the next try, if one is due.
    pub fn wait(&self) -> Option<Duration> {
        self.next_try
            .map(|at| at.saturating_duration_since(Instant::now()))
    }
}

/// The contexts whose registration with hostd was lost, and when to try
/// again.
#[derive(Debug)]
pub struct Link {
    tenant: String,
    down: BTreeSet<u64>,
    backoff: Backoff,
    /// A try failed since hostd went away (logged once).
    failing: bool,
    /// hostd handed over (the port stayed up) rather than went away, since
    /// then.
    handed_over: Option<Instant>,
}

/// How long contexts wait, their port up, for the hostd that took over:
/// past it (it died, or never served) hostd counts as gone — the ports go
/// down and the QPs are flushed, as after any hostd failure.
pub const HANDOVER_PATIENCE: Duration = Duration::from_secs(2);

impl Link {
    pub fn new(tenant: &str) -> Self {
        Link {
            tenant: tenant.to_owned(),
            down: BTreeSet::new(),
            backoff: Backoff::new(FIRST_PAUSE),
            failing: false,
            handed_over: None,
        }
    }

    /// Context `id`'s registration was lost: hostd went away, or handed
    /// over to a new hostd (`handed_over`: the new one is there already,
    /// so the first try is at once).
    pub fn lost(&mut self, id: u64, handed_over: bool) {
        if self.down.is_empty() {
            if handed_over {
                tracing::info!(tenant = %self.tenant,
                    "hostd handed over: registering with the new hostd");
                self.backoff.start_now();
            } else {
                tracing::warn!(tenant = %self.tenant,
                    "hostd went away: the device's port is down; registering again every {} ms \
                     to {} s until hostd is back", FIRST_PAUSE.as_millis(), LONGEST_PAUSE.as_secs());
                self.backoff.start();
            }
            self.failing = false;
            self.handed_over = handed_over.then(Instant::now);
        }
        self.down.insert(id);
    }

    /// Context `id` ended: nothing of it to register again.
    pub fn forget(&mut self, id: u64) {
        self.down.remove(&id);
        if self.down.is_empty() {
            self.backoff.stop();
        }
    }

    /// Whether no context waits for hostd.
    pub fn is_up(&self) -> bool {
        self.down.is_empty()
    }

    /// How long until the next try, if one is due.
    pub fn wait(&self) -> Option<Duration> {
        self.backoff.wait()
    }

    /// Registers the contexts that are down again, in order, each with its
    /// objects and its listener (`listen` starts it); stops at the first
    /// that fails (hostd is not back) and waits longer before the next
    /// try. Returns whether every context is up.
    pub fn retry(
        &mut self,
        backend_of: impl Fn(u64) -> Option<VrdmaBackend>,
        threads: &Threads,
        lost: impl Fn(u64) -> Box<dyn FnOnce() + Send>,
    ) -> bool {
        for id in self.down.clone() {
            let Some(backend) = backend_of(id) else {
                self.forget(id);
                continue;
            };
            match reregister(&backend, threads, lost(id)) {
                Ok(()) => {
                    self.down.remove(&id);
                }
                Err(e) => {
                    if self
                        .handed_over
                        .is_some_and(|t| t.elapsed() > HANDOVER_PATIENCE)
                    {
                        tracing::warn!(tenant = %self.tenant,
                            "The hostd that took over does not serve: the port is down");
                        self.handed_over = None;
                        for id in &self.down {
                            if let Some(backend) = backend_of(*id) {
                                let mut device = backend.device();
                                if let Some(fabric) = device.fabric().cloned() {
                                    fabric.take_handover();
                                }
                                device.port_lost();
                            }
                        }
                    }
                    if !self.failing {
                        tracing::info!(tenant = %self.tenant,
                            "hostd is not back yet ({}); still trying",
                            vrdma_errors::error_chain(&e));
                        self.failing = true;
                    }
                    self.backoff.failed();
                    return false;
                }
            }
        }
        if self.handed_over.take().is_some() {
            tracing::info!(tenant = %self.tenant, "Every context is on the new hostd");
        } else {
            tracing::info!(tenant = %self.tenant, "hostd is back: the device's port is active again");
        }
        self.backoff.stop();
        true
    }
}

/// Registers `backend`'s context with hostd again and gives hostd its
/// objects back, with the device locked throughout so that no verb runs
/// between the new registration and the objects' return; then starts its
/// listener on the new notification channel.
fn reregister(
    backend: &VrdmaBackend,
    threads: &Threads,
    lost: Box<dyn FnOnce() + Send>,
) -> Result<(), FabricError> {
    {
        let mut device = backend.device();
        let Some(fabric) = device.fabric().cloned() else {
            return Ok(());
        };
        let welcome = fabric.reconnect()?;
        let restored = device.restore(&welcome);
        tracing::info!(tenant = %device.tenant(), objects = restored.objects,
            refused = restored.refused, flushed_qps = restored.flushed_qps,
            gid_changed = restored.gid_changed, "Context registered with hostd again");
    }
    if let Err(e) = backend.listen_for_policy(threads, lost) {
        // The port works without it; policy reloads and hostd's next
        // departure go unnoticed by this context.
        tracing::warn!(tenant = %backend.device().tenant(), error = %e,
            "Cannot listen for hostd's notifications again");
    }
    Ok(())
}
