//! vdev's link to hostd, the host's NIC: registration, memory, keys and QP
//! connections over the control channel, and the physical queues hostd
//! granted (shared-memory rings with eventfd doorbells).

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, Weak};

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::channel::{Channel, ChannelError};
use vrdma_hostd_protocol::messages::{
    MrRegistration, Notification, QpConnection, QueueGrant, Request, Response, TenantPolicy,
    PROTOCOL_VERSION,
};
use vrdma_hostd_protocol::shm::{QueueLayout, SharedMapping, ShmError};
use vrdma_tenant_policy::PriorityClass;

use crate::seccomp::{Role, Threads};

/// Why talking to hostd failed.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error("Cannot reach hostd at {path}")]
    Connect {
        path: String,
        #[source]
        source: ChannelError,
    },
    #[error("hostd channel failed")]
    Channel(#[from] ChannelError),
    #[error("hostd refused: {reason}")]
    Refused { errno: i32, reason: String },
    #[error("hostd answered {0:?} where another answer was expected")]
    Unexpected(Box<Response>),
    #[error("hostd sent {got} descriptors, {want} expected")]
    Descriptors { got: usize, want: usize },
    #[error("Cannot map a physical queue")]
    Queue(#[source] ShmError),
}

impl FabricError {
    /// The errno to hand a verb's caller.
    pub fn errno(&self) -> i32 {
        match self {
            FabricError::Refused { errno, .. } => *errno,
            _ => libc::EIO,
        }
    }
}

/// One physical QP granted by hostd.
#[derive(Debug)]
pub struct PhysQueue {
    pub grant: QueueGrant,
    pub layout: QueueLayout,
    pub mem: SharedMapping,
}

/// A registered vdev on hostd.
#[derive(Debug)]
pub struct Fabric {
    channel: Mutex<Channel>,
    /// The LID hostd assigned this device.
    pub lid: u16,
    pub queues: Vec<PhysQueue>,
    /// Written after posting work while hostd's datapath sleeps.
    pub doorbell: EventFd,
    /// hostd writes it after completing work while vdev's datapath sleeps.
    pub completions: EventFd,
    /// The tenant's policy as hostd sent it at registration.
    pub policy: TenantPolicy,
    /// hostd's notifications (policy reloads); taken by the listener thread.
    notifications: Mutex<Option<Channel>>,
    /// The tenant's priority class as hostd last said (at registration,
    /// then in policy reloads); the datapath thread's CPU priority follows.
    class: AtomicU8,
}

impl Fabric {
    /// Connects to hostd and registers this device.
    pub fn connect(path: &Path, tenant: &str, device: &str) -> Result<Self, FabricError> {
        let channel = Channel::connect(path).map_err(|source| FabricError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            tenant: tenant.into(),
            device: device.into(),
        };
        let (response, mut files): (Response, Vec<File>) = channel.call(&hello, &[])?;
        let welcome = match response {
            Response::Welcome(w) => *w,
            Response::Refused { errno, reason } => {
                return Err(FabricError::Refused { errno, reason })
            }
            other => return Err(FabricError::Unexpected(Box::new(other))),
        };
        let want = welcome.queues.len() + 3;
        if files.len() != want {
            return Err(FabricError::Descriptors {
                got: files.len(),
                want,
            });
        }
        let notifications = files
            .pop()
            .map(|f| Channel::from(std::os::fd::OwnedFd::from(f)));
        let completions = eventfd_from(files.pop());
        let doorbell = eventfd_from(files.pop());
        let (Some(doorbell), Some(completions)) = (doorbell, completions) else {
            return Err(FabricError::Descriptors { got: 0, want });
        };
        let mut queues = Vec::new();
        for (grant, file) in welcome.queues.iter().zip(files) {
            let layout = QueueLayout::new(grant.sq_depth, grant.cq_depth);
            let mem =
                SharedMapping::map(file, 0, layout.bytes() as u64).map_err(FabricError::Queue)?;
            queues.push(PhysQueue {
                grant: *grant,
                layout,
                mem,
            });
        }
        Ok(Fabric {
            channel: Mutex::new(channel),
            lid: welcome.lid,
            queues,
            doorbell,
            completions,
            class: AtomicU8::new(welcome.policy.priority.class as u8),
            policy: welcome.policy,
            notifications: Mutex::new(notifications),
        })
    }

    /// The tenant's priority class now.
    pub fn priority_class(&self) -> PriorityClass {
        match self.class.load(Ordering::Relaxed) {
            c if c == PriorityClass::Realtime as u8 => PriorityClass::Realtime,
            c if c == PriorityClass::Priority as u8 => PriorityClass::Priority,
            _ => PriorityClass::Normal,
        }
    }

    /// Sends a request (with `fds`) and expects `Ok`.
    fn call(&self, request: &Request, fds: &[RawFd]) -> Result<(), FabricError> {
        let channel = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        let (response, _files): (Response, Vec<File>) = channel.call(request, fds)?;
        match response {
            Response::Ok => Ok(()),
            Response::Refused { errno, reason } => Err(FabricError::Refused { errno, reason }),
            other => Err(FabricError::Unexpected(Box::new(other))),
        }
    }

    /// Ends the registration: hostd sees the channel close and tears the
    /// device down, and closes the notification channel, which ends the
    /// policy listener. Needed because the listener holds the device, and
    /// with it this fabric, until then: dropping references alone would
    /// never close the channel.
    pub fn close(&self) {
        self.channel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .shutdown();
    }

    /// Takes the notification channel (once), for the thread that listens.
    pub fn take_notifications(&self) -> Option<Channel> {
        self.notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Tells hostd a verb was refused for the tenant's quota `quota`.
    pub fn quota_rejected(&self, quota: &str) -> Result<(), FabricError> {
        self.call(
            &Request::QuotaRejected {
                quota: quota.into(),
            },
            &[],
        )
    }

    pub fn add_memory(
        &self,
        slot: u32,
        gpa: u64,
        len: u64,
        file: &File,
        file_offset: u64,
    ) -> Result<(), FabricError> {
        self.call(
            &Request::AddMemory {
                slot,
                gpa,
                len,
                file_offset,
            },
            &[file.as_raw_fd()],
        )
    }

    pub fn remove_memory(&self, slot: u32) -> Result<(), FabricError> {
        self.call(&Request::RemoveMemory { slot }, &[])
    }

    pub fn register_mr(&self, reg: MrRegistration) -> Result<(), FabricError> {
        self.call(&Request::RegisterMr(reg), &[])
    }

    pub fn deregister_mr(&self, lkey: u32) -> Result<(), FabricError> {
        self.call(&Request::DeregisterMr { lkey }, &[])
    }

    pub fn create_qp(&self, vqpn: u32, pd: u32, pqp: u32) -> Result<(), FabricError> {
        self.call(&Request::CreateQp { vqpn, pd, pqp }, &[])
    }

    pub fn connect_qp(&self, connection: QpConnection) -> Result<(), FabricError> {
        self.call(&Request::ConnectQp(connection), &[])
    }

    pub fn set_qp_access(&self, vqpn: u32, access: u32) -> Result<(), FabricError> {
        self.call(&Request::SetQpAccess { vqpn, access }, &[])
    }

    pub fn error_qp(&self, vqpn: u32) -> Result<(), FabricError> {
        self.call(&Request::ErrorQp { vqpn }, &[])
    }

    pub fn reset_qp(&self, vqpn: u32) -> Result<(), FabricError> {
        self.call(&Request::ResetQp { vqpn }, &[])
    }

    pub fn destroy_qp(&self, vqpn: u32) -> Result<(), FabricError> {
        self.call(&Request::DestroyQp { vqpn }, &[])
    }

    /// The physical QP a virtual QP is multiplexed onto: spread by QPN so
    /// that each virtual QP always uses the same one (which keeps its work
    /// in order).
    pub fn pqp_index_for(&self, vqpn: u32) -> usize {
        (vqpn as usize) % self.queues.len().max(1)
    }
}

fn eventfd_from(file: Option<File>) -> Option<EventFd> {
    use std::os::fd::{FromRawFd, IntoRawFd};
    // SAFETY: the descriptor came from hostd as an eventfd and is ours now;
    // EventFd takes ownership of it.
    file.map(|f| unsafe { EventFd::from_raw_fd(f.into_raw_fd()) })
}

/// Starts the thread that applies hostd's policy notifications to `device`
/// until hostd closes the channel (the device's registration ended), under
/// the policy listener's filter.
///
/// The thread holds the device and the registration weakly: hostd closes
/// the channel only after the registration's connection closes, which
/// happens when the last `Fabric` goes — a strong reference here would keep
/// it open, and hostd would refuse this device's next registration (the
/// next frontend's) as still connected.
pub fn listen_for_policy(
    channel: Channel,
    device: Weak<Mutex<crate::verbs::RdmaDevice>>,
    fabric: Weak<Fabric>,
    threads: &Threads,
) -> std::io::Result<()> {
    threads.spawn(Role::PolicyListener, "policy-listener", move || loop {
        match channel.recv::<Notification>() {
            Ok((Notification::Policy(policy), _fds)) => {
                let (Some(fabric), Some(device)) = (fabric.upgrade(), device.upgrade()) else {
                    // The registration is being torn down.
                    return;
                };
                fabric
                    .class
                    .store(policy.priority.class as u8, Ordering::Relaxed);
                let mut device = device.lock().unwrap_or_else(|p| p.into_inner());
                device.set_policy_quotas(policy.quotas);
            }
            Err(ChannelError::Closed) => return,
            Err(e) => {
                tracing::warn!(error = %e, "Bad notification from hostd; no longer listening");
                return;
            }
        }
    })?;
    Ok(())
}
