//! Agents wired back to back (or one agent against hand-made MADs): the
//! connection life cycles of notes §2.8–2.9 and §4, with time passed in.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use crate::*;

const GUID_A: u64 = 0x0200_00ff_fe00_000a;
const GUID_B: u64 = 0x0200_00ff_fe00_000b;
const SERVICE: u64 = 0x0106_1c06;

fn gid_a() -> Gid {
    Gid::from(Ipv4Addr::new(10, 0, 0, 1))
}

fn gid_b() -> Gid {
    Gid::from(Ipv4Addr::new(10, 0, 0, 2))
}

/// A's view of the path to B.
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

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Two agents, A (active) and B (passive, listening on SERVICE), and the
/// MADs in flight between them.
struct Pair {
    a: Agent,
    b: Agent,
    now: Instant,
}

impl Pair {
    fn new() -> Pair {
        Pair::with(AgentConfig::new(GUID_A, 1), AgentConfig::new(GUID_B, 2))
    }

    fn with(a: AgentConfig, b: AgentConfig) -> Pair {
        let mut b = Agent::new(b);
        b.listen(SERVICE).unwrap();
        Pair {
            a: Agent::new(a),
            b,
            now: Instant::now(),
        }
    }

    /// Delivers every queued MAD, both ways, until none is left; returns
    /// them as (from A?, message) in delivery order.
    fn pump(&mut self) -> Vec<(bool, CmMessage)> {
        let mut log = Vec::new();
        loop {
            let mut moved = false;
            while let Some(tx) = self.a.poll_transmit() {
                assert_eq!(tx.path, path_ab());
                log.push((true, Mad::decode(&tx.mad).unwrap().msg));
                let _ = self.b.handle_mad(self.now, path_ba(), &tx.mad);
                moved = true;
            }
            while let Some(tx) = self.b.poll_transmit() {
                assert_eq!(tx.path, path_ba());
                log.push((false, Mad::decode(&tx.mad).unwrap().msg));
                let _ = self.a.handle_mad(self.now, path_ab(), &tx.mad);
                moved = true;
            }
            self.check();
            if !moved {
                return log;
            }
        }
    }

    /// Drops every queued MAD of `agent`; returns them.
    fn lose(agent: &mut Agent) -> Vec<CmMessage> {
        std::iter::from_fn(|| agent.poll_transmit())
            .map(|tx| Mad::decode(&tx.mad).unwrap().msg)
            .collect()
    }

    /// Moves time to `at` and runs both agents' timers.
    fn advance_to(&mut self, at: Instant) {
        assert!(at >= self.now);
        self.now = at;
        self.a.tick(at);
        self.b.tick(at);
        self.check();
    }

    fn advance(&mut self, by: Duration) {
        self.advance_to(self.now + by);
    }

    fn check(&self) {
        self.a.check_consistency().unwrap();
        self.b.check_consistency().unwrap();
        for agent in [&self.a, &self.b] {
            if let Some(at) = agent.next_deadline() {
                assert!(at > self.now, "a deadline in the past after tick");
            }
            assert_eq!(agent.stats().encode_failures, 0);
        }
    }

    /// A connects, B accepts, A establishes: returns (A's conn, B's conn).
    fn connect(&mut self) -> (ConnId, ConnId) {
        let ca = self
            .a
            .connect(
                self.now,
                &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
            )
            .unwrap();
        self.pump();
        let cb = expect_connect_request(&mut self.b);
        self.b
            .accept(self.now, cb, &Rep::accepting(0x200, 0x2000))
            .unwrap();
        self.pump();
        assert!(matches!(
            self.a.poll_event(),
            Some(Event::ConnectResponse { conn, .. }) if conn == ca
        ));
        self.a.establish(ca, &[]).unwrap();
        self.pump();
        assert_eq!(self.b.poll_event(), Some(Event::Established { conn: cb }));
        assert_eq!(self.a.state(ca), Some(CmState::Established));
        assert_eq!(self.b.state(cb), Some(CmState::Established));
        (ca, cb)
    }
}

fn expect_connect_request(agent: &mut Agent) -> ConnId {
    match agent.poll_event() {
        Some(Event::ConnectRequest { conn, .. }) => conn,
        other => panic!("expected a connect request, got {other:?}"),
    }
}

fn events(agent: &mut Agent) -> Vec<Event> {
    std::iter::from_fn(|| agent.poll_event()).collect()
}

fn kinds(log: &[(bool, CmMessage)]) -> Vec<(bool, MessageKind)> {
    log.iter().map(|(a, m)| (*a, m.kind())).collect()
}

#[test]
fn connect_and_disconnect() {
    let mut p = Pair::new();
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    assert_eq!(p.a.state(ca), Some(CmState::ReqSent));
    let log = p.pump();
    assert_eq!(kinds(&log), [(true, MessageKind::Req)]);
    let Some(Event::ConnectRequest {
        conn: cb,
        req,
        path,
    }) = p.b.poll_event()
    else {
        panic!("no connect request")
    };
    assert_eq!(path, path_ba());
    assert_eq!(req.local_comm_id, ca.comm_id());
    assert_eq!(req.local_ca_guid, GUID_A);
    // rdma_cm arms an MRA once the request is delivered.
    assert_eq!(p.b.state(cb), Some(CmState::MraReqSent));

    let mut rep = Rep::accepting(0x200, 0x2000);
    rep.responder_resources = 4;
    rep.initiator_depth = 2;
    let qp_b = p.b.accept(p.now, cb, &rep).unwrap();
    assert_eq!(p.b.state(cb), Some(CmState::RepSent));
    let log = p.pump();
    assert_eq!(kinds(&log), [(false, MessageKind::Rep)]);
    let CmMessage::Rep(sent) = &log[0].1 else {
        unreachable!()
    };
    assert_eq!(
        (sent.local_comm_id, sent.remote_comm_id),
        (cb.comm_id(), ca.comm_id())
    );
    let Some(Event::ConnectResponse { conn, qp: qp_a, .. }) = p.a.poll_event() else {
        panic!("no connect response")
    };
    assert_eq!(conn, ca);
    assert_eq!(p.a.state(ca), Some(CmState::MraRepSent));
    // Each side's receive PSN is what it advertised; resources swap.
    assert_eq!((qp_a.dest_qpn, qp_b.dest_qpn), (0x200, 0x100));
    assert_eq!((qp_a.rq_psn, qp_a.sq_psn), (0x1000, 0x2000));
    assert_eq!((qp_b.rq_psn, qp_b.sq_psn), (0x2000, 0x1000));
    assert_eq!((qp_a.max_rd_atomic, qp_a.max_dest_rd_atomic), (4, 2));
    assert_eq!((qp_b.max_rd_atomic, qp_b.max_dest_rd_atomic), (2, 4));
    assert_eq!((qp_a.local_gid, qp_a.remote_gid), (gid_a(), gid_b()));
    assert_eq!((qp_b.local_gid, qp_b.remote_gid), (gid_b(), gid_a()));

    p.a.establish(ca, b"rtu").unwrap();
    let log = p.pump();
    assert_eq!(kinds(&log), [(true, MessageKind::Rtu)]);
    assert_eq!(p.b.poll_event(), Some(Event::Established { conn: cb }));
    assert_eq!(p.a.poll_event(), None);
    assert_eq!(p.a.next_deadline(), None);
    assert_eq!(p.b.next_deadline(), None);

    // A disconnects; B hears of it and answers when its consumer does.
    p.a.disconnect(p.now, ca, b"bye").unwrap();
    assert_eq!(kinds(&p.pump()), [(true, MessageKind::Dreq)]);
    assert_eq!(
        p.b.poll_event(),
        Some(Event::Disconnected {
            conn: cb,
            timed_out: false
        })
    );
    assert_eq!(p.b.state(cb), Some(CmState::DreqRcvd));
    p.b.disconnect(p.now, cb, &[]).unwrap();
    assert_eq!(kinds(&p.pump()), [(false, MessageKind::Drep)]);
    assert_eq!(
        p.a.poll_event(),
        Some(Event::Disconnected {
            conn: ca,
            timed_out: false
        })
    );
    assert_eq!(p.a.state(ca), Some(CmState::Timewait));
    assert_eq!(p.b.state(cb), Some(CmState::Timewait));

    // Timewait: ms(av.timeout). A: cm_ack_timeout(15, 18) = 19 → 2048 ms;
    // B: the REQ's ACK timeout, 19 too.
    assert_eq!(p.a.next_deadline(), Some(p.now + ms(2048)));
    assert_eq!(p.b.next_deadline(), Some(p.now + ms(2048)));
    p.advance(ms(2047));
    assert_eq!(p.a.poll_event(), None);
    p.advance(ms(1));
    assert_eq!(p.a.poll_event(), Some(Event::TimewaitExit { conn: ca }));
    assert_eq!(p.b.poll_event(), Some(Event::TimewaitExit { conn: cb }));
    assert_eq!(p.a.connection_count(), 0);
    assert_eq!(p.b.connection_count(), 0);
    assert_eq!(p.a.next_deadline(), None);
    assert_eq!(p.a.stats().sent(MessageKind::Req), 1);
    assert_eq!(p.a.stats().retransmits + p.b.stats().retransmits, 0);
}

#[test]
fn lost_req_is_retried_then_unreachable() {
    let mut p = Pair::new();
    let start = p.now;
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    // 2·ms(PLT 18) + ms(20) = 6144 ms between sends; 15 retries.
    let interval = ms(6144);
    let mut sends = Pair::lose(&mut p.a).len();
    for i in 1..=15 {
        assert_eq!(p.a.next_deadline(), Some(start + interval * i));
        p.advance_to(start + interval * i);
        let lost = Pair::lose(&mut p.a);
        assert!(lost
            .iter()
            .all(|m| matches!(m, CmMessage::Req(r) if r.local_comm_id == ca.comm_id())));
        sends += lost.len();
        assert_eq!(p.a.poll_event(), None);
    }
    assert_eq!(sends, 16);
    p.advance_to(start + interval * 16);
    assert_eq!(Pair::lose(&mut p.a).len(), 0);
    assert_eq!(p.a.poll_event(), Some(Event::Unreachable { conn: ca }));
    assert_eq!(p.a.state(ca), None);
    assert_eq!(p.a.stats().retransmits, 15);
    assert_eq!(p.a.next_deadline(), None);
}

#[test]
fn no_listener_is_rej_8() {
    let mut p = Pair::new();
    let params = ConnectParams::new(SERVICE + 1, path_ab(), 0x100, 0x1000);
    let ca = p.a.connect(p.now, &params).unwrap();
    let req_tid = {
        let tx = p.a.poll_transmit().unwrap();
        let tid = Mad::decode(&tx.mad).unwrap().header.tid;
        p.b.handle_mad(p.now, path_ba(), &tx.mad).unwrap();
        tid
    };
    let tx = p.b.poll_transmit().unwrap();
    let mad = Mad::decode(&tx.mad).unwrap();
    assert_eq!(mad.header.tid, req_tid);
    let CmMessage::Rej(rej) = mad.msg else {
        panic!("not a REJ")
    };
    assert_eq!(rej.reason, RejectReason::INVALID_SERVICE_ID);
    assert_eq!(rej.message, TargetMessage::Req);
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (0, ca.comm_id()));
    p.a.handle_mad(p.now, path_ab(), &tx.mad).unwrap();
    let Some(Event::Rejected { conn, rej }) = p.a.poll_event() else {
        panic!("not rejected")
    };
    assert_eq!(conn, ca);
    assert_eq!(rej.reason.0, 8);
    assert_eq!(p.a.state(ca), None);
    assert_eq!(p.b.connection_count(), 0);
    assert_eq!(p.b.poll_event(), None);
}

#[test]
fn consumer_reject_carries_private_data() {
    for mra in [Some(LINUX_MRA_SERVICE_TIMEOUT), None] {
        let mut cfg_b = AgentConfig::new(GUID_B, 2);
        cfg_b.mra_service_timeout = mra;
        let mut p = Pair::with(AgentConfig::new(GUID_A, 1), cfg_b);
        let ca =
            p.a.connect(
                p.now,
                &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
            )
            .unwrap();
        p.pump();
        let cb = expect_connect_request(&mut p.b);
        p.b.reject(p.now, cb, RejectReason::CONSUMER_DEFINED, &[], b"go away")
            .unwrap();
        let log = p.pump();
        let CmMessage::Rej(rej) = &log[0].1 else {
            panic!("not a REJ")
        };
        // A REQ not yet MRAed is refused with local comm ID 0 (cm_format_rej).
        let local = if mra.is_some() { cb.comm_id() } else { 0 };
        assert_eq!(rej.local_comm_id, local);
        assert_eq!(rej.message, TargetMessage::Req);
        let Some(Event::Rejected { conn, rej }) = p.a.poll_event() else {
            panic!("not rejected")
        };
        assert_eq!(conn, ca);
        assert_eq!(rej.reason, RejectReason::CONSUMER_DEFINED);
        assert_eq!(rej.private_data.trimmed(), b"go away");
        assert_eq!(rej.private_data.as_bytes().len(), 148);
        assert_eq!(p.a.connection_count(), 0);
        assert_eq!(p.b.connection_count(), 0);
        // Too much private data is refused and changes nothing.
        let ca =
            p.a.connect(
                p.now,
                &ConnectParams::new(SERVICE, path_ab(), 0x101, 0x1000),
            )
            .unwrap();
        p.pump();
        let cb = expect_connect_request(&mut p.b);
        assert!(matches!(
            p.b.reject(p.now, cb, RejectReason::CONSUMER_DEFINED, &[], &[1; 149]),
            Err(AgentError::Encode(_))
        ));
        assert!(p.b.state(cb).is_some());
        assert!(p.a.state(ca).is_some());
    }
}

/// A REQ retransmitted while the consumer has not answered: answered with
/// the armed MRA, which makes the active side wait ms(24) + ms(av.timeout)
/// before its next retransmission (checklist §4.8).
#[test]
fn duplicate_req_gets_the_mra() {
    let mut p = Pair::new();
    let start = p.now;
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    p.advance_to(start + ms(6144));
    let log = p.pump();
    assert_eq!(
        kinds(&log),
        [(true, MessageKind::Req), (false, MessageKind::Mra)]
    );
    let CmMessage::Mra(mra) = &log[1].1 else {
        unreachable!()
    };
    assert_eq!(mra.message, TargetMessage::Req);
    assert_eq!(mra.service_timeout, 24);
    assert_eq!(
        (mra.local_comm_id, mra.remote_comm_id),
        (cb.comm_id(), ca.comm_id())
    );
    assert_eq!(p.a.state(ca), Some(CmState::MraReqRcvd));
    // ms(24) + ms(PLT 18 + 1 = 19).
    assert_eq!(p.a.next_deadline(), Some(p.now + ms(65536 + 2048)));
    assert_eq!(p.b.events_len(), 0);
    assert_eq!(p.b.stats().duplicates, 1);
    // A late accept still completes.
    p.b.accept(p.now, cb, &Rep::accepting(0x200, 0x2000))
        .unwrap();
    p.pump();
    assert!(matches!(
        p.a.poll_event(),
        Some(Event::ConnectResponse { .. })
    ));
    p.a.establish(ca, &[]).unwrap();
    p.pump();
    assert_eq!(p.b.poll_event(), Some(Event::Established { conn: cb }));
    // A duplicate REQ once the REP is out is dropped: the REP has its own
    // retransmission.
    let mut dup = ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000).req;
    dup.local_comm_id = ca.comm_id();
    dup.local_ca_guid = GUID_A;
    let bytes = Mad::new(1, CmMessage::Req(dup)).encode().unwrap();
    assert_eq!(
        p.b.handle_mad(p.now, path_ba(), &bytes),
        Err(DropReason::Duplicate)
    );
}

/// Without an armed MRA, a duplicate REQ is dropped.
#[test]
fn duplicate_req_without_mra_is_dropped() {
    let mut cfg_b = AgentConfig::new(GUID_B, 2);
    cfg_b.mra_service_timeout = None;
    let mut p = Pair::with(AgentConfig::new(GUID_A, 1), cfg_b);
    let start = p.now;
    p.a.connect(
        p.now,
        &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
    )
    .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    assert_eq!(p.b.state(cb), Some(CmState::ReqRcvd));
    p.advance_to(start + ms(6144));
    assert_eq!(kinds(&p.pump()), [(true, MessageKind::Req)]);
    assert_eq!(p.b.stats().dropped(DropReason::Duplicate), 1);
    assert_eq!(p.b.connection_count(), 1);
}

/// The RTU is lost: B retransmits its REP every ms(REQ's Local CM Response
/// Timeout); A, established, answers the duplicate REP with the RTU again
/// (checklist §4.7).
#[test]
fn lost_rtu_is_recovered_by_the_rep_retransmission() {
    let mut p = Pair::new();
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    p.b.accept(p.now, cb, &Rep::accepting(0x200, 0x2000))
        .unwrap();
    p.pump();
    p.a.poll_event();
    p.a.establish(ca, b"ready").unwrap();
    assert_eq!(Pair::lose(&mut p.a).len(), 1);
    assert_eq!(p.b.next_deadline(), Some(p.now + ms(4096)));
    p.advance(ms(4096));
    let log = p.pump();
    assert_eq!(
        kinds(&log),
        [(false, MessageKind::Rep), (true, MessageKind::Rtu)]
    );
    let CmMessage::Rtu(rtu) = &log[1].1 else {
        unreachable!()
    };
    assert_eq!(rtu.private_data.trimmed(), b"ready");
    assert_eq!(p.b.poll_event(), Some(Event::Established { conn: cb }));
    assert_eq!(p.a.stats().duplicates, 1);
    assert_eq!(p.b.next_deadline(), None);
    assert_eq!(p.a.poll_event(), None);
}

/// A duplicate REP before the consumer establishes gets the armed MRA.
#[test]
fn duplicate_rep_gets_the_mra() {
    let mut p = Pair::new();
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    p.b.accept(p.now, cb, &Rep::accepting(0x200, 0x2000))
        .unwrap();
    p.pump();
    assert_eq!(p.a.state(ca), Some(CmState::MraRepSent));
    p.advance(ms(4096));
    let log = p.pump();
    assert_eq!(
        kinds(&log),
        [(false, MessageKind::Rep), (true, MessageKind::Mra)]
    );
    assert_eq!(p.b.state(cb), Some(CmState::MraRepRcvd));
    // B now waits ms(24) + ms(its av.timeout 19).
    assert_eq!(p.b.next_deadline(), Some(p.now + ms(65536 + 2048)));
}

/// The peer vanishes after ESTABLISHED: the DREQ is retried with the
/// connection's interval, then DISCONNECTED (timed out) anyway, then
/// timewait and exit.
#[test]
fn dreq_to_a_vanished_peer_times_out() {
    let mut p = Pair::new();
    let (ca, _cb) = p.connect();
    let start = p.now;
    p.a.disconnect(p.now, ca, &[]).unwrap();
    let mut sends = Pair::lose(&mut p.a).len();
    for i in 1..=15 {
        p.advance_to(start + ms(6144) * i);
        sends += Pair::lose(&mut p.a).len();
    }
    assert_eq!(sends, 16);
    assert_eq!(p.a.poll_event(), None);
    p.advance_to(start + ms(6144) * 16);
    assert_eq!(
        p.a.poll_event(),
        Some(Event::Disconnected {
            conn: ca,
            timed_out: true
        })
    );
    assert_eq!(p.a.state(ca), Some(CmState::Timewait));
    p.advance(ms(2048));
    assert_eq!(p.a.poll_event(), Some(Event::TimewaitExit { conn: ca }));
    assert_eq!(p.a.connection_count(), 0);
}

/// Both sides disconnect at once: each gets one DISCONNECTED.
#[test]
fn simultaneous_disconnect() {
    let mut p = Pair::new();
    let (ca, cb) = p.connect();
    p.a.disconnect(p.now, ca, &[]).unwrap();
    p.b.disconnect(p.now, cb, &[]).unwrap();
    p.pump();
    assert_eq!(
        events(&mut p.a),
        [Event::Disconnected {
            conn: ca,
            timed_out: false
        }]
    );
    assert_eq!(
        events(&mut p.b),
        [Event::Disconnected {
            conn: cb,
            timed_out: false
        }]
    );
    // Each now holds the other's DREQ; answering it ends both.
    p.a.disconnect(p.now, ca, &[]).unwrap();
    p.b.disconnect(p.now, cb, &[]).unwrap();
    p.pump();
    assert_eq!(p.a.state(ca), Some(CmState::Timewait));
    assert_eq!(p.b.state(cb), Some(CmState::Timewait));
    assert_eq!(p.a.poll_event(), None);
    p.advance(ms(2048));
    assert_eq!(p.a.poll_event(), Some(Event::TimewaitExit { conn: ca }));
    assert_eq!(p.b.poll_event(), Some(Event::TimewaitExit { conn: cb }));
}

/// A DREQ naming another QPN is ignored (Linux does); one for no
/// connection is answered with a DREP; a duplicate DREQ in timewait gets
/// the DREP again.
#[test]
fn dreq_matching() {
    let mut p = Pair::new();
    let (ca, cb) = p.connect();
    let dreq = |qpn: u32| Dreq {
        local_comm_id: ca.comm_id(),
        remote_comm_id: cb.comm_id(),
        remote_qpn: qpn,
        private_data: PrivateData::default(),
    };
    let bytes = Mad::new(5, CmMessage::Dreq(dreq(0x201))).encode().unwrap();
    assert_eq!(
        p.b.handle_mad(p.now, path_ba(), &bytes),
        Err(DropReason::WrongQpn)
    );
    assert_eq!(p.b.state(cb), Some(CmState::Established));

    let stray = Dreq {
        local_comm_id: 0x5555,
        remote_comm_id: 0x6666,
        ..dreq(0x200)
    };
    let bytes = Mad::new(6, CmMessage::Dreq(stray)).encode().unwrap();
    p.b.handle_mad(p.now, path_ba(), &bytes).unwrap();
    let tx = p.b.poll_transmit().unwrap();
    let mad = Mad::decode(&tx.mad).unwrap();
    assert_eq!(mad.header.tid, 6);
    assert_eq!(
        mad.msg,
        CmMessage::Drep(Drep {
            local_comm_id: 0x6666,
            remote_comm_id: 0x5555,
            private_data: PrivateData::default(),
        })
    );

    p.a.disconnect(p.now, ca, &[]).unwrap();
    p.pump();
    p.b.disconnect(p.now, cb, b"drep").unwrap();
    p.pump();
    assert_eq!(p.b.state(cb), Some(CmState::Timewait));
    let bytes = Mad::new(7, CmMessage::Dreq(dreq(0x200))).encode().unwrap();
    p.b.handle_mad(p.now, path_ba(), &bytes).unwrap();
    let tx = p.b.poll_transmit().unwrap();
    let CmMessage::Drep(drep) = Mad::decode(&tx.mad).unwrap().msg else {
        panic!("not a DREP")
    };
    assert_eq!(drep.private_data.trimmed(), b"drep");
}

#[test]
fn sidr_request_and_response() {
    let mut p = Pair::new();
    let mut params = SidrParams::new(SERVICE, path_ab());
    params.private_data = PrivateData::new(b"who").unwrap();
    let ca = p.a.sidr_request(p.now, &params).unwrap();
    assert_eq!(p.a.state(ca), Some(CmState::SidrReqSent));
    p.pump();
    let Some(Event::SidrRequest { conn: cb, req, .. }) = p.b.poll_event() else {
        panic!("no SIDR request")
    };
    assert_eq!(req.request_id, ca.comm_id());
    assert_eq!(req.private_data.trimmed(), b"who");
    assert_eq!(p.b.state(cb), Some(CmState::SidrReqRcvd));
    p.b.sidr_accept(cb, 0x300, 0x0123_4567, b"here").unwrap();
    assert_eq!(p.b.state(cb), None);
    p.pump();
    let Some(Event::SidrResponse { conn, rep }) = p.a.poll_event() else {
        panic!("no SIDR response")
    };
    assert_eq!(conn, ca);
    assert_eq!(rep.status, SidrStatus::SUCCESS);
    assert_eq!((rep.qpn, rep.qkey), (0x300, 0x0123_4567));
    assert_eq!(rep.service_id, SERVICE);
    assert_eq!(rep.private_data.trimmed(), b"here");
    assert_eq!(p.a.connection_count() + p.b.connection_count(), 0);

    // No listener: status 1.
    let ca =
        p.a.sidr_request(p.now, &SidrParams::new(SERVICE + 1, path_ab()))
            .unwrap();
    p.pump();
    let Some(Event::SidrResponse { conn, rep }) = p.a.poll_event() else {
        panic!("no SIDR response")
    };
    assert_eq!((conn, rep.status), (ca, SidrStatus::UNSUPPORTED));

    // Consumer reject: status 2.
    let ca = p.a.sidr_request(p.now, &params).unwrap();
    p.pump();
    let Some(Event::SidrRequest { conn: cb, .. }) = p.b.poll_event() else {
        panic!("no SIDR request")
    };
    p.b.sidr_reject(cb, SidrStatus::REJECT, &[]).unwrap();
    p.pump();
    assert!(matches!(
        p.a.poll_event(),
        Some(Event::SidrResponse { conn, rep }) if conn == ca && rep.status == SidrStatus::REJECT
    ));
}

#[test]
fn sidr_retries_then_unreachable_and_duplicates() {
    let mut p = Pair::new();
    let start = p.now;
    let ca =
        p.a.sidr_request(p.now, &SidrParams::new(SERVICE, path_ab()))
            .unwrap();
    p.pump();
    let Some(Event::SidrRequest { .. }) = p.b.poll_event() else {
        panic!("no SIDR request")
    };
    // B's consumer does not answer: A retries every 4096 ms, B drops the
    // duplicates.
    for i in 1..=15 {
        p.advance_to(start + ms(4096) * i);
        p.pump();
    }
    assert_eq!(p.b.stats().dropped(DropReason::Duplicate), 15);
    assert_eq!(p.b.poll_event(), None);
    p.advance_to(start + ms(4096) * 16);
    assert_eq!(p.a.poll_event(), Some(Event::Unreachable { conn: ca }));
    assert_eq!(p.a.connection_count(), 0);
}

/// Linux's stale-connection rule: a REQ from a CA GUID reusing the QPN of a
/// live connection gets REJ 10, and the old connection a DREQ.
#[test]
fn stale_connection() {
    let mut p = Pair::new();
    let (_ca, cb) = p.connect();
    // A new REQ from A's GUID with the old QPN (0x100), another comm ID.
    let mut req = ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000).req;
    req.local_comm_id = 0x4242;
    req.local_ca_guid = GUID_A;
    let bytes = Mad::new(9, CmMessage::Req(req)).encode().unwrap();
    p.b.handle_mad(p.now, path_ba(), &bytes).unwrap();
    let sent: Vec<_> = Pair::lose(&mut p.b);
    assert_eq!(sent.len(), 2);
    let CmMessage::Rej(rej) = &sent[0] else {
        panic!("not a REJ")
    };
    assert_eq!(rej.reason, RejectReason::STALE_CONNECTION);
    assert_eq!(rej.remote_comm_id, 0x4242);
    assert!(matches!(&sent[1], CmMessage::Dreq(d) if d.local_comm_id == cb.comm_id()));
    assert_eq!(p.b.state(cb), Some(CmState::DreqSent));
    assert_eq!(p.b.poll_event(), None);
}

/// Destroying a connection whose REQ is unanswered withdraws it with
/// REJ(timeout), ARI = CA GUID; the passive side finds its connection by
/// that GUID.
#[test]
fn destroy_while_connecting() {
    let mut p = Pair::new();
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    p.a.destroy(p.now, ca).unwrap();
    assert_eq!(p.a.state(ca), None);
    let log = p.pump();
    let CmMessage::Rej(rej) = &log[0].1 else {
        panic!("not a REJ")
    };
    assert_eq!(rej.reason, RejectReason::TIMEOUT);
    assert_eq!(rej.ari(), &GUID_A.to_be_bytes());
    assert_eq!(rej.message, TargetMessage::Other);
    let Some(Event::Rejected { conn, rej }) = p.b.poll_event() else {
        panic!("not rejected")
    };
    assert_eq!((conn, rej.reason), (cb, RejectReason::TIMEOUT));
    assert_eq!(p.b.connection_count(), 0);
    assert_eq!(p.a.poll_event(), None);
}

/// Destroying an established connection sends one DREQ and finishes
/// timewait silently; the peer gets DISCONNECTED.
#[test]
fn destroy_established() {
    let mut p = Pair::new();
    let (ca, cb) = p.connect();
    p.a.destroy(p.now, ca).unwrap();
    assert_eq!(p.a.state(ca), Some(CmState::Timewait));
    assert!(matches!(
        p.a.disconnect(p.now, ca, &[]),
        Err(AgentError::WrongState { .. })
    ));
    assert_eq!(kinds(&p.pump()), [(true, MessageKind::Dreq)]);
    assert!(matches!(p.b.poll_event(), Some(Event::Disconnected { conn, .. }) if conn == cb));
    p.b.destroy(p.now, cb).unwrap();
    // B's DREP finds A in timewait: nothing more.
    assert_eq!(kinds(&p.pump()), [(false, MessageKind::Drep)]);
    p.advance(ms(2048));
    assert_eq!(p.a.poll_event(), None);
    assert_eq!(p.b.poll_event(), None);
    assert_eq!(p.a.connection_count() + p.b.connection_count(), 0);
}

/// The active side refuses the REP: the passive side, its REP answered,
/// is gone (Linux's `cm_rej_handler` resets REP_SENT to idle). A passive
/// side that itself refuses after its REP is out goes to timewait
/// (`cm_send_rej_locked`).
#[test]
fn a_refused_rep() {
    let mut p = Pair::new();
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    p.b.accept(p.now, cb, &Rep::accepting(0x200, 0x2000))
        .unwrap();
    p.pump();
    p.a.poll_event();
    // The active side's consumer fails to set up its QP and refuses the REP.
    p.a.reject(p.now, ca, RejectReason::CONSUMER_DEFINED, &[], &[])
        .unwrap();
    assert_eq!(p.a.state(ca), None);
    let log = p.pump();
    assert!(matches!(&log[0].1, CmMessage::Rej(r) if r.message == TargetMessage::Rep));
    assert!(matches!(p.b.poll_event(), Some(Event::Rejected { conn, .. }) if conn == cb));
    assert_eq!(p.b.state(cb), None);
    assert_eq!(p.b.next_deadline(), None);

    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x101, 0x1000),
        )
        .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    p.b.accept(p.now, cb, &Rep::accepting(0x201, 0x2000))
        .unwrap();
    p.pump();
    assert!(matches!(
        p.a.poll_event(),
        Some(Event::ConnectResponse { .. })
    ));
    p.b.reject(p.now, cb, RejectReason::CONSUMER_DEFINED, &[], &[])
        .unwrap();
    assert_eq!(p.b.state(cb), Some(CmState::Timewait));
    let log = p.pump();
    assert!(matches!(&log[0].1, CmMessage::Rej(r) if r.message == TargetMessage::Other));
    assert!(matches!(p.a.poll_event(), Some(Event::Rejected { conn, .. }) if conn == ca));
    // A had the REP: a REJ now puts it in timewait too.
    assert_eq!(p.a.state(ca), Some(CmState::Timewait));
    p.advance(ms(2048));
    assert_eq!(p.a.poll_event(), Some(Event::TimewaitExit { conn: ca }));
    assert_eq!(p.b.poll_event(), Some(Event::TimewaitExit { conn: cb }));
}

#[test]
fn lost_rep_retried_then_unreachable() {
    let mut p = Pair::new();
    p.a.connect(
        p.now,
        &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
    )
    .unwrap();
    p.pump();
    let cb = expect_connect_request(&mut p.b);
    let start = p.now;
    p.b.accept(p.now, cb, &Rep::accepting(0x200, 0x2000))
        .unwrap();
    Pair::lose(&mut p.b);
    // A's REQ retransmissions would reach B; keep them from it too.
    for i in 1..=15 {
        p.advance_to(start + ms(4096) * i);
        Pair::lose(&mut p.a);
        assert_eq!(Pair::lose(&mut p.b).len(), 1);
    }
    p.advance_to(start + ms(4096) * 16);
    assert_eq!(p.b.poll_event(), Some(Event::Unreachable { conn: cb }));
    assert_eq!(p.b.connection_count(), 0);
}

/// A flood of REQs cannot grow the table past its bound; each refusal is
/// counted. Listeners and queues are bounded too.
#[test]
fn tables_are_bounded() {
    let mut cfg = AgentConfig::new(GUID_B, 3);
    cfg.max_connections = 8;
    cfg.max_listeners = 2;
    cfg.max_queued = 4;
    let mut b = Agent::new(cfg);
    b.listen(SERVICE).unwrap();
    b.listen(SERVICE + 1).unwrap();
    assert_eq!(
        b.listen(SERVICE),
        Err(AgentError::AlreadyListening(SERVICE))
    );
    assert_eq!(b.listen(SERVICE + 2), Err(AgentError::TooManyListeners(2)));
    let now = Instant::now();
    for i in 0..100u32 {
        let mut req = ConnectParams::new(SERVICE, path_ab(), i, 0).req;
        req.local_comm_id = i;
        req.local_ca_guid = GUID_A;
        let bytes = Mad::new(u64::from(i), CmMessage::Req(req))
            .encode()
            .unwrap();
        let r = b.handle_mad(now, path_ba(), &bytes);
        assert_eq!(r.is_err(), i >= 8, "REQ {i}");
        b.check_consistency().unwrap();
    }
    assert_eq!(b.connection_count(), 8);
    assert_eq!(b.stats().dropped(DropReason::TableFull), 92);
    assert_eq!(b.stats().events_lost, 4);
    assert_eq!(events(&mut b).len(), 4);
    // The transmit queue: REJs to an unknown service beyond 4 are lost.
    for i in 0..10u32 {
        let mut req = ConnectParams::new(SERVICE + 7, path_ab(), 1000 + i, 0).req;
        req.local_comm_id = 1000 + i;
        let bytes = Mad::new(0, CmMessage::Req(req)).encode().unwrap();
        b.handle_mad(now, path_ba(), &bytes).unwrap();
    }
    assert_eq!(b.stats().transmits_lost, 6);
    assert_eq!(b.stats().sent(MessageKind::Rej), 4);
    // The consumer cannot exceed the bound either.
    assert_eq!(
        b.connect(now, &ConnectParams::new(SERVICE, path_ba(), 1, 1)),
        Err(AgentError::TooManyConnections(8))
    );
}

#[test]
fn garbage_and_unmatched_mads_are_dropped() {
    let mut p = Pair::new();
    let now = p.now;
    assert_eq!(
        p.b.handle_mad(now, path_ba(), &[0u8; 10]),
        Err(DropReason::Malformed)
    );
    let mut lap = Mad::new(0, CmMessage::Rtu(Rtu::default()))
        .encode()
        .unwrap();
    lap[17] = 0x19;
    assert_eq!(
        p.b.handle_mad(now, path_ba(), &lap),
        Err(DropReason::Unsupported)
    );
    for msg in [
        CmMessage::Rep(Rep::default()),
        CmMessage::Rtu(Rtu::default()),
        CmMessage::Drep(Drep::default()),
        CmMessage::Mra(Mra::default()),
        CmMessage::Rej(Rej::default()),
        CmMessage::SidrRep(SidrRep::default()),
    ] {
        let bytes = Mad::new(0, msg).encode().unwrap();
        assert_eq!(
            p.b.handle_mad(now, path_ba(), &bytes),
            Err(DropReason::UnknownConnection)
        );
    }
    assert_eq!(p.b.poll_transmit(), None);
    assert_eq!(p.b.stats().dropped(DropReason::UnknownConnection), 6);
    assert_eq!(p.b.stats().received(MessageKind::Rep), 1);
    // A REQ with a P_Key other than 0xFFFF: REJ 12 with the port GID.
    let mut req = ConnectParams::new(SERVICE, path_ab(), 1, 1).req;
    req.pkey = 0x8001;
    let bytes = Mad::new(0, CmMessage::Req(req)).encode().unwrap();
    p.b.handle_mad(now, path_ba(), &bytes).unwrap();
    let CmMessage::Rej(rej) = Mad::decode(&p.b.poll_transmit().unwrap().mad).unwrap().msg else {
        panic!("not a REJ")
    };
    assert_eq!(rej.reason, RejectReason::INVALID_GID);
    assert_eq!(rej.ari(), &gid_b().0);
}

#[test]
fn consumer_calls_in_the_wrong_state_change_nothing() {
    let mut p = Pair::new();
    let ca =
        p.a.connect(
            p.now,
            &ConnectParams::new(SERVICE, path_ab(), 0x100, 0x1000),
        )
        .unwrap();
    Pair::lose(&mut p.a);
    assert!(matches!(
        p.a.accept(p.now, ca, &Rep::default()),
        Err(AgentError::WrongState {
            state: CmState::ReqSent,
            ..
        })
    ));
    assert!(p.a.establish(ca, &[]).is_err());
    assert!(p.a.disconnect(p.now, ca, &[]).is_err());
    assert!(p.a.sidr_accept(ca, 1, 1, &[]).is_err());
    let gone = ConnId::clone(&ca);
    p.a.destroy(p.now, ca).unwrap();
    assert_eq!(
        p.a.destroy(p.now, gone),
        Err(AgentError::UnknownConnection(gone))
    );
    let mut params = ConnectParams::new(SERVICE, path_ab(), 1 << 24, 0);
    assert!(matches!(
        p.a.connect(p.now, &params),
        Err(AgentError::Encode(_))
    ));
    params.req.local_qpn = 1;
    assert_eq!(p.a.connection_count(), 0);
    assert!(p.a.connect(p.now, &params).is_ok());
}

/// Agents with the same seed make the same IDs; with different seeds,
/// different ones.
#[test]
fn comm_ids_come_from_the_seed() {
    let ids = |seed| {
        let mut a = Agent::new(AgentConfig::new(GUID_A, seed));
        let now = Instant::now();
        (0..4)
            .map(|_| {
                a.connect(now, &ConnectParams::new(SERVICE, path_ab(), 1, 1))
                    .unwrap()
                    .comm_id()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(5), ids(5));
    assert_ne!(ids(5), ids(6));
    assert!(ids(5).iter().all(|&id| id != 0));
}

trait EventsLen {
    fn events_len(&mut self) -> usize;
}

impl EventsLen for Agent {
    /// Drains the events and counts them.
    fn events_len(&mut self) -> usize {
        events(self).len()
    }
}
