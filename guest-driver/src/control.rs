//! The control queue: verbs commands, one at a time.
//!
//! A command is one chain (request header and payload, then room for the
//! response header and payload, [`vrdma_spec::control`]) in buffers the
//! queue owns. The driver waits for its answer by spinning briefly, then
//! on the queue's interrupt. When a command fails without an answer (a
//! timeout, a broken transport) the device may still write the buffers, so
//! the queue is never used again.

use std::sync::Arc;
use std::time::Instant;

use vrdma_spec::control::{Opcode, RequestHeader, ResponseHeader};
use vrdma_spec::{CONTROL_QUEUE, MAX_CONTROL_MSG};
use zerocopy::{FromBytes, IntoBytes};

use crate::device::DeviceOptions;
use crate::dma::{DmaArena, DmaBuf};
use crate::error::{Error, Result};
use crate::transport::Transport;
use crate::virtqueue::SplitQueue;

/// The control queue with its request and response buffers.
#[derive(Debug)]
pub(crate) struct ControlQueue {
    vq: SplitQueue,
    request: DmaBuf,
    response: DmaBuf,
    /// Set when a command's buffers may still be in the device's hands.
    broken: bool,
}

impl ControlQueue {
    /// The control queue `vq`, with its buffers from `arena`.
    pub(crate) fn new(vq: SplitQueue, arena: &Arc<DmaArena>) -> Result<Self> {
        Ok(Self {
            vq,
            request: arena.alloc_zeroed(MAX_CONTROL_MSG, 64)?,
            response: arena.alloc_zeroed(MAX_CONTROL_MSG, 64)?,
            broken: false,
        })
    }

    /// Runs one command: `request` is the request payload, `response`
    /// receives the response payload (exactly its length is required).
    pub(crate) fn run(
        &mut self,
        transport: &dyn Transport,
        options: &DeviceOptions,
        opcode: Opcode,
        request: &[u8],
        response: &mut [u8],
    ) -> Result<()> {
        let req_len = core::mem::size_of::<RequestHeader>() + request.len();
        let resp_len = core::mem::size_of::<ResponseHeader>() + response.len();
        if req_len > MAX_CONTROL_MSG || resp_len > MAX_CONTROL_MSG {
            return Err(Error::InvalidArgument("control message too large"));
        }
        if self.broken {
            return Err(Error::ControlBroken);
        }
        let header = RequestHeader {
            opcode: u16::from(opcode).into(),
            flags: 0.into(),
            // Bounded by MAX_CONTROL_MSG above.
            payload_len: (request.len() as u32).into(),
        };
        self.request.write_at(0, header.as_bytes());
        self.request.write_at(header.as_bytes().len(), request);
        // A stale header must not pass for this command's answer.
        self.response
            .write_at(0, ResponseHeader::default().as_bytes());
        let chain = (
            (self.request.device_addr(), req_len as u32),
            (self.response.device_addr(), resp_len as u32),
        );
        let head = self.vq.add_chain(&[chain.0], &[chain.1])?;
        let notify = self.vq.should_notify();
        let result = if notify {
            transport.notify(CONTROL_QUEUE).map_err(Error::from)
        } else {
            Ok(())
        }
        .and_then(|()| self.wait_used(transport, options));
        let (used_head, used_len) = match result {
            Ok(used) => used,
            Err(e) => {
                // The device may still write the buffers: never reuse them.
                self.broken = true;
                return Err(e);
            }
        };
        if used_head != head {
            self.broken = true;
            return Err(Error::Protocol("control queue returned another chain"));
        }
        let header_len = core::mem::size_of::<ResponseHeader>();
        if (used_len as usize) < header_len {
            return Err(Error::Protocol("control response shorter than its header"));
        }
        let mut raw = [0u8; core::mem::size_of::<ResponseHeader>()];
        self.response.read_at(0, &mut raw);
        let header = ResponseHeader::read_from_bytes(&raw)
            .map_err(|_| Error::Protocol("control response header"))?;
        let status = header.status.get();
        if status != 0 {
            tracing::debug!(?opcode, status, "Device refused a control command");
            return Err(match i32::try_from(status) {
                Ok(errno) if errno < 4096 => Error::Device(errno),
                _ => Error::Protocol("control status is not an errno"),
            });
        }
        if (header.payload_len.get() as usize) < response.len()
            || (used_len as usize) < header_len + response.len()
        {
            return Err(Error::Protocol("control response payload too short"));
        }
        self.response.read_at(header_len, response);
        Ok(())
    }

    /// Waits for the next used entry of the queue: spin briefly, then sleep on the
    /// queue's interrupt (up to the control timeout).
    fn wait_used(
        &mut self,
        transport: &dyn Transport,
        options: &DeviceOptions,
    ) -> Result<(u16, u32)> {
        let vq = &mut self.vq;
        let start = Instant::now();
        loop {
            if let Some(used) = vq.pop_used()? {
                return Ok(used);
            }
            if start.elapsed() >= options.spin {
                break;
            }
            std::hint::spin_loop();
        }
        let deadline = start + options.control_timeout;
        loop {
            if !vq.enable_interrupts() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Timeout(options.control_timeout));
                }
                transport.wait(CONTROL_QUEUE, Some(left))?;
            }
            if let Some(used) = vq.pop_used()? {
                return Ok(used);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vrdma_spec::control::Opcode;
    use vrdma_spec::CONTROL_QUEUE;
    use zerocopy::{FromZeros, IntoBytes};

    use crate::device::Device;
    use crate::error::Error;
    use crate::testing::{config, options, Reply, StubTransport, FEATURES};

    #[test]
    fn unanswered_command_times_out_and_breaks_the_control_queue() {
        let stub = Arc::new(StubTransport::with_config(&config(1, 64), FEATURES));
        let dev = Device::open(Box::new(Arc::clone(&stub)), options()).unwrap();
        let err = dev.command_no_reply(Opcode::AllocPd, &[]).unwrap_err();
        assert!(matches!(err, Error::Timeout(_)), "{err}");
        assert_eq!(err.errno(), libc::ETIMEDOUT);
        assert!(stub.notified.lock().unwrap().contains(&CONTROL_QUEUE));
        // The buffers may still be the device's: no further command is sent.
        let err = dev.command_no_reply(Opcode::AllocPd, &[]).unwrap_err();
        assert!(matches!(err, Error::ControlBroken));
    }

    #[test]
    fn command_chain_carries_header_request_and_response_room() {
        use vrdma_spec::config::PortAttr;
        use vrdma_spec::control::QueryPortReq;

        let mut port = PortAttr::new_zeroed();
        port.lid = 0x1234.into();
        let stub = Arc::new(
            StubTransport::with_config(&config(1, 64), FEATURES).answering(move |op, _| match op {
                Opcode::QueryPort => Reply::of(&port),
                _ => Reply::Silent,
            }),
        );
        let dev = Device::open(Box::new(Arc::clone(&stub)), options()).unwrap();
        let req = QueryPortReq {
            port_num: 1,
            ..Default::default()
        };
        let got: PortAttr = dev.command(Opcode::QueryPort, req.as_bytes()).unwrap();
        assert_eq!(got.lid.get(), 0x1234);
        // The device read the header and the request, and had room for
        // the header and the response.
        let (opcode, payload) = stub.commands.lock().unwrap().last().unwrap().clone();
        assert_eq!(
            (opcode, payload.as_slice()),
            (Opcode::QueryPort, req.as_bytes())
        );
        assert_eq!(
            *stub.chains.lock().unwrap().last().unwrap(),
            (8 + 8, 8 + core::mem::size_of::<PortAttr>())
        );
        // A refusal is the device's errno, and the queue stays usable.
        let stub = Arc::new(
            StubTransport::with_config(&config(1, 64), FEATURES)
                .answering(|_, _| Reply::Errno(libc::EBUSY as u32)),
        );
        let dev = Device::open(Box::new(Arc::clone(&stub)), options()).unwrap();
        for _ in 0..3 {
            let err = dev
                .command_no_reply(Opcode::DeallocPd, &[0; 8])
                .unwrap_err();
            assert_eq!(err.errno(), libc::EBUSY);
        }
    }
}
