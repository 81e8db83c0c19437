//! `reg_mr` of application memory: the pages shared with the device in
//! place, and left alone when a registration is refused.

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};
use vrdma_guest_driver::{Context, ProtectionDomain};
use vrdma_spec::verbs::access;
use vrdma_tests::daemon::Vdev;
use vrdma_tests::tenant::{pattern, read_mr};

use crate::device_view::*;
use crate::*;

/// A vdev without hostd, its device opened through a [`DeviceView`], and
/// a PD.
fn viewed(name: &str) -> (Vdev, Arc<DeviceView>, Context, ProtectionDomain) {
    let vdev = Vdev::start(name, &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    (vdev, view, ctx, pd)
}

/// Application memory the tests register: large enough for glibc to map it
/// privately (see [`AlignedBuf`]).
const LEN: usize = 1 << 20;

/// The end of a test: frees the application's `memory` (its MRs are gone),
/// destroys `pd`, and checks that vdev revoked no memory under a live MR.
fn release(vdev: &Vdev, pd: ProtectionDomain, memory: impl Sized) {
    drop(memory);
    destroyed(pd.destroy());
    assert_no_revocation(vdev);
}

#[test]
fn reg_mr_shares_page_aligned_application_memory_in_place() {
    let (vdev, view, _ctx, pd) = viewed("pm-regmr");
    let (buf, data) = AlignedBuf::patterned(LEN, 1);
    assert_eq!(buf.ptr as usize % PAGE, 0);
    let addr = buf.ptr as u64;
    assert!(view.regions_over(addr, LEN as u64).is_empty());

    // SAFETY: `buf` is this test's mapped allocation; no other thread uses
    // it; the MR is deregistered before `buf` is freed.
    let mr = unsafe { pd.reg_mr(buf.ptr, LEN, RW) }.expect("reg_mr");
    assert_eq!((mr.as_ptr(), mr.len(), mr.iova()), (buf.ptr, LEN, addr));
    assert_ne!(mr.lkey(), mr.rkey());
    // Exactly the buffer's pages were handed to the device.
    assert_eq!(
        view.regions_over(addr, LEN as u64),
        vec![(addr, LEN as u64)]
    );
    // The application's pointer still reads what it had ...
    assert_eq!(buf.read(0, LEN), data);
    assert_eq!(read_mr(&mr, 0, LEN), data);
    // ... and so does the device, through the fd it was given.
    let mem = view.memory();
    assert_eq!(read_vec(&mem, addr, LEN), data);
    // Application writes reach MemoryRegion::read and the device ...
    buf.write(4095, b"written by the application");
    assert_eq!(read_mr(&mr, 4095, 26), b"written by the application");
    assert_eq!(
        read_vec(&mem, addr + 4095, 26),
        b"written by the application"
    );
    // ... and device writes (what an RDMA WRITE will do) reach the application.
    mem.write_slice(
        b"written by the device",
        GuestAddress(addr + LEN as u64 - 21),
    )
    .expect("device write");
    assert_eq!(buf.read(LEN - 21, 21), b"written by the device");

    destroyed(mr.dereg());
    assert_eq!(view.seen().removed, vec![(addr, LEN as u64)]);
    assert!(view.regions_over(addr, LEN as u64).is_empty());
    // The memory stays the application's, contents and all.
    assert_eq!(buf.read(4095, 26), b"written by the application");
    buf.write(0, b"still writable");
    assert_eq!(buf.read(0, 14), b"still writable");
    release(&vdev, pd, buf);
}

#[test]
fn reg_mr_shares_an_unaligned_vec_in_place() {
    let (vdev, view, _ctx, pd) = viewed("pm-regvec");
    let mut vec = pattern((1 << 20) + 333, 2);
    let expected = vec.clone();
    // glibc puts a 16-byte header before an mmap-served allocation.
    let skip = if vec.as_ptr() as usize & (PAGE - 1) == 0 {
        100
    } else {
        0
    };
    let ptr = vec[skip..].as_mut_ptr();
    let len = vec.len() - skip;
    let addr = ptr as u64;
    assert_ne!(
        addr as usize % PAGE,
        0,
        "the buffer must not be page-aligned"
    );

    // SAFETY: `vec` is this test's live allocation, not used by any other
    // thread; the MR is deregistered before `vec` is dropped.
    let mr = unsafe { pd.reg_mr(ptr, len, RW) }.expect("reg_mr of a Vec");
    assert_eq!((mr.as_ptr(), mr.len(), mr.iova()), (ptr, len, addr));
    // The whole pages covering the range are shared.
    let first = addr & !(PAGE as u64 - 1);
    let end = (addr + len as u64).next_multiple_of(PAGE as u64);
    assert_eq!(
        view.regions_over(addr, len as u64),
        vec![(first, end - first)]
    );
    assert_eq!(read_app(vec.as_ptr(), vec.len(), 0, vec.len()), expected);
    assert_eq!(read_mr(&mr, 0, len), expected[skip..]);
    let mem = view.memory();
    assert_eq!(read_vec(&mem, addr, len), expected[skip..]);

    write_app(ptr, len, 10, b"vec write");
    assert_eq!(read_mr(&mr, 10, 9), b"vec write");
    assert_eq!(read_vec(&mem, addr + 10, 9), b"vec write");
    mem.write_slice(b"device", GuestAddress(addr + 500))
        .expect("device write");
    assert_eq!(read_app(ptr, len, 500, 6), b"device");

    destroyed(mr.dereg());
    assert!(view.regions_over(addr, len as u64).is_empty());
    // The Vec is intact and still the application's.
    let now = read_app(vec.as_ptr(), vec.len(), 0, vec.len());
    assert_eq!(now[skip + 10..skip + 19], *b"vec write");
    assert_eq!(now[skip + 500..skip + 506], *b"device");
    assert_eq!(now[skip + 506..], expected[skip + 506..]);
    vec[skip + 1] = 0xee;
    assert_eq!(vec[skip + 1], 0xee);
    release(&vdev, pd, vec);
}

#[test]
fn overlapping_registrations_share_memory_until_the_last_goes() {
    let (vdev, view, _ctx, pd) = viewed("pm-overlap");
    let (buf, data) = AlignedBuf::patterned(LEN, 3);
    let addr = buf.ptr as u64;
    let page = PAGE as u64;

    // SAFETY: inside `buf`, which outlives the MRs and which no other
    // thread touches (the same holds for the two registrations below).
    let middle = unsafe { pd.reg_mr(buf.ptr.add(PAGE), 2 * PAGE, RW) }.expect("middle");
    // SAFETY: as above.
    let whole = unsafe { pd.reg_mr(buf.ptr, LEN, access::LOCAL_WRITE) }.expect("whole");
    // SAFETY: as above.
    let again = unsafe { pd.reg_mr(buf.ptr.add(PAGE + 7), 100, 0) }.expect("same pages");
    let keys: std::collections::HashSet<u32> = [&middle, &whole, &again]
        .iter()
        .flat_map(|m| [m.lkey(), m.rkey()])
        .collect();
    assert_eq!(keys.len(), 6);
    // The whole buffer is covered by: the first page, the shared middle,
    // and the rest — one region each, no page twice.
    let mut regions = view.regions_over(addr, LEN as u64);
    regions.sort_unstable();
    assert_eq!(
        regions,
        vec![
            (addr, page),
            (addr + page, 2 * page),
            (addr + 3 * page, LEN as u64 - 3 * page)
        ]
    );
    assert_eq!(buf.read(0, LEN), data);

    destroyed(middle.dereg());
    destroyed(again.dereg());
    assert!(
        view.seen().removed.is_empty(),
        "the middle pages still belong to `whole`"
    );
    buf.write(PAGE + 1, b"shared");
    assert_eq!(read_mr(&whole, PAGE + 1, 6), b"shared");
    assert_eq!(read_vec(&view.memory(), addr + page + 1, 6), b"shared");

    destroyed(whole.dereg());
    assert_eq!(view.seen().removed.len(), 3);
    assert!(view.regions_over(addr, LEN as u64).is_empty());

    // Registering driver memory again (another access mode) adds no region.
    let dma = pd.alloc_mr(2 * PAGE, RW).expect("alloc_mr");
    let added = view.seen().added.len();
    // SAFETY: the range is the live MR `dma`'s driver memory.
    let alias = unsafe { pd.reg_mr(dma.as_ptr(), 2 * PAGE, access::REMOTE_READ | RW) }
        .expect("reg_mr of driver memory");
    assert_eq!(view.seen().added.len(), added);
    dma.write(0, b"alias").expect("write");
    assert_eq!(read_mr(&alias, 0, 5), b"alias");
    destroyed(alias.dereg());
    destroyed(dma.dereg());
    release(&vdev, pd, buf);
}

#[test]
fn refused_registrations_leave_application_memory_alone() {
    let (_vdev, view, _ctx, pd) = viewed("pm-regmr-bad");
    let (buf, data) = AlignedBuf::patterned(LEN, 4);
    let refused = [
        (
            access::REMOTE_WRITE,
            EINVAL,
            "REMOTE_WRITE without LOCAL_WRITE",
        ),
        (access::LOCAL_WRITE | access::MW_BIND, EOPNOTSUPP, "MW_BIND"),
    ];
    for (flags, errno, what) in refused {
        // SAFETY: `buf` is this test's allocation and outlives the call.
        let result = unsafe { pd.reg_mr(buf.ptr, LEN, flags) };
        assert_eq!(device_errno(result), errno, "{what}");
        // What was shared for the attempt was taken back.
        assert!(view.regions_over(buf.ptr as u64, LEN as u64).is_empty());
        assert_eq!(buf.read(0, LEN), data, "{what}: contents intact");
    }
    let (added, removed) = {
        let seen = view.seen();
        (seen.added.len(), seen.removed.len())
    };
    // SAFETY: zero length and null pointers are refused before any access.
    let zero = unsafe { pd.reg_mr(buf.ptr, 0, RW) };
    assert_eq!(driver_errno(zero), EINVAL);
    // SAFETY: as above.
    let null = unsafe { pd.reg_mr(std::ptr::null_mut(), PAGE, RW) };
    assert_eq!(driver_errno(null), EINVAL);
    let seen = view.seen();
    assert_eq!((seen.added.len(), seen.removed.len()), (added, removed));
    drop(seen);
    buf.write(0, b"ok");
    assert_eq!(buf.read(0, 2), b"ok");
    destroyed(pd.destroy());
}

// ---------------------------------------------------------------------------
