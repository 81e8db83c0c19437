//! The queue-pair state machines of RC, UC and UD: which transitions exist
//! and which attributes each one requires or allows (IBA vol. 1, table of
//! `Modify QP` attributes; the same table the Linux kernel keeps as
//! `qp_state_table`).

use crate::verbs::{QpState, QpType};

/// Attribute-mask bits (`enum ibv_qp_attr_mask`).
pub mod mask {
    pub const STATE: u32 = 1;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const ALT_PATH: u32 = 1 << 14;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const PATH_MIG_STATE: u32 = 1 << 18;
    pub const CAP: u32 = 1 << 19;
    pub const DEST_QPN: u32 = 1 << 20;
    pub const RATE_LIMIT: u32 = 1 << 25;

    /// Names of the bits, for error messages.
    pub const NAMES: [(u32, &str); 22] = [
        (STATE, "qp_state"),
        (CUR_STATE, "cur_qp_state"),
        (EN_SQD_ASYNC_NOTIFY, "en_sqd_async_notify"),
        (ACCESS_FLAGS, "qp_access_flags"),
        (PKEY_INDEX, "pkey_index"),
        (PORT, "port_num"),
        (QKEY, "qkey"),
        (AV, "ah_attr"),
        (PATH_MTU, "path_mtu"),
        (TIMEOUT, "timeout"),
        (RETRY_CNT, "retry_cnt"),
        (RNR_RETRY, "rnr_retry"),
        (RQ_PSN, "rq_psn"),
        (MAX_QP_RD_ATOMIC, "max_rd_atomic"),
        (ALT_PATH, "alt_path"),
        (MIN_RNR_TIMER, "min_rnr_timer"),
        (SQ_PSN, "sq_psn"),
        (MAX_DEST_RD_ATOMIC, "max_dest_rd_atomic"),
        (PATH_MIG_STATE, "path_mig_state"),
        (CAP, "cap"),
        (DEST_QPN, "dest_qp_num"),
        (RATE_LIMIT, "rate_limit"),
    ];

    /// Comma-separated attribute names of the bits set in `bits`.
    pub fn describe(bits: u32) -> String {
        let mut names: Vec<&str> = NAMES
            .iter()
            .filter(|(bit, _)| bits & bit != 0)
            .map(|(_, name)| *name)
            .collect();
        let known = NAMES.iter().fold(0, |acc, (bit, _)| acc | bit);
        if bits & !known != 0 {
            names.push("unknown bits");
        }
        names.join(", ")
    }
}

/// The attributes an RC transition requires and those it also accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransitionRule {
    pub required: u32,
    pub optional: u32,
}

/// Why a `modify_qp` attribute mask is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransitionError {
    /// No such transition from the current state.
    NoTransition { from: QpState, to: QpState },
    /// Required attributes are missing from the mask.
    Missing {
        from: QpState,
        to: QpState,
        bits: u32,
    },
    /// The mask carries attributes this transition does not accept.
    NotAllowed {
        from: QpState,
        to: QpState,
        bits: u32,
    },
}

impl std::fmt::Display for TransitionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoTransition { from, to } => write!(f, "No transition from {from:?} to {to:?}"),
            Self::Missing { from, to, bits } => write!(
                f,
                "Transition {from:?}->{to:?} requires attributes missing from the mask: {}",
                mask::describe(*bits)
            ),
            Self::NotAllowed { from, to, bits } => write!(
                f,
                "Transition {from:?}->{to:?} does not accept attributes: {}",
                mask::describe(*bits)
            ),
        }
    }
}

impl std::error::Error for TransitionError {}

/// The rule for an RC QP going from `from` to `to`, if that transition exists.
pub fn rc_transition(from: QpState, to: QpState) -> Option<TransitionRule> {
    use mask::*;
    use QpState::*;
    let rule = |required, optional| Some(TransitionRule { required, optional });
    match (from, to) {
        // Any state may go to RESET or ERR with no other attribute.
        (_, Reset) | (_, Err) => rule(0, 0),
        (Reset, Init) => rule(PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
        (Init, Init) => rule(0, PKEY_INDEX | PORT | ACCESS_FLAGS),
        (Init, Rtr) => rule(
            AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER,
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
        ),
        (Rtr, Rts) => rule(
            SQ_PSN | TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC,
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
        ),
        (Rts, Rts) => rule(
            0,
            CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER,
        ),
        (Rts, Sqd) => rule(0, EN_SQD_ASYNC_NOTIFY),
        (Sqd, Rts) => rule(
            0,
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
        ),
        (Sqd, Sqd) => rule(
            0,
            AV | ALT_PATH
                | ACCESS_FLAGS
                | PKEY_INDEX
                | MIN_RNR_TIMER
                | PATH_MIG_STATE
                | TIMEOUT
                | RETRY_CNT
                | RNR_RETRY
                | MAX_QP_RD_ATOMIC
                | MAX_DEST_RD_ATOMIC,
        ),
        (Sqe, Rts) => rule(0, CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER),
        _ => None,
    }
}

/// The rule for a UC QP going from `from` to `to`: RC's without what only
/// a reliable requester or responder has (RNR, retries, timeouts, RDMA
/// READ and atomics).
pub fn uc_transition(from: QpState, to: QpState) -> Option<TransitionRule> {
    use mask::*;
    use QpState::*;
    let rule = |required, optional| Some(TransitionRule { required, optional });
    match (from, to) {
        (Init, Rtr) => rule(
            AV | PATH_MTU | DEST_QPN | RQ_PSN,
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
        ),
        (Rtr, Rts) => rule(SQ_PSN, CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
        (Rts, Rts) | (Sqd, Rts) => rule(0, CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE),
        (Sqd, Sqd) => rule(
            0,
            AV | ALT_PATH | ACCESS_FLAGS | PKEY_INDEX | PATH_MIG_STATE,
        ),
        (Sqe, Rts) => rule(0, CUR_STATE | ACCESS_FLAGS),
        _ => rc_transition(from, to),
    }
}

/// The rule for a UD QP going from `from` to `to`: no connection, a Q_Key.
pub fn ud_transition(from: QpState, to: QpState) -> Option<TransitionRule> {
    use mask::*;
    use QpState::*;
    let rule = |required, optional| Some(TransitionRule { required, optional });
    match (from, to) {
        (_, Reset) | (_, Err) => rule(0, 0),
        (Reset, Init) => rule(PKEY_INDEX | PORT | QKEY, 0),
        (Init, Init) => rule(0, PKEY_INDEX | PORT | QKEY),
        (Init, Rtr) => rule(0, PKEY_INDEX | QKEY),
        (Rtr, Rts) => rule(SQ_PSN, CUR_STATE | QKEY),
        (Rts, Rts) | (Sqd, Rts) | (Sqe, Rts) => rule(0, CUR_STATE | QKEY),
        (Rts, Sqd) => rule(0, EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => rule(0, PKEY_INDEX | QKEY),
        _ => None,
    }
}

/// Checks an attribute mask for the RC transition `from` → `to`. The mask
/// must carry [`mask::STATE`] when the state changes; without it the QP
/// stays in `from` and only that state's self-transition attributes apply.
pub fn check_rc_mask(from: QpState, to: QpState, attr_mask: u32) -> Result<(), TransitionError> {
    check_mask(QpType::Rc, from, to, attr_mask)
}

/// [`check_rc_mask`] for a QP of type `qp_type`.
pub fn check_mask(
    qp_type: QpType,
    from: QpState,
    to: QpState,
    attr_mask: u32,
) -> Result<(), TransitionError> {
    let rule = match qp_type {
        QpType::Rc => rc_transition(from, to),
        QpType::Uc => uc_transition(from, to),
        QpType::Ud => ud_transition(from, to),
    }
    .ok_or(TransitionError::NoTransition { from, to })?;
    let given = attr_mask & !mask::STATE;
    let missing = rule.required & !given;
    if missing != 0 {
        return Err(TransitionError::Missing {
            from,
            to,
            bits: missing,
        });
    }
    let extra = given & !(rule.required | rule.optional);
    if extra != 0 {
        return Err(TransitionError::NotAllowed {
            from,
            to,
            bits: extra,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mask::*;
    use super::*;
    use QpState::*;

    const RTR_REQUIRED: u32 =
        AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER;

    #[test]
    fn the_connection_sequence_is_accepted() {
        check_rc_mask(Reset, Init, STATE | PKEY_INDEX | PORT | ACCESS_FLAGS).expect("init");
        check_rc_mask(Init, Rtr, STATE | RTR_REQUIRED).expect("rtr");
        let rts = STATE | SQ_PSN | TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC;
        check_rc_mask(Rtr, Rts, rts).expect("rts");
        check_rc_mask(Rts, Sqd, STATE).expect("sqd");
        check_rc_mask(Sqd, Rts, STATE).expect("back to rts");
        check_rc_mask(Rts, Err, STATE).expect("err");
        check_rc_mask(Err, Reset, STATE).expect("reset");
    }

    #[test]
    fn missing_and_extra_attributes_are_named() {
        let err = check_rc_mask(Init, Rtr, STATE | RTR_REQUIRED & !DEST_QPN).unwrap_err();
        assert_eq!(
            err,
            TransitionError::Missing {
                from: Init,
                to: Rtr,
                bits: DEST_QPN
            }
        );
        assert!(err.to_string().contains("dest_qp_num"), "{err}");
        let err = check_rc_mask(
            Reset,
            Init,
            STATE | PKEY_INDEX | PORT | ACCESS_FLAGS | SQ_PSN,
        )
        .unwrap_err();
        assert!(err.to_string().contains("sq_psn"), "{err}");
    }

    #[test]
    fn skipping_states_is_refused() {
        for (from, to) in [
            (Reset, Rtr),
            (Reset, Rts),
            (Init, Rts),
            (Err, Rts),
            (Rtr, Init),
        ] {
            assert_eq!(
                check_rc_mask(from, to, STATE | 0xffff_ffff),
                Result::Err(TransitionError::NoTransition { from, to })
            );
        }
    }

    #[test]
    fn ud_needs_a_qkey_and_no_connection() {
        let ud = |from, to, m| check_mask(QpType::Ud, from, to, m);
        ud(Reset, Init, STATE | PKEY_INDEX | PORT | QKEY).expect("init");
        ud(Init, Rtr, STATE).expect("rtr: the state alone");
        ud(Rtr, Rts, STATE | SQ_PSN).expect("rts");
        ud(Rts, Rts, QKEY).expect("a new Q_Key");
        assert!(ud(Reset, Init, STATE | PKEY_INDEX | PORT | ACCESS_FLAGS).is_err());
        assert!(ud(Init, Rtr, STATE | AV | DEST_QPN).is_err(), "no path");
        assert!(
            check_rc_mask(Reset, Init, STATE | PKEY_INDEX | PORT | ACCESS_FLAGS | QKEY).is_err()
        );
    }

    #[test]
    fn uc_connects_without_reliability_attributes() {
        let uc = |from, to, m| check_mask(QpType::Uc, from, to, m);
        uc(Reset, Init, STATE | PKEY_INDEX | PORT | ACCESS_FLAGS).expect("init");
        uc(Init, Rtr, STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN).expect("rtr");
        uc(Rtr, Rts, STATE | SQ_PSN).expect("rts");
        assert!(
            uc(Init, Rtr, STATE | RTR_REQUIRED).is_err(),
            "no RD atomics or RNR timer"
        );
        assert!(
            uc(Rtr, Rts, STATE | SQ_PSN | TIMEOUT).is_err(),
            "no timeout"
        );
        assert!(uc(Init, Rts, STATE | SQ_PSN).is_err());
    }

    #[test]
    fn describe_names_unknown_bits() {
        assert_eq!(describe(PATH_MTU | (1 << 30)), "path_mtu, unknown bits");
    }
}
