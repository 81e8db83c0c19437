//! Registration of a large region of already-shared guest memory, timed at
//! the control queue: a VMM-style frontend with a sparse memfd as guest
//! memory, vdev attached to hostd (so hostd records the region too),
//! against the registration of one page. And registration of a process's
//! own memory in process mode (`run_app_memory`).

use std::time::{Duration, Instant};

use vrdma_spec::control::{MrHandle, Opcode, PdHandle, RegMrReq, RegMrResp};
use vrdma_spec::verbs::access;
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_tools::vmm::{self, Vmm};

use crate::baselines::{memcpy_rate, PageBuffer};
use crate::host::{Host, Tenant};
use crate::report::{percentiles, us};
use crate::{verbs, BenchError, Result};

/// Registrations of the large region timed.
const ROUNDS: usize = 20;

pub fn run(host: &Host, size: usize) -> Result<()> {
    let vdev = host.vdev("alpha")?;
    let mut vmm = Vmm::attach_with_memory(vdev.socket(), size + (16 << 20));
    let pd: PdHandle = vmm.ok(Opcode::AllocPd, &[]);
    let mut samples = Vec::with_capacity(ROUNDS);
    let mut page = Duration::ZERO;
    for round in 0..=ROUNDS {
        // The last round registers one page.
        let (took, resp) = register(&mut vmm, &pd, if round < ROUNDS { size } else { 4096 });
        if round < ROUNDS {
            samples.push(took);
        } else {
            page = took;
        }
        let dereg = MrHandle {
            handle: resp.handle,
            reserved: 0.into(),
        };
        let _: () = vmm.ok(Opcode::DeregMr, dereg.as_bytes());
    }
    let (p50, p99) = percentiles(&mut samples);
    println!(
        "reg_mr     {:>5} MiB  p50 {} p99 {}  | one page {}  | ratio {:.2}",
        size >> 20,
        us(p50),
        us(p99),
        us(page),
        p50.as_secs_f64() / page.as_secs_f64()
    );
    Ok(())
}

/// Registers `length` bytes of free guest memory: the time it took.
fn register(vmm: &mut Vmm, pd: &PdHandle, length: usize) -> (Duration, RegMrResp) {
    let req = RegMrReq {
        pdn: pd.pdn,
        access: (access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ).into(),
        addr: vmm::FREE.into(),
        length: (length as u64).into(),
        iova: vmm::FREE.into(),
    };
    let start = Instant::now();
    let resp: RegMrResp = vmm.ok(Opcode::RegMr, req.as_bytes());
    (start.elapsed(), resp)
}

/// Sizes of application memory the second registration test registers.
const APP_SIZES: [usize; 3] = [4096, 1 << 20, 16 << 20];

/// Registration of the application's own memory in process mode, the way
/// `ibv_reg_mr` on a malloc'd buffer does it: `reg_mr` moves the pages
/// onto a memfd (other threads' writes held meanwhile) and announces them,
/// `dereg_mr` moves them back. Against, at their best on the same warm
/// range: what a kernel driver does instead, pinning the pages (`mlock`
/// and `munlock`), and the two copies the moves make (the bench's memcpy
/// baseline, twice).
pub fn run_app_memory(tenant: &Tenant) -> Result<()> {
    for size in APP_SIZES {
        let no_memory = |what| BenchError::Baseline {
            what,
            source: std::io::ErrorKind::OutOfMemory.into(),
        };
        let mut range = PageBuffer::new(size, 0x5a)
            .ok_or_else(|| no_memory("registration of application memory"))?;
        let rw = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
        let (mut reg, mut dereg) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let start = Instant::now();
            // SAFETY: `range` is this function's own heap buffer, alive
            // while the MR lives and touched by no other thread.
            let mr = unsafe { tenant.pd.reg_mr(range.bytes_mut().as_mut_ptr(), size, rw) }
                .map_err(verbs("register application memory"))?;
            reg.push(start.elapsed());
            let start = Instant::now();
            drop(mr);
            dereg.push(start.elapsed());
        }
        let pin = best_of(|| pin_and_unpin(range.bytes()))?;
        let rate = memcpy_rate(size, size, ROUNDS);
        if rate <= 0.0 {
            return Err(no_memory("memcpy"));
        }
        let copies = Duration::from_secs_f64(2.0 * size as f64 / rate);
        let (reg50, _) = percentiles(&mut reg);
        let (dereg50, _) = percentiles(&mut dereg);
        let whole = reg50 + dereg50;
        println!(
            "reg_mr app {:>6} KiB  reg p50 {} dereg p50 {}  | pin (mlock+munlock) {} ratio {:.1} \
             | 2 x memcpy {} ratio {:.1}",
            size >> 10,
            us(reg50),
            us(dereg50),
            us(pin),
            whole.as_secs_f64() / pin.as_secs_f64(),
            us(copies),
            whole.as_secs_f64() / copies.as_secs_f64(),
        );
    }
    Ok(())
}

/// The shortest of [`ROUNDS`] timed runs of `f`, after one to warm up.
fn best_of(mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    f()?;
    let mut best = Duration::MAX;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        f()?;
        best = best.min(start.elapsed());
    }
    Ok(best)
}

/// Locks `bytes` into memory and unlocks them: what a kernel driver's
/// pinning costs.
fn pin_and_unpin(bytes: &[u8]) -> Result<()> {
    let (addr, len) = (bytes.as_ptr().cast::<libc::c_void>(), bytes.len());
    // SAFETY: mlock/munlock of memory this borrow keeps alive change no
    // byte.
    let r = unsafe {
        if libc::mlock(addr, len) != 0 {
            -1
        } else {
            libc::munlock(addr, len)
        }
    };
    if r != 0 {
        return Err(BenchError::Baseline {
            what: "pinning (mlock; is RLIMIT_MEMLOCK too low?)",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}
