//! UD and UC between two engines ("hosts") over the in-memory [`Link`]:
//! datagrams with their GRH, Q_Keys and sender, the source network a
//! receiver's tenant must reach, UC messages that complete when sent and
//! a gap that drops only the message it interrupts; every drop counted.
//!
//! [`Link`]: super::link::Link

use std::time::Duration;

use vrdma_hostd_protocol::messages::{AhSetup, QpModify};
use vrdma_spec::ring::{wc_flags, Cqe, UdDest, GRH_SIZE, QKEY_CONTROLLED};
use vrdma_spec::verbs::{QpState, SendOpcode, WcOpcode, WcStatus};

use super::link::Faults;
use super::tests::{directory_with, pattern, status, Hosts};
use crate::engine::testing::{connection, gid, remote, send, sge, Side, IOVA};
use crate::engine::ud::DropCounts;
use crate::engine::{gsi, Engine};

const QKEY: u32 = 0x1111_1111;
/// The UD QPs of A and B (their second QP: index 1 on each side).
const A_UD: u32 = 0x101;
const B_UD: u32 = 0x201;
/// The UC QPs.
const A_UC: u32 = 0x102;
const B_UC: u32 = 0x202;
/// A's address handle towards B's GID.
const AH: u32 = 9;
const RUN: Duration = Duration::from_millis(50);

fn modify(engine: &mut Engine, m: QpModify) {
    engine.modify_qp(1, &m).expect("modify");
}

fn ud_up(engine: &mut Engine, vqpn: u32) {
    for (state, qkey) in [
        (QpState::Init, Some(QKEY)),
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
        modify(engine, m);
    }
}

/// Two hosts with a UD QP each in RTS and A's AH towards B.
fn ud_hosts(h: Hosts) -> Hosts {
    let mut h = h;
    h.sa.add_qp_of(&mut h.a, A_UD, 4);
    h.sb.add_qp_of(&mut h.b, B_UD, 4);
    ud_up(&mut h.a, A_UD);
    ud_up(&mut h.b, B_UD);
    let ah = AhSetup {
        ahn: AH,
        pd: 1,
        dgid: gid(20),
        dlid: None,
        flow_label: 0,
        hop_limit: 64,
        traffic_class: 0x20,
    };
    h.a.create_ah(1, &ah).expect("remote AH");
    h
}

/// A's UD send `wr_id` of `text` (WITH_IMM 9,8,7,6) to `(qpn, qkey)`.
fn ud_send(side: &mut Side, wr_id: u64, text: &[u8], qpn: u32, qkey: u32) {
    side.fill(0, text);
    let mut wqe = send(wr_id, SendOpcode::SendWithImm);
    wqe.imm_data = [9, 8, 7, 6];
    UdDest {
        ah: AH,
        remote_qpn: qpn,
        remote_qkey: qkey,
    }
    .write(&mut wqe);
    let lkey = side.lkey;
    let len = u32::try_from(text.len()).expect("short");
    side.post_sges(1, &wqe, &[sge(IOVA, len, lkey)]);
}

fn ids(cs: &[Cqe]) -> Vec<(u64, WcStatus)> {
    cs.iter().map(|c| (c.wr_id.get(), status(c))).collect()
}

fn dropped(engine: &Engine) -> DropCounts {
    engine.device_counters(1).expect("device").dropped
}

/// The host-level drops B counted for `reason`.
fn peer_drops(engine: &Engine, reason: &str) -> u64 {
    let peers = engine.wire().expect("wire").peers.snapshot();
    peers.iter().filter_map(|p| p.drops.get(reason)).sum()
}

#[test]
fn a_datagram_crosses_hosts_with_its_grh_imm_and_sender() {
    let mut h = ud_hosts(Hosts::new(1024));
    let lkey = h.sb.lkey;
    h.sb.post_recv(1, 5, &[sge(IOVA + 0x100, 40 + 1024, lkey)]);
    let text = pattern(1000, 4);
    ud_send(&mut h.sa, 1, &text, B_UD, QKEY);
    let (a, b) = h.run_for(RUN);
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert_eq!(ids(&b), vec![(5, WcStatus::Success)]);
    let r = &b[0];
    assert_eq!(r.opcode, u8::from(WcOpcode::Recv));
    assert_eq!(r.byte_len.get(), GRH_SIZE + 1000);
    assert_eq!(r.wc_flags, wc_flags::GRH | wc_flags::WITH_IMM);
    assert_eq!(r.imm_data, [9, 8, 7, 6]);
    assert_eq!((r.qp_num.get(), r.src_qp.get()), (B_UD, A_UD));
    assert_eq!(h.sb.bytes(0x100 + 40, 1000), text);
    // The GRH: 20 zero bytes, then the IPv4 header the packet came with.
    let grh = h.sb.bytes(0x100, 40);
    assert_eq!(grh[..20], [0; 20]);
    let ip = &grh[20..];
    assert_eq!(ip[0], 0x45);
    assert_eq!(ip[1], 0x20, "TOS: the AH's traffic class");
    // IPv4 20 + UDP 8 + BTH 12 + DETH 8 + immediate 4 + 1000 + ICRC 4.
    assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 1056);
    assert_eq!(ip[9], 17, "UDP");
    assert_eq!(ip[12..16], gid(10)[12..], "source: A's GID");
    assert_eq!(ip[16..20], gid(20)[12..], "destination: B's");
    assert_eq!(dropped(&h.b), DropCounts::default());
}

#[test]
fn a_wrong_qkey_a_missing_receive_or_qp_drop_the_datagram_and_count_it() {
    let mut h = ud_hosts(Hosts::new(1024));
    // No receive posted.
    ud_send(&mut h.sa, 1, b"lost", B_UD, QKEY);
    let (a, b) = h.run_for(RUN);
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)], "UD never tells");
    assert!(b.is_empty());
    assert_eq!(dropped(&h.b).no_receive, 1);
    let lkey = h.sb.lkey;
    h.sb.post_recv(1, 5, &[sge(IOVA + 0x100, 256, lkey)]);
    // A wrong Q_Key, then a QP B does not have.
    ud_send(&mut h.sa, 2, b"wrong key", B_UD, QKEY + 1);
    ud_send(&mut h.sa, 3, b"nobody", 0x777, QKEY);
    let (a, b) = h.run_for(RUN);
    assert_eq!(ids(&a).len(), 2);
    assert!(b.is_empty(), "{b:?}");
    let d = dropped(&h.b);
    assert_eq!((d.qkey, d.no_qp, d.no_receive), (1, 1, 1));
    assert_eq!(peer_drops(&h.b, "ud_qkey"), 1);
    assert_eq!(peer_drops(&h.b, "ud_no_qp"), 1);
    // A controlled Q_Key (high bit) in the WQE means the sender QP's own,
    // which is B's: delivered, into the receive still posted.
    ud_send(&mut h.sa, 4, b"controlled", B_UD, QKEY_CONTROLLED | 5);
    let (_, b) = h.run_for(RUN);
    assert_eq!(ids(&b), vec![(5, WcStatus::Success)]);
    assert_eq!(h.sb.bytes(0x100 + 40, 10), b"controlled");
    // B's QP goes, right after a datagram reached it (the receive path
    // remembers the QP of the last datagram): the next one is dropped as
    // for no QP, not delivered to what it remembered.
    h.b.destroy_qp(1, B_UD).expect("destroy B's QP");
    ud_send(&mut h.sa, 6, b"too late", B_UD, QKEY);
    let (_, b) = h.run_for(RUN);
    assert!(b.is_empty(), "{b:?}");
    assert_eq!(peer_drops(&h.b, "ud_no_qp"), 2);
}

#[test]
fn a_datagram_from_a_network_the_receiver_may_not_reach_is_dropped() {
    // A's GID is in network "other": B's tenant ("t", network "t")
    // reaches neither.
    let dir = directory_with(&[(10, "ha", "other"), (20, "hb", "t")]);
    let mut h = ud_hosts(Hosts::with_directory(1024, dir));
    let lkey = h.sb.lkey;
    h.sb.post_recv(1, 5, &[sge(IOVA + 0x100, 256, lkey)]);
    ud_send(&mut h.sa, 1, b"intruder", B_UD, QKEY);
    let (_, b) = h.run_for(RUN);
    assert!(b.is_empty(), "{b:?}");
    assert_eq!(peer_drops(&h.b, "ud_unreachable_source"), 1);
    assert_eq!(h.sb.bytes(0x100, 48), vec![0; 48], "nothing written");
}

#[test]
fn a_datagram_longer_than_the_port_mtu_fails_locally() {
    let mut h = ud_hosts(Hosts::new(1024));
    h.a.set_port_mtu(1024);
    ud_send(&mut h.sa, 1, &pattern(1025, 1), B_UD, QKEY);
    let (a, _) = h.run_for(RUN);
    assert_eq!(ids(&a), vec![(1, WcStatus::LocLenErr)]);
}

/// Connects A's and B's UC QPs to each other at `mtu`.
fn uc_hosts(mtu: u32) -> Hosts {
    let mut h = Hosts::new(mtu);
    h.sa.add_qp_of(&mut h.a, A_UC, 3);
    h.sb.add_qp_of(&mut h.b, B_UC, 3);
    for (engine, vqpn, dest, n) in [(&mut h.a, A_UC, B_UC, 20), (&mut h.b, B_UC, A_UC, 10)] {
        for state in [QpState::Init, QpState::Rtr, QpState::Rts] {
            let connection = (state != QpState::Init).then(|| {
                let mut c = connection(gid(n), dest);
                c.path_mtu = mtu;
                c.sq_psn = 0xff_fffe;
                c.rq_psn = 0xff_fffe;
                c
            });
            let m = QpModify {
                vqpn,
                state: state.into(),
                connection,
                access: Some(vrdma_spec::verbs::access::REMOTE_WRITE),
                qkey: None,
            };
            modify(engine, m);
        }
    }
    h
}

#[test]
fn uc_sends_and_writes_cross_hosts_in_packets_and_complete_when_sent() {
    let mut h = uc_hosts(256);
    let (lkey_a, rkey_b, lkey_b) = (h.sa.lkey, h.sb.rkey, h.sb.lkey);
    let data = pattern(5000, 2);
    h.sa.fill(0, &data);
    // A SEND of 20 packets (PSNs wrap at 2^24), a WRITE, a WRITE with
    // immediate that takes the second receive.
    h.sb.post_recv(1, 7, &[sge(IOVA + 0x8000, 8192, lkey_b)]);
    h.sb.post_recv(1, 8, &[sge(IOVA + 0x8000, 8192, lkey_b)]);
    h.sa.post_sges(1, &send(1, SendOpcode::Send), &[sge(IOVA, 5000, lkey_a)]);
    let w = remote(send(2, SendOpcode::RdmaWrite), IOVA + 0x20000, rkey_b);
    h.sa.post_sges(1, &w, &[sge(IOVA, 3000, lkey_a)]);
    let mut wi = remote(
        send(3, SendOpcode::RdmaWriteWithImm),
        IOVA + 0x30000,
        rkey_b,
    );
    wi.imm_data = [1, 2, 3, 4];
    h.sa.post_sges(1, &wi, &[sge(IOVA + 100, 700, lkey_a)]);
    let (a, b) = h.run_for(RUN);
    let ok = |n| (1..=n).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>();
    assert_eq!(ids(&a), ok(3));
    assert_eq!(
        ids(&b),
        vec![(7, WcStatus::Success), (8, WcStatus::Success)]
    );
    assert_eq!(b[0].byte_len.get(), 5000);
    assert_eq!(b[0].src_qp.get(), A_UC);
    assert_eq!(h.sb.bytes(0x8000, 5000), data);
    assert_eq!(h.sb.bytes(0x20000, 3000), data[..3000]);
    assert_eq!(h.sb.bytes(0x30000, 700), data[100..800]);
    assert_eq!(b[1].opcode, u8::from(WcOpcode::RecvRdmaWithImm));
    assert_eq!(b[1].imm_data, [1, 2, 3, 4]);
    // Nothing came back: UC is not acknowledged.
    let to_a = h.a.wire().expect("wire").peers.snapshot();
    assert_eq!(to_a.iter().map(|p| p.rx_packets).sum::<u64>(), 0);
}

#[test]
fn a_lost_uc_packet_drops_only_the_message_it_was_part_of() {
    for seed in [3, 5, 8] {
        let mut h = uc_hosts(256);
        h.link.set_faults(Faults {
            drop_one_in: 15,
            seed,
            ..Faults::default()
        });
        let (lkey_a, lkey_b) = (h.sa.lkey, h.sb.lkey);
        // 30 SENDs of 1,000 bytes (4 packets), each its own pattern.
        let mut sent = Vec::new();
        for i in 0..30u8 {
            let data = pattern(1000, i);
            h.sa.fill(u64::from(i) * 1024, &data);
            sent.push(data);
            h.sb.post_recv(
                1,
                u64::from(i),
                &[sge(IOVA + 0x10000 + u64::from(i) * 1024, 1024, lkey_b)],
            );
        }
        for i in 0..30u64 {
            let s = send(100 + i, SendOpcode::Send);
            h.sa.post_sges(1, &s, &[sge(IOVA + i * 1024, 1000, lkey_a)]);
        }
        let (a, b) = h.run_for(RUN);
        assert_eq!(a.len(), 30, "every send completes");
        assert!(a.iter().all(|c| status(c) == WcStatus::Success));
        // Receives are taken in order by the messages that arrived whole:
        // receive k holds the k-th of them, byte for byte.
        let whole: Vec<usize> = (0..30)
            .filter(|&i| {
                b.iter().zip(0..).any(|(c, k)| {
                    c.byte_len.get() == 1000 && h.sb.bytes(0x10000 + k * 1024, 1000) == sent[i]
                })
            })
            .collect();
        assert_eq!(
            whole.len(),
            b.len(),
            "seed {seed}: every receive holds one whole message"
        );
        assert!(b.len() < 30, "seed {seed}: the faults hit something");
        assert!(b.iter().all(|c| status(c) == WcStatus::Success));
        let d = dropped(&h.b);
        assert_eq!(d.invalid as usize, 30 - b.len(), "seed {seed}: {d:?}");
        assert!(h.link.harmed() > 0);
    }
}

#[test]
fn a_uc_message_without_a_receive_is_dropped_and_the_next_one_lands() {
    let mut h = uc_hosts(1024);
    let (lkey_a, lkey_b) = (h.sa.lkey, h.sb.lkey);
    h.sa.fill(0, b"first message");
    h.sa.post_sges(1, &send(1, SendOpcode::Send), &[sge(IOVA, 13, lkey_a)]);
    let (a, b) = h.run_for(RUN);
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert!(b.is_empty());
    assert_eq!(dropped(&h.b).no_receive, 1);
    h.sb.post_recv(1, 5, &[sge(IOVA + 0x100, 64, lkey_b)]);
    h.sa.fill(0, b"second one");
    h.sa.post_sges(1, &send(2, SendOpcode::Send), &[sge(IOVA, 10, lkey_a)]);
    // One too long for the receive: dropped, the receive stays.
    h.sa.post_sges(1, &send(3, SendOpcode::Send), &[sge(IOVA, 100, lkey_a)]);
    h.sb.post_recv(1, 6, &[sge(IOVA + 0x200, 64, lkey_b)]);
    let (_, b) = h.run_for(RUN);
    assert_eq!(ids(&b), vec![(5, WcStatus::Success)]);
    assert_eq!(h.sb.bytes(0x100, 10), b"second one");
    assert_eq!(dropped(&h.b).invalid, 1);
}

#[test]
fn a_controlled_qkey_is_refused_to_a_tenant_qp() {
    let mut h = Hosts::new(1024);
    h.sa.add_qp_of(&mut h.a, A_UD, 4);
    let m = QpModify {
        vqpn: A_UD,
        state: QpState::Init.into(),
        connection: None,
        access: None,
        qkey: Some(0x8001_0000),
    };
    let refused = h.a.modify_qp(1, &m).map_err(|e| e.errno());
    assert_eq!(refused, Err(libc::EPERM), "QP1's Q_Key is privileged");
}

/// A CM MAD (base version 1, class 0x07, method SEND, attribute REQ) with
/// `tag` in its first data byte.
fn cm_mad(tag: u8) -> Box<[u8; gsi::MAD_LEN]> {
    let mut m = Box::new([0u8; gsi::MAD_LEN]);
    m[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    m[16..18].copy_from_slice(&0x0010u16.to_be_bytes());
    m[24] = tag;
    m
}

fn mad_to(peer: u16, tag: u8) -> gsi::Mad {
    gsi::Mad {
        peer: gid(peer),
        peer_qpn: gsi::GSI_QPN,
        traffic_class: 0,
        bytes: cm_mad(tag),
    }
}

#[test]
fn a_cm_mad_travels_from_qp1_to_qp1_between_hosts() {
    let mut h = Hosts::new(1024);
    h.a.gsi_send(1, &mad_to(20, 7)).expect("send");
    h.run_for(RUN);
    let got = h.b.take_gsi(1, 16).expect("take");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].peer, gid(10), "the source GID");
    assert_eq!(got[0].peer_qpn, gsi::GSI_QPN);
    assert_eq!(got[0].bytes, cm_mad(7));
    assert_eq!(h.a.gsi_counts(1).map(|c| c.sent), Some(1));
    assert_eq!(h.b.gsi_counts(1).map(|c| c.received), Some(1));
    assert!(h.b.take_gsi(1, 16).expect("take").is_empty(), "taken once");
}

#[test]
fn qp1_carries_cm_mads_only_and_no_tenant_qp_reaches_it() {
    let mut h = ud_hosts(Hosts::new(1024));
    let mut not_cm = mad_to(20, 1);
    not_cm.bytes[1] = 0x04; // performance management
    let refused = h.a.gsi_send(1, &not_cm).map_err(|e| e.errno());
    assert_eq!(refused, Err(libc::EINVAL));
    // A tenant's UD QP sending to QP1 with QP1's Q_Key: the controlled
    // bit makes it its own Q_Key, which QP1 does not take.
    ud_send(&mut h.sa, 1, &cm_mad(9)[..], gsi::GSI_QPN, gsi::GSI_QKEY);
    h.run_for(RUN);
    assert!(h.b.take_gsi(1, 16).expect("take").is_empty());
    assert_eq!(peer_drops(&h.b, "gsi_qkey"), 1);
}

#[test]
fn a_cm_mad_from_a_network_the_receiver_may_not_reach_is_dropped() {
    let dir = directory_with(&[(10, "ha", "other"), (20, "hb", "t")]);
    let mut h = Hosts::with_directory(1024, dir);
    h.a.gsi_send(1, &mad_to(20, 3)).expect("send");
    h.run_for(RUN);
    assert!(h.b.take_gsi(1, 16).expect("take").is_empty());
    assert_eq!(peer_drops(&h.b, "gsi_unreachable_source"), 1);
}

#[test]
fn a_device_queues_a_bounded_number_of_mads() {
    let mut h = Hosts::new(1024);
    for i in 0..gsi::GSI_QUEUE + 5 {
        h.a.gsi_send(1, &mad_to(20, i as u8)).expect("send");
        if i % 32 == 31 {
            h.run_for(Duration::from_millis(1));
        }
    }
    h.run_for(RUN);
    let got = h.b.take_gsi(1, usize::MAX).expect("take");
    assert_eq!(got.len(), gsi::GSI_QUEUE);
    assert_eq!(h.b.gsi_counts(1).map(|c| c.queue_full), Some(5));
    assert_eq!(peer_drops(&h.b, "gsi_queue_full"), 5);
}

#[test]
fn a_round_that_only_took_mads_has_not_worked_for_the_datapath() {
    let mut h = Hosts::new(1024);
    h.run_for(RUN);
    h.a.gsi_send(1, &mad_to(20, 7)).expect("send");
    let sent = h.a.round(&[1], h.now);
    assert!(!sent.busy, "the MAD left in that round");
    // B takes the MAD in its round, which does not count as work: the
    // datapath does not start polling for the connection manager.
    let took = h.b.round(&[1], h.now);
    assert!(!took.worked && !took.busy, "{took:?}");
    let got = h.b.take_gsi(1, 16).expect("take");
    assert_eq!(got.len(), 1, "the MAD was handled all the same");
    // A tenant's packet does count.
    let (lkey_a, rkey_b) = (h.sa.lkey, h.sb.rkey);
    h.sa.fill(0, &pattern(64, 3));
    let w = remote(send(1, SendOpcode::RdmaWrite), IOVA + 0x1000, rkey_b);
    h.sa.post_sges(0, &w, &[sge(IOVA, 64, lkey_a)]);
    let posted = h.a.round(&[1], h.now);
    assert!(posted.worked);
    let received = h.b.round(&[1], h.now);
    assert!(received.worked, "{received:?}");
    assert_eq!(h.sb.bytes(0x1000, 64), pattern(64, 3));
}

#[test]
fn mads_beyond_the_send_queue_wait_in_order_for_the_datapath() {
    let mut h = Hosts::new(1024);
    // A burst from a connection thread between two rounds (a thousand
    // connects of one cmtime): more than the wire's queue holds.
    let burst = 200;
    assert!(burst > super::TX_BATCH);
    for i in 0..burst {
        h.a.gsi_send(1, &mad_to(20, i as u8))
            .expect("queued, not refused");
    }
    h.run_for(RUN);
    let got = h.b.take_gsi(1, usize::MAX).expect("take");
    let tags: Vec<u8> = got.iter().map(|m| m.bytes[24]).collect();
    assert_eq!(
        tags,
        (0..burst).map(|i| i as u8).collect::<Vec<_>>(),
        "all, in order"
    );
    assert_eq!(h.a.gsi_counts(1).map(|c| c.sent), Some(burst as u64));
    // The wait is bounded per device: beyond it, ENOSPC (the CM retries).
    let mut accepted = 0;
    let refused = loop {
        match h.a.gsi_send(1, &mad_to(20, 0)) {
            Ok(()) => accepted += 1,
            Err(e) => break e.errno(),
        }
        assert!(
            accepted <= super::TX_BATCH + gsi::OUTBOX_PER_DEVICE,
            "unbounded"
        );
    };
    assert_eq!(refused, libc::ENOSPC);
    assert_eq!(accepted, super::TX_BATCH + gsi::OUTBOX_PER_DEVICE);
}
