//! Which network interface holds an IPv4 address, and what AF_XDP needs to
//! know of it.
//!
//! hostd's AF_XDP path binds its sockets to the queues of the interface
//! that holds the host's RoCEv2 address and builds whole Ethernet frames
//! from that interface's MAC address, no larger than its MTU. It finds all
//! this out once, before its sandbox goes up (afterwards it can neither
//! open sockets): the address, the interface, its index and MAC address
//! from `getifaddrs`, the rest by ioctl (`SIOCGIFMTU`, ethtool's channels
//! and driver) — not from `/sys`, which shows the network namespace of
//! whoever mounted it.

use std::ffi::CStr;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A network interface as AF_XDP needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Its name (`eth0`), not an address label (`eth0:1`).
    pub name: String,
    /// Its index (ifindex), which AF_XDP sockets and XDP programs bind to.
    pub index: u32,
    /// Its hardware (Ethernet) address: the source of every frame sent.
    pub mac: [u8; 6],
    /// Its MTU: the largest IPv4 packet a frame may carry.
    pub mtu: u32,
    /// How many receive queues it has (at least 1): AF_XDP binds one socket
    /// per queue, numbered from 0.
    pub rx_queues: u32,
    /// Whether it has no backing device (a veth, tap, bridge, loopback …),
    /// whose driver usually has no zero-copy AF_XDP (only copy mode) and
    /// may take XDP programs in generic mode only.
    pub virtual_device: bool,
}

/// The interface that has IPv4 address `addr` (the first that has it, in
/// `getifaddrs` order). [`io::ErrorKind::NotFound`] if none has it; an
/// error too if the interface has no Ethernet address, or if `/sys` does
/// not show this network namespace's interfaces.
pub fn interface_of(addr: Ipv4Addr) -> io::Result<Interface> {
    let (name, index, mac) = {
        let addrs = IfAddrs::get()?;
        // The AF_INET entry's name is the address's label, which may be an
        // alias (`eth0:1`); an interface's name has no ':' (the kernel
        // refuses one), and the part before it is the interface's.
        let label = addrs
            .entries()
            .find(|e| e.ipv4 == Some(addr))
            .map(|e| e.name)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no network interface has the address {addr}"),
                )
            })?;
        let name = label.to_bytes().split(|&b| b == b':').next().unwrap_or(&[]);
        let link = addrs
            .entries()
            .find_map(|e| e.link.filter(|_| e.name.to_bytes() == name))
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "{addr} is on {}, which getifaddrs reports no link of",
                        label.to_string_lossy()
                    ),
                )
            })?;
        let name = String::from_utf8(name.to_vec()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the name of the interface with {addr} ({}) is not UTF-8",
                    label.to_string_lossy()
                ),
            )
        })?;
        let mac = link.mac.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{name} (with {addr}) has no Ethernet address"),
            )
        })?;
        (name, link.index, mac)
    };

    // Asked of the kernel by ioctl on a socket, which speaks for the
    // caller's network namespace — `/sys` shows the namespace of whoever
    // mounted it (hostd entered its namespace by `setns` need not have
    // remounted it).
    let sock = ioctl_socket()?;
    let mut req = ifreq(&name)?;
    ioctl(&sock, libc::SIOCGIFMTU, &mut req).map_err(|e| annotate(e, &name, "MTU"))?;
    // SAFETY: SIOCGIFMTU filled the union's `ifru_mtu`.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu } as u32;
    let mut channels = EthtoolChannels {
        cmd: ETHTOOL_GCHANNELS,
        ..Default::default()
    };
    let rx_queues = match ethtool(&sock, &name, &mut channels) {
        Ok(()) => (channels.rx_count + channels.combined_count).max(1),
        // A driver without channels (tap, bridge, loopback): one queue.
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => 1,
        Err(e) => return Err(annotate(e, &name, "queues")),
    };
    let mut info = EthtoolDrvinfo {
        cmd: ETHTOOL_GDRVINFO,
        ..Default::default()
    };
    let virtual_device = match ethtool(&sock, &name, &mut info) {
        Ok(()) => is_virtual(&c_text(&info.driver), &c_text(&info.bus_info)),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => true,
        Err(e) => return Err(annotate(e, &name, "driver")),
    };
    Ok(Interface {
        name,
        index,
        mac,
        mtu,
        rx_queues,
        virtual_device,
    })
}

/// Whether a driver (by its name and bus) is a software interface: no
/// device behind it, copy-mode AF_XDP only, generic XDP faster than its
/// native hook where it has one (measured on veth and tap:
/// `../shared/af-xdp-notes.md`).
fn is_virtual(driver: &str, bus: &str) -> bool {
    const SOFTWARE: &[&str] = &[
        "veth", "tun", "bridge", "dummy", "macvlan", "ipvlan", "vxlan", "geneve", "bonding", "team",
    ];
    SOFTWARE.contains(&driver) || bus.is_empty() || bus == "N/A"
}

/// `ETHTOOL_GCHANNELS`, `ETHTOOL_GDRVINFO` (`linux/ethtool.h`).
const ETHTOOL_GCHANNELS: u32 = 0x3c;
const ETHTOOL_GDRVINFO: u32 = 0x03;

/// `struct ethtool_channels`.
#[repr(C)]
#[derive(Default)]
struct EthtoolChannels {
    cmd: u32,
    max_rx: u32,
    max_tx: u32,
    max_other: u32,
    max_combined: u32,
    rx_count: u32,
    tx_count: u32,
    other_count: u32,
    combined_count: u32,
}

/// `struct ethtool_drvinfo`.
#[repr(C)]
struct EthtoolDrvinfo {
    cmd: u32,
    driver: [u8; 32],
    version: [u8; 32],
    fw_version: [u8; 32],
    bus_info: [u8; 32],
    erom_version: [u8; 32],
    reserved2: [u8; 12],
    n_priv_flags: u32,
    n_stats: u32,
    testinfo_len: u32,
    eedump_len: u32,
    regdump_len: u32,
}

impl Default for EthtoolDrvinfo {
    fn default() -> Self {
        // SAFETY: all-zero is a valid value of this plain C struct.
        unsafe { std::mem::zeroed() }
    }
}

/// A NUL-terminated field as text.
fn c_text(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn annotate(e: io::Error, name: &str, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("cannot read the {what} of {name}: {e}"))
}

/// A socket to ask interface ioctls on.
fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor just returned, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An `ifreq` naming interface `name`.
fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    // SAFETY: all-zero is a valid `ifreq` (an empty name, a zero union).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name} too long"),
        ));
    }
    for (d, b) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = b as libc::c_char;
    }
    Ok(req)
}

fn ioctl(sock: &OwnedFd, request: libc::Ioctl, req: &mut libc::ifreq) -> io::Result<()> {
    // SAFETY: `req` is a live `ifreq` the kernel reads the name of and
    // writes its answer into.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request, req as *mut libc::ifreq) } < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `SIOCETHTOOL` with `data` (an ethtool command struct, its `cmd` set).
fn ethtool<T>(sock: &OwnedFd, name: &str, data: &mut T) -> io::Result<()> {
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_data = (data as *mut T).cast();
    // `req` points at `data`, live and of the layout its command names,
    // for the call.
    ioctl(sock, libc::SIOCETHTOOL, &mut req)
}

/// The list `getifaddrs` returns, freed when dropped.
struct IfAddrs(*mut libc::ifaddrs);

/// What [`IfAddrs`] tells of one entry.
struct Entry<'a> {
    /// The interface's name, or the address's label for an AF_INET entry.
    name: &'a CStr,
    /// The address of an AF_INET entry.
    ipv4: Option<Ipv4Addr>,
    /// The link of an AF_PACKET entry (one per interface).
    link: Option<Link>,
}

/// An interface's index and Ethernet address (`None` when its hardware
/// address is not 6 bytes long), from its AF_PACKET entry.
#[derive(Clone, Copy)]
struct Link {
    index: u32,
    mac: Option<[u8; 6]>,
}

impl IfAddrs {
    /// Asks the C library (and it the kernel, over rtnetlink).
    fn get() -> io::Result<IfAddrs> {
        let mut list = std::ptr::null_mut();
        // SAFETY: `list` is a valid place for the list's pointer; on
        // success the list is ours until `freeifaddrs` (in `drop`).
        if unsafe { libc::getifaddrs(&mut list) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(IfAddrs(list))
    }

    /// The entries, in the list's order.
    fn entries(&self) -> impl Iterator<Item = Entry<'_>> {
        let mut next = self.0;
        std::iter::from_fn(move || {
            // SAFETY: `next` is null or points to an entry of the list,
            // which lives (unchanged) as long as `self`, the lifetime of
            // the reference made here.
            let ifa = unsafe { next.as_ref() }?;
            next = ifa.ifa_next;
            // SAFETY: every entry's `ifa_name` is a NUL-terminated string
            // in the list, which lives as long as `self`.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
            let (mut ipv4, mut link) = (None, None);
            if !ifa.ifa_addr.is_null() {
                // SAFETY: `ifa_addr`, not null, points to a socket address
                // of the list, which begins with its family; read
                // unaligned, which asks nothing of its alignment.
                let family = unsafe { std::ptr::read_unaligned(ifa.ifa_addr) }.sa_family;
                match i32::from(family) {
                    libc::AF_INET => {
                        // SAFETY: an AF_INET entry's address is a whole
                        // `sockaddr_in`.
                        let sin = unsafe {
                            std::ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in>())
                        };
                        ipv4 = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
                    }
                    libc::AF_PACKET => {
                        // SAFETY: an AF_PACKET entry's address is a whole
                        // `sockaddr_ll` (glibc's is longer still, for long
                        // hardware addresses).
                        let sll = unsafe {
                            std::ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_ll>())
                        };
                        let mac = (sll.sll_halen == 6).then(|| {
                            let mut mac = [0u8; 6];
                            mac.copy_from_slice(&sll.sll_addr[..6]);
                            mac
                        });
                        link = u32::try_from(sll.sll_ifindex)
                            .ok()
                            .map(|index| Link { index, mac });
                    }
                    _ => {}
                }
            }
            Some(Entry { name, ipv4, link })
        })
    }
}

impl Drop for IfAddrs {
    fn drop(&mut self) {
        // SAFETY: the list came from `getifaddrs`, is freed only here,
        // and no entry borrowed from it outlives `self`.
        unsafe { libc::freeifaddrs(self.0) }
    }
}

#[cfg(test)]
pub(crate) mod tests {

    /// `02:00:5e:10:00:01` (sysfs's form of a MAC address) as bytes.
    fn parse_mac(s: &str) -> Option<[u8; 6]> {
        let mut mac = [0u8; 6];
        let mut parts = s.split(':');
        for byte in &mut mac {
            let part = parts.next()?;
            if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            *byte = u8::from_str_radix(part, 16).ok()?;
        }
        parts.next().is_none().then_some(mac)
    }
    use super::*;
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// Runs `f` on a thread of its own in a new network namespace, with
    /// `lo` up, and a new mount namespace in which `/sys` is mounted anew
    /// so that it shows that network namespace. Both namespaces, and
    /// whatever interfaces `f` makes in them, go when the thread ends.
    /// Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN).
    pub(crate) fn in_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            let thread = s.spawn(|| {
                // SAFETY: unshare changes this thread's namespaces (and
                // gives it its own cwd and root), touching no memory.
                let r = unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) };
                assert_eq!(
                    r,
                    0,
                    "unshare(CLONE_NEWNET | CLONE_NEWNS) (the tests need root): {}",
                    io::Error::last_os_error()
                );
                // SAFETY: the strings are NUL-terminated literals; making
                // the new mount namespace's mounts private keeps what
                // follows from reaching the host's.
                let r = unsafe {
                    libc::mount(
                        std::ptr::null(),
                        c"/".as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null(),
                    )
                };
                assert_eq!(
                    r,
                    0,
                    "mount --make-rprivate /: {}",
                    io::Error::last_os_error()
                );
                // SAFETY: as above; a sysfs mounted by this thread shows
                // its network namespace.
                let r = unsafe {
                    libc::mount(
                        c"sysfs".as_ptr(),
                        c"/sys".as_ptr(),
                        c"sysfs".as_ptr(),
                        0,
                        std::ptr::null(),
                    )
                };
                assert_eq!(r, 0, "mount -t sysfs /sys: {}", io::Error::last_os_error());
                ip("link set lo up");
                f()
            });
            match thread.join() {
                Ok(t) => t,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Runs `ip <args>` (iproute2): whether it succeeded, and what it wrote
    /// (stdout, then stderr). Panics when there is no `ip` to run.
    pub(crate) fn try_ip(args: &str) -> (bool, String) {
        let mut not_found = None;
        // Some test environments leave the sbin directories out of PATH.
        for program in ["ip", "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"] {
            match Command::new(program).args(args.split_whitespace()).output() {
                Ok(out) => {
                    let mut said = String::from_utf8_lossy(&out.stdout).into_owned();
                    said.push_str(&String::from_utf8_lossy(&out.stderr));
                    return (out.status.success(), said);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => not_found = Some(e),
                Err(e) => panic!("running `ip {args}`: {e}"),
            }
        }
        panic!(
            "no `ip` command ({}): install iproute2 to run these tests",
            not_found.map_or_else(String::new, |e| e.to_string())
        )
    }

    /// Runs `ip <args>`, which must succeed.
    pub(crate) fn ip(args: &str) {
        let (ok, said) = try_ip(args);
        assert!(ok, "`ip {args}` failed: {said}");
    }

    /// The path of interface `name`'s directory in sysfs.
    fn sys_dir(name: &str) -> PathBuf {
        Path::new("/sys/class/net").join(name)
    }

    /// A sysfs attribute of interface `name`, trimmed.
    pub(crate) fn sys_attr(name: &str, attr: &str) -> String {
        let path = sys_dir(name).join(attr);
        match fs::read_to_string(&path) {
            Ok(s) => s.trim().to_owned(),
            Err(e) => panic!("{}: {e}", path.display()),
        }
    }

    #[test]
    fn finds_a_veth_by_address_and_alias() {
        in_netns(|| {
            ip("link add va numrxqueues 3 type veth peer name vb");
            ip("link set va mtu 1400");
            ip("addr add 10.77.0.1/24 dev va");
            ip("addr add 10.77.1.1/24 dev va label va:1");
            ip("link set va up");
            ip("link set vb up");

            let index: u32 = sys_attr("va", "ifindex").parse().unwrap_or(0);
            let mac = parse_mac(&sys_attr("va", "address"));
            let queues = fs::read_dir(sys_dir("va").join("queues"))
                .map(|d| {
                    d.filter_map(Result::ok)
                        .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
                        .count()
                })
                .unwrap_or(0);
            assert!(index > 1, "va's ifindex {index}");
            let mac = mac.unwrap_or_else(|| panic!("va's address: {}", sys_attr("va", "address")));

            let va = interface_of(Ipv4Addr::new(10, 77, 0, 1)).unwrap();
            assert_eq!(
                va,
                Interface {
                    name: "va".into(),
                    index,
                    mac,
                    mtu: 1400,
                    rx_queues: queues.max(1) as u32,
                    virtual_device: true,
                }
            );
            assert!(va.rx_queues >= 1);
            assert_ne!(va.mac, [0; 6]);
            // The address labelled `va:1` is va's too.
            assert_eq!(interface_of(Ipv4Addr::new(10, 77, 1, 1)).unwrap(), va);
            // The peer has no address.
            let vb = interface_of(Ipv4Addr::new(10, 77, 0, 2)).unwrap_err();
            assert_eq!(vb.kind(), io::ErrorKind::NotFound);
        })
    }

    #[test]
    fn loopback_is_virtual() {
        in_netns(|| {
            let lo = interface_of(Ipv4Addr::LOCALHOST).unwrap();
            assert_eq!(lo.name, "lo");
            assert_eq!(lo.index, 1);
            assert_eq!(lo.mac, [0; 6]);
            assert_eq!(lo.mtu, sys_attr("lo", "mtu").parse::<u32>().unwrap_or(0));
            assert!(lo.rx_queues >= 1);
            assert!(lo.virtual_device);
        })
    }

    #[test]
    fn an_address_nobody_has_is_not_found() {
        let e = interface_of(Ipv4Addr::new(192, 0, 2, 213)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("192.0.2.213"), "{e}");
    }

    #[test]
    fn an_interface_is_described_without_its_namespaces_sys() {
        // Without remounting /sys (as hostd entered by `setns`): /sys shows
        // the host's interfaces, but nothing is read from it.
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: as in `in_netns`.
                let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "unshare: {}", io::Error::last_os_error());
                ip("link set lo up");
                ip("link add vrdma-iface-t type veth peer name vrdma-iface-u");
                ip("link set vrdma-iface-t mtu 1800");
                ip("addr add 10.77.0.1/24 dev vrdma-iface-t");
                let i = interface_of(Ipv4Addr::new(10, 77, 0, 1)).expect("found");
                assert_eq!(i.name, "vrdma-iface-t");
                assert_eq!((i.mtu, i.rx_queues, i.virtual_device), (1800, 1, true));
            });
        });
    }

    #[test]
    fn parses_macs() {
        assert_eq!(
            parse_mac("02:00:5e:10:0a:FF"),
            Some([2, 0, 0x5e, 0x10, 0x0a, 0xff])
        );
        for bad in [
            "",
            "02:00:5e:10:0a",
            "02:00:5e:10:0a:ff:01",
            "2:00:5e:10:0a:ff",
            "02:00:5e:10:0a:fg",
            "02-00-5e-10-0a-ff",
            "+2:00:5e:10:0a:ff",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad:?}");
        }
    }
}
