//! Every check of a policy that serde cannot make, and where in the file
//! a refusal points: the line and dotted key path of each error.

use std::path::Path;

use super::{
    is_valid_name, Policy, PolicyError, RateLimit, TenantPolicy, MAX_BYTES_PER_SEC, MAX_DEVICES,
    MAX_NAME_LEN, MAX_OPS_PER_SEC, MAX_PHYSICAL_QUEUES, MAX_WEIGHT,
};
use crate::limits::{Limits, LimitsError};
use crate::locate::{KeyPath, Tree};

impl Policy {
    /// Every check serde cannot make; the first failure as `(key, message)`.
    pub(super) fn validate(&self, tree: &Tree<'_>) -> Result<(), (KeyPath, String)> {
        for (i, tenant) in self.tenants.iter().enumerate() {
            let at = KeyPath::tenant(i);
            tenant.validate(&at)?;
            if let Some(first) = self.tenants[..i].iter().position(|t| t.name == tenant.name) {
                return Err((
                    at.key("name"),
                    format!(
                        "duplicate tenant {:?}: already defined at line {} (tenant[{first}])",
                        tenant.name,
                        tree.line(&KeyPath::tenant(first).key("name")),
                    ),
                ));
            }
        }
        for (i, tenant) in self.tenants.iter().enumerate() {
            for (j, network) in tenant.reachable.iter().enumerate() {
                if !self.tenants.iter().any(|t| t.network() == network) {
                    return Err((
                        KeyPath::tenant(i).key("reachable").index(j),
                        format!("network {network:?} is not the network of any tenant"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl TenantPolicy {
    /// Checks one tenant's values; `at` is its key path.
    fn validate(&self, at: &KeyPath) -> Result<(), (KeyPath, String)> {
        check_name(at.key("name"), &self.name)?;
        if let Some(network) = &self.network {
            check_name(at.key("network"), network)?;
        }
        for (j, network) in self.reachable.iter().enumerate() {
            check_name(at.key("reachable").index(j), network)?;
        }
        if self.uid == Some(u32::MAX) {
            return Err((
                at.key("uid"),
                format!(
                    "{} is not a uid (it is (uid_t)-1); must be below 4294967295",
                    u32::MAX
                ),
            ));
        }
        check_range(
            at.key("physical_queues"),
            self.physical_queues.into(),
            1,
            MAX_PHYSICAL_QUEUES.into(),
        )?;
        check_range(
            at.key("max_devices"),
            self.max_devices.into(),
            1,
            MAX_DEVICES.into(),
        )?;
        check_range(
            at.key("priority.weight"),
            self.priority.weight.into(),
            1,
            MAX_WEIGHT.into(),
        )?;
        self.quotas
            .validate()
            .map_err(|e| quota_error(&at.key("quotas"), &self.quotas, e))?;
        self.rate.send.validate(&at.key("rate.send"))?;
        self.rate.read.validate(&at.key("rate.read"))
    }
}

impl RateLimit {
    /// Checks rates and bursts; `at` is this limit's key path.
    fn validate(&self, at: &KeyPath) -> Result<(), (KeyPath, String)> {
        for (unit, rate, burst, max) in [
            ("ops", self.ops_per_sec, self.ops_burst, MAX_OPS_PER_SEC),
            (
                "bytes",
                self.bytes_per_sec,
                self.bytes_burst,
                MAX_BYTES_PER_SEC,
            ),
        ] {
            let rate_key = format!("{unit}_per_sec");
            let burst_key = format!("{unit}_burst");
            if let Some(rate) = rate {
                if rate == 0 {
                    return Err((
                        at.key(&rate_key),
                        "must be at least 1 (leave the key out for no limit)".into(),
                    ));
                }
                check_range(at.key(&rate_key), rate, 1, max)?;
            }
            if let Some(burst) = burst {
                if rate.is_none() {
                    return Err((
                        at.key(&burst_key),
                        format!("a burst needs its rate: `{rate_key}` is not set"),
                    ));
                }
                check_range(at.key(&burst_key), burst, 1, max)?;
            }
        }
        Ok(())
    }
}

fn check_name(key: KeyPath, name: &str) -> Result<(), (KeyPath, String)> {
    if is_valid_name(name) {
        Ok(())
    } else {
        Err((
            key,
            format!(
                "{name:?} is not a valid name: 1 to {MAX_NAME_LEN} characters of A-Z a-z 0-9 _ . -, the first not . or -"
            ),
        ))
    }
}

fn check_range(key: KeyPath, value: u64, min: u64, max: u64) -> Result<(), (KeyPath, String)> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err((key, format!("{value} is outside {min}..={max}")))
    }
}

/// A [`LimitsError`] of tenant quotas `quotas` (at key path `at`).
fn quota_error(at: &KeyPath, quotas: &Limits, error: LimitsError) -> (KeyPath, String) {
    match error {
        LimitsError::Zero { key } => (at.key(key), "must be at least 1".into()),
        LimitsError::TooLarge { key, value, max } => (
            at.key(key),
            format!("{value} exceeds the device maximum {max}"),
        ),
        // Blame the key the operator wrote: max_mr_bytes unless only the
        // total was lowered below the default single-MR size.
        LimitsError::SingleAboveTotal { single, total }
            if quotas.max_mr_bytes == Limits::default().max_mr_bytes =>
        {
            (
                at.key("max_total_mr_bytes"),
                format!("{total} is below `max_mr_bytes` = {single}"),
            )
        }
        LimitsError::SingleAboveTotal { single, total } => (
            at.key("max_mr_bytes"),
            format!("{single} exceeds `max_total_mr_bytes` = {total}"),
        ),
    }
}

pub(super) fn invalid(path: &Path, line: usize, key: &KeyPath, message: &str) -> PolicyError {
    let message = if key.is_empty() {
        message.to_owned()
    } else {
        format!("key `{key}`: {message}")
    };
    PolicyError::Invalid {
        path: path.to_owned(),
        line,
        key: key.to_string(),
        message,
    }
}

/// A TOML syntax or deserialization error, with the line and key path of
/// where it points.
pub(super) fn toml_error(error: &toml::de::Error, tree: &Tree<'_>, path: &Path) -> PolicyError {
    let offset = error.span().map_or(0, |s| s.start);
    let line = tree.line_of(offset);
    let message = error
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    let mut key = match error.span() {
        Some(_) => tree.path_at(offset),
        None => KeyPath::default(),
    };
    // serde names a missing field only in its message, and points at the
    // table that lacks it.
    if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|m| m.strip_suffix('`'))
    {
        key = key.key(field);
    }
    invalid(path, line, &key, &message)
}
