//! The device's notification plumbing: its doorbell page (`SET_DOORBELL`),
//! the event rings of its completion vectors (`CREATE_EQ`) and the QPs'
//! doorbell indices.
//!
//! hostd reads the page and the rings and owns the eventfds from then on:
//! it sleeps on the doorbell virtqueue's kick and interrupts the driver
//! through an event virtqueue's call. vdev checks what the driver asks for,
//! records it and hands hostd the addresses with the eventfds. Where the
//! eventfds come from (the virtqueues) sits behind [`NotifyFds`], so this
//! layer knows nothing of virtqueues.

use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;

use vm_memory::{Bytes, GuestAddress};
use vrdma_spec::zerocopy::IntoBytes;

use vrdma_spec::control::{CreateEqReq, SetDoorbellReq};
use vrdma_spec::limits::MAX_QPS;
use vrdma_spec::ring::{self, doorbell};

use super::{RdmaDevice, VerbError, VerbResult};

/// The eventfds the device's notifications travel on, lent by whoever
/// holds them (the vhost-user backend's virtqueues). Each call returns a
/// new descriptor of the same eventfd, for hostd to own.
pub trait NotifyFds: Send + Sync + std::fmt::Debug {
    /// The eventfd the driver notifies the doorbell virtqueue with.
    fn doorbell_kick(&self) -> Result<OwnedFd, FdError>;
    /// The eventfd that interrupts the driver for completion vector
    /// `vector`.
    fn vector_call(&self, vector: u32) -> Result<OwnedFd, FdError>;
}

/// Why an eventfd of the device cannot be lent.
#[derive(Debug, thiserror::Error)]
pub enum FdError {
    /// The frontend never gave the virtqueue that eventfd (or took it back).
    #[error("The frontend has set no {kind} eventfd on virtqueue {queue}")]
    Missing { kind: &'static str, queue: u32 },
    #[error("Cannot duplicate the {kind} eventfd of virtqueue {queue}")]
    Dup {
        kind: &'static str,
        queue: u32,
        #[source]
        source: io::Error,
    },
}

impl FdError {
    /// The errno to answer: a missing eventfd is the frontend's setup
    /// error (`EINVAL`); running out of descriptors is a resource limit.
    pub fn errno(&self) -> i32 {
        match self {
            FdError::Missing { .. } => libc::EINVAL,
            FdError::Dup { .. } => libc::ENOMEM,
        }
    }
}

/// Why vdev could not post an event itself.
#[derive(Debug, thiserror::Error)]
pub(super) enum PostError {
    #[error("completion vector {0} has no event ring")]
    NoRing(u32),
    #[error("the event ring is outside guest memory")]
    Memory,
    #[error("no interrupt eventfd")]
    Fd(#[from] VerbError),
    #[error("cannot interrupt the driver")]
    Interrupt(#[source] io::Error),
}

/// An event ring of one completion vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRing {
    pub ring_addr: u64,
    pub depth: u32,
}

/// The doorbell indices of live QPs. The lowest free index is handed out,
/// so the QPs' bits stay dense at the start of the page and the device
/// scans few summary words.
#[derive(Debug, Default)]
pub struct DbIndexes {
    words: Vec<u64>,
}

impl DbIndexes {
    /// The lowest free index, now taken; `None` when all [`MAX_QPS`] are.
    pub fn alloc(&mut self) -> Option<u32> {
        let word = match self.words.iter().position(|&w| w != u64::MAX) {
            Some(word) => word,
            None if self.words.len() < doorbell::BITMAP_WORDS => {
                self.words.push(0);
                self.words.len() - 1
            }
            None => return None,
        };
        let bit = self.words[word].trailing_ones();
        self.words[word] |= 1 << bit;
        let index = word as u32 * 64 + bit;
        debug_assert!(index < MAX_QPS);
        Some(index)
    }

    /// Takes `index` (a QP taken over from a journal); false if it is
    /// taken or beyond the page.
    pub fn claim(&mut self, index: u32) -> bool {
        if index >= MAX_QPS {
            return false;
        }
        let word = index as usize / 64;
        if self.words.len() <= word {
            self.words.resize(word + 1, 0);
        }
        let bit = 1u64 << (index % 64);
        if self.words[word] & bit != 0 {
            return false;
        }
        self.words[word] |= bit;
        true
    }

    /// Gives `index` back.
    pub fn free(&mut self, index: u32) {
        if let Some(word) = self.words.get_mut(index as usize / 64) {
            *word &= !(1u64 << (index % 64));
        }
    }

    /// Gives every index back.
    pub fn clear(&mut self) {
        self.words.clear();
    }
}

impl RdmaDevice {
    /// `SET_DOORBELL`: once per driver, before the first QP.
    pub(super) fn set_doorbell(&mut self, req: &SetDoorbellReq) -> VerbResult<()> {
        let addr = req.addr.get();
        if let Some(current) = self.doorbell {
            return Err(VerbError::Exists(format!(
                "the doorbell page is already at {current:#x}"
            )));
        }
        self.check_ring(addr, doorbell::PAGE_SIZE)?;
        let kick = match &self.fabric {
            Some(_) => Some(self.lend_fd("SET_DOORBELL", |fds| fds.doorbell_kick())?),
            None => None,
        };
        // The device's line of the page starts clear (no NEED_KICK): the
        // page may hold a previous driver's bytes.
        self.clear_device_line(addr + doorbell::FLAGS_OFFSET)?;
        if let (Some(fabric), Some(kick)) = (&self.fabric, &kick) {
            fabric
                .set_doorbell(addr, kick.as_fd())
                .map_err(VerbError::Fabric)?;
        }
        self.doorbell = Some(addr);
        tracing::debug!(tenant = %self.tenant(), addr = format_args!("{addr:#x}"), "Doorbell page set");
        Ok(())
    }

    /// `CREATE_EQ`: the event ring of one completion vector, once.
    pub(super) fn create_eq(&mut self, req: &CreateEqReq) -> VerbResult<()> {
        let (vector, depth, addr) = (req.vector.get(), req.depth.get(), req.ring_addr.get());
        self.check_vector(vector)?;
        if self.eqs.contains_key(&vector) {
            return Err(VerbError::Exists(format!(
                "completion vector {vector} already has an event ring"
            )));
        }
        if !ring::valid_depth(depth) {
            return Err(VerbError::Invalid(format!(
                "event ring depth {depth} (a power of two up to {})",
                ring::MAX_RING_DEPTH
            )));
        }
        self.check_ring(addr, ring::event_ring_bytes(depth))?;
        let call = match &self.fabric {
            Some(_) => Some(self.lend_fd("CREATE_EQ", |fds| fds.vector_call(vector))?),
            None => None,
        };
        self.reset_ring(addr)?;
        if let (Some(fabric), Some(call)) = (&self.fabric, &call) {
            fabric
                .create_eq(vector, (addr, depth), call.as_fd(), false)
                .map_err(VerbError::Fabric)?;
        }
        self.eqs.insert(
            vector,
            EventRing {
                ring_addr: addr,
                depth,
            },
        );
        Ok(())
    }

    /// Writes an event on `vector`'s ring and interrupts the driver, as the
    /// device's datapath would; only while the datapath is detached.
    pub(super) fn post_event(&self, vector: u32, kind: u16, object: u32) -> Result<(), PostError> {
        let eq = self.event_ring(vector).ok_or(PostError::NoRing(vector))?;
        let at = |offset: u64| GuestAddress(eq.ring_addr + offset);
        let load = |offset| {
            self.mem
                .load::<u32>(at(offset), Ordering::Acquire)
                .map(u32::from_le)
                .map_err(|_| PostError::Memory)
        };
        let producer = load(ring::DEVICE_INDEX_OFFSET)?;
        let consumer = load(ring::DRIVER_INDEX_OFFSET)?;
        if producer.wrapping_sub(consumer) >= eq.depth {
            // Full (or a driver index that makes no sense): the event is
            // lost, as the datapath reports it.
            self.flag_ring_error(eq.ring_addr)
                .map_err(|_| PostError::Memory)?;
        } else {
            let event = ring::Event {
                kind: kind.into(),
                object: object.into(),
                ..ring::Event::default()
            };
            self.mem
                .write_slice(
                    event.as_bytes(),
                    at(ring::event_entry_offset(producer, eq.depth)),
                )
                .map_err(|_| PostError::Memory)?;
            self.mem
                .store(
                    producer.wrapping_add(1).to_le(),
                    at(ring::DEVICE_INDEX_OFFSET),
                    Ordering::Release,
                )
                .map_err(|_| PostError::Memory)?;
        }
        let call = self.lend_fd("event", |fds| fds.vector_call(vector))?;
        std::fs::File::from(call)
            .write_all(&1u64.to_ne_bytes())
            .map_err(PostError::Interrupt)
    }

    /// An eventfd of the device for hostd; a missing one is logged, since
    /// it is the frontend's (the VMM's) mistake rather than the driver's.
    pub(super) fn lend_fd(
        &self,
        command: &'static str,
        lend: impl FnOnce(&dyn NotifyFds) -> Result<OwnedFd, FdError>,
    ) -> VerbResult<OwnedFd> {
        let result = match &self.notify_fds {
            Some(fds) => lend(fds.as_ref()),
            None => lend(&NoFds),
        };
        result.map_err(|e| {
            tracing::warn!(tenant = %self.tenant(), command, error = %vrdma_errors::error_chain(&e),
                "Refused: hostd cannot be given the eventfd it needs");
            VerbError::Notify(e)
        })
    }

    /// The doorbell page, if the driver gave one.
    pub fn doorbell(&self) -> Option<u64> {
        self.doorbell
    }

    /// The event ring of completion vector `vector`, if the driver gave one.
    pub fn event_ring(&self, vector: u32) -> Option<EventRing> {
        self.eqs.get(&vector).copied()
    }

    /// Checks `vector` names one of the device's completion vectors.
    pub(super) fn check_vector(&self, vector: u32) -> VerbResult<()> {
        if vector >= u32::from(self.identity.comp_vectors) {
            return Err(VerbError::Invalid(format!(
                "completion vector {vector} (device has {})",
                self.identity.comp_vectors
            )));
        }
        Ok(())
    }
}

/// The eventfds of a device that has none (attached to hostd without a
/// transport: cannot happen through [`RdmaDevice::with_fabric`]).
#[derive(Debug)]
struct NoFds;

impl NotifyFds for NoFds {
    fn doorbell_kick(&self) -> Result<OwnedFd, FdError> {
        Err(FdError::Missing {
            kind: "kick",
            queue: u32::from(vrdma_spec::DOORBELL_QUEUE),
        })
    }

    fn vector_call(&self, vector: u32) -> Result<OwnedFd, FdError> {
        Err(FdError::Missing {
            kind: "call",
            queue: u32::from(vrdma_spec::FIRST_EVENT_QUEUE).saturating_add(vector),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doorbell_indices_are_dense_and_reused() {
        let mut ids = DbIndexes::default();
        let first: Vec<u32> = (0..130).map(|_| ids.alloc().expect("free")).collect();
        assert_eq!(first, (0..130).collect::<Vec<_>>());
        ids.free(5);
        ids.free(70);
        assert_eq!(ids.alloc(), Some(5), "the lowest free index first");
        assert_eq!(ids.alloc(), Some(70));
        assert_eq!(ids.alloc(), Some(130));
        ids.free(MAX_QPS + 7);
        ids.clear();
        assert_eq!(ids.alloc(), Some(0));
    }

    #[test]
    fn doorbell_indices_end_at_max_qps() {
        let mut ids = DbIndexes::default();
        for expected in 0..MAX_QPS {
            assert_eq!(ids.alloc(), Some(expected));
        }
        assert_eq!(ids.alloc(), None, "every bit of the page is taken");
        ids.free(MAX_QPS - 1);
        assert_eq!(ids.alloc(), Some(MAX_QPS - 1));
        assert!(
            doorbell::bit(MAX_QPS - 1).is_some(),
            "the last index has a bit"
        );
    }
}
