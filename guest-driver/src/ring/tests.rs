//! The driver's rings and doorbell page against the spec's byte layout.

use super::*;
use crate::dma::DmaArena;
use std::sync::Arc;
use vrdma_spec::ring::{rq_geometry, sq_geometry};
use zerocopy::FromBytes;

fn arena() -> Arc<DmaArena> {
    DmaArena::new(1 << 20).unwrap()
}

fn work_ring(geo: WorkRingGeometry) -> WorkRing {
    let (len, align) = WorkRing::alloc_args(geo).unwrap();
    WorkRing::new(arena().alloc_zeroed(len, align).unwrap(), geo)
}

/// QP 0's doorbell on a fresh page.
fn bit() -> Doorbell {
    let (len, align) = DoorbellPage::ALLOC_ARGS;
    let page = DoorbellPage::new(arena().alloc_zeroed(len, align).unwrap());
    Doorbell::new(Arc::new(page), spec::doorbell::bit(0).unwrap())
}

fn cq_ring(depth: u32) -> CqRing {
    let (len, align) = CqRing::alloc_args(depth).unwrap();
    CqRing::new(arena().alloc_zeroed(len, align).unwrap(), depth)
}

fn read(mem: &DmaBuf, offset: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    mem.read_at(offset, &mut v);
    v
}

/// The device completed (or flushed) the work up to `index`.
fn device_completes_work(ring: &WorkRing, index: u32) {
    ring.mem
        .atomic_u32(DEVICE_INDEX_OFFSET as usize)
        .store(index.to_le(), Ordering::Release);
}

/// Asserts that a push was refused with `EINVAL`.
#[track_caller]
fn assert_einval(pushed: Result<(), Error>) {
    assert_eq!(pushed.map_err(|e| e.errno()), Err(libc::EINVAL));
}

/// Posts `wrs` the way a post batch does: in order up to the first
/// failure (its index and error), then one publish.
fn post(sq: &mut SendRing, wrs: &[SendWr<'_>]) -> Result<(), (usize, Error)> {
    let result = wrs
        .iter()
        .enumerate()
        .try_for_each(|(i, wr)| sq.push(wr).map_err(|e| (i, e)));
    sq.ring.publish();
    result
}

#[test]
fn send_wqe_bytes_match_the_spec() {
    let geo = sq_geometry(4, 2, 32).unwrap();
    let mut sq = SendRing::new(work_ring(geo), bit(), 2, 32);
    let sges = [
        Sge {
            addr: 0x1111_2222_3333_4444,
            length: 100,
            lkey: 7,
        },
        Sge {
            addr: 0x5000,
            length: 8,
            lkey: 9,
        },
    ];
    let mut wr = SendWr::new(
        0xabcd,
        SendOpcode::RdmaWriteWithImm,
        SendPayload::Sges(&sges),
    );
    wr.flags = send_flags::SIGNALED | send_flags::SOLICITED;
    wr.imm_data = [1, 2, 3, 4];
    wr.remote_addr = 0xdead_beef_0000;
    wr.rkey = 0x77;
    let inline = SendWr::new(5, SendOpcode::Send, SendPayload::Inline(b"inline payload"));
    post(&mut sq, &[wr, inline]).unwrap();

    let mem = &sq.ring.mem;
    assert_eq!(
        read(mem, DRIVER_INDEX_OFFSET as usize, 4),
        2u32.to_le_bytes()
    );
    let stride = geo.stride as usize;
    let slot0 = read(mem, RING_HEADER_SIZE, stride);
    let fixed = size_of::<SendWqe>();
    let wqe = SendWqe::read_from_bytes(&slot0[..fixed]).unwrap();
    assert_eq!(wqe.wr_id.get(), 0xabcd);
    assert_eq!(wqe.opcode, u8::from(SendOpcode::RdmaWriteWithImm));
    assert_eq!(wqe.flags, send_flags::SIGNALED | send_flags::SOLICITED);
    assert_eq!(wqe.num_sge, 2);
    assert_eq!(wqe.imm_data, [1, 2, 3, 4]);
    assert_eq!(wqe.rkey.get(), 0x77);
    assert_eq!(wqe.remote_addr.get(), 0xdead_beef_0000);
    // Raw little-endian bytes of the first SGE right after the fixed part.
    let mut sge0 = Vec::new();
    sge0.extend_from_slice(&0x1111_2222_3333_4444u64.to_le_bytes());
    sge0.extend_from_slice(&100u32.to_le_bytes());
    sge0.extend_from_slice(&7u32.to_le_bytes());
    assert_eq!(&slot0[fixed..fixed + 16], &sge0[..]);
    let sge1 = spec::Sge::read_from_bytes(&slot0[fixed + 16..fixed + 32]).unwrap();
    assert_eq!(
        (sge1.addr.get(), sge1.length.get(), sge1.lkey.get()),
        (0x5000, 8, 9)
    );

    let slot1 = read(mem, RING_HEADER_SIZE + stride, stride);
    let wqe = SendWqe::read_from_bytes(&slot1[..fixed]).unwrap();
    assert_eq!(wqe.wr_id.get(), 5);
    assert_eq!(wqe.flags, send_flags::INLINE);
    assert_eq!(wqe.num_sge, 0);
    assert_eq!(wqe.inline_len.get(), 14);
    assert_eq!(&slot1[fixed..fixed + 14], b"inline payload");
}

#[test]
fn send_limits_are_checked() {
    let geo = sq_geometry(4, 1, 16).unwrap();
    let mut sq = SendRing::new(work_ring(geo), bit(), 1, 16);
    let sges = [Sge::default(); 2];
    let (bad, err) = post(
        &mut sq,
        &[
            SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sges[..1])),
            SendWr::new(2, SendOpcode::Send, SendPayload::Sges(&sges)),
        ],
    )
    .unwrap_err();
    assert_eq!((bad, err.errno()), (1, libc::EINVAL));
    // The first one was still published.
    assert_eq!(read(&sq.ring.mem, 0, 4), 1u32.to_le_bytes());
    let long = [0u8; 17];
    assert_einval(sq.push(&SendWr::new(
        3,
        SendOpcode::Send,
        SendPayload::Inline(&long),
    )));
    assert_einval(sq.push(&SendWr::new(
        3,
        SendOpcode::RdmaRead,
        SendPayload::Inline(b"x"),
    )));
    assert!(!sq.ring.publish(), "nothing new to publish");
    assert_eq!(read(&sq.ring.mem, 0, 4), 1u32.to_le_bytes());
}

#[test]
fn a_device_granting_beyond_the_format_is_held_to_it() {
    let geo = sq_geometry(1, MAX_SGE, MAX_INLINE_DATA).unwrap();
    let mut sq = SendRing::new(work_ring(geo), bit(), 1000, 100_000);
    let sges = [Sge::default(); MAX_SGE as usize + 1];
    assert_einval(sq.push(&SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sges))));
    let fits = &sges[..MAX_SGE as usize];
    sq.push(&SendWr::new(1, SendOpcode::Send, SendPayload::Sges(fits)))
        .unwrap();
    let data = [0u8; MAX_INLINE_DATA as usize + 1];
    assert_einval(sq.push(&SendWr::new(
        2,
        SendOpcode::Send,
        SendPayload::Inline(&data),
    )));
    let mut rq = RecvRing::new(
        work_ring(rq_geometry(1, MAX_SGE).unwrap()),
        Some(bit()),
        1000,
    );
    assert_einval(rq.push(&RecvWr {
        wr_id: 1,
        sg_list: &sges,
    }));
}

#[test]
fn full_ring_is_enomem_until_the_device_completes() {
    let geo = sq_geometry(4, 1, 0).unwrap();
    assert_eq!(geo.depth, 4);
    let mut sq = SendRing::new(work_ring(geo), bit(), 1, 0);
    let sge = [Sge {
        addr: 1,
        length: 1,
        lkey: 1,
    }];
    let wrs: Vec<_> = (0..5)
        .map(|i| SendWr::new(i, SendOpcode::Send, SendPayload::Sges(&sge)))
        .collect();
    let (bad, err) = post(&mut sq, &wrs).unwrap_err();
    assert_eq!(bad, 4);
    assert_eq!(err.errno(), libc::ENOMEM);
    assert!(matches!(err, Error::QueueFull));
    // The device completes two; two more fit, wrapping to slots 0 and 1.
    device_completes_work(&sq.ring, 2);
    post(&mut sq, &wrs[..2]).unwrap();
    assert_eq!(
        post(&mut sq, &wrs[..1]).unwrap_err().1.errno(),
        libc::ENOMEM
    );
    let slot0 = read(&sq.ring.mem, RING_HEADER_SIZE, size_of::<SendWqe>());
    assert_eq!(SendWqe::read_from_bytes(&slot0).unwrap().wr_id.get(), 0);
    // Many wraps of the u32-free-running index modulo depth.
    for round in 0..100u32 {
        device_completes_work(&sq.ring, sq.ring.producer);
        post(&mut sq, &wrs[..4]).unwrap();
        assert_eq!(sq.ring.producer, 10 + 4 * round);
    }
    // A device index ahead of the producer: treated as full.
    device_completes_work(&sq.ring, sq.ring.producer.wrapping_add(3));
    assert_eq!(sq.push(&wrs[0]).unwrap_err().errno(), libc::ENOMEM);
}

#[test]
fn publish_reports_new_entries_once() {
    let geo = sq_geometry(4, 1, 0).unwrap();
    let mut sq = SendRing::new(work_ring(geo), bit(), 1, 0);
    let sge = [Sge::default()];
    let wr = SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sge));
    assert!(!sq.ring.publish(), "nothing written");
    sq.push(&wr).unwrap();
    sq.push(&wr).unwrap();
    assert_eq!(read(&sq.ring.mem, 0, 4), 0u32.to_le_bytes(), "unpublished");
    assert!(sq.ring.publish());
    assert_eq!(read(&sq.ring.mem, 0, 4), 2u32.to_le_bytes());
    assert!(!sq.ring.publish(), "already published");
    assert!(!sq.ring.in_error());
    sq.ring
        .mem
        .atomic_u32(DEVICE_FLAGS_OFFSET as usize)
        .store(DEVICE_FLAG_ERROR.to_le(), Ordering::Release);
    assert!(sq.ring.in_error());
}

#[test]
fn recv_wqe_bytes() {
    let geo = rq_geometry(2, 3).unwrap();
    let mut rq = RecvRing::new(work_ring(geo), Some(bit()), 3);
    let sges = [
        Sge {
            addr: 0x10,
            length: 20,
            lkey: 30,
        },
        Sge {
            addr: 0x40,
            length: 50,
            lkey: 60,
        },
    ];
    rq.push(&RecvWr {
        wr_id: 99,
        sg_list: &sges,
    })
    .unwrap();
    let slot = read(&rq.ring.mem, RING_HEADER_SIZE, 48);
    let wqe = RecvWqe::read_from_bytes(&slot[..16]).unwrap();
    assert_eq!((wqe.wr_id.get(), wqe.num_sge), (99, 2));
    let sge = spec::Sge::read_from_bytes(&slot[32..48]).unwrap();
    assert_eq!(
        (sge.addr.get(), sge.length.get(), sge.lkey.get()),
        (0x40, 50, 60)
    );
    let too_many = [Sge::default(); 4];
    assert_einval(rq.push(&RecvWr {
        wr_id: 1,
        sg_list: &too_many,
    }));
}

/// Writes CQEs the way the device does: slots first, then the producer
/// index with release ordering.
fn device_completes(cq: &CqRing, producer: &mut u32, cqes: &[Cqe]) {
    let (mem, depth) = (&cq.ring.mem, cq.ring.depth);
    for cqe in cqes {
        let slot = (*producer & (depth - 1)) as usize;
        mem.write_at(RING_HEADER_SIZE + slot * CQE_SIZE, cqe.as_bytes());
        *producer = producer.wrapping_add(1);
    }
    mem.atomic_u32(DEVICE_INDEX_OFFSET as usize)
        .store(producer.to_le(), Ordering::Release);
}

fn cqe(wr_id: u64, status: u8, opcode: u8, flags: u8) -> Cqe {
    Cqe {
        wr_id: wr_id.into(),
        status,
        opcode,
        wc_flags: flags,
        byte_len: 64.into(),
        imm_data: [9, 8, 7, 6],
        qp_num: 17.into(),
        src_qp: 18.into(),
        ..Default::default()
    }
}

#[test]
fn a_cq_is_drained_exactly_when_every_produced_cqe_was_handed_back() {
    let mut cq = cq_ring(4);
    let indices = cq.indices();
    let mut producer = 0;
    let mut wc = [WorkCompletion::default(); 8];
    assert!(indices.drained());
    device_completes(&cq, &mut producer, &[cqe(1, 0, 0, 0), cqe(2, 0, 0, 0)]);
    assert!(!indices.drained(), "two CQEs unread");
    assert_eq!(cq.poll(&mut wc[..1]).unwrap(), 1);
    assert!(!indices.drained(), "one CQE unread");
    assert_eq!(cq.poll(&mut wc).unwrap(), 1);
    assert!(indices.drained());
    // Through a wrap of the ring.
    for round in 0..3u64 {
        let batch: Vec<_> = (0..4).map(|i| cqe(10 * round + i, 0, 0, 0)).collect();
        device_completes(&cq, &mut producer, &batch);
        assert!(!indices.drained());
        assert_eq!(cq.poll(&mut wc).unwrap(), 4);
        assert!(indices.drained());
    }
}

#[test]
fn poll_reads_device_cqes_and_advances_the_consumer() {
    let mut cq = cq_ring(4);
    let mut producer = 0;
    let mut wc = [WorkCompletion::default(); 8];
    assert_eq!(cq.poll(&mut wc).unwrap(), 0);
    device_completes(
        &cq,
        &mut producer,
        &[
            cqe(1, 0, u8::from(WcOpcode::Send), 0),
            cqe(
                2,
                0,
                u8::from(WcOpcode::RecvRdmaWithImm),
                wc_flags::WITH_IMM,
            ),
            cqe(3, u8::from(WcStatus::RemAccessErr), 0xee, 0),
        ],
    );
    assert_eq!(cq.poll(&mut wc[..2]).unwrap(), 2);
    assert_eq!(wc[0].wr_id, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    assert_eq!(wc[0].opcode, Some(WcOpcode::Send));
    assert_eq!(wc[0].imm_data, None);
    assert_eq!((wc[0].byte_len, wc[0].qp_num, wc[0].src_qp), (64, 17, 18));
    assert_eq!(wc[1].opcode, Some(WcOpcode::RecvRdmaWithImm));
    assert_eq!(wc[1].imm_data, Some([9, 8, 7, 6]));
    // The consumer index tells the device two slots are free.
    assert_eq!(
        read(&cq.ring.mem, DRIVER_INDEX_OFFSET as usize, 4),
        2u32.to_le_bytes()
    );
    assert_eq!(cq.poll(&mut wc).unwrap(), 1);
    assert_eq!(wc[0].wr_id, 3);
    assert_eq!(wc[0].status, WcStatus::RemAccessErr);
    assert_eq!(wc[0].opcode, None);
    // Wrap around the 4-slot ring a few times.
    for round in 0..10u64 {
        let batch: Vec<_> = (0..4).map(|i| cqe(100 * round + i, 0, 0, 0)).collect();
        device_completes(&cq, &mut producer, &batch);
        assert_eq!(cq.poll(&mut wc).unwrap(), 4);
        let ids: Vec<u64> = wc[..4].iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..4).map(|i| 100 * round + i).collect::<Vec<_>>());
    }
    // A producer more than a ring ahead is refused.
    producer = producer.wrapping_add(5);
    device_completes(&cq, &mut producer, &[]);
    assert_eq!(cq.poll(&mut wc).unwrap_err().errno(), libc::EPROTO);
}

#[test]
fn arming_writes_fresh_sequence_numbers() {
    let mut cq = cq_ring(2);
    assert_eq!(cq.notified_sn(), 0);
    cq.arm(false);
    let word = u32::from_le(cq.arm_word().load(Ordering::Acquire));
    assert_eq!(word, (1 << 8) | spec::CQ_ARM_NEXT);
    cq.arm(true);
    let word = u32::from_le(cq.arm_word().load(Ordering::Acquire));
    assert_eq!(word, (2 << 8) | spec::CQ_ARM_SOLICITED);
    assert_eq!(
        read(&cq.ring.mem, DRIVER_ARM_OFFSET as usize, 4),
        word.to_le_bytes()
    );
    cq.arm_sn = 0x00ff_ffff;
    cq.arm(false);
    assert_eq!(
        u32::from_le(cq.arm_word().load(Ordering::Acquire)) >> 8,
        1,
        "24-bit wrap skips 0"
    );
}

mod doorbell_page {
    use super::*;
    use crate::dma::DmaArena;
    use vrdma_spec::limits::MAX_QPS;

    fn page() -> DoorbellPage {
        let (len, align) = DoorbellPage::ALLOC_ARGS;
        let arena = DmaArena::new(1 << 16).unwrap();
        DoorbellPage::new(arena.alloc_zeroed(len, align).unwrap())
    }

    fn word(page: &DoorbellPage, offset: u64) -> u64 {
        let mut raw = [0u8; 8];
        page.mem.read_at(offset as usize, &mut raw);
        u64::from_le_bytes(raw)
    }

    /// The device's side of the handshake: take the summary, then the words.
    fn device_takes(page: &DoorbellPage) -> Vec<u32> {
        let mut found = Vec::new();
        for s in 0..doorbell::SUMMARY_WORDS {
            let summary_offset = doorbell::SUMMARY_OFFSET as usize + 8 * s;
            let mut summary = u64::from_le(
                page.mem
                    .atomic_u64(summary_offset)
                    .swap(0, Ordering::SeqCst),
            );
            while summary != 0 {
                let w = s * 64 + summary.trailing_zeros() as usize;
                summary &= summary - 1;
                let offset = doorbell::BITMAP_OFFSET as usize + 8 * w;
                let mut bits = u64::from_le(page.mem.atomic_u64(offset).swap(0, Ordering::SeqCst));
                while bits != 0 {
                    found.push((w * 64) as u32 + bits.trailing_zeros());
                    bits &= bits - 1;
                }
            }
        }
        found
    }

    #[test]
    fn ringing_sets_the_qp_bit_and_its_summary_bit() {
        let page = page();
        let qp = 64 * 65 + 3;
        let bit = doorbell::bit(qp).unwrap();
        assert!(!page.ring(&bit), "no kick while the device polls");
        // Bitmap word 65, bit 3; summary word 1 (words 64..127), bit 1.
        assert_eq!(word(&page, doorbell::BITMAP_OFFSET + 65 * 8), 1 << 3);
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET + 8), 1 << 1);
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET), 0);
        assert_eq!(word(&page, doorbell::BITMAP_OFFSET + 64 * 8), 0);
        // A second QP in the same word keeps the first one's bit.
        page.ring(&doorbell::bit(64 * 65 + 60).unwrap());
        assert_eq!(
            word(&page, doorbell::BITMAP_OFFSET + 65 * 8),
            (1 << 3) | (1 << 60)
        );
        page.ring(&doorbell::bit(0).unwrap());
        page.ring(&doorbell::bit(MAX_QPS - 1).unwrap());
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET), 1);
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET + 24), 1 << 63);
        assert_eq!(
            device_takes(&page),
            vec![0, 64 * 65 + 3, 64 * 65 + 60, MAX_QPS - 1]
        );
        // Taken: everything is clear, and ringing again sets it again.
        assert!(device_takes(&page).is_empty());
        page.ring(&bit);
        assert_eq!(device_takes(&page), vec![qp]);
        // The device line is never written by the driver.
        assert_eq!(word(&page, doorbell::FLAGS_OFFSET), 0);
    }

    #[test]
    fn kick_only_when_the_device_asked() {
        let page = page();
        let bit = doorbell::bit(7).unwrap();
        assert!(!page.ring(&bit));
        let flags = page.mem.atomic_u32(doorbell::FLAGS_OFFSET as usize);
        flags.store(doorbell::NEED_KICK.to_le(), Ordering::SeqCst);
        assert!(page.ring(&bit));
        // Other device flag bits do not ask for a kick.
        flags.store(0x8000_0000u32.to_le(), Ordering::SeqCst);
        assert!(!page.ring(&bit));
    }
}

#[test]
fn each_qp_type_posts_only_what_it_can_carry() {
    use SendOpcode::*;
    let sge = [Sge {
        addr: 1,
        length: 8,
        lkey: 1,
    }];
    let geo = sq_geometry(16, 1, 0).unwrap();
    let allowed = |qp_type: QpType, opcode: SendOpcode| {
        let mut sq = SendRing::new(work_ring(geo), bit(), 1, 0).of_type(qp_type);
        let dest = UdDest {
            ah: 3,
            remote_qpn: 0x12_3456,
            remote_qkey: 0x8000_0001,
        };
        let wr = SendWr::new(1, opcode, SendPayload::Sges(&sge)).to_ud(dest);
        match sq.push(&wr) {
            Ok(()) => {
                // The UD destination is where the device reads it.
                let wqe =
                    SendWqe::read_from_bytes(&read(&sq.ring.mem, RING_HEADER_SIZE, 48)).unwrap();
                assert_eq!(UdDest::of(&wqe), dest);
                true
            }
            Err(e) => {
                assert_eq!(e.errno(), libc::EINVAL);
                false
            }
        }
    };
    for op in [Send, SendWithImm, RdmaWrite, RdmaWriteWithImm, RdmaRead] {
        assert!(allowed(QpType::Rc, op), "RC {op:?}");
    }
    for op in [Send, SendWithImm, RdmaWrite, RdmaWriteWithImm] {
        assert!(allowed(QpType::Uc, op), "UC {op:?}");
    }
    for op in [RdmaRead, AtomicCmpAndSwp, AtomicFetchAndAdd] {
        assert!(!allowed(QpType::Uc, op), "UC {op:?}");
    }
    for op in [Send, SendWithImm] {
        assert!(allowed(QpType::Ud, op), "UD {op:?}");
    }
    for op in [RdmaWrite, RdmaWriteWithImm, RdmaRead, AtomicFetchAndAdd] {
        assert!(!allowed(QpType::Ud, op), "UD {op:?}");
    }
}

#[test]
fn a_qp_on_an_srq_refuses_receives_and_an_srq_needs_no_doorbell() {
    let geo = rq_geometry(4, 1).unwrap();
    let sge = [Sge {
        addr: 1,
        length: 8,
        lkey: 1,
    }];
    let wr = RecvWr {
        wr_id: 1,
        sg_list: &sge,
    };
    let mut shared = RecvRing::of_srq_qp(work_ring(geo));
    assert_eq!(shared.push(&wr).unwrap_err().errno(), libc::EINVAL);
    let mut srq = RecvRing::new(work_ring(geo), None, 1);
    srq.push(&wr).unwrap();
    assert!(srq.doorbell.is_none());
    assert!(srq.ring.publish());
}
