//! Address handles: the destinations of UD sends. Each is checked as a
//! connected QP's path is (device spec §5.5) and mirrored to hostd, which
//! checks that the tenant may reach the destination (as at RTR) and keeps
//! it for the datapath: a UD send names its AH by number.

use vrdma_hostd_protocol::messages::AhSetup;
use vrdma_spec::control::{AhAttr, AhHandle, CreateAhReq};

use super::qp::{destination, validate_av};
use super::share::Counted;
use super::{RdmaDevice, VerbError, VerbResult};

/// An address handle.
#[derive(Debug)]
pub struct AddressHandle {
    pub pdn: u32,
    pub attr: AhAttr,
}

impl AddressHandle {
    /// AH `ahn` as hostd's datapath needs it.
    pub(super) fn setup(&self, ahn: u32) -> AhSetup {
        let (dgid, dlid) = destination(&self.attr);
        AhSetup {
            ahn,
            pd: self.pdn,
            dgid,
            dlid,
            flow_label: self.attr.flow_label.get(),
            hop_limit: self.attr.hop_limit,
            traffic_class: self.attr.traffic_class,
        }
    }
}

impl RdmaDevice {
    pub(super) fn create_ah(&mut self, req: &CreateAhReq) -> VerbResult<AhHandle> {
        let pdn = req.pdn.get();
        self.pd_mut(pdn)?;
        let taken = self.share.take(Counted::Ah, self.limits.max_ah)?;
        let attr = req.attr;
        validate_av(&attr, self.identity.link_layer)?;
        let ahn = self.new_handle();
        let ah = AddressHandle { pdn, attr };
        if let Some(fabric) = &self.fabric {
            fabric.create_ah(ah.setup(ahn)).map_err(VerbError::Fabric)?;
        }
        self.ahs.insert(ahn, ah);
        taken.keep();
        self.pd_mut(pdn)?.qps += 1;
        Ok(AhHandle {
            ahn: ahn.into(),
            reserved: 0.into(),
        })
    }

    pub(super) fn destroy_ah(&mut self, ahn: u32) -> VerbResult<()> {
        let Some(ah) = self.ahs.remove(&ahn) else {
            return Err(VerbError::NoObject {
                kind: "AH",
                handle: ahn,
            });
        };
        self.share.give_back(Counted::Ah, 1);
        if let Some(fabric) = &self.fabric {
            // hostd answers once no send resolves it any more.
            if let Err(e) = fabric.destroy_ah(ahn) {
                tracing::warn!(tenant = %self.tenant(), ahn, error = %e, "hostd did not destroy the AH");
            }
        }
        if let Some(pd) = self.pds.get_mut(&ah.pdn) {
            pd.qps -= 1;
        }
        Ok(())
    }

    /// The address handle numbered `ahn`.
    pub fn ah(&self, ahn: u32) -> Option<&AddressHandle> {
        self.ahs.get(&ahn)
    }
}
