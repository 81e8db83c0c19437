//! The vdev→hostd protocol as hostd receives it: the request decoder
//! (`messages::decode::<Request>`) and the shared rings, whose indices and
//! entries the other side writes (`shm::Ring`).

use vrdma_hostd_protocol::entries::{PhysCqe, PhysWqe, MAX_PHYS_SGE};
use vrdma_hostd_protocol::messages::{self, Request, MAX_MESSAGE};
use vrdma_hostd_protocol::shm::{self, Ring, RingPlace, SharedMapping, RING_HEADER};

use crate::input::Input;

/// Bytes of the shared mapping the ring check uses.
const MAP_BYTES: usize = 64 * 1024;
/// Filler of the mapping, so that stray reads and writes show.
const CANARY: u8 = 0xa5;

thread_local! {
    /// One mapping per thread (property tests run in parallel), reused
    /// across inputs: creating a memfd per input would dominate.
    static MAPPING: Option<SharedMapping> = shm::sealed_memfd("fuzz-ring", MAP_BYTES as u64)
        .ok()
        .and_then(|file| SharedMapping::map(file, 0, MAP_BYTES as u64).ok());
}

/// The first byte selects the check: even, the rest is a request message;
/// odd, the rest drives a ring with hostile indices and entries.
pub fn check(data: &[u8]) {
    match data.split_first() {
        Some((selector, rest)) if selector & 1 == 1 => check_ring(rest),
        Some((_, rest)) => check_request(rest),
        None => check_request(data),
    }
}

/// `decode::<Request>`: never panics; refuses oversized input; whatever it
/// accepts encodes again and decodes to the same request.
pub fn check_request(data: &[u8]) {
    match messages::decode::<Request>(data) {
        Ok(request) => {
            assert!(data.len() <= MAX_MESSAGE, "oversized message accepted");
            let bytes = messages::encode(&request).expect("an accepted request encodes");
            let again: Request = messages::decode(&bytes).expect("a re-encoded request decodes");
            assert_eq!(again, request, "round trip changed the request");
        }
        Err(_) => {
            // A refusal is the expected answer to garbage; hostd answers it
            // with an error response and keeps the connection's state.
        }
    }
}

/// A ring placed in the mapping with hostile header and entries. Consuming
/// (hostd's side of the submission ring) yields at most `depth` entries and
/// reports corruption exactly when the indices are more than `depth` apart;
/// producing (hostd's side of the completion ring, whose consumer index vdev
/// writes) never writes outside the ring and never overfills it.
pub fn check_ring(data: &[u8]) {
    MAPPING.with(|mapping| {
        if let Some(mapping) = mapping {
            check_ring_in(mapping, data);
        }
    });
}

fn check_ring_in(mem: &SharedMapping, data: &[u8]) {
    let mut input = Input::new(data);
    let depth_code = input.u8();
    // Mostly powers of two up to 64; sometimes anything, which must be refused.
    let depth = if depth_code & 0x80 != 0 {
        u32::from(input.u16())
    } else {
        1u32 << (depth_code % 7)
    };
    let offset = if input.bool() {
        usize::from(input.u16())
    } else {
        usize::from(input.u8() % 8) * 64
    };
    let place = RingPlace { offset, depth };
    let producer = input.u32();
    let consumer = input.u32();
    let sleeping = input.u32();

    // Fresh mapping contents: canary everywhere, then the hostile ring.
    let canary = vec![CANARY; MAP_BYTES];
    assert!(mem.write(0, &canary));
    let header_fits = offset
        .checked_add(RING_HEADER)
        .is_some_and(|e| e <= MAP_BYTES);
    if header_fits {
        assert!(mem.write(offset, &producer.to_le_bytes()));
        assert!(mem.write(offset + 64, &consumer.to_le_bytes()));
        assert!(mem.write(offset + 128, &sleeping.to_le_bytes()));
        let n = usize::from(input.u16()) % 4096;
        let entries = input.bytes(n);
        let start = offset + RING_HEADER;
        let room = MAP_BYTES - start;
        assert!(mem.write(start, &entries[..entries.len().min(room)]));
    }

    let fits = |bytes: usize| {
        offset.is_multiple_of(64)
            && depth.is_power_of_two()
            && offset.checked_add(bytes).is_some_and(|e| e <= MAP_BYTES)
    };
    let used = producer.wrapping_sub(consumer);
    let corrupt = used > depth;

    // hostd consuming vdev's submissions.
    match Ring::<PhysWqe>::new(mem, place) {
        None => assert!(
            !fits(place.bytes::<PhysWqe>()),
            "a fitting ring was refused"
        ),
        Some(ring) => {
            assert!(
                fits(place.bytes::<PhysWqe>()),
                "a ring outside the mapping was accepted"
            );
            match ring.pending() {
                Err(_) => assert!(corrupt, "sane indices reported corrupt"),
                Ok(n) => {
                    assert!(!corrupt, "corrupt indices accepted");
                    assert_eq!(n, used);
                }
            }
            let mut popped = 0u32;
            loop {
                match ring.pop() {
                    Ok(Some(wqe)) => {
                        popped += 1;
                        assert!(popped <= depth, "more entries than the ring holds");
                        if let Some(sges) = wqe.sges() {
                            assert!(sges.len() <= MAX_PHYS_SGE);
                            assert_eq!(sges.len(), usize::from(wqe.num_sge));
                        } else {
                            assert!(usize::from(wqe.num_sge) > MAX_PHYS_SGE);
                        }
                    }
                    Ok(None) => break,
                    Err(_) => {
                        assert!(corrupt && popped == 0, "corruption appeared mid-drain");
                        break;
                    }
                }
            }
            if !corrupt {
                assert_eq!(popped, used, "drain did not take every pending entry");
                assert_eq!(ring.pending().ok(), Some(0));
            }
        }
    }

    // hostd producing completions into a ring whose consumer vdev moves.
    let cq_place = place;
    let end = cq_place.offset.saturating_add(cq_place.bytes::<PhysCqe>());
    // Reset the header (the drain above moved the consumer index).
    if header_fits {
        assert!(mem.write(offset, &producer.to_le_bytes()));
        assert!(mem.write(offset + 64, &consumer.to_le_bytes()));
    }
    if let Some(ring) = Ring::<PhysCqe>::new(mem, cq_place) {
        let mut before = vec![0u8; MAP_BYTES];
        assert!(mem.read(0, &mut before));
        let pushes = input.u8() % 80;
        let mut pushed = 0u32;
        for i in 0..pushes {
            let cqe = PhysCqe {
                token: u64::from(i).into(),
                ..PhysCqe::default()
            };
            match ring.push(&cqe) {
                Ok(true) => pushed += 1,
                Ok(false) => break,
                Err(_) => {
                    assert!(corrupt, "sane indices reported corrupt");
                    break;
                }
            }
        }
        if !corrupt {
            assert!(pushed <= depth - used, "pushed past a full ring");
        }
        // Nothing outside [offset, end) changed.
        let mut all = vec![0u8; MAP_BYTES];
        assert!(mem.read(0, &mut all));
        assert!(
            all[..cq_place.offset] == before[..cq_place.offset],
            "ring wrote before its start"
        );
        assert!(all[end..] == before[end..], "ring wrote after its end");
    }
}
