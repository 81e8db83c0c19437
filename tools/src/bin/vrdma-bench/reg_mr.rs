//! Registration of a large region of already-shared guest memory, timed at
//! the control queue: a VMM-style frontend with a sparse memfd as guest
//! memory, vdev attached to hostd (so hostd records the region too),
//! against the registration of one page.

use std::time::{Duration, Instant};

use vrdma_spec::control::{MrHandle, Opcode, PdHandle, RegMrReq, RegMrResp};
use vrdma_spec::verbs::access;
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_tools::vmm::{self, Vmm};

use crate::host::Host;
use crate::report::{percentiles, us};
use crate::Result;

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
