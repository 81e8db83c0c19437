//! Tests of hostd's access to guest memory: mappings and copies, rings
//! and the doorbell page, completions and events.

mod mapping {
    use super::super::*;
    use std::fs::File;
    use std::os::fd::FromRawFd;
    use std::sync::atomic::Ordering;
    use vrdma_hostd_protocol::shm::sealed_memfd;

    fn mapping(bytes: usize) -> SharedMapping {
        let file = sealed_memfd("shm-test", bytes as u64).expect("memfd");
        SharedMapping::map(file, 0, bytes as u64).expect("map")
    }

    #[test]
    fn reads_writes_and_copies_stay_inside_the_mapping() {
        let mem = mapping(4096);
        assert!(mem.write(4090, b"abcdef"));
        assert!(!mem.write(4091, b"abcdef"), "one byte past the end");
        assert!(!mem.write(usize::MAX, b"a"), "offset overflow");
        let mut out = [0u8; 6];
        assert!(mem.read(4090, &mut out));
        assert_eq!(&out, b"abcdef");
        assert!(!mem.read(4091, &mut out));
        let other = mapping(8192);
        assert!(mem.copy_to(4090, &other, 8186, 6));
        assert!(!mem.copy_to(4090, &other, 8187, 6));
        assert!(other.read(8186, &mut out));
        assert_eq!(&out, b"abcdef");
    }

    /// Every length around the vector path's thresholds, at mutually
    /// misaligned offsets, and overlapping ranges both ways, copy exactly
    /// their bytes.
    #[test]
    fn dma_copies_are_exact_at_any_alignment_and_overlap() {
        let pattern: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [0, 1, 127, 1023, 1024, 1025, 1151, 4096, 65_536, 65_537] {
            for (from, to) in [(0, 0), (8, 0), (1, 63), (64, 3)] {
                let mut dst = vec![0xeeu8; len + 128];
                // SAFETY: both ranges are inside their vectors.
                unsafe { dma_copy(pattern[from..].as_ptr(), dst[to..].as_mut_ptr(), len) };
                assert_eq!(
                    &dst[to..to + len],
                    &pattern[from..from + len],
                    "{len} {from}->{to}"
                );
                assert!(dst[..to].iter().all(|&b| b == 0xee), "before {len}");
                assert!(dst[to + len..].iter().all(|&b| b == 0xee), "after {len}");
            }
        }
        for shift in [-4096isize, -1, 1, 4096] {
            let mut buf = pattern[..20_000].to_vec();
            let (from, to) = if shift > 0 {
                (0, shift as usize)
            } else {
                (-shift as usize, 0)
            };
            let len = 12_000;
            let want = pattern[from..from + len].to_vec();
            // SAFETY: both ranges are inside `buf`; they overlap, which
            // `dma_copy` allows.
            unsafe { dma_copy(buf.as_ptr().add(from), buf.as_mut_ptr().add(to), len) };
            assert_eq!(&buf[to..to + len], &want[..], "shift {shift}");
        }
    }

    #[test]
    fn atomics_must_be_aligned_and_inside() {
        let mem = mapping(4096);
        let word = mem.atomic_u32(4092).expect("last word");
        word.store(7, Ordering::Release);
        assert_eq!(
            mem.atomic_u32(4092).map(|w| w.load(Ordering::Acquire)),
            Some(7)
        );
        assert!(mem.atomic_u32(4094).is_none(), "misaligned");
        assert!(mem.atomic_u32(4096).is_none(), "outside");
        assert!(mem.atomic_u64(4088).is_some());
        assert!(mem.atomic_u64(4092).is_none(), "misaligned");
        assert!(mem.atomic_u64(usize::MAX - 3).is_none());
    }

    #[test]
    fn unsealed_or_short_files_are_refused() {
        let name = std::ffi::CString::new("unsealed").expect("name");
        // SAFETY: valid name; result checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh descriptor.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(8192).expect("size");
        assert!(matches!(
            SharedMapping::map(file, 0, 4096),
            Err(ShmError::NotSealed)
        ));
        let sealed = sealed_memfd("short", 4096).expect("memfd");
        assert!(matches!(
            SharedMapping::map(sealed, 0, 8192),
            Err(ShmError::TooSmall { .. })
        ));
        let sealed = sealed_memfd("offset", 4096).expect("memfd");
        assert!(matches!(
            SharedMapping::map(sealed, u64::MAX, 2),
            Err(ShmError::TooSmall { .. })
        ));
    }
}

mod rings {
    use super::super::*;
    use vrdma_hostd_protocol::shm::sealed_memfd;
    use vrdma_spec::ring::doorbell;

    const GPA: u64 = 0x10_0000;

    fn memory(bytes: u64) -> (GuestMemory, Arc<SharedMapping>) {
        let file = sealed_memfd("guest-test", bytes).expect("memfd");
        let view = SharedMapping::map(file.try_clone().expect("dup"), 0, bytes).expect("map");
        let mut mem = GuestMemory::default();
        mem.add(
            3,
            GPA,
            SharedMapping::map(file, 0, bytes).expect("map"),
            MAX_SLOTS,
        )
        .expect("slot");
        (mem, Arc::new(view))
    }

    #[test]
    fn a_device_has_as_many_slots_as_its_tenant_has_memory_regions_and_a_few() {
        let limit = slot_limit(4);
        assert_eq!(limit, 4 + SLOTS_BESIDE_MRS);
        assert_eq!(slot_limit(u32::MAX), MAX_SLOTS);
        let mut mem = GuestMemory::default();
        let map = || {
            let file = sealed_memfd("slots-test", 4096).expect("memfd");
            SharedMapping::map(file, 0, 4096).expect("map")
        };
        let last = u32::try_from(limit - 1).expect("small");
        mem.add(last, 0, map(), limit).expect("the last slot");
        let refused = mem
            .add(last + 1, 1 << 20, map(), limit)
            .expect_err("one past");
        assert!(
            matches!(refused, EngineError::SlotLimit { .. }),
            "{refused}"
        );
        // policy.md: a limit hit is ENOMEM, with the reason.
        assert_eq!(refused.errno(), libc::ENOMEM);
        assert!(refused.to_string().contains("max_mr"), "{refused}");
    }

    #[test]
    fn places_lie_in_one_slot_and_are_aligned() {
        let (mem, _) = memory(64 * 1024);
        assert!(mem.place(GPA, 64 * 1024, 4096).is_some());
        assert!(mem.place(GPA + 1, 16, 4096).is_none(), "misaligned");
        assert!(
            mem.place(GPA + 60 * 1024, 8 * 1024, 4096).is_none(),
            "past the end"
        );
        assert!(
            mem.place(GPA - 4096, 8192, 4096).is_none(),
            "before the slot"
        );
        assert!(mem.place(u64::MAX - 4095, 8192, 4096).is_none(), "wraps");
        assert!(GuestRing::new(&mem, GPA, 3, 64, 1 << 16).is_err(), "depth");
        assert!(
            GuestRing::new(&mem, GPA, 1024, 128, 1 << 16).is_err(),
            "too big"
        );
        assert!(
            GuestRing::new(&mem, GPA, 1 << 17, 16, 1 << 16).is_err(),
            "max depth"
        );
        let ring = GuestRing::new(&mem, GPA + 4096, 16, 64, 1 << 16).expect("fits");
        assert_eq!(ring.slot(), 3);
    }

    #[test]
    fn ring_entries_and_header_go_where_the_spec_says() {
        let (mem, view) = memory(64 * 1024);
        let ring = GuestRing::new(&mem, GPA, 4, 64, 1 << 16).expect("fits");
        assert!(view.write(DRIVER_INDEX_OFFSET as usize, &7u32.to_le_bytes()));
        assert_eq!(ring.driver_index(), Some(7));
        ring.set_device_index(5);
        let mut word = [0u8; 4];
        assert!(view.read(DEVICE_INDEX_OFFSET as usize, &mut word));
        assert_eq!(u32::from_le_bytes(word), 5);
        // Entry 6 wraps to slot 2.
        assert!(ring.write_entry(6, b"hello"));
        let mut out = [0u8; 5];
        assert!(view.read(RING_HEADER_SIZE + 2 * 64, &mut out));
        assert_eq!(&out, b"hello");
        assert!(ring.read_entry(2, 1, &mut out[..4]));
        assert_eq!(&out[..4], b"ello");
        assert!(
            !ring.read_entry(0, 60, &mut out),
            "crosses into the next entry"
        );
        assert!(!ring.write_entry(0, &[0u8; 65]));
    }

    #[test]
    fn doorbells_are_taken_once_and_in_full() {
        let (mem, view) = memory(8192);
        let page = DoorbellPage::new(&mem, GPA).expect("page");
        let ring = |db: u32| {
            let bit = doorbell::bit(db).expect("in range");
            let word = view.atomic_u64(bit.word_offset as usize).expect("word");
            word.fetch_or(bit.mask.to_le(), Ordering::SeqCst);
            let summary = view
                .atomic_u64(bit.summary_offset as usize)
                .expect("summary");
            summary.fetch_or(bit.summary_mask.to_le(), Ordering::SeqCst);
        };
        let hint = page.hint().expect("a hint on the page");
        assert!(!page.pending());
        assert!(!hint.rung());
        for db in [0, 63, 64, 4097, 16383] {
            ring(db);
        }
        assert!(page.pending());
        assert!(hint.rung(), "the hint sees what the page shows");
        let mut seen = Vec::new();
        assert_eq!(page.take(|db| seen.push(db)), 5);
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 63, 64, 4097, 16383]);
        assert!(!page.pending());
        assert!(!hint.rung());
        // Only the last summary word rung: the hint covers every word.
        ring(16383);
        assert!(hint.rung());
        assert_eq!(page.take(|_| {}), 1);
        assert_eq!(page.take(|_| panic!("nothing rang")), 0);
        page.set_need_kick(true);
        let flags = view.atomic_u32(0).expect("flags").load(Ordering::SeqCst);
        assert_eq!(u32::from_le(flags), doorbell::NEED_KICK);
    }
}

mod completions {
    use super::super::*;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
    use vrdma_hostd_protocol::shm::sealed_memfd;
    use vrdma_spec::ring::{
        DEVICE_INDEX_OFFSET, DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET, RING_HEADER_SIZE,
    };

    fn rings() -> (GuestMemory, SharedMapping) {
        let file = sealed_memfd("completion-test", 1 << 16).expect("memfd");
        let view = SharedMapping::map(file.try_clone().expect("dup"), 0, 1 << 16).expect("map");
        let mut mem = GuestMemory::default();
        mem.add(
            0,
            0,
            SharedMapping::map(file, 0, 1 << 16).expect("map"),
            MAX_SLOTS,
        )
        .expect("slot");
        (mem, view)
    }

    fn word(view: &SharedMapping, at: u64) -> u32 {
        let mut b = [0u8; 4];
        assert!(view.read(at as usize, &mut b));
        u32::from_le_bytes(b)
    }

    fn put(view: &SharedMapping, at: u64, v: u32) {
        assert!(view.write(at as usize, &v.to_le_bytes()));
    }

    #[test]
    fn cqes_fill_the_ring_then_overrun_once() {
        let (mem, view) = rings();
        let ring = GuestRing::new(&mem, 0, 2, CQE_SIZE as u32, 1 << 16).expect("ring");
        let mut cq = Cq::new(5, ring, 0);
        let eq_ring = GuestRing::new(&mem, 8192, 4, EVENT_SIZE as u32, 1 << 16).expect("eq");
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let mut eqs = vec![Some(EventRing::new(eq_ring, irq.try_clone().expect("dup")))];
        let cqe = |id: u64| Cqe {
            wr_id: id.into(),
            ..Cqe::default()
        };
        assert!(complete(&mut cq, &mut eqs, &cqe(1), false));
        assert!(complete(&mut cq, &mut eqs, &cqe(2), false));
        assert_eq!(word(&view, DEVICE_INDEX_OFFSET), 2);
        assert!(!complete(&mut cq, &mut eqs, &cqe(3), false), "full");
        assert!(!complete(&mut cq, &mut eqs, &cqe(4), false), "still full");
        // One CQ_ERROR event for the overrun.
        assert_eq!(word(&view, 8192 + DEVICE_INDEX_OFFSET), 1);
        let mut event = [0u8; 4];
        assert!(view.read(8192 + RING_HEADER_SIZE, &mut event));
        assert_eq!(
            u16::from_le_bytes([event[0], event[1]]),
            event_kind::CQ_ERROR
        );
        assert_eq!(irq.read().expect("interrupted"), 1);
        // The driver consumes one: the next fits, in slot 0.
        put(&view, DRIVER_INDEX_OFFSET, 1);
        assert!(complete(&mut cq, &mut eqs, &cqe(5), false));
        let mut id = [0u8; 8];
        assert!(view.read(RING_HEADER_SIZE, &mut id));
        assert_eq!(u64::from_le_bytes(id), 5);
    }

    #[test]
    fn an_armed_cq_fires_once_per_arm() {
        let (mem, view) = rings();
        let ring = GuestRing::new(&mem, 0, 8, CQE_SIZE as u32, 1 << 16).expect("ring");
        let mut cq = Cq::new(9, ring, 0);
        let ok = Cqe::default();
        assert_eq!(cq.post(&ok, false), Ok(None), "not armed");
        put(&view, DRIVER_ARM_OFFSET, (1 << 8) | CQ_ARM_SOLICITED);
        assert_eq!(cq.post(&ok, false), Ok(None), "not solicited");
        assert_eq!(cq.post(&ok, true), Ok(Some(9)));
        assert_eq!(cq.post(&ok, true), Ok(None), "this arm was answered");
        put(&view, DRIVER_ARM_OFFSET, (2 << 8) | CQ_ARM_NEXT);
        assert_eq!(cq.post(&ok, false), Ok(Some(9)));
    }

    /// Inside a datapath round receive completions are written at once
    /// and shown together: the driver sees none of them until the
    /// publication, then all, with one index store; an armed CQ fires once
    /// for the lot, a solicited arm if any of them was solicited.
    #[test]
    fn cqes_written_in_a_round_are_shown_together_with_one_event() {
        let (mem, view) = rings();
        let ring = GuestRing::new(&mem, 0, 8, CQE_SIZE as u32, 1 << 16).expect("ring");
        let mut cq = Cq::new(7, ring, 0);
        let eq_ring = GuestRing::new(&mem, 8192, 4, EVENT_SIZE as u32, 1 << 16).expect("eq");
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let mut eqs = vec![Some(EventRing::new(eq_ring, irq.try_clone().expect("dup")))];
        put(&view, DRIVER_ARM_OFFSET, (1 << 8) | CQ_ARM_SOLICITED);
        let cqe = |id: u64| Cqe {
            wr_id: id.into(),
            ..Cqe::default()
        };
        for (id, solicited) in [(1, false), (2, true), (3, false)] {
            assert!(complete_later(&mut cq, &mut eqs, &cqe(id), solicited));
            assert_eq!(word(&view, DEVICE_INDEX_OFFSET), 0, "not shown yet");
        }
        publish(&mut cq, &mut eqs);
        assert_eq!(word(&view, DEVICE_INDEX_OFFSET), 3);
        assert_eq!(word(&view, 8192 + DEVICE_INDEX_OFFSET), 1, "one event");
        assert_eq!(irq.read().expect("interrupted"), 1);
        // Nothing new: publishing again shows and posts nothing.
        publish(&mut cq, &mut eqs);
        assert_eq!(word(&view, 8192 + DEVICE_INDEX_OFFSET), 1);
        // An immediate completion shows what was written before it too.
        assert!(complete_later(&mut cq, &mut eqs, &cqe(4), false));
        assert!(complete(&mut cq, &mut eqs, &cqe(5), false));
        assert_eq!(word(&view, DEVICE_INDEX_OFFSET), 5);
    }

    #[test]
    fn a_full_event_ring_flags_its_loss() {
        let (mem, view) = rings();
        let ring = GuestRing::new(&mem, 0, 2, EVENT_SIZE as u32, 1 << 16).expect("ring");
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let mut eq = EventRing::new(ring, irq.try_clone().expect("dup"));
        for cq in 0..3 {
            eq.post(event_kind::COMPLETION, cq);
        }
        assert_eq!(eq.lost_events, 1);
        assert_eq!(
            word(&view, vrdma_spec::ring::DEVICE_FLAGS_OFFSET),
            DEVICE_FLAG_ERROR
        );
        assert_eq!(irq.read().expect("interrupted"), 3);
    }
}
