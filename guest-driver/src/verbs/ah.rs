//! Address handles (`struct ibv_ah`): device objects naming a UD
//! destination, checked by the device (and by hostd: the tenant must reach
//! it) when created. A UD send names one by number (`SendWr::to_ud`).

use std::sync::Arc;

use vrdma_spec::control::{AhAttr, AhHandle, CreateAhReq, Opcode};
use zerocopy::IntoBytes;

use super::{Handle, PdInner, ProtectionDomain};
use crate::error::{DestroyError, Result};

/// An address handle.
#[derive(Debug)]
pub struct AddressHandle {
    pd: Arc<PdInner>,
    handle: Handle<AhHandle>,
}

impl ProtectionDomain {
    /// `ibv_create_ah`: `EINVAL` for a path the port cannot use, `EACCES`
    /// for a destination outside the networks the tenant reaches, `ENOENT`
    /// for an unknown one, `ENOMEM` beyond the tenant's `max_ah`.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let req = CreateAhReq {
            pdn: self.inner.handle.wire.pdn,
            reserved: 0.into(),
            attr: *attr,
        };
        let handle: AhHandle = self.inner.dev.command(Opcode::CreateAh, req.as_bytes())?;
        Ok(AddressHandle {
            pd: Arc::clone(&self.inner),
            handle: Handle::new(Opcode::DestroyAh, handle),
        })
    }
}

impl AddressHandle {
    /// The device's number for it (what a UD send names).
    pub fn ahn(&self) -> u32 {
        self.handle.wire.ahn.get()
    }

    /// `ibv_destroy_ah`, returning the device's errno; on failure the AH
    /// is handed back.
    pub fn destroy(self) -> Result<(), DestroyError<Self>> {
        let result = self.handle.destroy(&self.pd.dev);
        DestroyError::hand_back(self, result)
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        if let Err(e) = self.handle.destroy(&self.pd.dev) {
            tracing::warn!(error = %e, ahn = self.ahn(), "Cannot destroy an address handle");
        }
    }
}
