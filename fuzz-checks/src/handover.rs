//! The blob a running hostd hands a new hostd (`hostd --take-over`), as
//! the new hostd decodes it (`vrdma_hostd::handover::decode`): every
//! context with its token, tenant, device and its QPs' transport state.
//!
//! The input either is the blob itself or edits a valid one (two
//! contexts; QPs connected to another host in the middle of a WRITE, with
//! READ responses owed and atomic results kept, a UD QP, a QP in RESET):
//! its JSON bytes flipped, cut, spliced with input bytes, digits changed,
//! a field's number replaced. Invariants: no panic; a blob that decodes
//! has only contexts whose every field is in bounds (tokens of 32 hex
//! digits, each once; names of 1-256 bytes; each QP once, PSNs of 24 bits,
//! a message being received within its length, at most 16 READ responses
//! and 16 atomic results, an SRQ receive taken of at most 64 SGEs and
//! 2 GiB) — a blob with one bad field is refused whole —
//! and encodes back to a blob that decodes to the same.

use vrdma_hostd::engine::handover::{
    HandedAtomic, HandedRead, HandedReceive, HandedReceiving, QpTransport, RemoteTransport,
};
use vrdma_hostd::handover::{decode, Blob, HandedContext, BLOB_VERSION};

use crate::input::Input;

/// Most edits per input.
const MAX_EDITS: usize = 16;

/// A valid blob of two contexts.
pub fn template() -> Blob {
    let remote = RemoteTransport {
        next_psn: 0x00ff_fff0,
        acked: 0x00ff_ffef,
        high: 0x0000_0004,
        epsn: 77,
        msn: 12,
        receiving: HandedReceiving::Write {
            va: 0x7f00_0000_1000,
            rkey: 0x1234,
            len: 65536,
            offset: 8192,
        },
        reads: vec![HandedRead {
            first: 70,
            va: 0x7f00_0000_2000,
            rkey: 0x1235,
            len: 4096,
            sent: 1,
        }],
        atomics: vec![HandedAtomic { psn: 60, orig: 5 }],
        nak_sent: true,
        dropping: false,
    };
    Blob {
        version: BLOB_VERSION,
        contexts: vec![
            HandedContext {
                token: "00112233445566778899aabbccddeeff".into(),
                tenant: "alpha".into(),
                device: "vdev-1".into(),
                gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7],
                pid: Some(4242),
                qps: vec![
                    QpTransport {
                        vqpn: 1,
                        state: 3,
                        ud_psn: 0,
                        remote: Some(remote.clone()),
                        srq_receive: Some(HandedReceive {
                            wr_id: 0xfeed,
                            sges: vec![(0x7f00_0000_3000, 4096, 0x1236), (0x1000, 0, 7)],
                        }),
                    },
                    QpTransport {
                        vqpn: 2,
                        state: 0,
                        ud_psn: 0,
                        remote: None,
                        srq_receive: None,
                    },
                ],
            },
            HandedContext {
                token: "ffeeddccbbaa99887766554433221100".into(),
                tenant: "beta".into(),
                device: "vdev-2".into(),
                gid: [0; 16],
                pid: None,
                qps: vec![QpTransport {
                    vqpn: 0x00ff_ffff,
                    state: 3,
                    ud_psn: 99,
                    remote: None,
                    srq_receive: None,
                }],
            },
        ],
    }
}

/// Edits the blob's JSON text as the input says.
fn edit(input: &mut Input, text: &mut Vec<u8>) {
    for _ in 0..MAX_EDITS {
        if input.is_empty() || text.is_empty() {
            return;
        }
        let at = usize::from(input.u16()) % text.len();
        match input.u8() % 5 {
            0 => text[at] ^= input.u8().max(1),
            1 => text.truncate(at),
            2 => {
                let len = usize::from(input.u8() % 16);
                let splice = input.bytes(len).to_vec();
                text.splice(at..at, splice);
            }
            3 => {
                // A digit changed: numbers stay numbers, bounds are hit.
                if text[at].is_ascii_digit() {
                    text[at] = b'0' + input.u8() % 10;
                }
            }
            _ => {
                // A number replaced by one of the input's.
                let start = (0..=at).rev().find(|&i| !text[i].is_ascii_digit());
                if let Some(start) = start.map(|i| i + 1).filter(|&s| s <= at) {
                    let end = (at..text.len())
                        .find(|&i| !text[i].is_ascii_digit())
                        .unwrap_or(text.len());
                    let n = input.u64().to_string().into_bytes();
                    text.splice(start..end, n);
                }
            }
        }
    }
}

pub fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let text = if input.bool() {
        input.bytes(data.len()).to_vec()
    } else {
        let mut text = serde_json::to_vec(&template()).expect("the template encodes");
        edit(&mut input, &mut text);
        text
    };
    let Ok(handover) = decode(&text) else {
        return;
    };
    let mut qps = 0;
    for (token, c) in &handover.contexts {
        assert_eq!(token, &c.token);
        assert!(token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!c.tenant.is_empty() && c.tenant.len() <= 256);
        assert!(!c.device.is_empty() && c.device.len() <= 256);
        let mut seen = std::collections::HashSet::new();
        for q in &c.qps {
            assert!(seen.insert(q.vqpn), "QP {} twice", q.vqpn);
            assert_eq!(q.check(), Ok(()));
            assert!(q.vqpn <= 0x00ff_ffff && q.state <= 6 && q.ud_psn <= 0x00ff_ffff);
            if let Some(r) = &q.remote {
                for v in [r.next_psn, r.acked, r.high, r.epsn, r.msn] {
                    assert!(v <= 0x00ff_ffff);
                }
                assert!(r.reads.len() <= 16 && r.atomics.len() <= 16);
                if let HandedReceiving::Write { len, offset, .. } = r.receiving {
                    assert!(offset <= len);
                }
            }
            if let Some(r) = &q.srq_receive {
                assert!(r.sges.len() <= 64);
                assert!(r.sges.iter().map(|s| u64::from(s.1)).sum::<u64>() <= 1 << 31);
            }
        }
        qps += c.qps.len();
    }
    // What decoded encodes back to a blob that decodes to the same.
    let again = Blob {
        version: BLOB_VERSION,
        contexts: handover.contexts.values().cloned().collect(),
    };
    let text = serde_json::to_vec(&again).expect("encodes");
    let back = decode(&text).expect("a decoded blob decodes again");
    assert_eq!(back.contexts, handover.contexts);
    assert_eq!(
        back.contexts.values().map(|c| c.qps.len()).sum::<usize>(),
        qps
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_decodes() {
        let text = serde_json::to_vec(&template()).expect("encodes");
        let h = decode(&text).expect("valid");
        assert_eq!(h.contexts.len(), 2);
    }
}
