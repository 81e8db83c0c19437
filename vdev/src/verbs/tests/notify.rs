//! The doorbell page (`SET_DOORBELL`) and event rings (`CREATE_EQ`).

use vrdma_spec::ring::{doorbell, MAX_RING_DEPTH};

use super::*;

const EQ_RING: u64 = MEM_BASE + 0x31_0000;

/// Fills `len` bytes at `addr` with `byte`.
fn dirty(dev: &RdmaDevice, addr: u64, len: usize, byte: u8) {
    dev.mem
        .write_slice(&vec![byte; len], GuestAddress(addr))
        .expect("in memory");
}

fn bytes_at(dev: &RdmaDevice, addr: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    dev.mem
        .read_slice(&mut bytes, GuestAddress(addr))
        .expect("in memory");
    bytes
}

#[test]
fn the_doorbell_page_is_checked_and_given_once() {
    let mut dev = device_without_doorbell(Limits::default());
    let end = MEM_BASE + MEM_SIZE as u64;
    for (addr, what) in [
        (DOORBELL + 64, "misaligned"),
        (end, "past guest memory"),
        (MEM_BASE - RING_ALIGN, "before guest memory"),
        (!(RING_ALIGN - 1), "wrapping the address space"),
    ] {
        assert_eq!(set_doorbell(&mut dev, addr), Err(libc::EINVAL), "{what}");
        assert_eq!(dev.doorbell(), None, "{what}: nothing recorded");
    }
    set_doorbell(&mut dev, end - doorbell::PAGE_SIZE).expect("the last page fits");
    dev.release_all();
    assert_eq!(dev.doorbell(), None, "a reset forgets the page");

    // The device's line starts clear; what the driver writes is untouched.
    dirty(&dev, DOORBELL, doorbell::PAGE_SIZE as usize, 0xff);
    set_doorbell(&mut dev, DOORBELL).expect("doorbell page");
    assert_eq!(dev.doorbell(), Some(DOORBELL));
    let page = bytes_at(&dev, DOORBELL, doorbell::PAGE_SIZE as usize);
    let device_line = doorbell::SUMMARY_OFFSET as usize;
    assert!(
        page[..device_line].iter().all(|&b| b == 0),
        "no stale NEED_KICK"
    );
    assert!(
        page[device_line..].iter().all(|&b| b == 0xff),
        "summary and bitmap are the driver's"
    );

    assert_eq!(
        set_doorbell(&mut dev, DOORBELL),
        Err(libc::EEXIST),
        "a second SET_DOORBELL"
    );
    let other = DOORBELL + doorbell::PAGE_SIZE;
    dirty(&dev, other, 64, 0xff);
    assert_eq!(set_doorbell(&mut dev, other), Err(libc::EEXIST));
    assert_eq!(dev.doorbell(), Some(DOORBELL), "the first page stays");
    assert!(
        bytes_at(&dev, other, 64).iter().all(|&b| b == 0xff),
        "a refused SET_DOORBELL writes nothing"
    );
}

#[test]
fn event_rings_are_checked_and_made_once_per_vector() {
    let mut dev = device();
    let end = MEM_BASE + MEM_SIZE as u64;
    let cases = [
        (2, 64, EQ_RING, "vector beyond num_comp_vectors"),
        (0, 0, EQ_RING, "depth 0"),
        (0, 48, EQ_RING, "depth not a power of two"),
        (
            0,
            MAX_RING_DEPTH * 2,
            EQ_RING,
            "depth beyond MAX_RING_DEPTH",
        ),
        (0, 64, EQ_RING + 64, "misaligned ring"),
        (0, 512, end - RING_ALIGN, "ring past guest memory"),
        (0, 64, !(RING_ALIGN - 1), "ring wrapping around"),
    ];
    for (vector, depth, addr, what) in cases {
        assert_eq!(
            create_eq(&mut dev, vector, depth, addr),
            Err(libc::EINVAL),
            "{what}"
        );
    }
    assert_eq!(dev.event_ring(0), None, "no refusal recorded anything");

    dirty(&dev, EQ_RING, ring::RING_HEADER_SIZE, 0xff);
    create_eq(&mut dev, 0, 64, EQ_RING).expect("EQ of vector 0");
    let header = bytes_at(&dev, EQ_RING, ring::RING_HEADER_SIZE);
    assert!(
        header[..64].iter().all(|&b| b == 0xff),
        "driver line untouched"
    );
    assert!(header[64..].iter().all(|&b| b == 0), "device line reset");
    assert_eq!(
        dev.event_ring(0),
        Some(EventRing {
            ring_addr: EQ_RING,
            depth: 64
        })
    );

    // Room for the deepest ring: 1 MiB of events.
    let second = MEM_BASE + 0x1_0000;
    dirty(&dev, second, ring::RING_HEADER_SIZE, 0xff);
    assert_eq!(
        create_eq(&mut dev, 0, 64, second),
        Err(libc::EEXIST),
        "a second ring for vector 0"
    );
    assert!(
        bytes_at(&dev, second, ring::RING_HEADER_SIZE)
            .iter()
            .all(|&b| b == 0xff),
        "a refused CREATE_EQ writes nothing"
    );
    create_eq(&mut dev, 1, MAX_RING_DEPTH, second).expect("EQ of vector 1, deepest");
    assert_eq!(dev.event_ring(1).map(|eq| eq.depth), Some(MAX_RING_DEPTH));

    dev.release_all();
    assert_eq!((dev.event_ring(0), dev.event_ring(1)), (None, None));
    create_eq(&mut dev, 0, 64, EQ_RING).expect("after a reset, a new driver's EQ");
}

#[test]
fn create_qp_needs_the_doorbell_page_first() {
    let mut dev = device_without_doorbell(Limits::default());
    let pdn = alloc_pd(&mut dev);
    let cqn = create_cq(&mut dev, MEM_BASE).expect("cq");
    let (sq, rq) = (MEM_BASE + 0x10000, MEM_BASE + 0x20000);
    dirty(&dev, sq, ring::RING_HEADER_SIZE, 0xab);
    assert_eq!(
        create_qp(&mut dev, pdn, cqn, sq, rq).map(|_| ()),
        Err(libc::EINVAL),
        "no SET_DOORBELL yet"
    );
    assert_eq!(dev.object_counts().3, 0);
    assert!(
        bytes_at(&dev, sq, ring::RING_HEADER_SIZE)
            .iter()
            .all(|&b| b == 0xab),
        "the refused QP's rings are untouched"
    );
    set_doorbell(&mut dev, DOORBELL).expect("doorbell page");
    let qp = create_qp(&mut dev, pdn, cqn, sq, rq).expect("qp");
    assert_eq!(qp.db_index.get(), 0);
}
