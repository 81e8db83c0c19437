//! What hostd decodes from a less trusted party outside the datapath's
//! rings: the vdev→hostd request decoder (`messages::decode::<Request>`),
//! and the doorbell page, which a hostile guest writes as it likes
//! (`engine::guest::DoorbellPage`: placement and `take`). The WQEs and
//! rings themselves are the `wqe` and `rings` targets.

use std::collections::BTreeSet;

use vrdma_hostd::engine::guest::SharedMapping;
use vrdma_hostd::engine::guest::{DoorbellPage, GuestMemory, MAX_SLOTS};
use vrdma_hostd_protocol::messages::{self, Request, MAX_MESSAGE};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::limits::MAX_QPS;
use vrdma_spec::ring::doorbell::{
    self, BITMAP_OFFSET, BITMAP_WORDS, FLAGS_OFFSET, NEED_KICK, PAGE_SIZE, SUMMARY_OFFSET,
    SUMMARY_WORDS,
};

use crate::input::Input;

/// Guest-physical address of the one memory slot the page check uses.
const SLOT_GPA: u64 = 0x10_0000;
/// Its size: three pages, so a page in the middle has neighbours on both
/// sides whose bytes must not change.
const SLOT_BYTES: u64 = 3 * PAGE_SIZE;
/// Filler of the slot, so that stray writes show.
const CANARY: u8 = 0xa5;

/// One guest memory slot as hostd maps it, and the test's own view of the
/// same memfd (what the guest writes).
struct Slot {
    mem: GuestMemory,
    view: SharedMapping,
}

thread_local! {
    /// One slot per thread (property tests run in parallel), reused across
    /// inputs: creating a memfd per input would dominate.
    static SLOT: Option<Slot> = new_slot();
}

fn new_slot() -> Option<Slot> {
    let file = sealed_memfd("fuzz-doorbell", SLOT_BYTES).ok()?;
    let view = SharedMapping::map(file.try_clone().ok()?, 0, SLOT_BYTES).ok()?;
    let mut mem = GuestMemory::default();
    mem.add(
        0,
        SLOT_GPA,
        SharedMapping::map(file, 0, SLOT_BYTES).ok()?,
        MAX_SLOTS,
    )
    .ok()?;
    Some(Slot { mem, view })
}

/// The first byte selects the check: even, the rest is a request message;
/// odd, the rest is a doorbell page and where the driver placed it.
pub fn check(data: &[u8]) {
    match data.split_first() {
        Some((selector, rest)) if selector & 1 == 1 => check_doorbell(rest),
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
            // with an error response and hangs up.
        }
    }
}

/// A doorbell page full of the guest's bytes. Invariants: the page is
/// accepted exactly where it is page-aligned inside the slot; `take`
/// reports each bit that is set in a bitmap word its summary names, once,
/// only indices below `MAX_QPS`, and as many as it says; it clears those
/// summary and bitmap words and writes nothing else; a second `take` finds
/// nothing; `pending` tells whether a summary word was set;
/// `set_need_kick` writes the flags word alone.
pub fn check_doorbell(data: &[u8]) {
    SLOT.with(|slot| {
        if let Some(slot) = slot {
            check_doorbell_in(slot, data);
        }
    });
}

fn check_doorbell_in(slot: &Slot, data: &[u8]) {
    let mut input = Input::new(data);
    // Mostly one of the slot's pages; sometimes near them or anywhere.
    let gpa = match input.u8() % 8 {
        0..=3 => SLOT_GPA + PAGE_SIZE,
        4 => SLOT_GPA + u64::from(input.u8() % 4) * PAGE_SIZE,
        5 => SLOT_GPA + PAGE_SIZE + u64::from(input.u16()),
        6 => SLOT_GPA.wrapping_sub(u64::from(input.u16())),
        _ => input.u64(),
    };
    let fits = gpa.is_multiple_of(PAGE_SIZE)
        && gpa >= SLOT_GPA
        && gpa
            .checked_add(PAGE_SIZE)
            .is_some_and(|end| end <= SLOT_GPA + SLOT_BYTES);
    let page = match DoorbellPage::new(&slot.mem, gpa) {
        Ok(page) => {
            assert!(
                fits,
                "a doorbell page at {gpa:#x} outside the slot accepted"
            );
            page
        }
        Err(_) => {
            assert!(!fits, "a doorbell page at {gpa:#x} inside the slot refused");
            return;
        }
    };
    assert_eq!(page.slot(), 0);
    let base = usize::try_from(gpa - SLOT_GPA).expect("inside the slot");

    // The guest's page: canary around it, its bytes in it. Summary words
    // are often sparse, so that the bitmap words they name are reached.
    let mut before = vec![CANARY; SLOT_BYTES as usize];
    let bytes = input.bytes(PAGE_SIZE as usize);
    before[base..base + bytes.len()].copy_from_slice(bytes);
    let sparse = input.u8();
    for s in 0..SUMMARY_WORDS {
        if sparse & (1 << s) != 0 {
            let at = base + SUMMARY_OFFSET as usize + 8 * s;
            let word = u64::from_le_bytes(before[at..at + 8].try_into().expect("8 bytes"));
            let bits = word & u64::from(input.u32()).rotate_left(u32::from(input.u8()));
            before[at..at + 8].copy_from_slice(&bits.to_le_bytes());
        }
    }
    assert!(slot.view.write(0, &before));

    let word = |bytes: &[u8], offset: u64| {
        let at = base + offset as usize;
        u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
    };
    // What a correct take finds and clears.
    let mut expected = BTreeSet::new();
    let mut after = before.clone();
    for s in 0..SUMMARY_WORDS {
        let offset = SUMMARY_OFFSET + 8 * s as u64;
        let summary = word(&before, offset);
        let at = base + offset as usize;
        after[at..at + 8].fill(0);
        for bit in 0..64 {
            let w = s * 64 + bit;
            if summary & (1 << bit) == 0 || w >= BITMAP_WORDS {
                continue;
            }
            let offset = BITMAP_OFFSET + 8 * w as u64;
            let bits = word(&before, offset);
            for b in 0..64 {
                if bits & (1 << b) != 0 {
                    expected.insert(w as u32 * 64 + b);
                }
            }
            let at = base + offset as usize;
            after[at..at + 8].fill(0);
        }
    }

    let announced = (0..SUMMARY_WORDS).any(|s| word(&before, SUMMARY_OFFSET + 8 * s as u64) != 0);
    assert_eq!(
        page.pending(),
        announced,
        "pending() disagrees with the summary"
    );
    let mut seen = BTreeSet::new();
    let found = page.take(|index| {
        assert!(index < MAX_QPS, "doorbell index {index} beyond MAX_QPS");
        assert!(doorbell::bit(index).is_some());
        assert!(seen.insert(index), "doorbell index {index} reported twice");
    });
    assert_eq!(
        found,
        seen.len(),
        "take's count differs from what it reported"
    );
    assert_eq!(seen, expected, "take reported other indices than were rung");
    let mut now = vec![0u8; SLOT_BYTES as usize];
    assert!(slot.view.read(0, &mut now));
    assert!(
        now == after,
        "take wrote other bytes than the words it read"
    );
    assert!(!page.pending(), "work still announced after take");
    assert_eq!(page.take(|i| panic!("index {i} taken twice")), 0);

    let need = input.bool();
    page.set_need_kick(need);
    let flags = base + FLAGS_OFFSET as usize;
    let value = if need { NEED_KICK } else { 0 };
    after[flags..flags + 4].copy_from_slice(&value.to_le_bytes());
    assert!(slot.view.read(0, &mut now));
    assert!(now == after, "set_need_kick wrote beyond the flags word");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rung_page_is_taken_and_a_misplaced_one_refused() {
        // Every bit of summary word 0 and of the bitmap words it names.
        let mut page = vec![0u8; PAGE_SIZE as usize];
        page[SUMMARY_OFFSET as usize..SUMMARY_OFFSET as usize + 8].fill(0xff);
        page[BITMAP_OFFSET as usize..].fill(0xff);
        let mut data = vec![1, 0];
        data.extend_from_slice(&page);
        check(&data);
        // Misplaced, garbage, empty.
        check(&[1, 5, 0x10, 0]);
        check(&[1, 7, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        check(&[1; 5000]);
        check(&[]);
    }
}
