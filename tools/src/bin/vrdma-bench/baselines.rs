//! The baselines vrdma is measured against, each at its best on this
//! machine and measured in the same run:
//!
//! - TCP over loopback, the way a tenant talks without RDMA: a ping-pong
//!   with blocking sockets (the kernel wakes the reader) and one with
//!   busy-polling non-blocking sockets (no wake-up: what TCP gives an
//!   application that spends a core on it). TCP's figure is the better of
//!   the two. Both warm up first, so that no measurement pays for a cold
//!   socket or an idle CPU's wake-up.
//! - Shared memory: one cache line handed back and forth between two
//!   threads, the machine's limit for any handoff; and the same through a
//!   relay thread in between, the limit for any design in which a third
//!   party (a NIC, hostd) moves the bytes.
//! - memcpy of the same size, for bandwidth.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cores::{self, SHARED_YIELD_EVERY};
use crate::report::percentiles;
use crate::{BenchError, Result};

/// Round trips run before measuring (sockets, caches and CPUs warm).
pub const WARMUP: usize = 2000;

/// TCP's half round trip (p50) of `size`-byte messages.
#[derive(Debug, Clone, Copy)]
pub struct Tcp {
    pub blocking: Duration,
    pub busy_poll: Duration,
}

impl Tcp {
    /// Both ping-pongs, `iters` round trips each after the warm-up.
    pub fn measure(size: usize, iters: usize) -> Result<Self> {
        let tcp = |spin| {
            tcp_pingpong(size, iters, spin).map_err(|source| BenchError::Baseline {
                what: "the TCP ping-pong",
                source,
            })
        };
        cores::on_every_cpu(|| {
            Ok(Tcp {
                blocking: tcp(false)?,
                busy_poll: tcp(true)?,
            })
        })
        .map_err(pinning)?
    }

    /// The better of the two.
    pub fn best(&self) -> Duration {
        self.blocking.min(self.busy_poll)
    }
}

/// Reads exactly `buf.len()` bytes; with `spin`, from a non-blocking
/// socket, retrying at once on EAGAIN.
pub fn read_all(s: &mut TcpStream, buf: &mut [u8], spin: bool) -> io::Result<()> {
    if !spin {
        return s.read_exact(buf);
    }
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf`; with `spin`, retrying at once on EAGAIN.
pub fn write_all(s: &mut TcpStream, buf: &[u8], spin: bool) -> io::Result<()> {
    if !spin {
        return s.write_all(buf);
    }
    let mut sent = 0;
    while sent < buf.len() {
        match s.write(&buf[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One side of a ping-pong: nodelay, and non-blocking when it spins.
pub fn tune(s: &TcpStream, spin: bool) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_nonblocking(spin)
}

/// The echoing side of a `size`-byte TCP ping-pong of [`WARMUP`] +
/// `iters` round trips.
pub fn pingpong_server(mut s: TcpStream, size: usize, iters: usize, spin: bool) -> io::Result<()> {
    tune(&s, spin)?;
    let mut buf = vec![0u8; size];
    for _ in 0..WARMUP + iters {
        read_all(&mut s, &mut buf, spin)?;
        write_all(&mut s, &buf, spin)?;
    }
    Ok(())
}

/// The timing side of that ping-pong: p50 of the half round trip, after
/// [`WARMUP`] round trips.
pub fn pingpong_client(
    mut c: TcpStream,
    size: usize,
    iters: usize,
    spin: bool,
) -> io::Result<Duration> {
    tune(&c, spin)?;
    let mut buf = vec![1u8; size];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..WARMUP + iters {
        let start = Instant::now();
        write_all(&mut c, &buf, spin)?;
        read_all(&mut c, &mut buf, spin)?;
        if i >= WARMUP {
            samples.push(start.elapsed());
        }
    }
    Ok(percentiles(&mut samples).0 / 2)
}

/// p50 of the half round trip of a loopback TCP ping-pong.
fn tcp_pingpong(size: usize, iters: usize, spin: bool) -> io::Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> io::Result<()> {
        let (s, _) = listener.accept()?;
        pingpong_server(s, size, iters, spin)
    });
    let p50 = pingpong_client(TcpStream::connect(addr)?, size, iters, spin)?;
    server
        .join()
        .map_err(|_| io::Error::other("the TCP server thread panicked"))??;
    Ok(p50)
}

/// A cache line of its own.
#[repr(align(64))]
#[derive(Default)]
struct Line(AtomicU64);

/// One cache line handed back and forth between two threads, wherever the
/// kernel puts them: the half round trip, p50.
pub fn shared_memory_half_rtt(iters: usize) -> Result<Duration> {
    let line = Line::default();
    let total = (WARMUP + iters) as u64;
    let every = SHARED_YIELD_EVERY;
    let mut samples = Vec::with_capacity(iters);
    cores::on_every_cpu(|| {
        std::thread::scope(|scope| {
            let line = &line;
            scope.spawn(move || {
                for i in 0..total {
                    // Wait for ping 2i+1, answer 2i+2.
                    wait_for(&line.0, 2 * i + 1, every);
                    line.0.store(2 * i + 2, Ordering::Release);
                }
            });
            for i in 0..total {
                let start = Instant::now();
                line.0.store(2 * i + 1, Ordering::Release);
                wait_for(&line.0, 2 * i + 2, every);
                if i >= WARMUP as u64 {
                    samples.push(start.elapsed());
                }
            }
        })
    })
    .map_err(pinning)?;
    Ok(percentiles(&mut samples).0 / 2)
}

/// The same ping-pong with a relay thread that copies each value from the
/// sender's line to the receiver's, in both directions: the half round
/// trip, p50, the better of two layouts — every thread wherever the kernel
/// puts it, and (with a dedicated core) the relay on hostd's core and the
/// two ends on the tenants'.
pub fn relayed_half_rtt(iters: usize) -> Result<Duration> {
    let shared = cores::on_every_cpu(|| relayed(iters, None)).map_err(pinning)??;
    Ok(match cores::datapath_cpu() {
        Some(cpu) => shared.min(relayed(iters, Some(cpu))?),
        None => shared,
    })
}

fn pinning(source: io::Error) -> BenchError {
    BenchError::Baseline {
        what: "a baseline on the CPUs it needs",
        source,
    }
}

/// The relayed ping-pong, its relay on `relay_cpu` if given (the ends
/// then on the calling thread's CPUs).
fn relayed(iters: usize, relay_cpu: Option<usize>) -> Result<Duration> {
    // a_out → relay → b_in, b_out → relay → a_in.
    let [a_out, b_in, b_out, a_in] = [(); 4].map(|_| Line::default());
    let total = (WARMUP + iters) as u64;
    let every = match relay_cpu {
        Some(_) => cores::yield_every(),
        None => SHARED_YIELD_EVERY,
    };
    let mut samples = Vec::with_capacity(iters);
    std::thread::scope(|scope| -> Result<()> {
        let (a_out, b_in, b_out, a_in) = (&a_out, &b_in, &b_out, &a_in);
        let relay = scope.spawn(move || -> io::Result<()> {
            if let Some(cpu) = relay_cpu {
                vrdma_isolation::cpus::pin_current_thread(&[cpu])?;
            }
            let (mut to_b, mut to_a) = (0, 0);
            let mut spins = 0u32;
            while to_a < total {
                let v = a_out.0.load(Ordering::Acquire);
                if v != to_b {
                    to_b = v;
                    b_in.0.store(v, Ordering::Release);
                }
                let v = b_out.0.load(Ordering::Acquire);
                if v != to_a {
                    to_a = v;
                    a_in.0.store(v, Ordering::Release);
                }
                spins = spins.wrapping_add(1);
                pause_every(spins, SHARED_YIELD_EVERY);
            }
            Ok(())
        });
        scope.spawn(move || {
            for i in 1..=total {
                wait_for(&b_in.0, i, every);
                b_out.0.store(i, Ordering::Release);
            }
        });
        for i in 1..=total {
            let start = Instant::now();
            a_out.0.store(i, Ordering::Release);
            wait_for(&a_in.0, i, every);
            if i > WARMUP as u64 {
                samples.push(start.elapsed());
            }
        }
        relay
            .join()
            .map_err(|_| BenchError::Panicked)?
            .map_err(pinning)
    })?;
    Ok(percentiles(&mut samples).0 / 2)
}

/// Spins until `word` holds `value`, yielding every `every` turns.
fn wait_for(word: &AtomicU64, value: u64, every: u32) {
    let mut spins = 0u32;
    while word.load(Ordering::Acquire) != value {
        spins = spins.wrapping_add(1);
        pause_every(spins, every);
    }
}

/// One turn of a tenant thread's spinning wait: a pause, and now and then
/// the core ([`cores::yield_every`]), so that on a host with fewer free
/// cores than spinners the other side runs.
pub fn pause(spins: u32) {
    pause_every(spins, cores::yield_every());
}

/// One turn of a spinning wait that yields every `every` turns.
pub fn pause_every(spins: u32, every: u32) {
    if spins.is_multiple_of(every) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Single-thread copies of `size`-byte messages between page-aligned
/// buffers (as registered memory is), bytes per second: the best of
/// `trials` runs over `total` bytes each, with glibc's `memcpy` and, where
/// the CPU has AVX2, a plain vector loop — `memcpy`'s `rep movsb` is slow
/// on some CPUs (this host's AMD EPYC among them, for some alignments), and
/// the baseline is a copy at its best.
pub fn memcpy_rate(size: usize, total: usize, trials: usize) -> f64 {
    let (src, dst) = (PageBuffer::new(size, 0x5a), PageBuffer::new(size, 0));
    let (Some(src), Some(mut dst)) = (src, dst) else {
        return 0.0;
    };
    let rounds = (total / size).max(1);
    let mut best = 0.0f64;
    for vector in [false, true] {
        if vector && !has_avx2() {
            continue;
        }
        for _ in 0..trials {
            let start = Instant::now();
            for _ in 0..rounds {
                let (from, to) = (std::hint::black_box(src.bytes()), dst.bytes_mut());
                if vector {
                    vector_copy(from, to);
                } else {
                    to.copy_from_slice(from);
                }
                std::hint::black_box(&mut *to);
            }
            best = best.max((rounds * size) as f64 / start.elapsed().as_secs_f64());
        }
    }
    best
}

/// A zeroed-then-filled page-aligned heap buffer.
pub struct PageBuffer {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl PageBuffer {
    pub fn new(len: usize, fill: u8) -> Option<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        let mut buf = PageBuffer { ptr, layout };
        buf.bytes_mut().fill(fill);
        Some(buf)
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is a live, initialised allocation of `layout.size()`
        // bytes, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Copies `from` into `to` (of the same length) 128 bytes at a time with
/// AVX2 loads and stores; a plain copy where there is no AVX2.
fn vector_copy(from: &[u8], to: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { avx2_copy(from, to) };
        return;
    }
    to.copy_from_slice(from);
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_copy(from: &[u8], to: &mut [u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let len = from.len().min(to.len());
    let (src, dst) = (from.as_ptr(), to.as_mut_ptr());
    let mut i = 0;
    while i + 128 <= len {
        // SAFETY: i + 128 <= len, inside both slices; unaligned loads and
        // stores have no alignment requirement.
        unsafe {
            let v = [0, 32, 64, 96].map(|o| _mm256_loadu_si256(src.add(i + o).cast::<__m256i>()));
            for (o, v) in [0, 32, 64, 96].into_iter().zip(v) {
                _mm256_storeu_si256(dst.add(i + o).cast::<__m256i>(), v);
            }
        }
        i += 128;
    }
    to[i..len].copy_from_slice(&from[i..len]);
}
