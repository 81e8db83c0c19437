use std::time::Instant;
use vrdma_hostd::engine::testing::{remote, send, sge, Env, IOVA};
use vrdma_spec::verbs::SendOpcode;

#[test]
fn probe() {
    let mut env = Env::new();
    let (la, rb) = (env.a.lkey, env.b.rkey);
    let n: u64 = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000_000);
    let batch = 16u64;
    let start = Instant::now();
    let mut done = 0u64;
    let mut i = 0u64;
    while done < n {
        for k in 0..batch {
            let mut w = remote(send(i + k, SendOpcode::RdmaWrite), IOVA + 0x1000, rb);
            if k != batch - 1 { w.flags = 0; }
            env.a.post_sges(0, &w, &[sge(IOVA, 64, la)]);
        }
        i += batch;
        env.engine.round(&[1, 2], env.now);
        let mut c = 0;
        env.a.poll_each(|_| c += 1);
        done += batch;
    }
    let el = start.elapsed();
    eprintln!("{} WQEs in {:?}: {:.1} ns/WQE, {:.2} Mop/s", n, el, el.as_nanos() as f64 / n as f64, n as f64 / el.as_secs_f64() / 1e6);
}
