//! The virtio vendor capabilities of a PCI function: where its common
//! configuration, notification, ISR and device configuration structures
//! are. Parsed from config-space bytes the device controls, so every read
//! is bounds-checked: a hostile or broken device gives an error, never a
//! panic.

use super::{common, PciError};

pub(super) const PCI_STATUS: usize = 0x06;
pub(super) const PCI_CAPABILITY_LIST: usize = 0x34;
pub(super) const PCI_STATUS_CAP_LIST: u16 = 0x10;
/// Capabilities start after the standard header.
const PCI_CAP_MIN: usize = 0x40;
pub(super) const PCI_CAP_ID_VNDR: u8 = 0x09;

/// `cfg_type` of the virtio vendor capabilities.
mod cfg_type {
    pub const COMMON: u8 = 1;
    pub const NOTIFY: u8 = 2;
    pub const ISR: u8 = 3;
    pub const DEVICE: u8 = 4;
}

/// A BAR index must be 0–5.
const MAX_BAR: u8 = 5;
/// Longest capability walk: the config space holds fewer capabilities.
pub(super) const MAX_CAPS: usize = 48;

/// Where one virtio structure is: `length` bytes at `offset` in BAR `bar`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapLocation {
    pub bar: u8,
    pub offset: u32,
    pub length: u32,
}

/// The virtio structures a function's capabilities point at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCaps {
    pub common: CapLocation,
    pub notify: CapLocation,
    pub notify_off_multiplier: u32,
    pub isr: CapLocation,
    pub device: Option<CapLocation>,
}

pub(super) fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Parses the virtio vendor capabilities from a function's config space.
///
/// Follows the virtio 1.2 rules (4.1.4): the first capability of each type
/// wins, capabilities naming a reserved BAR (above 5) are ignored, as are
/// types this driver does not use. Everything is bounds-checked against
/// `config`; the walk stops on a loop.
pub fn parse_capabilities(config: &[u8]) -> Result<VirtioCaps, PciError> {
    let len = config.len();
    let short = PciError::ShortConfig { len };
    let status = le16(config, PCI_STATUS).ok_or(short)?;
    if status & PCI_STATUS_CAP_LIST == 0 {
        return Err(PciError::NoCapabilities);
    }
    let mut at = usize::from(
        *config
            .get(PCI_CAPABILITY_LIST)
            .ok_or(PciError::ShortConfig { len })?
            & 0xfc,
    );
    let (mut common, mut notify, mut isr, mut device) = (None, None, None, None);
    let mut seen = 0;
    while at != 0 {
        seen += 1;
        if seen > MAX_CAPS {
            return Err(PciError::CapLoop);
        }
        if at < PCI_CAP_MIN || at + 2 > len {
            return Err(PciError::CapOutside { at, len });
        }
        let (id, next) = (config[at], usize::from(config[at + 1] & 0xfc));
        if id == PCI_CAP_ID_VNDR {
            if at + 16 > len {
                return Err(PciError::CapOutside { at, len });
            }
            let cap_len = config[at + 2];
            let (kind, bar) = (config[at + 3], config[at + 4]);
            let offset = le32(config, at + 8).ok_or(PciError::CapOutside { at, len })?;
            let length = le32(config, at + 12).ok_or(PciError::CapOutside { at, len })?;
            let needed = if kind == cfg_type::NOTIFY { 20 } else { 16 };
            if usize::from(cap_len) < needed {
                return Err(PciError::CapTooShort { at, cap_len });
            }
            if at + usize::from(cap_len) > len {
                return Err(PciError::CapOutside { at, len });
            }
            if offset.checked_add(length).is_none() {
                return Err(PciError::CapOverflow { at, offset, length });
            }
            let loc = CapLocation {
                bar,
                offset,
                length,
            };
            if bar <= MAX_BAR {
                match kind {
                    cfg_type::COMMON if common.is_none() => common = Some(loc),
                    cfg_type::NOTIFY if notify.is_none() => {
                        let mult = le32(config, at + 16).ok_or(PciError::CapOutside { at, len })?;
                        notify = Some((loc, mult));
                    }
                    cfg_type::ISR if isr.is_none() => isr = Some(loc),
                    cfg_type::DEVICE if device.is_none() => device = Some(loc),
                    _ => {}
                }
            }
        }
        at = next;
    }
    let common = common.ok_or(PciError::MissingCap("common configuration"))?;
    if common.length < common::MIN_LEN {
        return Err(PciError::MissingCap("common configuration (too short)"));
    }
    let (notify, notify_off_multiplier) = notify.ok_or(PciError::MissingCap("notification"))?;
    let isr = isr.ok_or(PciError::MissingCap("ISR status"))?;
    if isr.length == 0 {
        return Err(PciError::MissingCap("ISR status (empty)"));
    }
    Ok(VirtioCaps {
        common,
        notify,
        notify_off_multiplier,
        isr,
        device,
    })
}

#[cfg(test)]
mod tests {
    use super::super::VIRTIO_PCI_VENDOR;
    use super::*;
    use std::path::Path;

    /// Config space of a modern virtio PCI function laid out the way QEMU
    /// lays out its virtio-pci devices (built by hand from the virtio 1.2
    /// capability layout and QEMU's `virtio-pci` modern BAR: BAR 4 with
    /// common config at 0, ISR at 0x1000, device config at 0x2000, notify
    /// at 0x3000 with multiplier 4), behind an MSI-X capability and the
    /// PCI-config-access capability, for virtio id 38.
    fn qemu_like_config() -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[0..2].copy_from_slice(&VIRTIO_PCI_VENDOR.to_le_bytes());
        c[2..4].copy_from_slice(&0x1066u16.to_le_bytes());
        c[PCI_STATUS..PCI_STATUS + 2].copy_from_slice(&PCI_STATUS_CAP_LIST.to_le_bytes());
        c[PCI_CAPABILITY_LIST] = 0x98;
        // MSI-X (id 0x11), 12 bytes.
        c[0x98] = 0x11;
        c[0x99] = 0x84;
        let mut vndr = |at: usize, next: u8, len: u8, kind: u8, bar: u8, off: u32, length: u32| {
            c[at] = PCI_CAP_ID_VNDR;
            c[at + 1] = next;
            c[at + 2] = len;
            c[at + 3] = kind;
            c[at + 4] = bar;
            c[at + 8..at + 12].copy_from_slice(&off.to_le_bytes());
            c[at + 12..at + 16].copy_from_slice(&length.to_le_bytes());
        };
        vndr(0x84, 0x70, 20, 5, 0, 0, 0); // VIRTIO_PCI_CAP_PCI_CFG
        vndr(0x70, 0x60, 20, cfg_type::NOTIFY, 4, 0x3000, 0x1000);
        vndr(0x60, 0x50, 16, cfg_type::DEVICE, 4, 0x2000, 0x1000);
        vndr(0x50, 0x40, 16, cfg_type::ISR, 4, 0x1000, 0x1000);
        vndr(0x40, 0x00, 16, cfg_type::COMMON, 4, 0, 0x1000);
        c[0x70 + 16..0x70 + 20].copy_from_slice(&4u32.to_le_bytes());
        c
    }

    fn expected() -> VirtioCaps {
        let at = |offset| CapLocation {
            bar: 4,
            offset,
            length: 0x1000,
        };
        VirtioCaps {
            common: at(0),
            notify: at(0x3000),
            notify_off_multiplier: 4,
            isr: at(0x1000),
            device: Some(at(0x2000)),
        }
    }

    #[test]
    fn qemu_layout_parses() {
        assert_eq!(parse_capabilities(&qemu_like_config()).unwrap(), expected());
        // A 4 KiB (PCIe) config space with the same capabilities parses too.
        let mut big = qemu_like_config();
        big.resize(4096, 0);
        assert_eq!(parse_capabilities(&big).unwrap(), expected());
    }

    /// The real device's config space saved from QEMU by the VM test
    /// harness, when it is there.
    #[test]
    fn saved_qemu_config_spaces_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/vm/fixtures");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            eprintln!("no fixtures in {}", dir.display());
            return;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.contains("config") || name.ends_with(".md") {
                continue;
            }
            let bytes = std::fs::read(e.path()).expect("fixture");
            let caps = parse_capabilities(&bytes).unwrap_or_else(|err| panic!("{name}: {err}"));
            assert!(caps.device.is_some(), "{name}: no device config");
        }
    }

    #[test]
    fn first_capability_of_a_type_wins_and_reserved_bars_are_ignored() {
        let mut c = qemu_like_config();
        // A second common cap in front, naming BAR 6: ignored, the real one wins.
        c[PCI_CAPABILITY_LIST] = 0xb0;
        c[0xb0] = PCI_CAP_ID_VNDR;
        c[0xb1] = 0x98;
        c[0xb2] = 16;
        c[0xb3] = cfg_type::COMMON;
        c[0xb4] = 6;
        assert_eq!(parse_capabilities(&c).unwrap(), expected());
        // If the BAR-6 one is the only common cap, there is none.
        c[0x43] = 0x7f;
        assert!(matches!(
            parse_capabilities(&c),
            Err(PciError::MissingCap("common configuration"))
        ));
    }

    #[test]
    fn hostile_capability_lists_are_errors() {
        let base = qemu_like_config();
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut c = base.clone();
            f(&mut c);
            parse_capabilities(&c)
        };
        // A loop: the last capability points back at the first.
        assert!(matches!(with(&|c| c[0x41] = 0x98), Err(PciError::CapLoop)));
        // A self-loop.
        assert!(matches!(with(&|c| c[0x51] = 0x50), Err(PciError::CapLoop)));
        // The list pointer past the config space (a 64-byte header only).
        assert!(matches!(
            with(&|c| c.truncate(0x90)),
            Err(PciError::CapOutside { at: 0x98, .. })
        ));
        // A capability in the standard header.
        assert!(matches!(
            with(&|c| c[PCI_CAPABILITY_LIST] = 0x20),
            Err(PciError::CapOutside { at: 0x20, .. })
        ));
        // A capability whose body runs past the end.
        assert!(matches!(
            with(&|c| {
                c[0x41] = 0xf8;
                c[0xf8] = PCI_CAP_ID_VNDR;
            }),
            Err(PciError::CapOutside { at: 0xf8, .. })
        ));
        // cap_len running past the end of the config space.
        assert!(matches!(
            with(&|c| {
                c[0x41] = 0xe8;
                c[0xe8] = PCI_CAP_ID_VNDR;
                c[0xea] = 0xff;
            }),
            Err(PciError::CapOutside { at: 0xe8, .. })
        ));
        // offset + length overflows.
        assert!(matches!(
            with(&|c| {
                c[0x40 + 8] = 0x10;
                c[0x40 + 12..0x40 + 16].copy_from_slice(&u32::MAX.to_le_bytes());
            }),
            Err(PciError::CapOverflow { at: 0x40, .. })
        ));
        // A notify capability without room for its multiplier.
        assert!(matches!(
            with(&|c| c[0x72] = 16),
            Err(PciError::CapTooShort {
                at: 0x70,
                cap_len: 16
            })
        ));
        // A common configuration too short for the registers.
        assert!(matches!(
            with(&|c| c[0x40 + 12..0x40 + 16].copy_from_slice(&0x10u32.to_le_bytes())),
            Err(PciError::MissingCap(_))
        ));
        // No capability list at all, or a config space with no header.
        assert!(matches!(
            with(&|c| c[PCI_STATUS] = 0),
            Err(PciError::NoCapabilities)
        ));
        assert!(matches!(
            parse_capabilities(&base[..4]),
            Err(PciError::ShortConfig { len: 4 })
        ));
        // Every prefix of the config space gives an answer, never a panic.
        for len in 0..base.len() {
            let _ = parse_capabilities(&base[..len]);
        }
    }
}
