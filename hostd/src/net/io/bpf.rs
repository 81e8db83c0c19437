//! The classic BPF socket filters of [`super::UdpIo`] (`SO_ATTACH_FILTER`).
//!
//! The receive socket is a packet socket, which sees every IPv4 frame of
//! every interface, its link-layer header first: the receive filter
//! addresses the IPv4 header through the kernel's `SKF_NET_OFF` base
//! (whatever the link header's length) and keeps frames to this host
//! (`PACKET_HOST`) that are IPv4, UDP, unfragmented, to the RoCEv2 port;
//! the rest is dropped in the kernel, before it is queued. The send socket's filter drops
//! everything: that socket only exists to send and to keep the kernel from
//! answering RoCEv2 packets with ICMP port-unreachable.

use libc::sock_filter;

const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const LD_B_ABS: u16 = (libc::BPF_LD | libc::BPF_B | libc::BPF_ABS) as u16;
const LD_H_ABS: u16 = (libc::BPF_LD | libc::BPF_H | libc::BPF_ABS) as u16;
const LD_H_IND: u16 = (libc::BPF_LD | libc::BPF_H | libc::BPF_IND) as u16;
const LDX_MSH: u16 = (libc::BPF_LDX | libc::BPF_B | libc::BPF_MSH) as u16;
const AND_K: u16 = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;
const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

/// What a filter returns to keep a packet whole.
const ACCEPT: u32 = u32::MAX;
/// What a filter returns to drop a packet.
const DROP: u32 = 0;

const fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

const fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// Where the kernel's loads address the network header.
const NET: u32 = libc::SKF_NET_OFF as u32;
/// The load of the frame's packet type (`skb->pkt_type`).
const PKTTYPE: u32 = (libc::SKF_AD_OFF + libc::SKF_AD_PKTTYPE) as u32;

/// The receive filter: a frame to this host, IPv4, protocol UDP, neither
/// a fragment nor more fragments to come, UDP destination port `port`.
pub(super) fn roce(port: u16) -> [sock_filter; 14] {
    // Jump offsets count from the next instruction; DROP is instruction 13.
    [
        // 0-1: to this host (not broadcast, multicast, another host's).
        stmt(LD_W_ABS, PKTTYPE),
        jump(JEQ_K, u32::from(libc::PACKET_HOST), 0, 11),
        // 2-4: version 4.
        stmt(LD_B_ABS, NET),
        stmt(AND_K, 0xf0),
        jump(JEQ_K, 0x40, 0, 8),
        // 5-6: protocol 17.
        stmt(LD_B_ABS, NET + 9),
        jump(JEQ_K, libc::IPPROTO_UDP as u32, 0, 6),
        // 7-8: MF clear and fragment offset 0.
        stmt(LD_H_ABS, NET + 6),
        jump(JSET_K, 0x3fff, 4, 0),
        // 9-11: X = the IPv4 header's length; the UDP destination port.
        stmt(LDX_MSH, NET),
        stmt(LD_H_IND, NET + 2),
        jump(JEQ_K, port as u32, 0, 1),
        stmt(RET_K, ACCEPT),
        stmt(RET_K, DROP),
    ]
}

/// The send socket's filter: nothing is ever queued on it.
pub(super) fn drop_all() -> [sock_filter; 1] {
    [stmt(RET_K, DROP)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the few instructions these filters use over `packet` (an
    /// IPv4 packet, the network header) of type `pkttype` as the kernel
    /// does (a load past the end drops the packet).
    fn run_as(program: &[sock_filter], packet: &[u8], pkttype: u8) -> u32 {
        let (mut a, mut x, mut pc) = (0u32, 0u32, 0usize);
        let net = |off: usize| off.checked_sub(NET as usize);
        let byte = |off: usize| packet.get(net(off)?).map(|&b| u32::from(b));
        let half = |off: usize| Some(byte(off)? << 8 | byte(off + 1)?);
        loop {
            let i = program[pc];
            pc += 1;
            let k = i.k as usize;
            match i.code {
                LD_W_ABS if i.k == PKTTYPE => a = u32::from(pkttype),
                LD_B_ABS => match byte(k) {
                    Some(v) => a = v,
                    None => return DROP,
                },
                LD_H_ABS => match half(k) {
                    Some(v) => a = v,
                    None => return DROP,
                },
                LD_H_IND => match half(x as usize + k) {
                    Some(v) => a = v,
                    None => return DROP,
                },
                LDX_MSH => match byte(k) {
                    Some(v) => x = (v & 0xf) * 4,
                    None => return DROP,
                },
                AND_K => a &= i.k,
                JEQ_K | JSET_K => {
                    let taken = if i.code == JEQ_K {
                        a == i.k
                    } else {
                        a & i.k != 0
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                RET_K => return i.k,
                other => panic!("instruction {other:#x} not modelled"),
            }
        }
    }

    fn run(program: &[sock_filter], packet: &[u8]) -> u32 {
        run_as(program, packet, libc::PACKET_HOST)
    }

    /// An IPv4 header of `ihl` words, then a UDP header to `dport`.
    fn packet(ihl: u8, proto: u8, flags_frag: u16, dport: u16) -> Vec<u8> {
        let mut p = vec![0u8; usize::from(ihl) * 4 + 8 + 12];
        p[0] = 0x40 | ihl;
        p[9] = proto;
        p[6..8].copy_from_slice(&flags_frag.to_be_bytes());
        let udp = usize::from(ihl) * 4;
        p[udp..udp + 2].copy_from_slice(&4791u16.to_be_bytes());
        p[udp + 2..udp + 4].copy_from_slice(&dport.to_be_bytes());
        p
    }

    #[test]
    fn the_receive_filter_keeps_only_whole_udp_packets_to_the_port() {
        let f = roce(4791);
        assert_eq!(run(&f, &packet(5, 17, 0x4000, 4791)), ACCEPT);
        assert_eq!(run(&f, &packet(5, 17, 0, 4791)), ACCEPT);
        // Options move the UDP header; the filter follows.
        assert_eq!(run(&f, &packet(7, 17, 0x4000, 4791)), ACCEPT);
        assert_eq!(run(&f, &packet(7, 17, 0x4000, 4792)), DROP);
        assert_eq!(run(&f, &packet(5, 17, 0x4000, 4792)), DROP);
        assert_eq!(run(&f, &packet(5, 6, 0x4000, 4791)), DROP);
        // More fragments, a later fragment.
        assert_eq!(run(&f, &packet(5, 17, 0x2000, 4791)), DROP);
        assert_eq!(run(&f, &packet(5, 17, 0x0001, 4791)), DROP);
        let mut v6 = packet(5, 17, 0, 4791);
        v6[0] = 0x65;
        assert_eq!(run(&f, &v6), DROP);
        // Too short to hold the port.
        assert_eq!(run(&f, &packet(5, 17, 0, 4791)[..22]), DROP);
        assert_eq!(run(&roce(5000), &packet(5, 17, 0, 5000)), ACCEPT);
        // Frames to other hosts, broadcast, multicast.
        for other in [
            libc::PACKET_OTHERHOST,
            libc::PACKET_BROADCAST,
            libc::PACKET_MULTICAST,
        ] {
            assert_eq!(run_as(&f, &packet(5, 17, 0, 4791), other), DROP);
        }
        assert_eq!(run(&drop_all(), &packet(5, 17, 0, 4791)), DROP);
    }
}
