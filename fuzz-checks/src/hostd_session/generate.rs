//! The fuzzed vdev's requests: every kind, with numbers aimed at what the
//! connection holds (its slots, rings, CQs, QPs, keys), at what beta and
//! delta hold, and at nothing, and with right and wrong descriptors.

use vrdma_hostd_protocol::messages::{
    MrRegistration, MrSegment, QpConnection, QpModify, QpSetup, Request, WorkRing, MAX_MESSAGE,
    PROTOCOL_VERSION,
};
use vrdma_spec::gid::loopback_gid;
use vrdma_spec::limits::MAX_QPS;
use vrdma_spec::verbs::access;

use super::{Fd, Session, ALPHA, BETA, BETA_CQN, BETA_DEVICE, BETA_QP, DELTA, DELTA_DEVICE, GAMMA};
use crate::input::Input;

/// A page of guest memory (rings and doorbell pages are aligned to it).
const PAGE: u64 = 4096;

/// What one step of the input sends.
pub(super) enum Step {
    Request(Request, Vec<Fd>),
    /// Bytes as they are.
    Raw(Vec<u8>),
}

impl Session<'_> {
    pub(super) fn gen_hello(&self, input: &mut Input) -> (Request, Vec<Fd>) {
        let kind = input.u8();
        let name = input.u8();
        let good = ["fuzz0", "fuzz1", "fuzz2", "fuzz3"][usize::from(name % 4)];
        let hello = |version: u32, tenant: &str, device: &str| Request::Hello {
            version,
            tenant: tenant.to_owned(),
            device: device.to_owned(),
        };
        let request = match kind % 12 {
            6 => hello(u32::from(name), ALPHA, good),
            7 => {
                let bad = ["", "a b", "../x", "caf\u{e9}", &"a".repeat(65)];
                hello(PROTOCOL_VERSION, ALPHA, bad[usize::from(name) % bad.len()])
            }
            8 => hello(
                PROTOCOL_VERSION,
                ["nobody", "", "ALPHA"][usize::from(name % 3)],
                good,
            ),
            9 => hello(PROTOCOL_VERSION, GAMMA, good),
            10 => {
                let (tenant, device) = if name & 1 == 0 {
                    (BETA, BETA_DEVICE)
                } else {
                    (DELTA, DELTA_DEVICE)
                };
                hello(PROTOCOL_VERSION, tenant, device)
            }
            11 => {
                return (
                    hello(PROTOCOL_VERSION, ALPHA, good),
                    vec![Fd::Sealed(usize::from(name % 4))],
                )
            }
            _ => hello(PROTOCOL_VERSION, ALPHA, good),
        };
        (request, Vec::new())
    }

    /// One request from the input.
    pub(super) fn gen_step(&self, input: &mut Input) -> Step {
        let code = self.steer(input.u8());
        let plain = |request| Step::Request(request, Vec::new());
        match code % 20 {
            0 => self.gen_add_memory(input),
            1 => plain(Request::RemoveMemory {
                slot: self.slot(input),
            }),
            2 | 3 => plain(Request::RegisterMr(self.gen_mr(input))),
            4 => plain(Request::DeregisterMr {
                lkey: self.key(input),
            }),
            5 => Step::Request(
                Request::SetDoorbell {
                    gpa: self.gpa(input),
                },
                self.eventfd_or_not(input),
            ),
            6 => {
                let vector = self.vector(input);
                let gpa = self.gpa(input);
                let depth = self.depth(input);
                let fds = self.eventfd_or_not(input);
                Step::Request(Request::CreateEq { vector, gpa, depth }, fds)
            }
            7 => plain(Request::CreateCq {
                cqn: self.cqn(input),
                gpa: self.gpa(input),
                depth: self.depth(input),
                vector: self.vector(input),
            }),
            8 => plain(Request::DestroyCq {
                cqn: self.cqn(input),
            }),
            9 | 10 => plain(Request::CreateQp(self.gen_qp(input))),
            11 | 12 => plain(Request::ModifyQp(self.gen_modify(input))),
            13 => plain(Request::QueryQp {
                vqpn: self.vqpn(input),
            }),
            14 => plain(Request::DestroyQp {
                vqpn: self.vqpn(input),
            }),
            15 => plain(Request::ResetDevice),
            16 => {
                let b = input.u8();
                let quota = match b % 6 {
                    0 => "max_qp".to_owned(),
                    1 => "max_total_mr_bytes".to_owned(),
                    2 => "bogus".to_owned(),
                    3 => String::new(),
                    4 => "mrs".to_owned(),
                    _ => String::from_utf8_lossy(input.bytes(usize::from(b % 24))).into_owned(),
                };
                plain(Request::QuotaRejected { quota })
            }
            17 => {
                let (request, fds) = self.gen_hello(input);
                Step::Request(request, fds)
            }
            18 => {
                let n = input.u8();
                Step::Raw(if n == 0xff {
                    vec![b' '; MAX_MESSAGE + 1]
                } else {
                    input.bytes(usize::from(n % 96)).to_vec()
                })
            }
            _ => {
                // A request that carries no descriptor, with one.
                let b = input.u8();
                let request = match b % 4 {
                    0 => Request::RemoveMemory { slot: 0 },
                    1 => Request::DestroyQp { vqpn: 1 },
                    2 => Request::ResetDevice,
                    _ => Request::QuotaRejected {
                        quota: "max_qp".into(),
                    },
                };
                let fd = [Fd::Sealed(0), Fd::Unsealed, Fd::Eventfd, Fd::Pipe][usize::from(b % 4)];
                Step::Request(request, vec![fd])
            }
        }
    }

    /// Op code `code`, or one time in four what the connection lacks to
    /// go deeper (memory, then a CQ, then QPs, then transitions), so that
    /// short random inputs reach the states that need several requests.
    fn steer(&self, code: u8) -> u8 {
        if code & 0xc0 != 0xc0 {
            return code;
        }
        let m = &self.model;
        if m.slots.is_empty() {
            0
        } else if m.cqs.is_empty() {
            7
        } else if m.qps.len() < 2 {
            9
        } else {
            11
        }
    }

    fn gen_add_memory(&self, input: &mut Input) -> Step {
        let slot = self.slot(input);
        let b = input.u8();
        // Mostly a sealed memfd of 64 KiB or 1 MiB.
        let fds = match b % 16 {
            0..=5 => vec![Fd::Sealed(1)],
            6..=9 => vec![Fd::Sealed(2)],
            10 => vec![Fd::Sealed(usize::from(b >> 4) % 4)],
            11 => vec![Fd::Unsealed],
            12 => vec![[Fd::Eventfd, Fd::Pipe][usize::from(b >> 7)]],
            13 => Vec::new(),
            _ => vec![Fd::Sealed(0), Fd::Sealed(1)],
        };
        let size = match fds.first() {
            Some(Fd::Sealed(i)) => super::MEMFD_SIZES[*i],
            _ => 64 * 1024,
        };
        let file_offset = match input.u8() % 8 {
            0..=4 => 0,
            5 => 64 * 1024,
            6 => 4096 * u64::from(input.u8() % 16),
            _ => u64::from(input.u16()),
        };
        let len = match input.u8() % 8 {
            0..=3 => size.saturating_sub(file_offset),
            4 => 4096,
            5 => size + 4096,
            6 => 0,
            _ => input.u64(),
        };
        // Slots side by side, overlapping, at the top of the address space.
        let gpa = match input.u8() % 8 {
            0..=3 => 0x10_0000 * u64::from(input.u8() % 8),
            4 => 0x10_0000 + u64::from(input.u16()) * PAGE,
            5 => u64::MAX - len.wrapping_sub(1),
            6 => u64::MAX - u64::from(input.u16()),
            _ => input.u64(),
        };
        let request = Request::AddMemory {
            slot,
            gpa,
            len,
            file_offset,
        };
        Step::Request(request, fds)
    }

    fn gen_mr(&self, input: &mut Input) -> MrRegistration {
        let pd = u32::from(input.u8() % 4);
        let access = self.mr_access(input);
        let iova = if input.bool() {
            input.u64()
        } else {
            u64::from(input.u16()) << 12
        };
        let n = usize::from(input.u8() % 5);
        let segments: Vec<MrSegment> = (0..n).map(|_| self.segment(input)).collect();
        let sum = segments
            .iter()
            .try_fold(0u64, |acc, s| acc.checked_add(s.len));
        let len = match (input.u8() % 6, sum) {
            (0, Some(s)) => s.wrapping_add(1),
            (1, Some(s)) => s.wrapping_sub(1),
            (2, _) | (_, None) => input.u64(),
            (_, Some(s)) => s,
        };
        MrRegistration {
            pd,
            access,
            iova,
            len,
            segments,
        }
    }

    fn gen_qp(&self, input: &mut Input) -> QpSetup {
        let vqpn = self.vqpn(input);
        let db_index = match input.u8() % 16 {
            0..=11 => u32::from(input.u8() % 4),
            12 => MAX_QPS - 1,
            13 => MAX_QPS,
            _ => input.u32(),
        };
        let send_cqn = self.cqn(input);
        let recv_cqn = if input.u8().is_multiple_of(4) {
            self.cqn(input)
        } else {
            send_cqn
        };
        let ring = |input: &mut Input| WorkRing {
            gpa: self.gpa(input),
            depth: self.depth(input),
            stride: match input.u8() % 8 {
                6 => 32,
                7 => input.u32(),
                b => 64 << b,
            },
        };
        let sq = ring(input);
        let rq = ring(input);
        QpSetup {
            vqpn,
            pd: u32::from(input.u8() % 4),
            db_index,
            send_cqn,
            recv_cqn,
            sq_sig_all: input.bool(),
            sq,
            rq,
            max_send_sge: u32::from(input.u8()),
            max_recv_sge: u32::from(input.u8()),
            max_inline_data: u32::from(input.u16()),
            srqn: None,
            qp_type: 2,
        }
    }

    fn gen_modify(&self, input: &mut Input) -> QpModify {
        let vqpn = self.vqpn(input);
        let state = match input.u8() % 10 {
            7 => 7,
            8 => input.u8(),
            b => b % 7,
        };
        let connection = input.bool().then(|| QpConnection {
            dgid: self.gid(input),
            // A LID-addressed peer: this hostd's ports are Ethernet.
            dlid: input.u8().is_multiple_of(8).then(|| input.u16()),
            dest_qpn: match input.u8() % 5 {
                0 => 0x0100_0000,
                1 => input.u32(),
                2 => BETA_QP,
                _ => u32::from(input.u8() % 4) + 1,
            },
            flow_label: if input.u8().is_multiple_of(16) {
                0x0010_0000
            } else {
                input.u32() & 0x000f_ffff
            },
            hop_limit: input.u8(),
            traffic_class: input.u8(),
            access: self.qp_access(input),
            rnr_retry: input.u8() % 9,
            retry_cnt: input.u8() % 9,
            min_rnr_timer: input.u8() % 33,
            timeout: input.u8() % 33,
            path_mtu: [256, 1024, 4096, 4096, 0, 1000, 8192][usize::from(input.u8() % 7)],
            sq_psn: self.psn(input),
            rq_psn: self.psn(input),
            max_rd_atomic: input.u8(),
            max_dest_rd_atomic: input.u8(),
        });
        let access = input.u8().is_multiple_of(4).then(|| self.qp_access(input));
        QpModify {
            vqpn,
            state,
            connection,
            access,
            qkey: None,
        }
    }

    /// An eventfd (as SetDoorbell and CreateEq need), mostly; else none,
    /// two, or a file that is no eventfd.
    fn eventfd_or_not(&self, input: &mut Input) -> Vec<Fd> {
        match input.u8() % 12 {
            0 => Vec::new(),
            1 => vec![Fd::Eventfd, Fd::Eventfd],
            2 => vec![Fd::Sealed(1)],
            3 => vec![Fd::Unsealed],
            4 => vec![Fd::Pipe],
            _ => vec![Fd::Eventfd],
        }
    }

    fn slot(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b {
            0xff => 1024,
            0xfe => 1023,
            _ if b % 8 == 7 => input.u32(),
            _ => u32::from(b % 4),
        }
    }

    /// A guest address: a page of a slot this connection added (mostly),
    /// a misaligned or past-the-end one, or anything.
    fn gpa(&self, input: &mut Input) -> u64 {
        let b = input.u8();
        let slots: Vec<_> = self.model.slots.values().collect();
        let Some(slot) = slots.get(usize::from(b >> 3) % slots.len().max(1)) else {
            return input.u64();
        };
        let pages = (slot.len / PAGE).max(1);
        match b % 8 {
            0..=4 => slot.gpa + u64::from(input.u8()) % pages.min(32) * PAGE,
            5 => slot.gpa.wrapping_add(u64::from(input.u16())),
            6 => (slot.gpa + slot.len).wrapping_sub(u64::from(input.u8() % 4) * PAGE),
            _ => input.u64(),
        }
    }

    fn depth(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b % 16 {
            0..=10 => 1 << (b % 8),
            11 | 12 => 1 << (b >> 3),
            13 => 3,
            14 => 0,
            _ => input.u32(),
        }
    }

    fn vector(&self, input: &mut Input) -> u32 {
        match input.u8() % 8 {
            0..=3 => 0,
            4 => 1,
            5 => 255,
            6 => 256,
            _ => input.u32(),
        }
    }

    fn cqn(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        let cqs: Vec<u32> = self.model.cqs.keys().copied().collect();
        match b % 8 {
            0..=2 if !cqs.is_empty() => cqs[usize::from(b >> 3) % cqs.len()],
            0..=4 => u32::from(b % 3) + 1,
            5 => BETA_CQN,
            6 => 0,
            _ => input.u32(),
        }
    }

    fn key(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        let own: Vec<u32> = self.model.keys().collect();
        match b % 8 {
            0..=3 if !own.is_empty() => own[usize::from(b >> 2) % own.len()],
            4 | 5 => self.h.beta_keys[usize::from(b >> 3) % 4],
            6 => 0,
            _ => input.u32(),
        }
    }

    fn vqpn(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b % 16 {
            15 => input.u32(),
            14 => 0x00ff_ffff,
            13 => 0x0100_0000,
            _ => u32::from(b % 4) + 1,
        }
    }

    /// A destination GID: alpha's, beta's, delta's (as hostd assigns
    /// them without a fabric, from their LIDs), or one of nobody's.
    fn gid(&self, input: &mut Input) -> [u8; 16] {
        let b = input.u8();
        let lid = match b % 7 {
            0 | 1 => self.model.greeted.unwrap_or(0),
            2 => self.h.beta_lid,
            3 => self.h.delta_lid,
            4 => [0, 0xffff, 0xc000][usize::from(b >> 6) % 3],
            5 => {
                let mut raw = [0u8; 16];
                for byte in &mut raw {
                    *byte = input.u8();
                }
                return raw;
            }
            _ => input.u16(),
        };
        loopback_gid(lid)
    }

    /// A PSN: mostly 24 bits, sometimes wider.
    fn psn(&self, input: &mut Input) -> u32 {
        match input.u8() % 8 {
            0 => input.u32(),
            _ => input.u32() & 0x00ff_ffff,
        }
    }

    fn mr_access(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b % 8 {
            0 => access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE,
            1 => access::LOCAL_WRITE,
            2 => access::REMOTE_READ,
            3 => access::REMOTE_WRITE,
            4 => access::LOCAL_WRITE | access::REMOTE_ATOMIC,
            5 => access::ZERO_BASED | access::LOCAL_WRITE,
            6 => input.u32(),
            _ => 0,
        }
    }

    fn qp_access(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b % 5 {
            0 => 0,
            1 => access::REMOTE_READ | access::REMOTE_WRITE,
            2 => access::QP_SUPPORTED,
            3 => access::LOCAL_WRITE,
            _ => input.u32(),
        }
    }

    fn segment(&self, input: &mut Input) -> MrSegment {
        let b = input.u8();
        let slots: Vec<(u32, u64)> = self.model.slots.iter().map(|(&s, v)| (s, v.len)).collect();
        let (slot, bytes) = match slots.get(usize::from(b >> 2) % slots.len().max(1)) {
            Some(&(s, l)) if b & 3 != 3 => (s, l),
            _ => (self.slot(input), 4096),
        };
        let offset = match input.u8() % 5 {
            0 => 0,
            1 => u64::from(input.u8()) * 4096,
            2 => bytes.saturating_sub(u64::from(input.u8())),
            3 => input.u64(),
            _ => u64::from(input.u16()),
        };
        let rest = bytes.saturating_sub(offset);
        let len = match input.u8() % 6 {
            0 => rest,
            1 => rest + 1,
            2 => 0,
            3 => input.u64(),
            _ => u64::from(input.u16()).min(rest.max(1)),
        };
        MrSegment { slot, offset, len }
    }
}
