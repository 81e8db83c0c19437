//! The function's one INTx line, shared by every queue, handled the way a
//! kernel handles a shared interrupt line.
//!
//! One thread owns the line (`/dev/uioN`): it sleeps in `poll` until the
//! line fires, takes the interrupt (reads the uio count, reads the virtio
//! ISR, which acknowledges every queue's interrupt at once, and unmasks
//! INTx), and then wakes the waiter of **every** queue by writing that
//! queue's eventfd, because the ISR does not say which queue it was for.
//! A waiter sleeps on its queue's eventfd only; [`Interrupts::wait`] and
//! [`Interrupts::acknowledge`] clear it before the waiter re-checks its
//! queue, so a wake-up for another queue costs one look, and none is
//! lost: the interrupt for an event that comes after that look sets the
//! eventfd again.
//!
//! (Before, every waiter polled its own open file of `/dev/uioN` and read
//! the ISR itself: one waiter's ISR read acknowledged the interrupt of a
//! queue whose waiter had not looked yet, and `ibv_rc_pingpong -e` stalled
//! for its 10 s timeout in 2 of 17 VM runs.)
//!
//! The thread ends when the [`Interrupts`] drop (a stop eventfd it also
//! polls), or when the line fails; waiters then get an error instead of
//! sleeping for ever.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The interrupt line as the interrupt thread sees it.
pub(super) trait Line: Send + 'static {
    /// Readable while an interrupt is pending (`/dev/uioN`).
    fn fd(&self) -> BorrowedFd<'_>;
    /// Takes the pending interrupt: consumes it from [`Line::fd`],
    /// acknowledges it at the device and lets the line fire again. An error
    /// means no further interrupt can be taken.
    fn service(&mut self) -> io::Result<()>;
}

/// What the waiters and the interrupt thread share.
#[derive(Debug)]
struct Shared {
    /// Per queue: written by the thread at every interrupt.
    queues: Vec<EventFd>,
    /// The thread has ended on a failure of the line.
    dead: AtomicBool,
}

impl Shared {
    fn wake_all(&self) {
        for q in &self.queues {
            // EAGAIN (a counter at its maximum) still leaves it readable.
            let _ = q.write(1);
        }
    }
}

/// The interrupt thread of a transport and the per-queue eventfds it sets.
#[derive(Debug)]
pub(super) struct Interrupts {
    shared: Arc<Shared>,
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

/// Why a wait cannot be served.
fn dead_line() -> io::Error {
    io::Error::other("the interrupt line failed; no interrupt can come")
}

impl Interrupts {
    /// Starts the thread serving `line` for `queues` queues.
    pub(super) fn start(line: impl Line, queues: u16) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            queues: (0..queues)
                .map(|_| EventFd::new(EFD_NONBLOCK))
                .collect::<io::Result<_>>()?,
            dead: AtomicBool::new(false),
        });
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let thread = {
            let shared = Arc::clone(&shared);
            let stop = stop.try_clone()?;
            std::thread::Builder::new()
                .name("vrdma-intx".into())
                .spawn(move || run(line, &shared, &stop))?
        };
        Ok(Self {
            shared,
            stop,
            thread: Some(thread),
        })
    }

    fn queue(&self, queue: u16) -> io::Result<&EventFd> {
        self.shared
            .queues
            .get(usize::from(queue))
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    /// Waits up to `timeout` (`None`: forever) for an interrupt since the
    /// queue was last acknowledged, and acknowledges it; returns whether
    /// one came.
    pub(super) fn wait(&self, queue: u16, timeout: Option<Duration>) -> io::Result<bool> {
        let fd = self.queue(queue)?;
        if self.shared.dead.load(Ordering::Acquire) {
            return Err(dead_line());
        }
        let timeout_ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call; the
        // eventfd lives as long as `self`.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        if n == 0 {
            return Ok(false);
        }
        self.acknowledge(queue)?;
        Ok(true)
    }

    /// Readable after an interrupt, until [`Interrupts::acknowledge`].
    pub(super) fn fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        let q = self.queue(queue).ok()?;
        // SAFETY: the eventfd is owned by `self` and stays open as long as
        // the returned borrow, which is tied to `&self`.
        Some(unsafe { BorrowedFd::borrow_raw(q.as_raw_fd()) })
    }

    /// Clears `queue`'s eventfd without blocking.
    pub(super) fn acknowledge(&self, queue: u16) -> io::Result<()> {
        match self.queue(queue)?.read() {
            Ok(_) => Ok(()),
            // Nothing pending, or another thread took it: either way the
            // queue's waiter re-checks its queue.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Stops the thread and waits for it to end (idempotent).
    pub(super) fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        if let Err(e) = self.stop.write(1) {
            // The thread cannot be told: leave it rather than hang here.
            tracing::error!(error = %e, "Cannot stop the interrupt thread");
            return;
        }
        if thread.join().is_err() {
            tracing::error!("The interrupt thread panicked");
        }
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The interrupt thread: takes every interrupt of `line` and wakes every
/// queue, until `stop` is written or the line fails.
fn run(mut line: impl Line, shared: &Shared, stop: &EventFd) {
    loop {
        let mut pfds = [
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: line.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: a valid array of two pollfds for the duration of the
        // call; both fds live as long as this thread (the line is owned
        // here, `stop` is borrowed from the caller that joins us).
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return fail(shared, "Cannot wait for the interrupt line", &e);
        }
        if pfds[0].revents != 0 {
            return;
        }
        let revents = pfds[1].revents;
        if revents & libc::POLLIN != 0 {
            if let Err(e) = line.service() {
                return fail(shared, "Cannot take an interrupt", &e);
            }
            shared.wake_all();
        } else if revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            let e = io::Error::other(format!("poll reported {revents:#x}"));
            return fail(shared, "The interrupt line went away", &e);
        }
    }
}

/// Ends the thread on a failure of the line: waiters are woken and get an
/// error from then on, instead of sleeping for ever.
fn fail(shared: &Shared, what: &str, e: &io::Error) {
    tracing::error!(error = %e, "{what}; queue waits fail from now on");
    shared.dead.store(true, Ordering::Release);
    shared.wake_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    /// A stand-in for `/dev/uioN`: a pipe whose read end is the line; a byte
    /// written is an interrupt, closing the write end takes the line away.
    /// `service` counts its "ISR reads".
    struct PipeLine {
        read: OwnedFd,
        isr_reads: Arc<AtomicUsize>,
        dropped: Arc<AtomicBool>,
        fail_service: bool,
    }

    impl Line for PipeLine {
        fn fd(&self) -> BorrowedFd<'_> {
            self.read.as_fd()
        }
        fn service(&mut self) -> io::Result<()> {
            if self.fail_service {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            let mut buf = [0u8; 64];
            // SAFETY: reads into a valid buffer from a pipe we own.
            let n = unsafe { libc::read(self.read.as_raw_fd(), buf.as_mut_ptr().cast(), 64) };
            assert!(n > 0, "serviced without an interrupt pending");
            self.isr_reads.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    impl Drop for PipeLine {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    struct Fixture {
        irq: Option<OwnedFd>,
        isr_reads: Arc<AtomicUsize>,
        dropped: Arc<AtomicBool>,
        interrupts: Interrupts,
    }

    impl Fixture {
        fn new(queues: u16, fail_service: bool) -> Self {
            let mut fds = [0; 2];
            // SAFETY: pipe2 writes two fds into the array.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            // SAFETY: two new fds this test owns.
            let (read, write) =
                unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            let isr_reads = Arc::new(AtomicUsize::new(0));
            let dropped = Arc::new(AtomicBool::new(false));
            let line = PipeLine {
                read,
                isr_reads: Arc::clone(&isr_reads),
                dropped: Arc::clone(&dropped),
                fail_service,
            };
            Self {
                irq: Some(write),
                isr_reads,
                dropped,
                interrupts: Interrupts::start(line, queues).unwrap(),
            }
        }

        fn fire(&self) {
            let fd = self.irq.as_ref().unwrap().as_raw_fd();
            // SAFETY: writes one byte from a valid buffer to our pipe.
            assert_eq!(unsafe { libc::write(fd, [1u8].as_ptr().cast(), 1) }, 1);
        }

        /// Waits until the thread took `n` interrupts in all.
        fn serviced(&self, n: usize) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.isr_reads.load(Ordering::SeqCst) < n {
                assert!(Instant::now() < deadline, "interrupt not serviced");
                std::thread::sleep(Duration::from_millis(1));
            }
        }

        fn readable(&self, queue: u16) -> bool {
            crate::testing::readable(self.interrupts.fd(queue).unwrap())
        }
    }

    #[test]
    fn one_interrupt_wakes_the_waiter_of_every_queue() {
        let f = Arc::new(Fixture::new(3, false));
        let waiters: Vec<_> = [0u16, 2]
            .into_iter()
            .map(|q| {
                let f = Arc::clone(&f);
                std::thread::spawn(move || f.interrupts.wait(q, Some(Duration::from_secs(10))))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        f.fire();
        for w in waiters {
            assert!(w.join().unwrap().unwrap(), "woken, not timed out");
        }
        assert!(start.elapsed() < Duration::from_secs(5));
        f.serviced(1);
        assert_eq!(f.isr_reads.load(Ordering::SeqCst), 1, "one ISR read");
        // The queue nobody waited on was woken too, and stays readable
        // until its own waiter acknowledges.
        assert!(f.readable(1));
        assert!(!f.readable(0), "the waiter acknowledged");
    }

    #[test]
    fn a_waiter_that_comes_late_still_sees_the_interrupt() {
        let f = Fixture::new(2, false);
        f.fire();
        f.serviced(1);
        // Queue 1's waiter was busy elsewhere when the interrupt came, and
        // queue 0's waiter took it: queue 1 still sees it.
        assert!(f.interrupts.wait(0, Some(Duration::ZERO)).unwrap());
        assert!(f.interrupts.wait(1, Some(Duration::ZERO)).unwrap());
        // Acknowledged: the next wait times out.
        let start = Instant::now();
        assert!(!f
            .interrupts
            .wait(1, Some(Duration::from_millis(30)))
            .unwrap());
        assert!(start.elapsed() >= Duration::from_millis(30));
        // acknowledge() clears one queue only.
        f.fire();
        f.serviced(2);
        f.interrupts.acknowledge(0).unwrap();
        f.interrupts.acknowledge(0).unwrap();
        assert!(!f.readable(0));
        assert!(f.readable(1));
        assert!(f.interrupts.wait(5, Some(Duration::ZERO)).is_err());
        assert!(f.interrupts.fd(5).is_none());
    }

    #[test]
    fn every_interrupt_is_taken_once() {
        let f = Fixture::new(1, false);
        for i in 1..=20 {
            f.fire();
            f.serviced(i);
            assert!(f.interrupts.wait(0, Some(Duration::from_secs(10))).unwrap());
        }
        assert_eq!(f.isr_reads.load(Ordering::SeqCst), 20);
    }

    #[test]
    fn dropping_stops_the_thread() {
        let f = Fixture::new(2, false);
        let dropped = Arc::clone(&f.dropped);
        assert!(!dropped.load(Ordering::SeqCst));
        drop(f.interrupts);
        // The thread owned the line: it is gone once the join returned.
        assert!(dropped.load(Ordering::SeqCst));
    }

    #[test]
    fn a_line_that_goes_away_fails_the_waiters_instead_of_hanging_them() {
        let mut f = Fixture::new(2, false);
        // The writer closed: the line reports a hang-up.
        drop(f.irq.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f.interrupts.shared.dead.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the thread did not notice");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(f.readable(0) && f.readable(1), "waiters were woken");
        assert!(f.interrupts.wait(0, None).is_err());
        let f = Fixture::new(1, true);
        f.fire();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f.interrupts.shared.dead.load(Ordering::SeqCst) {
            assert!(
                Instant::now() < deadline,
                "a failed service ends the thread"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            f.interrupts
                .wait(0, Some(Duration::ZERO))
                .unwrap_err()
                .kind(),
            io::ErrorKind::Other
        );
    }
}
