//! The tenant policy file parser, `Policy::parse` (hostd reads it as root;
//! the file is operator input, but a policy reload must never crash hostd).

use std::path::Path;

use vrdma_tenant_policy::policy::Policy;

/// Parses `data` as a policy file. Invariants: parsing is deterministic;
/// an accepted policy passes its own validation again after a round trip
/// through TOML (what `parse` accepts is a fixed point), every tenant has
/// valid, distinct names and sane quotas; a refusal names the file.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("fuzz-policy.toml");
    let first = Policy::parse(text, path);
    let second = Policy::parse(text, path);
    match (first, second) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b, "parse is not deterministic");
            check_accepted(&a, path);
        }
        (Err(a), Err(b)) => {
            let (a, b) = (a.to_string(), b.to_string());
            assert_eq!(a, b, "parse errors differ between runs");
            assert!(
                a.starts_with("fuzz-policy.toml:"),
                "error without location: {a}"
            );
        }
        (a, b) => panic!("parse not deterministic: {a:?} vs {b:?}"),
    }
}

fn check_accepted(policy: &Policy, path: &Path) {
    for tenant in &policy.tenants {
        assert!(
            vrdma_tenant_policy::policy::is_valid_name(&tenant.name),
            "accepted tenant name {:?}",
            tenant.name
        );
        assert!(
            vrdma_tenant_policy::policy::is_valid_name(tenant.network()),
            "accepted network {:?}",
            tenant.network()
        );
        assert!(
            tenant.quotas.validate().is_ok(),
            "accepted invalid quotas {:?}",
            tenant.quotas
        );
    }
    let mut names: Vec<&str> = policy.tenants.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(
        names.len(),
        policy.tenants.len(),
        "duplicate tenant accepted"
    );
    // Round trip: what was accepted, written back, is accepted as the same.
    if let Ok(text) = toml::to_string(policy) {
        match Policy::parse(&text, path) {
            Ok(again) => assert_eq!(&again, policy, "round trip changed the policy"),
            Err(e) => panic!("accepted policy refused after a round trip: {e}\n{text}"),
        }
    }
}
