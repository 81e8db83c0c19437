//! UD and UC between the two devices of [`Env`]: datagrams with their GRH,
//! Q_Keys, drops and their counts, address handles, and UC's requester
//! that never waits for its responder.

use std::time::Duration;

use vrdma_hostd_protocol::messages::{AhSetup, QpModify};
use vrdma_spec::ring::{send_flags, wc_flags, Cqe, UdDest, GRH_SIZE, QKEY_CONTROLLED};
use vrdma_spec::verbs::{QpState, SendOpcode, WcOpcode, WcStatus};

use super::testing::{connection, gid, remote, send, sge, Env, IOVA};
use super::ud::DropCounts;
use super::EngineError;

const QKEY: u32 = 0x1111_1111;
/// A's UD QP.
const A_UD: u32 = 0x101;
/// B's UD QP.
const B_UD: u32 = 0x201;
/// A's AH towards B.
const AH: u32 = 77;

fn ids(cs: &[Cqe]) -> Vec<(u64, WcStatus)> {
    cs.iter()
        .map(|c| (c.wr_id.get(), WcStatus::try_from(c.status).expect("status")))
        .collect()
}

/// Moves UD QP `vqpn` of device `id` to RTS with Q_Key `qkey`.
fn ud_up(env: &mut Env, id: u64, vqpn: u32, qkey: u32) {
    for (state, qkey) in [
        (QpState::Init, Some(qkey)),
        (QpState::Rtr, None),
        (QpState::Rts, None),
    ] {
        let m = QpModify {
            vqpn,
            state: state.into(),
            connection: None,
            access: None,
            qkey,
        };
        env.engine.modify_qp(id, &m).expect("modify");
    }
}

/// An AH numbered `ahn` of device `id` towards `dgid`, hop limit 64,
/// traffic class 0x20.
fn ah(ahn: u32, dgid: [u8; 16]) -> AhSetup {
    AhSetup {
        ahn,
        pd: 1,
        dgid,
        dlid: None,
        flow_label: 0,
        hop_limit: 64,
        traffic_class: 0x20,
    }
}

/// The env with a UD QP on each side (QP 1 of A and of B, in RTS with
/// [`QKEY`]) and A's AH [`AH`] towards B.
fn ud_env() -> Env {
    let mut env = Env::new();
    env.a.add_qp_of(&mut env.engine, A_UD, 4);
    env.b.add_qp_of(&mut env.engine, B_UD, 4);
    ud_up(&mut env, 1, A_UD, QKEY);
    ud_up(&mut env, 2, B_UD, QKEY);
    env.engine.create_ah(1, &ah(AH, gid(20))).expect("ah");
    env
}

/// A's UD send of `text` (from A's data offset 0) to B's QP `qpn` with
/// `qkey`, through AH `ahn`.
fn ud_send(env: &mut Env, wr_id: u64, text: &[u8], (ahn, qpn, qkey): (u32, u32, u32)) {
    env.a.fill(0, text);
    let mut wqe = send(wr_id, SendOpcode::SendWithImm);
    wqe.imm_data = [9, 8, 7, 6];
    UdDest {
        ah: ahn,
        remote_qpn: qpn,
        remote_qkey: qkey,
    }
    .write(&mut wqe);
    let lkey = env.a.lkey;
    let len = u32::try_from(text.len()).expect("short");
    env.a.post_sges(1, &wqe, &[sge(IOVA, len, lkey)]);
}

fn dropped(env: &Env, id: u64) -> DropCounts {
    env.engine.device_counters(id).expect("device").dropped
}

#[test]
fn a_datagram_lands_after_its_grh_with_the_senders_qpn() {
    let mut env = ud_env();
    let lkey = env.b.lkey;
    env.b.post_recv(1, 5, &[sge(IOVA + 0x100, 40 + 64, lkey)]);
    ud_send(&mut env, 1, b"datagram", (AH, B_UD, QKEY));
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert_eq!(ids(&b), vec![(5, WcStatus::Success)]);
    let r = &b[0];
    assert_eq!(r.opcode, u8::from(WcOpcode::Recv));
    assert_eq!(r.byte_len.get(), GRH_SIZE + 8, "GRH and message");
    assert_eq!(r.wc_flags, wc_flags::GRH | wc_flags::WITH_IMM);
    assert_eq!(r.imm_data, [9, 8, 7, 6]);
    assert_eq!((r.qp_num.get(), r.src_qp.get()), (B_UD, A_UD));
    assert_eq!(r.slid.get(), 0, "an Ethernet port has no LID");
    assert_eq!(env.b.bytes(0x100 + 40, 8), b"datagram");
    // The GRH as rxe writes it for RoCEv2 over IPv4: 20 zero bytes, then
    // the IPv4 header of the packet.
    let grh = env.b.bytes(0x100, 40);
    assert_eq!(grh[..20], [0; 20]);
    let ip = &grh[20..];
    assert_eq!(ip[0], 0x45, "IPv4, 20-byte header");
    assert_eq!(ip[1], 0x20, "TOS: the AH's traffic class");
    // IPv4 20 + UDP 8 + BTH 12 + DETH 8 + immediate 4 + 8 + ICRC 4.
    assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 64);
    assert_eq!(u16::from_be_bytes([ip[6], ip[7]]), 0x4000, "DF");
    assert_eq!(ip[8], 64, "TTL: the AH's hop limit");
    assert_eq!(ip[9], 17, "UDP");
    assert_eq!(ip[12..16], gid(10)[12..], "source: A's IPv4 address");
    assert_eq!(ip[16..20], gid(20)[12..], "destination: B's");
    // The header checksum sums to 0xffff.
    let sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    assert_eq!((sum & 0xffff) + (sum >> 16), 0xffff);
}

/// On an InfiniBand port: a datagram through an AH without a GRH (named
/// by LID; hostd put the LID's GID in `dgid`) arrives without one — the
/// 40 bytes before the message untouched, no `GRH` flag —, one through an
/// AH with a GRH arrives with it, and both name the sending port's LID.
#[test]
fn on_infiniband_a_datagram_has_a_grh_only_if_its_ah_had_one_and_names_its_senders_lid() {
    let mut env = ud_env();
    let policy = super::testing::tenant("ta", vrdma_tenant_policy::PriorityClass::Normal);
    let port = super::Address {
        gid: gid(30),
        lid: 7,
    };
    let mut c = super::testing::Side::at(&mut env.engine, 3, port, &policy);
    let c_ud = c.add_qp_of(&mut env.engine, 0x301, 4);
    ud_up(&mut env, 3, 0x301, QKEY);
    let by_lid = AhSetup {
        dlid: Some(2),
        ..ah(1, gid(20))
    };
    env.engine.create_ah(3, &by_lid).expect("AH by LID");
    env.engine
        .create_ah(3, &ah(2, gid(20)))
        .expect("AH with a GRH");
    let lkey = env.b.lkey;
    env.b.fill(0x100, &[0xaa; 40]);
    env.b.post_recv(1, 5, &[sge(IOVA + 0x100, 40 + 64, lkey)]);
    env.b.post_recv(1, 6, &[sge(IOVA + 0x200, 40 + 64, lkey)]);
    for (wr_id, ahn) in [(1, 1), (2, 2)] {
        c.fill(0, b"from C");
        let mut wqe = send(wr_id, SendOpcode::Send);
        UdDest {
            ah: ahn,
            remote_qpn: B_UD,
            remote_qkey: QKEY,
        }
        .write(&mut wqe);
        let lkey = c.lkey;
        c.post_sges(c_ud, &wqe, &[sge(IOVA, 6, lkey)]);
    }
    for _ in 0..100 {
        env.engine.round(&[3, 2], env.now);
    }
    assert_eq!(
        ids(&c.poll()),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let b = env.b.poll();
    assert_eq!(
        ids(&b),
        vec![(5, WcStatus::Success), (6, WcStatus::Success)]
    );
    let flags_lids: Vec<_> = b.iter().map(|r| (r.wc_flags, r.slid.get())).collect();
    assert_eq!(flags_lids, [(0, 7), (wc_flags::GRH, 7)]);
    assert!(b.iter().all(|r| r.byte_len.get() == GRH_SIZE + 6));
    assert_eq!(env.b.bytes(0x100, 40), [0xaa; 40], "no GRH written");
    assert_eq!(env.b.bytes(0x100 + 40, 6), b"from C");
    assert_eq!(env.b.bytes(0x200 + 40, 6), b"from C");
    assert_eq!(env.b.bytes(0x200 + 20, 1), [0x45], "the GRH, as on RoCE");
}

#[test]
fn a_wrong_qkey_is_dropped_and_counted_and_a_controlled_one_uses_the_senders() {
    let mut env = ud_env();
    let lkey = env.b.lkey;
    env.b.post_recv(1, 5, &[sge(IOVA, 256, lkey)]);
    ud_send(&mut env, 1, b"x", (AH, B_UD, QKEY + 1));
    let (a, b) = env.run();
    // The sender cannot tell: its send completed.
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert!(b.is_empty(), "dropped");
    assert_eq!(dropped(&env, 2).qkey, 1);
    // A Q_Key with the high bit set: the sending QP's own (QKEY) is used,
    // which matches.
    ud_send(&mut env, 2, b"y", (AH, B_UD, QKEY_CONTROLLED | 5));
    let (_, b) = env.run();
    assert_eq!(
        ids(&b),
        vec![(5, WcStatus::Success)],
        "the receive was kept"
    );
    // The receiver's Q_Key changes: the old one no longer reaches it.
    let m = QpModify {
        vqpn: B_UD,
        state: QpState::Rts.into(),
        connection: None,
        access: None,
        qkey: Some(QKEY + 1),
    };
    env.engine.modify_qp(2, &m).expect("new qkey");
    env.b.post_recv(1, 6, &[sge(IOVA, 256, lkey)]);
    ud_send(&mut env, 3, b"z", (AH, B_UD, QKEY));
    let (_, b) = env.run();
    assert!(b.is_empty());
    assert_eq!(dropped(&env, 2).qkey, 2);
}

#[test]
fn datagrams_without_a_receive_or_a_qp_are_dropped_and_counted() {
    let mut env = ud_env();
    ud_send(&mut env, 1, b"none posted", (AH, B_UD, QKEY));
    ud_send(&mut env, 2, b"no such QP", (AH, 0x999, QKEY));
    // B's RC QP is no UD QP.
    ud_send(&mut env, 3, b"an RC QP", (AH, 200, QKEY));
    let (a1, b1) = env.run();
    let lkey = env.b.lkey;
    env.b.post_recv(1, 7, &[sge(IOVA, 40 + 4, lkey)]);
    ud_send(&mut env, 4, b"too long for the buffer", (AH, B_UD, QKEY));
    let (a2, b2) = env.run();
    let (a, b) = ([a1, a2].concat(), [b1, b2].concat());
    assert_eq!(
        ids(&a),
        (1..=4).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    assert!(b.is_empty());
    let d = dropped(&env, 2);
    assert_eq!((d.no_receive, d.no_qp, d.invalid, d.qkey), (1, 2, 1, 0));
    // The short receive is still posted: a message that fits takes it.
    ud_send(&mut env, 5, b"fits", (AH, B_UD, QKEY));
    let (_, b) = env.run();
    assert_eq!(ids(&b), vec![(7, WcStatus::Success)]);
}

#[test]
fn what_a_ud_wqe_cannot_be_fails_at_the_sender() {
    let mut env = ud_env();
    env.engine.set_port_mtu(1024);
    // Longer than the port's MTU.
    ud_send(&mut env, 1, &[7; 1025], (AH, B_UD, QKEY));
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::LocLenErr)]);
    // A QP in ERR after a failed WQE: reset and bring it up again.
    env.modify(1, A_UD, QpState::Reset, None).expect("reset");
    ud_up(&mut env, 1, A_UD, QKEY);
    // No such address handle.
    ud_send(&mut env, 2, b"x", (AH + 1, B_UD, QKEY));
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(2, WcStatus::LocQpOpErr)]);
    env.modify(1, A_UD, QpState::Reset, None).expect("reset");
    ud_up(&mut env, 1, A_UD, QKEY);
    // An RDMA WRITE on a UD QP (the guest driver refuses it; a hostile
    // one's WQE fails here).
    let wqe = remote(send(3, SendOpcode::RdmaWrite), IOVA, env.b.rkey);
    let lkey = env.a.lkey;
    env.a.post_sges(1, &wqe, &[sge(IOVA, 8, lkey)]);
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(3, WcStatus::LocQpOpErr)]);
    assert!(b.is_empty());
}

#[test]
fn address_handles_reach_only_devices_of_this_host_and_their_tenant() {
    let mut env = ud_env();
    // A GID no device of this host has, and no fabric to reach it on
    // (`wire::tests_unreliable` has UD between hosts).
    let far = vrdma_spec::gid::ipv4_mapped([10, 9, 9, 9]);
    assert_eq!(
        env.engine.create_ah(1, &ah(1, far)),
        Err(EngineError::Unsupported(
            "UD towards another host (this hostd is on no fabric)"
        ))
    );
    assert_eq!(
        env.engine
            .create_ah(1, &ah(AH, gid(20)))
            .map_err(|e| e.errno()),
        Err(libc::EEXIST)
    );
    // B's device goes, and a device of another tenant takes its GID: the
    // AH (checked against B's tenant) delivers nothing to it.
    env.engine.detach_device(2);
    let other = super::testing::tenant("other", vrdma_tenant_policy::PriorityClass::Normal);
    let mut c = super::testing::Side::new(&mut env.engine, 3, 20, &other);
    c.add_qp_of(&mut env.engine, 0x300, 4);
    c.add_qp_of(&mut env.engine, B_UD, 4);
    ud_up(&mut env, 3, B_UD, QKEY);
    let lkey = c.lkey;
    c.post_recv(1, 1, &[sge(IOVA, 256, lkey)]);
    ud_send(&mut env, 1, b"for B only", (AH, B_UD, QKEY));
    for _ in 0..100 {
        env.engine.round(&[1, 3], env.now);
    }
    assert_eq!(ids(&env.a.poll()), vec![(1, WcStatus::Success)]);
    assert!(c.poll().is_empty(), "nothing crossed to the other tenant");
    assert_eq!(dropped(&env, 1).no_qp, 1, "counted at the sender");
    env.engine.destroy_ah(1, AH).expect("destroy");
    assert!(env.engine.destroy_ah(1, AH).is_err());
}

/// A's UC QP 0x102 connected to B's UC QP 0x202.
fn uc_env() -> Env {
    let mut env = Env::new();
    env.a.add_qp_of(&mut env.engine, 0x102, 3);
    env.b.add_qp_of(&mut env.engine, 0x202, 3);
    for (id, vqpn, n, dest) in [(1, 0x102, 20, 0x202), (2, 0x202, 10, 0x102)] {
        for state in [QpState::Init, QpState::Rtr, QpState::Rts] {
            let c = (state != QpState::Init).then(|| connection(gid(n), dest));
            env.modify(id, vqpn, state, c).expect("modify");
        }
    }
    env
}

#[test]
fn uc_completes_when_sent_and_never_waits_for_its_responder() {
    let mut env = uc_env();
    env.a.fill(0, b"unacknowledged");
    let lkey = env.a.lkey;
    // No receive posted: an RC requester would wait out RNR timers; UC's
    // message is dropped and its send completes at once.
    let mut s = send(1, SendOpcode::Send);
    s.flags |= send_flags::SOLICITED;
    env.a.post_sges(1, &s, &[sge(IOVA, 14, lkey)]);
    // A bad rkey: dropped at the responder, which stays as it was.
    let w = remote(send(2, SendOpcode::RdmaWrite), IOVA, 0xdead);
    env.a.post_sges(1, &w, &[sge(IOVA, 14, lkey)]);
    let (a, b) = env.run();
    assert_eq!(
        ids(&a),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)],
        "no retries, no errors: nothing is acknowledged"
    );
    assert!(b.is_empty());
    assert_eq!(dropped(&env, 2).no_receive, 1);
    // The responder is still working: a WRITE and a SEND land.
    let rkey = env.b.rkey;
    let w = remote(send(3, SendOpcode::RdmaWrite), IOVA + 0x40, rkey);
    env.a.post_sges(1, &w, &[sge(IOVA, 14, lkey)]);
    let lkey_b = env.b.lkey;
    env.b.post_recv(1, 9, &[sge(IOVA + 0x80, 64, lkey_b)]);
    env.a
        .post_sges(1, &send(4, SendOpcode::Send), &[sge(IOVA, 14, lkey)]);
    let (a, b) = env.run();
    assert_eq!(
        ids(&a),
        vec![(3, WcStatus::Success), (4, WcStatus::Success)]
    );
    assert_eq!(ids(&b), vec![(9, WcStatus::Success)]);
    assert_eq!(env.b.bytes(0x40, 14), b"unacknowledged");
    assert_eq!(env.b.bytes(0x80, 14), b"unacknowledged");
    // A responder gone: still no retries (an RC requester would retry
    // `retry_cnt` times, RETRY_STEP apart).
    env.modify(2, 0x202, QpState::Reset, None).expect("reset");
    env.a
        .post_sges(1, &send(5, SendOpcode::Send), &[sge(IOVA, 14, lkey)]);
    let (a, _) = env.advance(Duration::ZERO);
    assert_eq!(ids(&a), vec![(5, WcStatus::Success)]);
    // A short receive: dropped, and the receive stays for the next one.
    for state in [QpState::Init, QpState::Rtr, QpState::Rts] {
        let c = (state != QpState::Init).then(|| connection(gid(10), 0x102));
        env.modify(2, 0x202, state, c).expect("modify");
    }
    env.b.post_recv(1, 10, &[sge(IOVA + 0x80, 4, lkey_b)]);
    env.a
        .post_sges(1, &send(6, SendOpcode::Send), &[sge(IOVA, 14, lkey)]);
    env.a
        .post_sges(1, &send(7, SendOpcode::Send), &[sge(IOVA, 4, lkey)]);
    let (a, b) = env.run();
    assert_eq!(
        ids(&a),
        vec![(6, WcStatus::Success), (7, WcStatus::Success)]
    );
    assert_eq!(ids(&b), vec![(10, WcStatus::Success)]);
    assert_eq!(b[0].byte_len.get(), 4);
    assert_eq!(dropped(&env, 2).invalid, 1);
}

#[test]
fn uc_reaches_only_uc() {
    let mut env = uc_env();
    // A UC QP connected to an RC QP gets nothing across.
    let lkey = env.a.lkey;
    env.modify(1, 0x102, QpState::Reset, None).expect("reset");
    env.modify(1, 0x102, QpState::Init, None).expect("init");
    env.modify(1, 0x102, QpState::Rtr, Some(connection(gid(20), 200)))
        .expect("towards B's RC QP");
    env.modify(1, 0x102, QpState::Rts, Some(connection(gid(20), 200)))
        .expect("rts");
    let lkey_b = env.b.lkey;
    env.b.post_recv(0, 1, &[sge(IOVA, 64, lkey_b)]);
    env.a
        .post_sges(1, &send(1, SendOpcode::Send), &[sge(IOVA, 4, lkey)]);
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert!(b.is_empty(), "an RC QP takes no UC message");
    assert_eq!(dropped(&env, 1).no_qp, 1);
}

#[test]
fn a_cm_mad_reaches_qp1_of_a_device_of_this_host_only_within_the_tenants_networks() {
    use super::gsi::{Mad, GSI_QPN, MAD_LEN};
    let mut env = Env::new();
    let policy = super::testing::tenant("ta", vrdma_tenant_policy::PriorityClass::Normal);
    let _c = env.add_side(3, 30, &policy, 300);
    let mut bytes = Box::new([0u8; MAD_LEN]);
    bytes[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    let to = |n: u16| Mad {
        peer: gid(n),
        peer_qpn: GSI_QPN,
        traffic_class: 0,
        bytes: bytes.clone(),
    };
    env.engine.gsi_send(1, &to(30)).expect("same tenant");
    let got = env.engine.take_gsi(3, 8).expect("take");
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].peer, got[0].peer_qpn), (gid(10), GSI_QPN));
    // B is tenant tb, in a network of its own.
    let refused = env.engine.gsi_send(1, &to(20)).map_err(|e| e.errno());
    assert_eq!(refused, Err(libc::EPERM));
    assert!(env.engine.take_gsi(2, 8).expect("take").is_empty());
}

#[test]
fn qp1_is_the_devices_whichever_context_asks_or_leaves() {
    use super::gsi::{Mad, GSI_QPN, MAD_LEN};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
    let mut env = Env::new();
    let policy = super::testing::tenant("ta", vrdma_tenant_policy::PriorityClass::Normal);
    // Contexts 3 and 4 of one device (GID 30).
    let _c = env.add_side(3, 30, &policy, 300);
    let _d = env.add_side(4, 30, &policy, 400);
    let mut bytes = Box::new([0u8; MAD_LEN]);
    bytes[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    let to = |tag: u8| {
        let mut b = bytes.clone();
        b[24] = tag;
        Mad {
            peer: gid(30),
            peer_qpn: GSI_QPN,
            traffic_class: 0,
            bytes: b,
        }
    };
    // The second context asks to be woken: a MAD wakes it.
    let woken = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    env.engine
        .set_gsi_notify(4, woken.try_clone().expect("dup"))
        .expect("notify");
    env.engine.gsi_send(1, &to(1)).expect("send");
    assert_eq!(woken.read().ok(), Some(1), "the asking context is woken");
    env.engine.gsi_send(1, &to(2)).expect("send");
    // The first context leaves: what waits, and the eventfd, stay with
    // the device.
    env.engine.detach_device(3);
    let got = env.engine.take_gsi(4, 8).expect("take");
    assert_eq!(got.iter().map(|m| m.bytes[24]).collect::<Vec<_>>(), [1, 2]);
    env.engine.gsi_send(1, &to(3)).expect("send");
    assert_eq!(
        woken.read().ok(),
        Some(1),
        "still woken after the hand-over"
    );
}
