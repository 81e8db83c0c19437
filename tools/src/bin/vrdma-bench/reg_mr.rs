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
/// and `munlock`), and the two copies the moves make (`memcpy` twice).
pub fn run_app_memory(tenant: &Tenant) -> Result<()> {
    for size in APP_SIZES {
        let range = AppMemory::new(size)?;
        let rw = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
        let (mut reg, mut dereg) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let start = Instant::now();
            // SAFETY: `range` is this function's own anonymous mapping,
            // mapped while the MR lives and touched by no other thread.
            let mr = unsafe { tenant.pd.reg_mr(range.ptr, size, rw) }
                .map_err(verbs("register application memory"))?;
            reg.push(start.elapsed());
            let start = Instant::now();
            drop(mr);
            dereg.push(start.elapsed());
        }
        let pin = best_of(|| range.pin_and_unpin())?;
        let mut copy_to = AppMemory::new(size)?;
        let copies = best_of(|| {
            copy_to.copy_from(&range);
            copy_to.copy_from(&range);
            Ok(())
        })?;
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

/// Anonymous private memory, touched, as a malloc'd buffer is.
struct AppMemory {
    ptr: *mut u8,
    len: usize,
}

impl AppMemory {
    fn new(len: usize) -> Result<Self> {
        // SAFETY: a fresh anonymous mapping at a kernel-chosen address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(BenchError::Baseline {
                what: "registration of application memory (mmap)",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: the `len` bytes just mapped.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0x5a, len) };
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn pin_and_unpin(&self) -> Result<()> {
        // SAFETY: mlock/munlock of this mapping change no byte.
        let r = unsafe {
            if libc::mlock(self.ptr.cast(), self.len) != 0 {
                -1
            } else {
                libc::munlock(self.ptr.cast(), self.len)
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

    fn copy_from(&mut self, other: &AppMemory) {
        // SAFETY: two distinct mappings of at least `len` bytes each.
        unsafe { std::ptr::copy_nonoverlapping(other.ptr, self.ptr, self.len.min(other.len)) };
        std::hint::black_box(self.ptr);
    }
}

impl Drop for AppMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping this value's own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
