//! Verbs enumerations with the numeric values libibverbs (`<infiniband/verbs.h>`)
//! gives them, so a verbs library passes them through unchanged.

/// Defines a fieldless enum with explicit discriminants and a checked
/// conversion from its wire integer, because a wire value is untrusted.
macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident: $repr:ty { $($(#[$vmeta:meta])* $variant:ident = $value:expr,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name {
            $($(#[$vmeta])* $variant = $value,)+
        }

        impl TryFrom<$repr> for $name {
            type Error = $repr;

            /// Returns the unknown value itself as the error.
            fn try_from(value: $repr) -> Result<Self, $repr> {
                match value {
                    $(v if v == $value => Ok(Self::$variant),)+
                    other => Err(other),
                }
            }
        }

        impl From<$name> for $repr {
            fn from(value: $name) -> $repr {
                value as $repr
            }
        }
    };
}
pub(crate) use wire_enum;

wire_enum! {
    /// Queue-pair states (`enum ibv_qp_state`).
    QpState: u8 {
        Reset = 0,
        Init = 1,
        Rtr = 2,
        Rts = 3,
        Sqd = 4,
        Sqe = 5,
        Err = 6,
    }
}

wire_enum! {
    /// Queue-pair transport types (`enum ibv_qp_type`). vrdma serves RC.
    QpType: u8 {
        Rc = 2,
        Uc = 3,
        Ud = 4,
    }
}

wire_enum! {
    /// Path MTU (`enum ibv_mtu`).
    Mtu: u8 {
        Mtu256 = 1,
        Mtu512 = 2,
        Mtu1024 = 3,
        Mtu2048 = 4,
        Mtu4096 = 5,
    }
}

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// The largest MTU of at most `bytes` bytes (`None` below 256).
    pub fn at_most(bytes: u32) -> Option<Mtu> {
        [
            Mtu::Mtu4096,
            Mtu::Mtu2048,
            Mtu::Mtu1024,
            Mtu::Mtu512,
            Mtu::Mtu256,
        ]
        .into_iter()
        .find(|m| m.bytes() <= bytes)
    }
}

wire_enum! {
    /// Port states (`enum ibv_port_state`).
    PortState: u8 {
        Nop = 0,
        Down = 1,
        Init = 2,
        Armed = 3,
        Active = 4,
        ActiveDefer = 5,
    }
}

wire_enum! {
    /// Port link layers (`IBV_LINK_LAYER_*`).
    LinkLayer: u8 {
        Unspecified = 0,
        Infiniband = 1,
        Ethernet = 2,
    }
}

/// LIDs (IBA 4.1.3): 0 is reserved, 0x0001–0xbfff are unicast,
/// 0xc000–0xfffe multicast and 0xffff is the permissive LID.
pub mod lid {
    /// The largest unicast LID.
    pub const MAX_UNICAST: u16 = 0xbfff;

    /// Whether `lid` names one port (unicast).
    pub const fn is_unicast(lid: u16) -> bool {
        lid != 0 && lid <= MAX_UNICAST
    }
}

wire_enum! {
    /// Send work-request opcodes (`enum ibv_wr_opcode`).
    SendOpcode: u8 {
        RdmaWrite = 0,
        RdmaWriteWithImm = 1,
        Send = 2,
        SendWithImm = 3,
        RdmaRead = 4,
        AtomicCmpAndSwp = 5,
        AtomicFetchAndAdd = 6,
        LocalInv = 7,
        BindMw = 8,
        SendWithInv = 9,
    }
}

wire_enum! {
    /// Work-completion opcodes (`enum ibv_wc_opcode`).
    WcOpcode: u8 {
        Send = 0,
        RdmaWrite = 1,
        RdmaRead = 2,
        CompSwap = 3,
        FetchAdd = 4,
        BindMw = 5,
        LocalInv = 6,
        Recv = 128,
        RecvRdmaWithImm = 129,
    }
}

wire_enum! {
    /// Work-completion status (`enum ibv_wc_status`), carried 1:1 in a CQE.
    WcStatus: u8 {
        Success = 0,
        LocLenErr = 1,
        LocQpOpErr = 2,
        LocEecOpErr = 3,
        LocProtErr = 4,
        WrFlushErr = 5,
        MwBindErr = 6,
        BadRespErr = 7,
        LocAccessErr = 8,
        RemInvReqErr = 9,
        RemAccessErr = 10,
        RemOpErr = 11,
        RetryExcErr = 12,
        RnrRetryExcErr = 13,
        LocRddViolErr = 14,
        RemInvRdReqErr = 15,
        RemAbortErr = 16,
        InvEecnErr = 17,
        InvEecStateErr = 18,
        FatalErr = 19,
        RespTimeoutErr = 20,
        GeneralErr = 21,
    }
}

impl SendOpcode {
    /// The completion opcode a successful WQE of this opcode reports.
    pub fn completion_opcode(self) -> WcOpcode {
        match self {
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            SendOpcode::Send | SendOpcode::SendWithImm | SendOpcode::SendWithInv => WcOpcode::Send,
            SendOpcode::RdmaRead => WcOpcode::RdmaRead,
            SendOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            SendOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
            SendOpcode::LocalInv => WcOpcode::LocalInv,
            SendOpcode::BindMw => WcOpcode::BindMw,
        }
    }
}

/// Memory-region and QP access flags (`enum ibv_access_flags`).
pub mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 1 << 1;
    pub const REMOTE_READ: u32 = 1 << 2;
    pub const REMOTE_ATOMIC: u32 = 1 << 3;
    pub const MW_BIND: u32 = 1 << 4;
    pub const ZERO_BASED: u32 = 1 << 5;
    pub const ON_DEMAND: u32 = 1 << 6;
    pub const HUGETLB: u32 = 1 << 7;
    pub const RELAXED_ORDERING: u32 = 1 << 20;
    /// Flags a QP's `qp_access_flags` may carry.
    pub const QP_SUPPORTED: u32 = REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;
    /// Flags vrdma's `reg_mr` implements. `RELAXED_ORDERING` is a hint that is
    /// always honoured (the soft datapath is strongly ordered) and `HUGETLB`
    /// only describes the backing pages, so both are accepted.
    /// Every MR access flag libibverbs defines.
    pub const MR_KNOWN: u32 = LOCAL_WRITE
        | REMOTE_WRITE
        | REMOTE_READ
        | REMOTE_ATOMIC
        | MW_BIND
        | ZERO_BASED
        | ON_DEMAND
        | HUGETLB
        | RELAXED_ORDERING;
    pub const MR_SUPPORTED: u32 =
        LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC | HUGETLB | RELAXED_ORDERING;
}

/// `ibv_device_attr.atomic_cap` values.
pub mod atomic_cap {
    pub const NONE: u32 = 0;
    pub const HCA: u32 = 1;
    pub const GLOB: u32 = 2;
}

/// `ibv_device_attr.device_cap_flags` bits vrdma reports.
pub mod device_cap {
    pub const CURR_QP_STATE_MOD: u32 = 1 << 7;
    pub const PORT_ACTIVE_EVENT: u32 = 1 << 10;
    pub const SYS_IMAGE_GUID: u32 = 1 << 11;
    pub const RC_RNR_NAK_GEN: u32 = 1 << 12;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_libibverbs() {
        assert_eq!(u8::from(QpState::Err), 6);
        assert_eq!(u8::from(WcStatus::RnrRetryExcErr), 13);
        assert_eq!(u8::from(WcStatus::GeneralErr), 21);
        assert_eq!(u8::from(WcOpcode::RecvRdmaWithImm), 129);
        assert_eq!(u8::from(SendOpcode::AtomicFetchAndAdd), 6);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::Mtu256.bytes(), 256);
    }

    #[test]
    fn unknown_wire_values_are_rejected() {
        assert_eq!(QpState::try_from(7), Err(7));
        assert_eq!(Mtu::try_from(0), Err(0));
        assert_eq!(WcOpcode::try_from(7), Err(7));
        assert_eq!(SendOpcode::try_from(3), Ok(SendOpcode::SendWithImm));
    }
}
