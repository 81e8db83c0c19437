//! The datapath allocates nothing per WQE in steady state: a counting
//! global allocator watches the engine run WRITEs, READs, SEND/RECVs,
//! atomics and inline sends between two devices (doorbells, WQE reads, key
//! lookups, copies, CQE writes, events) after a warm-up.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use vrdma_hostd::engine::testing::{remote, send, sge, Env, IOVA};
use vrdma_spec::ring::{send_flags, CQ_ARM_NEXT};
use vrdma_spec::verbs::{SendOpcode, WcStatus};

/// Counts the allocations of the thread that set `COUNTING` (the engine
/// runs on the test's thread; the test harness's own threads, which
/// allocate when the machine is loaded, are not the datapath).
struct Counting;

thread_local! {
    // `const` with a plain Cell: reading it never allocates.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn counting() -> bool {
    COUNTING.try_with(Cell::get).unwrap_or(false)
}
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static ABORT: AtomicBool = AtomicBool::new(false);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counter is an atomic and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if counting() {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            if ABORT.load(Ordering::Relaxed) {
                std::process::abort();
            }
        }
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if counting() {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Posts one of each kind of work on both sides, runs the engine until it
/// is idle and checks every completion succeeded. Returns the completions
/// (A: WRITE, SEND, FAA and a receive; B: READ, inline SEND, a receive).
fn one_of_each(env: &mut Env, round: u64) -> usize {
    let (la, lb, ra, rb) = (env.a.lkey, env.b.lkey, env.a.rkey, env.b.rkey);
    let write = remote(send(round, SendOpcode::RdmaWrite), IOVA + 0x1000, rb);
    env.a.post_sges(0, &write, &[sge(IOVA, 64, la)]);
    let read = remote(send(round, SendOpcode::RdmaRead), IOVA + 0x2000, ra);
    env.b.post_sges(0, &read, &[sge(IOVA + 0x3000, 4096, lb)]);
    env.b.post_recv(0, round, &[sge(IOVA + 0x4000, 256, lb)]);
    let mut s = send(round, SendOpcode::SendWithImm);
    s.imm_data = [1, 2, 3, 4];
    env.a.post_sges(0, &s, &[sge(IOVA + 0x100, 200, la)]);
    let mut faa = remote(
        send(round, SendOpcode::AtomicFetchAndAdd),
        IOVA + 0x5000,
        rb,
    );
    faa.compare_add = 1.into();
    env.a.post_sges(0, &faa, &[sge(IOVA + 0x5000, 8, la)]);
    env.a.post_recv(0, round, &[sge(IOVA + 0x6000, 64, la)]);
    let mut inline = send(round, SendOpcode::Send);
    inline.flags |= send_flags::INLINE;
    inline.inline_len = 32.into();
    env.b.post_send(0, &inline, &[9u8; 32]);
    // An armed CQ: the event ring and its interrupt are on the path too.
    env.a.arm(round as u32 + 1, CQ_ARM_NEXT);
    for _ in 0..64 {
        let r = env.engine.round(&[1, 2], env.now);
        if !r.worked && !r.busy {
            break;
        }
    }
    let mut done = 0;
    let mut check = |cqe: vrdma_spec::ring::Cqe| {
        assert_eq!(cqe.status, u8::from(WcStatus::Success), "{cqe:?}");
        done += 1;
    };
    env.a.poll_each(&mut check);
    env.b.poll_each(&mut check);
    let mut events = 0;
    env.a.events_each(|_, _| events += 1);
    assert_eq!(events, 1, "one completion event per arm");
    let _ = env.a.irq.read();
    done
}

#[test]
fn steady_state_work_allocates_nothing() {
    let mut env = Env::new();
    // Warm-up: the engine's lists and the tests' rings reach their size.
    for round in 0..50 {
        assert_eq!(one_of_each(&mut env, round), 7);
    }
    ALLOCATIONS.store(0, Ordering::SeqCst);
    ABORT.store(
        std::env::var_os("ABORT_ON_ALLOC").is_some(),
        Ordering::SeqCst,
    );
    COUNTING.set(true);
    let mut completed = 0;
    for round in 50..1050 {
        completed += one_of_each(&mut env, round);
    }
    COUNTING.set(false);
    let allocations = ALLOCATIONS.load(Ordering::SeqCst);
    assert_eq!(completed, 7000);
    assert_eq!(
        allocations, 0,
        "{allocations} allocations for {completed} completed WQEs"
    );
}
