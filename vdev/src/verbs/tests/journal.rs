//! A context rebuilt from its journal, as a successor vdev does: the
//! objects a driver made come back with their handles, states and
//! dependencies, and hostile records are refused whole.

use vrdma_hostd_protocol::messages::Record;

use super::*;

const CQ_RING: u64 = MEM_BASE + 0x1000;
const SQ_RING: u64 = MEM_BASE + 0x4_0000;
const RQ_RING: u64 = MEM_BASE + 0x8_0000;
const EQ_RING: u64 = MEM_BASE + 0x10_0000;

/// A device with a PD, a CQ, an event ring and an RC QP in INIT.
fn driven() -> (RdmaDevice, u32, u32, u32) {
    let mut dev = device();
    let pdn = alloc_pd(&mut dev);
    let cqn = create_cq(&mut dev, CQ_RING).expect("cq");
    create_eq(&mut dev, 1, 64, EQ_RING).expect("eq");
    let qpn = create_qp(&mut dev, pdn, cqn, SQ_RING, RQ_RING)
        .expect("qp")
        .qpn
        .get();
    to_state(&mut dev, qpn, QpState::Reset).expect("reset");
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        qp_access_flags: access::REMOTE_WRITE.into(),
        ..QpAttr::default()
    };
    modify(&mut dev, qpn, INIT_MASK, init).expect("init");
    (dev, pdn, cqn, qpn)
}

/// A fresh device over the same guest memory (the successor's context).
fn successor() -> RdmaDevice {
    device_without_doorbell(Limits::default())
}

#[test]
fn a_context_comes_back_whole_from_its_records() {
    let (dev, pdn, cqn, qpn) = driven();
    let records = dev.journal_records();
    let mut next = successor();
    next.rebuild_from(&records).expect("rebuilt");
    assert_eq!(next.object_counts(), dev.object_counts());
    assert_eq!(query_state(&mut next, qpn), QpState::Init);
    assert_eq!(next.doorbell(), Some(DOORBELL));
    assert!(next.event_ring(1).is_some());
    // The dependencies were recounted: the CQ and PD are busy while the
    // QP lives, free after it.
    assert_eq!(release(&mut next, Opcode::DestroyCq, cqn), Err(libc::EBUSY));
    assert_eq!(release(&mut next, Opcode::DeallocPd, pdn), Err(libc::EBUSY));
    release(&mut next, Opcode::DestroyQp, qpn).expect("destroy qp");
    release(&mut next, Opcode::DestroyCq, cqn).expect("destroy cq");
    release(&mut next, Opcode::DeallocPd, pdn).expect("dealloc pd");
    // New handles do not collide with the old ones.
    assert!(alloc_pd(&mut next) > cqn.max(pdn));
    // The doorbell index of the old QP is taken until it goes.
    let again = successor_with(&records);
    assert_eq!(again.qps_iter().count(), 1);
}

fn successor_with(records: &[Record]) -> RdmaDevice {
    let mut next = successor();
    next.rebuild_from(records).expect("rebuilt");
    next
}

/// A change made to a journal.
type Mutation = Box<dyn Fn(&mut Vec<Record>)>;

/// Every record changed one way, in turn: refused whole, nothing of it
/// kept.
#[test]
fn hostile_records_are_refused_and_nothing_is_half_restored() {
    let (dev, _, cqn, _) = driven();
    let records = dev.journal_records();
    let kinds: Vec<u8> = records.iter().map(|r| r.kind).collect();
    let mutations: Vec<(&str, Mutation)> = vec![
        (
            "truncated data",
            Box::new(|rs: &mut Vec<Record>| {
                for r in rs.iter_mut().filter(|r| r.kind == 4) {
                    if let Some(d) = &mut r.data {
                        d.truncate(d.len() / 2);
                    }
                }
            }),
        ),
        (
            "a QP on a CQ that is not there",
            Box::new(move |rs: &mut Vec<Record>| {
                rs.retain(|r| !(r.kind == 3 && r.id == cqn));
            }),
        ),
        (
            "an unknown kind",
            Box::new(|rs: &mut Vec<Record>| {
                rs.push(Record {
                    kind: 99,
                    id: 1,
                    data: Some("{}".into()),
                });
            }),
        ),
        (
            "an unknown field",
            Box::new(|rs: &mut Vec<Record>| {
                for r in rs.iter_mut().filter(|r| r.kind == 3) {
                    r.data = Some(r.data.clone().unwrap_or_default().replacen(
                        '{',
                        "{\"evil\":1,",
                        1,
                    ));
                }
            }),
        ),
        (
            "a ring outside guest memory",
            Box::new(|rs: &mut Vec<Record>| {
                for r in rs.iter_mut().filter(|r| r.kind == 3) {
                    r.data = r.data.as_ref().map(|d| {
                        d.replace(&format!("\"ring_addr\":{CQ_RING}"), "\"ring_addr\":4096")
                    });
                }
            }),
        ),
        (
            "a handle counter behind the handles",
            Box::new(|rs: &mut Vec<Record>| {
                for r in rs.iter_mut().filter(|r| r.kind == 10) {
                    r.data = Some("{\"next\":1}".into());
                }
            }),
        ),
        (
            "a QP state that does not exist",
            Box::new(|rs: &mut Vec<Record>| {
                for r in rs.iter_mut().filter(|r| r.kind == 4) {
                    r.data = r
                        .data
                        .as_ref()
                        .map(|d| d.replace("\"state\":1", "\"state\":9"));
                }
            }),
        ),
    ];
    assert!(kinds.contains(&4) && kinds.contains(&3), "{kinds:?}");
    for (what, mutate) in mutations {
        let mut bad = records.clone();
        mutate(&mut bad);
        assert_ne!(bad, records, "{what}: the mutation changed nothing");
        let mut next = successor();
        let result = next.rebuild_from(&bad);
        assert!(result.is_err(), "{what}: accepted");
        assert_eq!(next.object_counts(), (0, 0, 0, 0), "{what}: half restored");
        assert_eq!(next.doorbell(), None, "{what}: half restored");
    }
}

/// A command the previous vdev executed and journaled, offered again at
/// the same position of the control queue (its answer never reached the
/// queue): answered from the journal, not run twice; anything else runs.
#[test]
fn a_command_offered_again_is_answered_from_the_journal_once() {
    let (dev, pdn, _, _) = driven();
    let mut records = dev.journal_records();
    // The previous vdev's last command: ALLOC_PD at position 9, which
    // made PD `pdn` (already among the records).
    let answer = PdHandle {
        pdn: pdn.into(),
        reserved: 0.into(),
    };
    let done = format!(
        r#"{{"position":9,"opcode":{},"request":[],"errno":0,"payload":{:?}}}"#,
        u16::from(Opcode::AllocPd),
        answer.as_bytes()
    )
    .replace(' ', "");
    records.push(Record {
        kind: record_kind::DONE,
        id: 0,
        data: Some(done),
    });
    let mut next = successor();
    next.rebuild_from(&records).expect("rebuilt");
    let before = next.object_counts();
    // Another command at that position is not the journaled one: it runs.
    let query = next.execute_at(9, Opcode::QueryDevice, &[]);
    assert!(query.is_ok());
    // The replay is spent once another command came: ALLOC_PD now runs.
    let mut again = successor();
    again.rebuild_from(&records).expect("rebuilt");
    let replayed = again.execute_at(9, Opcode::AllocPd, &[]).expect("answered");
    assert_eq!(replayed, answer.as_bytes(), "the journal's answer");
    assert_eq!(again.object_counts(), before, "nothing ran twice");
    let fresh = again
        .execute_at(10, Opcode::AllocPd, &[])
        .expect("a new PD");
    assert_ne!(fresh, answer.as_bytes());
    assert_eq!(again.object_counts().0, before.0 + 1);
}
