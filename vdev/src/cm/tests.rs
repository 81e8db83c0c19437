//! The service's state without hostd: two devices' [`State`]s whose QP1s
//! are a queue in memory, for the ID and port-space rules, the checks on
//! connect requests and hostile MADs.

use std::cell::RefCell;
use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Instant;

use vrdma_cm::{DropReason, MessageKind};
use vrdma_hostd_protocol::messages::{MadIn, MadOut};
use vrdma_spec::gid::ipv4_mapped;
use vrdma_spec::verbs::QpState;

use super::event::{CmEventKind, MAX_QUEUED_EVENTS};
use super::state::{CmConfig, Qp1, State};
use super::{ConnParam, IdState, OwnerId, PortSpace};
use crate::fabric::FabricError;

/// A QP1 that keeps what is sent, and knows which GIDs are reachable.
#[derive(Default)]
struct Loop {
    sent: RefCell<Vec<MadOut>>,
    reachable: HashSet<[u8; 16]>,
    /// resolve_gid calls (hostd round trips).
    asked: std::cell::Cell<usize>,
}

impl Qp1 for Loop {
    fn send_mad(&self, mad: MadOut) -> Result<(), FabricError> {
        self.sent.borrow_mut().push(mad);
        Ok(())
    }

    fn resolve_gid(&self, gid: [u8; 16]) -> Result<(), FabricError> {
        self.asked.set(self.asked.get() + 1);
        match self.reachable.contains(&gid) {
            true => Ok(()),
            false => Err(FabricError::Refused {
                errno: libc::EACCES,
                reason: "not reachable".into(),
            }),
        }
    }
}

const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

struct Dev {
    st: State,
    qp1: Loop,
    ip: Ipv4Addr,
}

fn dev(ip: Ipv4Addr) -> Dev {
    dev_with(ip, CmConfig::default())
}

fn dev_with(ip: Ipv4Addr, config: CmConfig) -> Dev {
    let st = State::new(Arc::from("t"), ipv4_mapped(ip.octets()), config).unwrap();
    let mut qp1 = Loop::default();
    qp1.reachable.insert(ipv4_mapped(A.octets()));
    qp1.reachable.insert(ipv4_mapped(B.octets()));
    qp1.reachable.insert(ipv4_mapped([10, 0, 0, 9]));
    Dev { st, qp1, ip }
}

/// Hands what `from` sent to `to`, as from GID `src`.
fn deliver(from: &Dev, src: Ipv4Addr, to: &mut Dev) -> usize {
    let mads: Vec<MadOut> = from.qp1.sent.borrow_mut().drain(..).collect();
    let now = Instant::now();
    for m in &mads {
        let mad = MadIn {
            peer: ipv4_mapped(src.octets()),
            peer_qpn: 1,
            traffic_class: 0,
            mad: m.mad.clone(),
        };
        to.st.handle_mad(now, &mad);
    }
    to.st.flush(now, &to.qp1);
    mads.len()
}

fn listen(d: &mut Dev, owner: OwnerId, port: u16) -> super::IdNum {
    let id = d.st.create_id(owner, PortSpace::Tcp, None).unwrap();
    d.st.bind_addr(owner, id, SocketAddrV4::new(d.ip, port))
        .unwrap();
    d.st.listen(owner, id, 0).unwrap();
    id
}

/// An ID of `owner` on `d` resolved towards `to`, its events taken.
fn resolved(d: &mut Dev, owner: OwnerId, to: SocketAddrV4) -> super::IdNum {
    let id = d.st.create_id(owner, PortSpace::Tcp, None).unwrap();
    d.st.resolve_addr(owner, id, None, to, &d.qp1).unwrap();
    d.st.resolve_route(owner, id).unwrap();
    let kinds: Vec<_> = std::iter::from_fn(|| d.st.get_event(owner).unwrap())
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        [CmEventKind::AddrResolved, CmEventKind::RouteResolved]
    );
    id
}

#[test]
fn commands_follow_the_id_state_machine_and_its_owner() {
    let mut a = dev(A);
    let (o1, o2) = (a.st.create_owner().unwrap(), a.st.create_owner().unwrap());
    let id = a.st.create_id(o1, PortSpace::Tcp, None).unwrap();
    let errno = |r: Result<(), super::CmError>| r.map_err(|e| e.errno());
    let now = Instant::now();
    // Nothing before its time.
    assert_eq!(errno(a.st.resolve_route(o1, id)), Err(libc::EINVAL));
    assert_eq!(
        errno(a.st.connect(now, o1, id, &ConnParam::default(), &a.qp1)),
        Err(libc::EINVAL)
    );
    assert_eq!(
        errno(a.st.disconnect(now, o1, id, &a.qp1)),
        Err(libc::EINVAL)
    );
    // Another owner's ID is not there for o2.
    assert_eq!(errno(a.st.listen(o2, id, 1)), Err(libc::EINVAL));
    assert_eq!(
        errno(a.st.destroy_id(now, o2, id, &a.qp1)),
        Err(libc::EINVAL)
    );
    // A foreign address: EADDRNOTAVAIL; bound once only.
    let foreign = SocketAddrV4::new(B, 1);
    assert_eq!(
        a.st.bind_addr(o1, id, foreign).map_err(|e| e.errno()),
        Err(libc::EADDRNOTAVAIL)
    );
    let bound = a.st.bind_addr(o1, id, SocketAddrV4::new(A, 0)).unwrap();
    assert!(bound.port() >= 32768);
    assert_eq!(
        a.st.bind_addr(o1, id, SocketAddrV4::new(A, 0))
            .map_err(|e| e.errno()),
        Err(libc::EINVAL)
    );
    a.st.listen(o1, id, 1).unwrap();
    assert_eq!(errno(a.st.listen(o1, id, 1)), Err(libc::EINVAL));
    assert_eq!(a.st.query(o1, id).unwrap().state, IdState::Listen);
    // UDP ids refuse an RC QP type, IPoIB is not served.
    assert!(a
        .st
        .create_id(o1, PortSpace::Udp, Some(vrdma_spec::verbs::QpType::Rc))
        .is_err());
    assert!(a.st.create_id(o1, PortSpace::Ipoib, None).is_err());
    // Closing the owner frees the port.
    a.st.close_owner(now, o1, &a.qp1);
    let id = a.st.create_id(o2, PortSpace::Tcp, None).unwrap();
    a.st.bind_addr(o2, id, SocketAddrV4::new(A, bound.port()))
        .unwrap();
    assert_eq!(a.st.counters().ids, 1);
    assert_eq!(a.st.counters().owners, 1);
}

#[test]
fn private_data_is_bounded_by_each_message() {
    let (mut a, mut b) = (dev(A), dev(B));
    let (oa, ob) = (a.st.create_owner().unwrap(), b.st.create_owner().unwrap());
    listen(&mut b, ob, 80);
    let id = resolved(&mut a, oa, SocketAddrV4::new(B, 80));
    let now = Instant::now();
    let long = |n: usize| ConnParam {
        private_data: vec![7; n],
        ..ConnParam::default()
    };
    let e = a.st.connect(now, oa, id, &long(57), &a.qp1).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    a.st.connect(now, oa, id, &long(56), &a.qp1).unwrap();
    deliver(&a, A, &mut b);
    let req = b.st.get_event(ob).unwrap().unwrap();
    assert_eq!(req.kind, CmEventKind::ConnectRequest);
    assert_eq!(req.private_data(), &[7; 56][..]);
    let e =
        b.st.accept(now, ob, req.id, &long(197), &b.qp1)
            .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    let e = b.st.reject(now, ob, req.id, &[1; 149], &b.qp1).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    b.st.reject(now, ob, req.id, &[1; 148], &b.qp1).unwrap();
    deliver(&b, B, &mut a);
    let rej = a.st.get_event(oa).unwrap().unwrap();
    assert_eq!((rej.kind, rej.status), (CmEventKind::Rejected, 28));
    assert_eq!(rej.private_data(), &[1; 148][..]);
}

#[test]
fn requests_not_meant_for_the_listener_are_refused_as_linux_refuses_them() {
    let (mut a, mut b) = (dev(A), dev(B));
    let (oa, ob) = (a.st.create_owner().unwrap(), b.st.create_owner().unwrap());
    listen(&mut b, ob, 80);
    let now = Instant::now();
    // The CMA header names 10.0.0.9, not B: REJ 28, no event.
    let id = resolved(
        &mut a,
        oa,
        SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 80),
    );
    a.st.connect(now, oa, id, &ConnParam::default(), &a.qp1)
        .unwrap();
    deliver(&a, A, &mut b);
    // The header's source (A) is not the GID it came from.
    let id2 = resolved(&mut a, oa, SocketAddrV4::new(B, 80));
    a.st.connect(now, oa, id2, &ConnParam::default(), &a.qp1)
        .unwrap();
    deliver(&a, Ipv4Addr::new(10, 0, 0, 9), &mut b);
    assert!(b.st.get_event(ob).unwrap().is_none());
    let c = b.st.counters();
    assert_eq!(c.requests_refused, 2);
    assert_eq!(c.sent(MessageKind::Rej), 2);
    // The REJ that went back to A names its REQ.
    deliver(&b, B, &mut a);
    let rej = a.st.get_event(oa).unwrap().unwrap();
    assert_eq!(
        (rej.kind, rej.id, rej.status),
        (CmEventKind::Rejected, id, 28)
    );
}

#[test]
fn hostile_mads_change_nothing_and_are_counted() {
    let mut b = dev(B);
    let ob = b.st.create_owner().unwrap();
    listen(&mut b, ob, 80);
    let now = Instant::now();
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for n in 0..5000u32 {
        let len = match n % 4 {
            0 => (next() % 300) as usize,
            _ => 256,
        };
        let mut mad: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if n % 2 == 1 && len >= 24 {
            // A CM MAD header with a real attribute, random body.
            mad[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
            let attr = 0x10 + (next() % 11) as u16;
            mad[16..18].copy_from_slice(&attr.to_be_bytes());
        }
        let m = MadIn {
            peer: ipv4_mapped([10, 0, 0, (next() % 4) as u8]),
            peer_qpn: 1,
            traffic_class: 0,
            mad,
        };
        b.st.handle_mad(now, &m);
        b.st.flush(now, &b.qp1);
    }
    let c = b.st.counters();
    assert!(c.dropped(DropReason::Malformed) > 0);
    assert_eq!(c.connections_live, 0);
    // Whatever requests got through were answered or refused; the listener
    // is still there.
    let l = b.st.counters().listeners;
    assert_eq!(l, 1);
    b.st.tick(now + std::time::Duration::from_secs(3600));
    b.st.flush(now, &b.qp1);
}

#[test]
fn a_full_event_queue_drops_and_counts() {
    let mut a = dev(A);
    let oa = a.st.create_owner().unwrap();
    for _ in 0..=MAX_QUEUED_EVENTS {
        let id = a.st.create_id(oa, PortSpace::Tcp, None).unwrap();
        a.st.resolve_addr(oa, id, None, SocketAddrV4::new(B, 1), &a.qp1)
            .unwrap();
    }
    assert_eq!(a.st.counters().events_dropped, 1);
    assert!(a.st.get_event(oa).unwrap().is_some());
}

#[test]
fn unreachable_and_unknown_destinations_give_one_answer() {
    let mut a = dev(A);
    let oa = a.st.create_owner().unwrap();
    let mut statuses = Vec::new();
    for dst in [Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(10, 0, 0, 77)] {
        let id = a.st.create_id(oa, PortSpace::Tcp, None).unwrap();
        a.st.resolve_addr(oa, id, None, SocketAddrV4::new(dst, 1), &a.qp1)
            .unwrap();
        let e = a.st.get_event(oa).unwrap().unwrap();
        assert_eq!(e.kind, CmEventKind::AddrError);
        statuses.push(e.status);
        assert_eq!(a.st.query(oa, id).unwrap().state, IdState::AddrBound);
    }
    assert_eq!(statuses, [-libc::EHOSTUNREACH; 2]);
    // And the INIT attributes of a UD ID carry rdma_cm's Q_Key.
    let u = a.st.create_id(oa, PortSpace::Udp, None).unwrap();
    let init = a.st.init_qp_attr(oa, u, QpState::Init).unwrap();
    assert_eq!(init.qkey, super::qp_attr::RDMA_UDP_QKEY);
}

/// hostd's yes is remembered for a second (one round trip per peer, not
/// per connection); its no is not: a peer the policy starts allowing
/// resolves at once.
#[test]
fn reachable_destinations_are_asked_once_and_refused_ones_every_time() {
    let mut a = dev(A);
    let oa = a.st.create_owner().unwrap();
    let resolve = |a: &mut Dev, dst: Ipv4Addr| {
        let id = a.st.create_id(oa, PortSpace::Tcp, None).unwrap();
        a.st.resolve_addr(oa, id, None, SocketAddrV4::new(dst, 1), &a.qp1)
            .unwrap();
        a.st.get_event(oa).unwrap().unwrap().kind
    };
    for _ in 0..3 {
        assert_eq!(resolve(&mut a, B), CmEventKind::AddrResolved);
    }
    assert_eq!(a.qp1.asked.get(), 1, "B asked once");
    let c = Ipv4Addr::new(10, 0, 0, 3);
    for _ in 0..2 {
        assert_eq!(resolve(&mut a, c), CmEventKind::AddrError);
    }
    assert_eq!(a.qp1.asked.get(), 3, "C asked each time");
    a.qp1.reachable.insert(ipv4_mapped(c.octets()));
    assert_eq!(resolve(&mut a, c), CmEventKind::AddrResolved);
}

#[test]
fn a_listener_holds_at_most_max_pending_unanswered_requests_whatever_its_backlog() {
    let config = CmConfig {
        max_pending: 2,
        ..CmConfig::default()
    };
    let (mut a, mut b) = (dev(A), dev_with(B, config));
    let (oa, ob) = (a.st.create_owner().unwrap(), b.st.create_owner().unwrap());
    let l = b.st.create_id(ob, PortSpace::Tcp, None).unwrap();
    b.st.bind_addr(ob, l, SocketAddrV4::new(B, 80)).unwrap();
    // A backlog of 1 is not what bounds it (Linux's CM ignores it on RoCE).
    b.st.listen(ob, l, 1).unwrap();
    let now = Instant::now();
    let mut qpn = 0x100;
    let mut connect = |a: &mut Dev, b: &mut Dev| {
        let id = resolved(a, oa, SocketAddrV4::new(B, 80));
        // Each from a QP of its own (a second REQ of one QP is stale).
        qpn += 1;
        let param = ConnParam {
            qp_num: qpn,
            ..ConnParam::default()
        };
        a.st.connect(now, oa, id, &param, &a.qp1).unwrap();
        deliver(a, A, b);
        deliver(b, B, a);
        id
    };
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            connect(&mut a, &mut b);
            let req = b.st.get_event(ob).unwrap().expect("a request");
            assert_eq!(req.kind, CmEventKind::ConnectRequest);
            req.id
        })
        .collect();
    // The third finds two unanswered: REJ 28 (consumer defined), as the
    // cma refuses a request it cannot take.
    let third = connect(&mut a, &mut b);
    assert!(b.st.get_event(ob).unwrap().is_none(), "not delivered");
    let rej = a.st.get_event(oa).unwrap().expect("refused");
    assert_eq!(
        (rej.id, rej.kind, rej.status),
        (third, CmEventKind::Rejected, 28)
    );
    assert_eq!(b.st.counters().requests_refused, 1);
    // One answered makes room for the next.
    b.st.destroy_id(now, ob, waiting[0], &b.qp1).unwrap();
    deliver(&b, B, &mut a);
    assert_eq!(
        a.st.get_event(oa).unwrap().expect("REJ").kind,
        CmEventKind::Rejected
    );
    connect(&mut a, &mut b);
    let req = b.st.get_event(ob).unwrap().expect("room again");
    assert_eq!(req.kind, CmEventKind::ConnectRequest);
}

#[test]
fn destroying_an_unanswered_request_frees_its_place_in_the_backlog() {
    let (mut a, mut b) = (dev(A), dev(B));
    let (oa, ob) = (a.st.create_owner().unwrap(), b.st.create_owner().unwrap());
    let l = b.st.create_id(ob, PortSpace::Tcp, None).unwrap();
    b.st.bind_addr(ob, l, SocketAddrV4::new(B, 80)).unwrap();
    b.st.listen(ob, l, 1).unwrap();
    let now = Instant::now();
    for round in 0..3 {
        let id = resolved(&mut a, oa, SocketAddrV4::new(B, 80));
        a.st.connect(now, oa, id, &ConnParam::default(), &a.qp1)
            .unwrap();
        deliver(&a, A, &mut b);
        let req = b.st.get_event(ob).unwrap().expect("a request each round");
        assert_eq!(req.kind, CmEventKind::ConnectRequest, "round {round}");
        // Destroyed unanswered: REJ to the requester, room in the backlog.
        b.st.destroy_id(now, ob, req.id, &b.qp1).unwrap();
        deliver(&b, B, &mut a);
        let rej = a.st.get_event(oa).unwrap().unwrap();
        assert_eq!((rej.kind, rej.status), (CmEventKind::Rejected, 28));
    }
    assert_eq!(b.st.counters().requests_refused, 0);
}
