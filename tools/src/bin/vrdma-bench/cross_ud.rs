//! UD's message rate across hosts (`--cross-host`): 64 B SENDs on
//! [`QPS`] UD QPs of alpha (h1), each to a UD QP of beta (h2) through one
//! address handle, in the same shape as the RC message-rate test (a
//! window of [`WINDOW`] per QP in lists of [`BATCH`]). A UD send completes
//! once its packet is queued, so the sender's completions say nothing of
//! delivery: the figure is the messages beta *received* per second, a
//! thread on h2's side keeping [`RECEIVES`] receives posted on each QP;
//! what was sent and not received by a trial's end is reported as "not
//! received" (lost, or still queued: a UD send completes once hostd has
//! queued its packet, so what a trial sent last may arrive in the next),
//! beside every drop counter of the receiving side.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest_driver::{
    QpCapabilities, QpInitAttr, QueuePair, RecvWr, SendPayload, SendWr, Sge, UdDest, WorkCompletion,
};
use vrdma_spec::control::{AhAttr, QpAttr};
use vrdma_spec::qp_state::mask;
use vrdma_spec::verbs::{QpState, QpType, SendOpcode};

use crate::baselines::pause;
use crate::host::{poll_ok, Tenant};
use crate::report::{Bound, Targets};
use crate::{verbs, BenchError, Result};

/// UD QPs on each side.
const QPS: usize = 8;
/// Sends in flight per QP, and per post (the last one signaled).
const WINDOW: usize = 128;
const BATCH: usize = 16;
/// Receives each of beta's QPs keeps posted: one scheduler time slice of
/// traffic (8 QPs × 1,024 ≈ 3.5 ms at 2.3 M/s). The receiving thread
/// shares the tenants' core with the sending one; with 256 each, the queues
/// ran dry while it was off the core and 43,000–84,000 messages a run found
/// no receive (perftest's `ib_send_bw -c UD` posts 512).
const RECEIVES: usize = 1024;
/// The message, and the GRH before it in the receive buffer.
const SIZE: u32 = 64;
const GRH: u32 = 40;
const QKEY: u32 = 0x1111_1111;
/// Trials; the best is reported.
const TRIALS: usize = 3;

/// A UD QP of `t` in RTS with [`QKEY`], `depth` slots each way.
fn ud_qp(t: &Tenant, depth: u32) -> Result<QueuePair> {
    let caps = QpCapabilities {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let qp = (t.pd)
        .create_qp(&QpInitAttr {
            send_cq: &t.cq,
            recv_cq: &t.cq,
            cap: caps,
            qp_type: QpType::Ud,
            sq_sig_all: false,
            srq: None,
        })
        .map_err(verbs("create a UD QP"))?;
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        qkey: QKEY.into(),
        port_num: 1,
        ..QpAttr::default()
    };
    let init_mask = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY;
    qp.modify(&init, init_mask)
        .map_err(verbs("UD QP to INIT"))?;
    let state = |s: QpState| QpAttr {
        qp_state: s.into(),
        ..QpAttr::default()
    };
    qp.modify(&state(QpState::Rtr), mask::STATE)
        .map_err(verbs("UD QP to RTR"))?;
    qp.modify(&state(QpState::Rts), mask::STATE | mask::SQ_PSN)
        .map_err(verbs("UD QP to RTS"))?;
    Ok(qp)
}

/// Runs the test and checks that UD delivers at least `rc` Mop/s, the RC
/// message rate of the same run.
pub fn message_rate(
    a: &Tenant,
    b: &Tenant,
    hosts: &[crate::host::Host; 2],
    secs: Duration,
    (rc, rc_cost): (f64, Option<f64>),
    tag: &str,
    targets: &mut Targets,
) -> Result<()> {
    let senders: Vec<QueuePair> = (0..QPS)
        .map(|_| ud_qp(a, WINDOW as u32))
        .collect::<Result<_>>()?;
    let receivers: Vec<QueuePair> = (0..QPS)
        .map(|_| ud_qp(b, RECEIVES as u32))
        .collect::<Result<_>>()?;
    let path = AhAttr {
        dgid: b.gid,
        is_global: 1,
        port_num: 1,
        hop_limit: 64,
        ..AhAttr::default()
    };
    let ah = a.pd.create_ah(&path).map_err(verbs("create an AH"))?;
    let src = a.buffer(QPS * SIZE as usize)?;
    let dst = b.buffer(QPS * 128)?;
    let sges: Vec<[Sge; 1]> = (0..QPS)
        .map(|i| [src.sge(i as u64 * u64::from(SIZE), SIZE)])
        .collect();
    let lists: Vec<Vec<SendWr<'_>>> = (sges.iter().zip(&receivers).enumerate())
        .map(|(i, (sge, qb))| {
            let dest = UdDest {
                ah: ah.ahn(),
                remote_qpn: qb.qp_num(),
                remote_qkey: QKEY,
            };
            let wr = SendWr::new(i as u64, SendOpcode::Send, SendPayload::Sges(sge)).to_ud(dest);
            let mut list = vec![wr; BATCH];
            if let Some(last) = list.last_mut() {
                last.flags = vrdma_spec::ring::send_flags::SIGNALED;
            }
            list
        })
        .collect();
    let recv_sges: Vec<[Sge; 1]> = (0..QPS)
        .map(|i| [dst.sge(i as u64 * 128, GRH + SIZE)])
        .collect();
    for (qb, sge) in receivers.iter().zip(&recv_sges) {
        let wrs: Vec<RecvWr<'_>> = (0..RECEIVES)
            .map(|_| RecvWr {
                wr_id: 0,
                sg_list: sge,
            })
            .collect();
        qb.post_recv(&wrs).map_err(BenchError::Post)?;
    }
    let received = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let mut trials = Vec::new();
    let mut unreceived = Vec::new();
    let (mut before, mut after) = (None, None);
    std::thread::scope(|scope| -> Result<()> {
        let receiver = scope.spawn(|| keep_receiving(b, &receivers, &recv_sges, &received, &stop));
        let mut run = || -> Result<()> {
            before = crate::hostd_cost::Sample::take(hosts, "alpha", "send");
            for _ in 0..TRIALS {
                let (got_before, t0) = (received.load(Ordering::Acquire), Instant::now());
                let sent = send_for(a, &senders, &lists, secs)?;
                // Whatever is still on its way arrives within a moment.
                std::thread::sleep(Duration::from_millis(20));
                let got = received.load(Ordering::Acquire) - got_before;
                let elapsed = t0.elapsed().saturating_sub(Duration::from_millis(20));
                trials.push(got as f64 / elapsed.as_secs_f64() / 1e6);
                unreceived.push(sent.saturating_sub(got));
            }
            after = crate::hostd_cost::Sample::take(hosts, "alpha", "send");
            Ok(())
        };
        let sent = run();
        stop.store(true, Ordering::Release);
        let got = receiver.join().map_err(|_| BenchError::Panicked)?;
        sent.and(got)
    })?;
    let best = trials.iter().copied().fold(0.0, f64::max);
    println!(
        "cross ud_msg_rate [{tag}] receiving hostd's drops over the trials: {}",
        drops(&hosts[1]).unwrap_or_else(|| "(vrdmactl peers could not say)".into())
    );
    let lists = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let cost = before.zip(after).and_then(|(b, a)| b.per_op_until(&a));
    println!(
        "cross ud_msg_rate [{tag}] 64 B  {QPS} UD QPs, {WINDOW} in flight each in lists of {BATCH}, {RECEIVES} receives posted each: {best:.3} Mop/s received (trials {}; not received by each trial's end {unreceived:?}); RC WRITE {rc:.3} Mop/s: {:.2}×; hostds' CPU per message: UD SEND {}, RC WRITE {}",
        lists(&trials),
        best / rc.max(f64::MIN_POSITIVE),
        crate::hostd_cost::show(cost),
        crate::hostd_cost::show(rc_cost),
    );
    let what = format!(
        "across hosts [{tag}]: {QPS} UD QPs of 64 B SENDs received, ÷ RC's 64 B WRITE rate"
    );
    targets.check(
        what,
        best / rc.max(f64::MIN_POSITIVE),
        "×",
        Bound::AtLeast(1.0),
    );
    Ok(())
}

/// Sends on every QP for `duration` (each completion reposting its
/// list), then waits for what is in flight; returns the sends made.
fn send_for(
    a: &Tenant,
    qps: &[QueuePair],
    lists: &[Vec<SendWr<'_>>],
    duration: Duration,
) -> Result<usize> {
    let mut in_flight = [0usize; QPS];
    for ((qp, list), flight) in qps.iter().zip(lists).zip(in_flight.iter_mut()) {
        while *flight + list.len() <= WINDOW {
            qp.post_send(list).map_err(BenchError::Post)?;
            *flight += list.len();
        }
    }
    let mut sent = QPS * WINDOW;
    let mut wcs = [WorkCompletion::default(); 64];
    let end = Instant::now() + duration;
    let mut spins = 0u32;
    while in_flight.iter().any(|&f| f > 0) {
        let n = poll_ok(&a.cq, &mut wcs)?;
        let more = Instant::now() < end;
        for wc in &wcs[..n] {
            let i = wc.wr_id as usize;
            let (Some(qp), Some(list), Some(flight)) =
                (qps.get(i), lists.get(i), in_flight.get_mut(i))
            else {
                return Err(BenchError::Panicked);
            };
            if more {
                qp.post_send(list).map_err(BenchError::Post)?;
                sent += BATCH;
            } else {
                *flight -= BATCH;
            }
        }
        if n == 0 {
            spins = spins.wrapping_add(1);
            pause(spins);
        }
    }
    Ok(sent)
}

/// Keeps [`RECEIVES`] receives posted on each of `qps` until `stop`,
/// counting what arrives in `received`.
fn keep_receiving(
    b: &Tenant,
    qps: &[QueuePair],
    sges: &[[Sge; 1]],
    received: &AtomicUsize,
    stop: &AtomicBool,
) -> Result<()> {
    let mut wcs = [WorkCompletion::default(); 64];
    let mut again = [0usize; QPS];
    let mut spins = 0u32;
    while !stop.load(Ordering::Acquire) {
        let n = poll_ok(&b.cq, &mut wcs)?;
        if n == 0 {
            spins = spins.wrapping_add(1);
            pause(spins);
            continue;
        }
        for wc in &wcs[..n] {
            let i = (qps.iter())
                .position(|q| q.qp_num() == wc.qp_num)
                .ok_or(BenchError::Panicked)?;
            again[i] += 1;
        }
        for (i, count) in again.iter_mut().enumerate() {
            if *count == 0 {
                continue;
            }
            let wrs: Vec<RecvWr<'_>> = (0..*count)
                .map(|_| RecvWr {
                    wr_id: 0,
                    sg_list: &sges[i],
                })
                .collect();
            qps[i].post_recv(&wrs).map_err(BenchError::Post)?;
            *count = 0;
        }
        received.fetch_add(n, Ordering::AcqRel);
    }
    Ok(())
}

/// Every drop counter of the receiving side: the drops by reason over
/// every peer of the hostd of `host` and over its devices (`device_…`), its
/// packet queue's, its network
/// namespace's UDP receive-buffer overflows and interfaces' drops, and the
/// kernel's input backlogs: where a lost datagram would have gone.
fn drops(host: &crate::host::Host) -> Option<String> {
    let peers = host.ctl_json("peers")?;
    let mut by_reason = std::collections::BTreeMap::<String, u64>::new();
    for p in peers.as_array()? {
        for (reason, n) in p["drops"].as_object().into_iter().flatten() {
            *by_reason.entry(reason.clone()).or_default() += n.as_u64().unwrap_or(0);
        }
    }
    let stats = host.ctl_json("stats")?;
    // What the receiving devices dropped, by reason (`no_receive`: a UD
    // message that found no receive posted — the receiving tenant's
    // thread fell behind).
    for t in stats["tenants"].as_array().into_iter().flatten() {
        for (reason, n) in t["dropped"].as_object().into_iter().flatten() {
            *by_reason.entry(format!("device_{reason}")).or_default() += n.as_u64().unwrap_or(0);
        }
    }
    for key in [
        "receive_kernel_drops",
        "receive_truncated",
        "xdp_rx_dropped",
        "xdp_rx_ring_full",
        "xdp_fill_ring_empty",
    ] {
        by_reason.insert(key.into(), stats["packet_io"][key].as_u64().unwrap_or(0));
    }
    // /proc/<pid>/net is the network namespace of that process: hostd's.
    let snmp = std::fs::read_to_string(format!("/proc/{}/net/snmp", host.hostd_pid())).ok()?;
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp:"));
    let (names, values) = (udp.next()?, udp.next()?);
    for (name, value) in names.split_whitespace().zip(values.split_whitespace()) {
        if name == "RcvbufErrors" {
            by_reason.insert("udp_rcvbuf_errors".into(), value.parse().unwrap_or(0));
        }
    }
    // The namespace's interfaces: frames dropped on receive and send.
    let dev = std::fs::read_to_string(format!("/proc/{}/net/dev", host.hostd_pid())).ok()?;
    for line in dev.lines().skip(2) {
        let Some((name, counters)) = line.split_once(':') else {
            continue;
        };
        let c: Vec<u64> = counters
            .split_whitespace()
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        if let (Some(rx), Some(tx)) = (c.get(3), c.get(11)) {
            by_reason.insert(format!("{}_rx_dropped", name.trim()), *rx);
            by_reason.insert(format!("{}_tx_dropped", name.trim()), *tx);
        }
    }
    // The kernel's per-CPU input backlogs (netdev_max_backlog), which a
    // veth delivers into: second column, summed over CPUs.
    let softnet = std::fs::read_to_string("/proc/net/softnet_stat").ok()?;
    let backlog: u64 = softnet
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter_map(|v| u64::from_str_radix(v, 16).ok())
        .sum();
    by_reason.insert("softnet_backlog_drops_since_boot".into(), backlog);
    Some(format!("{by_reason:?}"))
}
