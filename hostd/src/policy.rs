//! The tenant policy as hostd loads it: the operator's file (or the
//! built-in default), validated by `vrdma-tenant-policy` and then against
//! what this hostd can grant, and the changes between two policies for the
//! reload report.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use vrdma_tenant_policy::{Policy, PolicyError, TenantPolicy};

/// Most physical QPs one device is granted: beyond that, spreading one
/// VM's virtual QPs wider buys nothing but scheduler work.
pub const MAX_QUEUES_PER_DEVICE: u32 = 64;

/// Reads and validates the policy file at `path` for a hostd with
/// `physical_qps` physical QPs.
pub fn load(path: &Path, physical_qps: u32) -> Result<Policy, PolicyError> {
    let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
        path: path.to_owned(),
        source,
    })?;
    let policy = Policy::parse(&text, path)?;
    check(&policy, physical_qps, path, Some(&text))?;
    Ok(policy)
}

/// The built-in policy (tenants `alpha` and `beta` in network `demo`),
/// checked against this hostd's `physical_qps`.
pub fn builtin(physical_qps: u32) -> Result<Policy, PolicyError> {
    let policy = Policy::default_policy();
    check(
        &policy,
        physical_qps,
        Path::new("<built-in default policy>"),
        None,
    )?;
    Ok(policy)
}

/// What this hostd can grant: every tenant's `physical_queues` must fit
/// the per-device cap and the NIC.
fn check(
    policy: &Policy,
    physical_qps: u32,
    path: &Path,
    text: Option<&str>,
) -> Result<(), PolicyError> {
    let max = MAX_QUEUES_PER_DEVICE.min(physical_qps);
    for (i, t) in policy.tenants.iter().enumerate() {
        if t.physical_queues > max {
            let key = format!("tenant[{i}].physical_queues");
            return Err(PolicyError::Invalid {
                path: path.to_owned(),
                line: text.map_or(0, |text| key_line(text, i, "physical_queues")),
                message: format!(
                    "key `{key}`: {} exceeds the {max} physical queues this hostd grants one device \
                     (physical_qps = {physical_qps}, at most {MAX_QUEUES_PER_DEVICE} per device)",
                    t.physical_queues
                ),
                key,
            });
        }
    }
    Ok(())
}

/// The line (from 1) of `key` in the `index`th `[[tenant]]` block of
/// `text`, else of the block's header; 0 if not found.
fn key_line(text: &str, index: usize, key: &str) -> usize {
    let mut block = None;
    let mut header = 0;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.starts_with("[[tenant]]") {
            block = Some(block.map_or(0, |b| b + 1));
            if block == Some(index) {
                header = n + 1;
            }
            continue;
        }
        if line.starts_with('[') && block == Some(index) {
            break;
        }
        if block == Some(index)
            && line
                .strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        {
            return n + 1;
        }
    }
    header
}

/// A policy error as one line: `FILE:LINE: key `KEY`: what` (the policy
/// crate puts the key at the head of the message), or why the file could
/// not be read.
pub fn describe(e: &PolicyError) -> String {
    vrdma_errors::error_chain(e)
}

/// Where the policy came from, for logs and the reload report.
pub fn source_name(path: Option<&PathBuf>) -> String {
    path.map_or_else(
        || "<built-in default policy>".to_owned(),
        |p| p.display().to_string(),
    )
}

/// Flattens a serialized value into dotted keys.
fn flatten(prefix: &str, value: &serde_json::Value, out: &mut BTreeMap<String, String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        serde_json::Value::Null => {
            out.insert(prefix.to_owned(), "(unset)".to_owned());
        }
        serde_json::Value::String(s) => {
            out.insert(prefix.to_owned(), s.clone());
        }
        other => {
            out.insert(prefix.to_owned(), other.to_string());
        }
    }
}

fn keys_of(t: &TenantPolicy) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Ok(value) = serde_json::to_value(t) {
        flatten("", &value, &mut out);
    }
    out
}

/// What changed from `old` to `new`, one line each: tenants added or
/// removed, and every key whose value changed (`tenant alpha:
/// quotas.max_mr 1024 -> 2048`).
pub fn diff(old: &Policy, new: &Policy) -> Vec<String> {
    let mut changes = Vec::new();
    for t in &new.tenants {
        match old.tenant(&t.name) {
            None => changes.push(format!("tenant {} added", t.name)),
            Some(before) if before != t => {
                let (a, b) = (keys_of(before), keys_of(t));
                for (key, value) in &b {
                    let was = a.get(key).map_or("(unset)", String::as_str);
                    if was != value {
                        changes.push(format!("tenant {}: {key} {was} -> {value}", t.name));
                    }
                }
            }
            Some(_) => {}
        }
    }
    for t in &old.tenants {
        if new.tenant(&t.name).is_none() {
            changes.push(format!(
                "tenant {} removed (its connected devices keep running; new ones are refused)",
                t.name
            ));
        }
    }
    changes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hostd-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn physical_queues_must_fit_this_hostd() {
        let text =
            "[[tenant]]\nname = \"a\"\n\n[[tenant]]\nname = \"b\"\n# note\nphysical_queues = 8\n";
        let path = write("queues.toml", text);
        let policy = load(&path, 64).expect("8 queues fit");
        assert_eq!(policy.tenants[1].physical_queues, 8);
        let e = describe(&load(&path, 4).expect_err("4 pQPs only"));
        assert!(
            e.contains("queues.toml:7: key `tenant[1].physical_queues`: 8 exceeds"),
            "{e}"
        );
        let over = write(
            "over.toml",
            "[[tenant]]\nname = \"a\"\nphysical_queues = 65\n",
        );
        let e = describe(&load(&over, 1024).expect_err("65 are more than one device gets"));
        assert!(e.contains(":3: key `tenant[0].physical_queues`"), "{e}");
        builtin(64).expect("the built-in policy fits");
        assert!(builtin(1).is_err(), "2 queues per device, 1 pQP");
    }

    #[test]
    fn errors_name_file_line_and_key() {
        let path = write(
            "bad.toml",
            "[[tenant]]\nname = \"a\"\nquotas = { max_qp = 0 }\n",
        );
        let e = describe(&load(&path, 64).expect_err("zero quota"));
        assert!(
            e.contains("bad.toml:3") && e.contains("tenant[0].quotas.max_qp"),
            "{e}"
        );
        let missing = describe(&load(Path::new("/nonexistent/p.toml"), 64).expect_err("missing"));
        assert!(missing.contains("/nonexistent/p.toml"), "{missing}");
    }

    #[test]
    fn diff_names_every_change() {
        let old = Policy::parse(
            "[[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"b\"\n",
            Path::new("old"),
        )
        .expect("old");
        let new = Policy::parse(
            "[[tenant]]\nname = \"a\"\nquotas = { max_mr = 5 }\nrate.send = { ops_per_sec = 10 }\n\
             [[tenant]]\nname = \"c\"\n",
            Path::new("new"),
        )
        .expect("new");
        assert_eq!(
            diff(&old, &new),
            vec![
                "tenant a: quotas.max_mr 1024 -> 5".to_owned(),
                "tenant a: rate.send.ops_per_sec (unset) -> 10".to_owned(),
                "tenant c added".to_owned(),
                "tenant b removed (its connected devices keep running; new ones are refused)"
                    .to_owned(),
            ]
        );
        assert!(diff(&new, &new).is_empty());
    }
}
