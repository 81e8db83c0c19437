//! Per-tenant policy of vrdma: what each tenant may use of the shared NIC.
//!
//! - [`limits`]: object and memory quotas of one device ([`Limits`]); vdev
//!   advertises them as the device's limits and enforces them at each verb.
//! - [`policy`]: the operator's policy file — per tenant: quotas, memory
//!   quota, rate limits, priority class and weight, reachable networks,
//!   physical queues — parsed and validated into a [`Policy`].

pub mod limits;
mod locate;
pub mod policy;

pub use limits::{Limits, LimitsError, CEILING};
pub use policy::{
    is_valid_name, EffectiveRate, Policy, PolicyError, Priority, PriorityClass, RateLimit, Rates,
    TenantPolicy,
};
