//! The IB CM (`vrdma_cm`): the MAD codec and the agent, fed what a peer
//! host (or anyone who can send to QP1 of a device) puts on the wire.
//! Decoding never panics; a refusal names the first thing Linux would
//! refuse too; an accepted MAD re-encodes to its own bytes with only its
//! reserved bits cleared (the reserved bits are written out again here,
//! from the notes' layouts, not taken from the codec) and decodes back to
//! itself. Agents never panic, keep their tables consistent and bounded,
//! send only MADs that decode, and report each connection's end once.
//!
//! The first byte picks the mode:
//! - 0: the rest is a MAD, as is (random bytes rarely pass the header);
//! - 1: the same with a valid CM header and one of the nine attributes,
//!   so that every message's body is reached;
//! - 2..: a session between two agents (A active, B listening) played by
//!   the input: consumer calls on either side, MADs delivered, lost,
//!   duplicated or damaged on the way, time passing, and forged MADs of
//!   any kind aimed at the comm IDs either agent really uses.

use std::collections::{BTreeSet, HashSet};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use vrdma_cm::{
    Agent, AgentConfig, CmState, ConnId, ConnectParams, DecodeError, Event, Gid, Mad, MadPath,
    MessageKind, RejectReason, Rep, SidrParams, SidrStatus, MAD_SIZE,
};

use crate::input::Input;

pub fn check(data: &[u8]) {
    run(data);
}

/// [`check`], returning whether a MAD was decoded (for tests of the
/// check itself).
pub fn run(data: &[u8]) -> bool {
    run_counting(data).0
}

/// [`run`], also returning how many connections a session established
/// (B's ESTABLISHED events).
pub fn run_counting(data: &[u8]) -> (bool, usize) {
    let mut input = Input::new(data);
    match input.u8() % 4 {
        0 => (feed(input.bytes(usize::MAX)), 0),
        1 => {
            let mut mad = [0u8; MAD_SIZE];
            let rest = input.bytes(MAD_SIZE);
            mad[..rest.len()].copy_from_slice(rest);
            mad[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
            mad[16] = 0;
            mad[17] = 0x10 + mad[17] % 9;
            (feed(&mad), 0)
        }
        _ => session(&mut input),
    }
}

/// Checks the codec on `bytes`, then hands them to a listening agent.
fn feed(bytes: &[u8]) -> bool {
    let accepted = check_codec(bytes);
    let now = Instant::now();
    let mut agent = Agent::new(small_config(0xb, 2));
    agent.listen(SERVICE).expect("listen");
    let result = agent.handle_mad(now, path_ba(), bytes);
    if !accepted {
        assert!(
            result.is_err(),
            "the agent acted on a MAD that does not decode"
        );
    }
    agent.check_consistency().expect("consistent agent");
    while let Some(tx) = agent.poll_transmit() {
        check_sent(&tx.mad);
    }
    accepted
}

/// The codec's invariants on any bytes; whether it accepted them.
pub fn check_codec(bytes: &[u8]) -> bool {
    let first = Mad::decode(bytes);
    assert_eq!(first, Mad::decode(bytes), "decode is not deterministic");
    match first {
        Ok(mad) => {
            let enc = mad.encode().expect("a decoded MAD encodes");
            assert_eq!(Mad::decode(&enc).as_ref(), Ok(&mad), "no round trip");
            let mask = reserved_bits(mad.msg.kind());
            for (i, ((&got, &sent), &m)) in enc.iter().zip(bytes).zip(mask.iter()).enumerate() {
                assert_eq!(
                    got,
                    sent & !m,
                    "byte {i} of a {:?} not carried",
                    mad.msg.kind()
                );
            }
            true
        }
        Err(e) => {
            assert_eq!(Some(e), expected_refusal(bytes), "wrong refusal");
            false
        }
    }
}

/// The refusal the notes call for, checked in the order Linux checks.
fn expected_refusal(b: &[u8]) -> Option<DecodeError> {
    if b.len() != MAD_SIZE {
        return Some(DecodeError::BadLength(b.len()));
    }
    if b[0] != 1 {
        return Some(DecodeError::BadBaseVersion(b[0]));
    }
    if b[1] != 0x07 {
        return Some(DecodeError::BadClass(b[1]));
    }
    if b[2] != 2 {
        return Some(DecodeError::BadClassVersion(b[2]));
    }
    if b[3] != 0x03 {
        return Some(DecodeError::BadMethod(b[3]));
    }
    let attr = u16::from_be_bytes([b[16], b[17]]);
    let Some(kind) = MessageKind::from_attr_id(attr) else {
        return Some(if attr == 0x19 || attr == 0x1a {
            DecodeError::UnsupportedAttribute(attr)
        } else {
            DecodeError::UnknownAttribute(attr)
        });
    };
    match kind {
        // Message MRAed / Rejected: code 3 is reserved.
        MessageKind::Mra | MessageKind::Rej if b[32] >> 6 == 3 => {
            Some(DecodeError::ReservedValue {
                field: if kind == MessageKind::Mra {
                    "MRA Message MRAed"
                } else {
                    "REJ Message Rejected"
                },
                value: 3,
            })
        }
        // Lengths of the 72-byte ARI and additional information.
        MessageKind::Rej if b[33] >> 1 > 72 => Some(DecodeError::LengthTooLong {
            field: "REJ Reject Info Length",
            len: b[33] >> 1,
        }),
        MessageKind::SidrRep if b[29] > 72 => Some(DecodeError::LengthTooLong {
            field: "SIDR_REP Additional Information Length",
            len: b[29],
        }),
        _ => None,
    }
}

/// The reserved bits of each message (absolute offsets; notes §2.3 and
/// §2.5): what the codec may drop.
pub fn reserved_bits(kind: MessageKind) -> [u8; MAD_SIZE] {
    let mut m = [0u8; MAD_SIZE];
    m[18] = 0xff; // MAD header reserved
    m[19] = 0xff;
    let path = |m: &mut [u8; MAD_SIZE], p: usize| {
        m[p + 38] = 0x0f; // under the 20-bit flow label
        m[p + 39] = 0xc0; // over the 6-bit packet rate
        m[p + 42] = 0x07; // after SL and Subnet Local
        m[p + 43] = 0x07; // after the ACK timeout
    };
    match kind {
        MessageKind::Req => {
            m[28] = 0xff; // body 4, before the ECE vendor ID
            m[48..52].fill(0xff); // body 24..28
            path(&mut m, 76);
            path(&mut m, 120);
            m[163] = 0x03; // alternate ACK timeout | SAP supported | 2 reserved
        }
        MessageKind::Mra => {
            m[32] = 0x3f;
            m[33] = 0x07;
        }
        MessageKind::Rej => {
            m[32] = 0x3f;
            m[33] = 0x01;
        }
        MessageKind::Rep => m[51] = 0x0f,
        MessageKind::Dreq => m[35] = 0xff,
        MessageKind::SidrReq => m[30..32].fill(0xff),
        MessageKind::Rtu | MessageKind::Drep | MessageKind::SidrRep => {}
    }
    m
}

/// What an agent sends decodes, and is the agent's own encoding.
fn check_sent(mad: &[u8; MAD_SIZE]) -> Mad {
    let m = Mad::decode(mad).expect("an agent sent a MAD that does not decode");
    assert_eq!(&m.encode().expect("re-encodes"), mad);
    m
}

const SERVICE: u64 = 0x0106_1c06;
const OTHER_SERVICE: u64 = 0x0111_0007;
const GUID_A: u64 = 0x0200_00ff_fe00_000a;
const GUID_B: u64 = 0x0200_00ff_fe00_000b;

fn gid_a() -> Gid {
    Gid::from(Ipv4Addr::new(10, 0, 0, 1))
}

fn gid_b() -> Gid {
    Gid::from(Ipv4Addr::new(10, 0, 0, 2))
}

fn path_ab() -> MadPath {
    MadPath {
        local: gid_a(),
        remote: gid_b(),
    }
}

fn path_ba() -> MadPath {
    MadPath {
        local: gid_b(),
        remote: gid_a(),
    }
}

/// Small bounds, so that inputs reach them.
fn small_config(guid: u64, seed: u64) -> AgentConfig {
    let mut c = AgentConfig::new(guid, seed);
    c.max_connections = 12;
    c.max_listeners = 3;
    c.max_queued = 48;
    c
}

/// One side of a session: its agent, the MADs it sent and not yet
/// delivered, and what its consumer learnt.
struct Side {
    agent: Agent,
    path: MadPath,
    in_flight: Vec<[u8; MAD_SIZE]>,
    /// Connections this side has heard of (from calls or events).
    known: BTreeSet<ConnId>,
    /// Connections whose end was reported (gone for good).
    ended: HashSet<ConnId>,
    disconnected: HashSet<ConnId>,
    established: usize,
    /// The connection the last event ended for good, if it did.
    last_terminal: Option<ConnId>,
}

impl Side {
    fn new(agent: Agent, path: MadPath) -> Side {
        Side {
            agent,
            path,
            in_flight: Vec::new(),
            known: BTreeSet::new(),
            ended: HashSet::new(),
            disconnected: HashSet::new(),
            established: 0,
            last_terminal: None,
        }
    }

    fn pick(&self, input: &mut Input) -> Option<ConnId> {
        let known: Vec<_> = self.known.iter().copied().collect();
        input.pick(&known).copied()
    }

    /// Drains the agent: MADs to the wire, events checked.
    fn drain(&mut self) {
        while let Some(tx) = self.agent.poll_transmit() {
            assert_eq!(tx.path, self.path, "a MAD for another peer");
            check_sent(&tx.mad);
            self.in_flight.push(tx.mad);
        }
        // Several MADs may have been delivered in one step: a connection
        // can begin and end within one drain.
        let mut seen = Vec::new();
        let mut finished = HashSet::new();
        while let Some(event) = self.agent.poll_event() {
            let conn = self.event(event, &finished);
            if matches!(self.last_terminal, Some(c) if c == conn) {
                finished.insert(conn);
            }
            seen.push(conn);
        }
        for conn in seen.into_iter().chain(self.known.clone()) {
            if self.agent.state(conn).is_none() {
                self.ended.insert(conn);
                self.known.remove(&conn);
            }
        }
        self.agent.check_consistency().expect("consistent agent");
        assert_eq!(self.agent.stats().encode_failures, 0);
    }

    /// Checks one event; returns its connection.
    fn event(&mut self, event: Event, finished: &HashSet<ConnId>) -> ConnId {
        let conn = match &event {
            Event::ConnectRequest { conn, .. }
            | Event::ConnectResponse { conn, .. }
            | Event::Established { conn }
            | Event::Rejected { conn, .. }
            | Event::Unreachable { conn }
            | Event::Disconnected { conn, .. }
            | Event::TimewaitExit { conn }
            | Event::SidrRequest { conn, .. }
            | Event::SidrResponse { conn, .. } => *conn,
        };
        assert!(
            !self.ended.contains(&conn) && !finished.contains(&conn),
            "{event:?} after the end"
        );
        self.last_terminal = None;
        match &event {
            Event::ConnectRequest { .. } | Event::SidrRequest { .. } => {
                assert!(self.known.insert(conn), "a new connection reuses an ID");
            }
            Event::Disconnected { .. } => {
                assert!(self.disconnected.insert(conn), "disconnected twice");
            }
            Event::Unreachable { .. } | Event::TimewaitExit { .. } | Event::SidrResponse { .. } => {
                assert_eq!(
                    self.agent.state(conn),
                    None,
                    "{event:?} for a connection still there"
                );
                self.last_terminal = Some(conn);
            }
            Event::Established { .. } => self.established += 1,
            Event::ConnectResponse { .. } | Event::Rejected { .. } => {}
        }
        conn
    }
}

fn session(input: &mut Input) -> (bool, usize) {
    let start = Instant::now();
    let mut now = start;
    let mut a = Side::new(Agent::new(small_config(GUID_A, input.u64())), path_ab());
    let mut b = Side::new(Agent::new(small_config(GUID_B, input.u64())), path_ba());
    b.agent.listen(SERVICE).expect("listen");
    let mut decoded = false;
    for _ in 0..64 {
        if input.is_empty() {
            break;
        }
        let a_first = input.bool();
        let (me, peer) = if a_first {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        match input.u8() % 12 {
            0 => {
                let service = if input.bool() { SERVICE } else { OTHER_SERVICE };
                let mut params = ConnectParams::new(service, me.path, input.u32(), input.u32());
                if input.bool() {
                    params.req.local_qpn &= 0xff_ffff;
                    params.req.starting_psn &= 0xff_ffff;
                }
                params.req.max_cm_retries = input.u8() % 4;
                params.req.remote_cm_response_timeout = input.u8() % 24;
                params.req.primary.local_ack_timeout = input.u8() % 24;
                params.packet_life_time = input.u8() % 24;
                params.req.pkey = if input.u8() == 0 { input.u16() } else { 0xffff };
                let count = me.agent.connection_count();
                match me.agent.connect(now, &params) {
                    Ok(conn) => {
                        assert!(me.known.insert(conn), "connect reuses an ID");
                        assert_eq!(me.agent.state(conn), Some(CmState::ReqSent));
                    }
                    Err(_) => assert_eq!(me.agent.connection_count(), count),
                }
            }
            1 => {
                if let Some(conn) = me.pick(input) {
                    let mut rep = Rep::accepting(input.u32() & 0xff_ffff, input.u32() & 0xff_ffff);
                    rep.responder_resources = input.u8();
                    rep.initiator_depth = input.u8();
                    if me.agent.accept(now, conn, &rep).is_ok() {
                        assert_eq!(me.agent.state(conn), Some(CmState::RepSent));
                    }
                }
            }
            2 => {
                if let Some(conn) = me.pick(input) {
                    let len = usize::from(input.u8());
                    if me.agent.establish(conn, &vec![7; len]).is_ok() {
                        assert!(len <= 224);
                        assert_eq!(me.agent.state(conn), Some(CmState::Established));
                    }
                }
            }
            3 => {
                if let Some(conn) = me.pick(input) {
                    let reason = RejectReason(input.u16() % 40);
                    let ari = vec![1; usize::from(input.u8() % 80)];
                    let private = vec![2; usize::from(input.u8())];
                    let before = me.agent.state(conn);
                    if me.agent.reject(now, conn, reason, &ari, &private).is_err() {
                        assert_eq!(
                            me.agent.state(conn),
                            before,
                            "a refused reject changed state"
                        );
                    } else {
                        assert!(ari.len() <= 72 && private.len() <= 148);
                    }
                }
            }
            4 => {
                if let Some(conn) = me.pick(input) {
                    let before = me.agent.state(conn);
                    let len = usize::from(input.u8());
                    if me.agent.disconnect(now, conn, &vec![3; len]).is_err() {
                        assert_eq!(me.agent.state(conn), before);
                    }
                }
            }
            5 => {
                if let Some(conn) = me.pick(input) {
                    if me.agent.destroy(now, conn).is_ok() {
                        // Nothing more for the consumer about it.
                        me.known.remove(&conn);
                        me.ended.insert(conn);
                        assert!(matches!(
                            me.agent.state(conn),
                            None | Some(CmState::Timewait)
                        ));
                    }
                }
            }
            6 | 7 => {
                // Deliver my in-flight MADs: some lost, duplicated or
                // damaged.
                let n = usize::from(input.u8() % 4) + 1;
                for _ in 0..n.min(me.in_flight.len()) {
                    let mut mad = me.in_flight.remove(0);
                    // 0: lost; 1: damaged; 2: duplicated; else delivered.
                    let fate = input.u8() % 8;
                    if fate == 0 {
                        continue;
                    }
                    if fate == 1 {
                        let at = usize::from(input.u8());
                        mad[at % MAD_SIZE] ^= input.u8() | 1;
                    }
                    decoded |= check_codec(&mad);
                    let _ = peer.agent.handle_mad(now, peer.path, &mad);
                    if fate == 2 {
                        let _ = peer.agent.handle_mad(now, peer.path, &mad);
                    }
                }
            }
            8 => {
                let step = match input.u8() % 4 {
                    0 => Duration::from_millis(u64::from(input.u16())),
                    1 => Duration::from_millis(u64::from(input.u32() % 200_000)),
                    _ => {
                        // Straight to the next deadline of either side.
                        let next = [a.agent.next_deadline(), b.agent.next_deadline()]
                            .into_iter()
                            .flatten()
                            .min();
                        next.map_or(Duration::ZERO, |at| at.saturating_duration_since(now))
                    }
                };
                now += step;
                for side in [&mut a, &mut b] {
                    side.agent.tick(now);
                    if let Some(at) = side.agent.next_deadline() {
                        assert!(at > now, "a deadline left in the past by tick");
                    }
                }
            }
            9 => {
                let forged = forge(input, me, peer);
                decoded |= check_codec(&forged);
                let _ = peer.agent.handle_mad(now, peer.path, &forged);
            }
            10 => match input.u8() % 3 {
                0 => {
                    let service = if input.bool() { SERVICE } else { OTHER_SERVICE };
                    let mut params = SidrParams::new(service, me.path);
                    params.max_retries = input.u8() % 4;
                    params.timeout = input.u8() % 24;
                    if let Ok(conn) = me.agent.sidr_request(now, &params) {
                        assert!(me.known.insert(conn));
                    }
                }
                1 => {
                    if let Some(conn) = me.pick(input) {
                        let len = usize::from(input.u8());
                        if me
                            .agent
                            .sidr_accept(conn, input.u32() & 0xff_ffff, 0x0123_4567, &vec![4; len])
                            .is_ok()
                        {
                            assert!(len <= 136);
                            assert_eq!(me.agent.state(conn), None);
                            me.known.remove(&conn);
                        }
                    }
                }
                _ => {
                    if let Some(conn) = me.pick(input) {
                        if me
                            .agent
                            .sidr_reject(conn, SidrStatus(input.u8()), &[])
                            .is_ok()
                        {
                            me.known.remove(&conn);
                        }
                    }
                }
            },
            _ => {
                let service = [SERVICE, OTHER_SERVICE, input.u64()];
                let service = *input.pick(&service).unwrap_or(&SERVICE);
                if input.bool() {
                    let _ = me.agent.listen(service);
                } else {
                    me.agent.unlisten(service);
                }
                assert!(me.agent.listener_count() <= 3);
            }
        }
        a.drain();
        b.drain();
    }
    (decoded, b.established)
}

/// A MAD of a kind the input picks, its body from the input, its comm ID
/// fields aimed at IDs the sender and receiver really use (so that the
/// agent's matching is reached), its header valid.
fn forge(input: &mut Input, me: &Side, peer: &Side) -> [u8; MAD_SIZE] {
    let kind = *input.pick(&MessageKind::ALL).unwrap_or(&MessageKind::Req);
    let mut mad = [0u8; MAD_SIZE];
    let body = input.bytes(MAD_SIZE - 24);
    mad[24..24 + body.len()].copy_from_slice(body);
    mad[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    mad[8..16].copy_from_slice(&input.u64().to_be_bytes());
    mad[16..18].copy_from_slice(&kind.attr_id().to_be_bytes());
    let mine = me.pick(input).map_or(input.u32(), ConnId::comm_id);
    let theirs = peer.pick(input).map_or(input.u32(), ConnId::comm_id);
    match kind {
        // Request ID / Local Comm ID only.
        MessageKind::Req | MessageKind::SidrReq => mad[24..28].copy_from_slice(&mine.to_be_bytes()),
        MessageKind::SidrRep => mad[24..28].copy_from_slice(&theirs.to_be_bytes()),
        _ => {
            mad[24..28].copy_from_slice(&mine.to_be_bytes());
            mad[28..32].copy_from_slice(&theirs.to_be_bytes());
        }
    }
    if kind == MessageKind::Req {
        // Now and then a REQ for the listened service, with a real CA GUID.
        if input.bool() {
            mad[32..40].copy_from_slice(&SERVICE.to_be_bytes());
            let guid = if me.path.local == gid_a() {
                GUID_A
            } else {
                GUID_B
            };
            mad[40..48].copy_from_slice(&guid.to_be_bytes());
            mad[72..74].copy_from_slice(&[0xff, 0xff]);
        }
    }
    if kind == MessageKind::Dreq && input.bool() {
        // The QPNs the sessions use are small: aim at them.
        mad[32..35].copy_from_slice(&[0, 0, input.u8()]);
    }
    mad
}

#[cfg(test)]
mod tests {
    use vrdma_cm::CmMessage;

    use super::*;

    #[test]
    fn a_valid_mad_reaches_the_accepted_path() {
        for kind in MessageKind::ALL {
            let mut data = vec![1u8];
            let mut mad = [0u8; MAD_SIZE];
            mad[17] = kind.attr_id() as u8 - 0x10;
            data.extend_from_slice(&mad);
            assert!(run(&data), "{kind:?}");
        }
        let mad = Mad::new(1, CmMessage::Rtu(Default::default()))
            .encode()
            .unwrap();
        let mut data = vec![0u8];
        data.extend_from_slice(&mad);
        assert!(run(&data));
    }

    #[test]
    fn reserved_masks_match_the_codec() {
        // A message of all ones in its carried bits: the codec keeps
        // exactly the complement of the mask (where no code or length
        // forbids all ones).
        for kind in [
            MessageKind::Req,
            MessageKind::Rep,
            MessageKind::Rtu,
            MessageKind::Dreq,
            MessageKind::Drep,
            MessageKind::SidrReq,
        ] {
            let mut b = [0xffu8; MAD_SIZE];
            b[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
            b[16..18].copy_from_slice(&kind.attr_id().to_be_bytes());
            assert!(check_codec(&b), "{kind:?}");
        }
        // The kinds with codes and lengths: all ones but where that is
        // refused.
        for (kind, fix) in [
            (MessageKind::Mra, [(32, 0xbf), (33, 0xff)]),
            (MessageKind::Rej, [(32, 0xbf), (33, 72 << 1 | 1)]),
            (MessageKind::SidrRep, [(29, 72), (28, 0xff)]),
        ] {
            let mut b = [0xffu8; MAD_SIZE];
            b[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
            b[16..18].copy_from_slice(&kind.attr_id().to_be_bytes());
            for (at, v) in fix {
                b[at] = v;
            }
            assert!(check_codec(&b), "{kind:?}");
        }
    }

    /// Session inputs written op by op, in the order `session` reads them.
    struct Script(Vec<u8>);

    impl Script {
        fn new() -> Script {
            let mut v = vec![2u8];
            v.extend_from_slice(&[0; 16]); // the agents' seeds
            Script(v)
        }

        fn op(&mut self, a: bool, op: u8, args: &[u8]) -> &mut Script {
            self.0.push(u8::from(a));
            self.0.push(op);
            self.0.extend_from_slice(args);
            self
        }

        /// QPN `qpn`, PSN 9, `retries` CM retries, timeouts 20/19, PLT 18.
        fn connect(&mut self, a: bool, listened: bool, qpn: u8, retries: u8) -> &mut Script {
            let args = [
                u8::from(listened),
                qpn,
                0,
                0,
                0,
                9,
                0,
                0,
                0,
                1,
                retries,
                20,
                19,
                18,
                1,
            ];
            self.op(a, 0, &args)
        }

        fn accept(&mut self, a: bool, qpn: u8) -> &mut Script {
            self.op(a, 1, &[0, qpn, 0, 0, 0, 7, 0, 0, 0, 1, 1])
        }

        fn establish(&mut self, a: bool) -> &mut Script {
            self.op(a, 2, &[0, 0])
        }

        fn reject(&mut self, a: bool) -> &mut Script {
            self.op(a, 3, &[0, 28, 0, 0, 10])
        }

        fn disconnect(&mut self, a: bool) -> &mut Script {
            self.op(a, 4, &[0, 0])
        }

        fn destroy(&mut self, a: bool) -> &mut Script {
            self.op(a, 5, &[0])
        }

        /// Delivers exactly `n` MADs (as many as are in flight).
        fn deliver(&mut self, a: bool, n: u8) -> &mut Script {
            let mut args = vec![n - 1];
            args.extend(std::iter::repeat_n(3, usize::from(n)));
            self.op(a, 6, &args)
        }

        fn advance_to_next_deadline(&mut self) -> &mut Script {
            self.op(true, 8, &[2])
        }

        fn sidr_request(&mut self, a: bool, listened: bool) -> &mut Script {
            self.op(a, 10, &[0, u8::from(listened), 1, 20])
        }

        fn sidr_accept(&mut self, a: bool) -> &mut Script {
            self.op(a, 10, &[1, 0, 3, 0x33, 0, 0, 0])
        }
    }

    const A: bool = true;
    const B: bool = false;

    /// Named session inputs and the connections each establishes.
    fn scripts() -> Vec<(&'static str, Vec<u8>, usize)> {
        let mut out = Vec::new();
        let mut s = Script::new();
        s.connect(A, true, 5, 3)
            .deliver(A, 1)
            .accept(B, 6)
            .deliver(B, 1);
        s.establish(A).deliver(A, 1);
        let established = s.0.clone();
        s.disconnect(A).deliver(A, 1).disconnect(B).deliver(B, 1);
        s.advance_to_next_deadline().advance_to_next_deadline();
        out.push(("session-connect-disconnect", s.0.clone(), 1));
        let mut s = Script(established.clone());
        s.destroy(A).deliver(A, 1).destroy(B).deliver(B, 1);
        s.advance_to_next_deadline();
        out.push(("session-destroy-established", s.0.clone(), 1));
        let mut s = Script::new();
        s.connect(A, true, 5, 3)
            .deliver(A, 1)
            .reject(B)
            .deliver(B, 1);
        out.push(("session-reject", s.0.clone(), 0));
        let mut s = Script::new();
        s.connect(A, false, 5, 3).deliver(A, 1).deliver(B, 1);
        out.push(("session-no-listener", s.0.clone(), 0));
        let mut s = Script::new();
        s.connect(A, true, 5, 2);
        for _ in 0..3 {
            s.advance_to_next_deadline();
        }
        // The REQ and its two retries reach B after A gave up.
        s.deliver(A, 3).deliver(B, 2);
        out.push(("session-lost-req", s.0.clone(), 0));
        let mut s = Script::new();
        s.connect(A, true, 5, 3)
            .deliver(A, 1)
            .advance_to_next_deadline();
        s.deliver(A, 1).deliver(B, 1).accept(B, 6).deliver(B, 1);
        s.establish(A).deliver(A, 1);
        out.push(("session-mra", s.0.clone(), 1));
        let mut s = Script::new();
        s.connect(A, true, 5, 3)
            .deliver(A, 1)
            .accept(B, 6)
            .deliver(B, 1);
        s.establish(A)
            .advance_to_next_deadline()
            .deliver(B, 1)
            .deliver(A, 2);
        out.push(("session-lost-rtu", s.0.clone(), 1));
        let mut s = Script::new();
        s.sidr_request(A, true)
            .deliver(A, 1)
            .sidr_accept(B)
            .deliver(B, 1);
        out.push(("session-sidr", s.0.clone(), 0));
        let mut s = Script::new();
        s.sidr_request(A, false).deliver(A, 1).deliver(B, 1);
        out.push(("session-sidr-no-listener", s.0.clone(), 0));
        out
    }

    #[test]
    fn scripted_sessions_reach_their_ends() {
        for (name, data, established) in scripts() {
            assert_eq!(run_counting(&data), (true, established), "{name}");
        }
    }

    /// Writes the seed corpus of `cm_mad` (the scripts above, and one MAD
    /// of every kind in modes 0 and 1):
    /// `cargo test -p vrdma-fuzz-checks -- --ignored write_cm_seed_corpus`.
    #[test]
    #[ignore]
    fn write_cm_seed_corpus() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/cm_mad");
        std::fs::create_dir_all(&dir).unwrap();
        let mut seeds: Vec<(String, Vec<u8>)> = scripts()
            .into_iter()
            .map(|(name, data, _)| (name.to_owned(), data))
            .collect();
        for kind in MessageKind::ALL {
            let mut mad = [0u8; MAD_SIZE];
            mad[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
            mad[16..18].copy_from_slice(&kind.attr_id().to_be_bytes());
            for mode in [0u8, 1] {
                let mut data = vec![mode];
                data.extend_from_slice(&mad);
                seeds.push((format!("mode{mode}-{}", kind.name()), data));
            }
        }
        for (name, data) in seeds {
            std::fs::write(dir.join(name), data).unwrap();
        }
    }
}
