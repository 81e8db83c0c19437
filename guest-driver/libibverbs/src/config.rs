//! Which vrdma devices the library offers: from the environment or a small
//! config file (documented in docs/compat.md).
//!
//! The first source that is set wins:
//! 1. `VRDMA_DEVICES`: a comma-separated list of `[name=]endpoint` entries,
//!    e.g. `VRDMA_DEVICES=/run/vrdma/a.sock` or
//!    `VRDMA_DEVICES=mlx_a=/run/vrdma/a.sock,mlx_b=/run/vrdma/b.sock`.
//!    An endpoint is vdev's vhost-user socket (process mode) or, inside a
//!    VM, the device's PCI functions (each a context slot): `pci:auto`
//!    (every vrdma function of the VM: one device) or addresses joined by
//!    `+`, `pci:0000:00:04.0+0000:00:05.0` (a VM with several devices). `VRDMA_VIRTIO_ID` says which virtio
//!    device id the PCI function runs with (42 unless set; 38 under QEMU
//!    11, which cannot run 42).
//! 2. `VRDMA_CONFIG`: the path of a TOML file (below).
//! 3. [`DEFAULT_CONFIG_FILE`], if it exists.
//!
//! ```toml
//! [[device]]
//! socket = "/run/vrdma/tenant-a.sock"   # vdev's vhost-user socket
//! name = "vrdma0"                       # optional: vrdma<index> by default
//!
//! [[device]]                            # VM mode
//! pci = "auto"                          # or "0000:00:04.0+0000:00:05.0"
//! virtio_id = 38                        # optional: 42 by default
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;
use vrdma_guest_driver::transport::virtio_pci::{device_id, VIRTIO_ID_RDMA};
use vrdma_guest_driver::PciDevice;

/// The config file read when neither variable is set.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/vrdma/libibverbs.toml";
/// The device-list variable.
pub const DEVICES_VAR: &str = "VRDMA_DEVICES";
/// The config-file variable.
pub const CONFIG_VAR: &str = "VRDMA_CONFIG";
/// The variable naming the virtio id of PCI devices from `VRDMA_DEVICES`.
pub const VIRTIO_ID_VAR: &str = "VRDMA_VIRTIO_ID";
/// Prefix of a PCI endpoint in `VRDMA_DEVICES`.
const PCI_PREFIX: &str = "pci:";

/// Longest device name (`ibv_device.name` holds 64 bytes with the NUL).
const MAX_NAME: usize = 63;
/// Longest socket path (`ibv_device.dev_path` holds 256 bytes with the NUL;
/// a unix socket path is shorter still).
const MAX_SOCKET: usize = 107;

/// One device the library offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// What `ibv_get_device_name` returns.
    pub name: String,
    /// How the device is reached.
    pub endpoint: Endpoint,
}

/// How a device is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// Process mode: vdev's vhost-user socket.
    Socket(PathBuf),
    /// VM mode: the device's virtio-pci functions, one per context.
    Pci {
        /// Their PCI addresses; empty: every vrdma function of the VM.
        functions: Vec<String>,
        /// The virtio device id it runs with.
        virtio_id: u16,
    },
}

impl Endpoint {
    /// What `ibv_device.dev_path` shows.
    pub fn display(&self) -> String {
        match self {
            Endpoint::Socket(p) => p.display().to_string(),
            Endpoint::Pci { functions, .. } if functions.is_empty() => {
                format!("{PCI_PREFIX}auto")
            }
            Endpoint::Pci { functions, .. } => format!("{PCI_PREFIX}{}", functions.join("+")),
        }
    }
}

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "no vrdma device is configured: set {DEVICES_VAR}=/path/to/vdev.sock \
         (or {CONFIG_VAR}=/path/to/libibverbs.toml, or write {DEFAULT_CONFIG_FILE})"
    )]
    NotConfigured,
    #[error("invalid vrdma configuration in {origin}: {reason}")]
    Invalid { origin: String, reason: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    device: Vec<FileDevice>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDevice {
    socket: Option<PathBuf>,
    pci: Option<String>,
    virtio_id: Option<u16>,
    name: Option<String>,
}

/// An entry before validation: name, and socket or PCI address with its id.
type Entry = (Option<String>, RawEndpoint);

#[derive(Debug)]
enum RawEndpoint {
    Socket(PathBuf),
    Pci(String, Option<u16>),
    Invalid(String),
}

/// Reads the configuration from this process's environment.
pub fn load() -> Result<Vec<DeviceSpec>, ConfigError> {
    let var = |name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    load_from(
        var(DEVICES_VAR),
        var(CONFIG_VAR).map(PathBuf::from),
        Path::new(DEFAULT_CONFIG_FILE),
        var(VIRTIO_ID_VAR),
    )
}

/// [`load`] with its inputs given.
pub fn load_from(
    devices_var: Option<String>,
    config_var: Option<PathBuf>,
    default_file: &Path,
    virtio_id_var: Option<String>,
) -> Result<Vec<DeviceSpec>, ConfigError> {
    if let Some(list) = devices_var.filter(|v| !v.trim().is_empty()) {
        let virtio_id = match virtio_id_var.filter(|v| !v.trim().is_empty()) {
            None => None,
            Some(v) => Some(v.trim().parse::<u16>().map_err(|_| ConfigError::Invalid {
                origin: VIRTIO_ID_VAR.to_owned(),
                reason: format!("{v:?} is not a virtio device id (a number, e.g. 38)"),
            })?),
        };
        return parse_list_with(&list, virtio_id);
    }
    let (path, must_exist) = match config_var {
        Some(p) => (p, true),
        None => (default_file.to_path_buf(), false),
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_file(&text, &path.display().to_string()),
        Err(e) if !must_exist && e.kind() == std::io::ErrorKind::NotFound => {
            Err(ConfigError::NotConfigured)
        }
        Err(e) => Err(ConfigError::Invalid {
            origin: path.display().to_string(),
            reason: e.to_string(),
        }),
    }
}

/// Parses a `VRDMA_DEVICES` value (PCI devices with the default id).
pub fn parse_list(list: &str) -> Result<Vec<DeviceSpec>, ConfigError> {
    parse_list_with(list, None)
}

/// Parses a `VRDMA_DEVICES` value; PCI devices run with `virtio_id`
/// (`VRDMA_VIRTIO_ID`) when given.
pub fn parse_list_with(list: &str, virtio_id: Option<u16>) -> Result<Vec<DeviceSpec>, ConfigError> {
    let endpoint = |e: &str| match e.strip_prefix(PCI_PREFIX) {
        Some(pci) => RawEndpoint::Pci(pci.to_owned(), virtio_id),
        None => RawEndpoint::Socket(PathBuf::from(e)),
    };
    let entries = list
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| match e.split_once('=') {
            Some((name, rest)) => (Some(name.trim().to_owned()), endpoint(rest.trim())),
            None => (None, endpoint(e)),
        })
        .collect();
    validate(entries, DEVICES_VAR)
}

/// Parses a config file's text.
pub fn parse_file(text: &str, source: &str) -> Result<Vec<DeviceSpec>, ConfigError> {
    let file: File = toml::from_str(text).map_err(|e| ConfigError::Invalid {
        origin: source.to_owned(),
        reason: e.to_string(),
    })?;
    validate(
        file.device
            .into_iter()
            .map(|d| {
                let endpoint = match (d.socket, d.pci) {
                    (Some(socket), None) if d.virtio_id.is_none() => RawEndpoint::Socket(socket),
                    (None, Some(pci)) => RawEndpoint::Pci(pci, d.virtio_id),
                    (Some(_), None) => {
                        RawEndpoint::Invalid("virtio_id applies to pci devices only".into())
                    }
                    _ => RawEndpoint::Invalid("give exactly one of socket and pci".into()),
                };
                (d.name, endpoint)
            })
            .collect(),
        source,
    )
}

fn validate(entries: Vec<Entry>, source: &str) -> Result<Vec<DeviceSpec>, ConfigError> {
    let invalid = |reason: String| ConfigError::Invalid {
        origin: source.to_owned(),
        reason,
    };
    if entries.is_empty() {
        return Err(ConfigError::NotConfigured);
    }
    let mut out: Vec<DeviceSpec> = Vec::with_capacity(entries.len());
    for (i, (name, raw)) in entries.into_iter().enumerate() {
        let name = name.unwrap_or_else(|| format!("vrdma{i}"));
        let valid_name = !name.is_empty()
            && name.len() <= MAX_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if !valid_name {
            return Err(invalid(format!(
                "device name {name:?}: use 1 to {MAX_NAME} letters, digits, '_', '-' or '.'"
            )));
        }
        if out.iter().any(|d| d.name == name) {
            return Err(invalid(format!("device name {name:?} is used twice")));
        }
        let endpoint = match raw {
            RawEndpoint::Invalid(reason) => {
                return Err(invalid(format!("device {name:?}: {reason}")))
            }
            RawEndpoint::Socket(socket) => {
                let len = socket.as_os_str().len();
                if len == 0 || len > MAX_SOCKET {
                    return Err(invalid(format!(
                        "device {name:?}: socket path must have 1 to {MAX_SOCKET} bytes"
                    )));
                }
                Endpoint::Socket(socket)
            }
            RawEndpoint::Pci(pci, id) => {
                let virtio_id = id.unwrap_or(VIRTIO_ID_RDMA);
                device_id(virtio_id).map_err(|e| invalid(format!("device {name:?}: {e}")))?;
                let functions = match pci.as_str() {
                    "auto" => Vec::new(),
                    list => {
                        let mut functions: Vec<String> = Vec::new();
                        for bdf in list.split('+').map(str::trim) {
                            let bdf = PciDevice::at(bdf)
                                .map_err(|e| invalid(format!("device {name:?}: {e}")))?
                                .address()
                                .to_owned();
                            if functions.contains(&bdf) {
                                return Err(invalid(format!(
                                    "device {name:?}: function {bdf} is listed twice"
                                )));
                            }
                            functions.push(bdf);
                        }
                        functions
                    }
                };
                Endpoint::Pci {
                    functions,
                    virtio_id,
                }
            }
        };
        out.push(DeviceSpec { name, endpoint });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, socket: &str) -> DeviceSpec {
        DeviceSpec {
            name: name.into(),
            endpoint: Endpoint::Socket(socket.into()),
        }
    }

    fn pci(name: &str, address: Option<&str>, virtio_id: u16) -> DeviceSpec {
        DeviceSpec {
            name: name.into(),
            endpoint: Endpoint::Pci {
                functions: address
                    .map(|a| a.split('+').map(str::to_owned).collect())
                    .unwrap_or_default(),
                virtio_id,
            },
        }
    }

    #[test]
    fn pci_devices_from_the_variable_and_the_file() {
        assert_eq!(
            parse_list("vrdma0=pci:0000:00:04.0,pci:auto").unwrap(),
            vec![
                pci("vrdma0", Some("0000:00:04.0"), 42),
                pci("vrdma1", None, 42)
            ]
        );
        assert_eq!(
            parse_list_with("pci:00:05.0", Some(38)).unwrap(),
            vec![pci("vrdma0", Some("0000:00:05.0"), 38)]
        );
        assert_eq!(pci("x", None, 38).endpoint.display(), "pci:auto");
        // A device of several functions (its context slots).
        let two =
            parse_list_with("alpha=pci:00:04.0+0000:00:05.0,beta=pci:00:06.0", Some(38)).unwrap();
        assert_eq!(
            two,
            vec![
                pci("alpha", Some("0000:00:04.0+0000:00:05.0"), 38),
                pci("beta", Some("0000:00:06.0"), 38)
            ]
        );
        assert_eq!(two[0].endpoint.display(), "pci:0000:00:04.0+0000:00:05.0");
        let err = parse_list("pci:00:04.0+00:04.0").unwrap_err();
        assert!(err.to_string().contains("listed twice"), "{err}");
        let err = parse_list("pci:00:04.0+").unwrap_err();
        assert!(err.to_string().contains("not a PCI address"), "{err}");
        let err = parse_list("pci:00:04").unwrap_err();
        assert!(err.to_string().contains("not a PCI address"), "{err}");
        let err = parse_list_with("pci:auto", Some(0)).unwrap_err();
        assert!(err.to_string().contains("Virtio id 0"), "{err}");
        let dir = std::path::Path::new("/nonexistent");
        let err = load_from(Some("pci:auto".into()), None, dir, Some("forty".into())).unwrap_err();
        assert!(err.to_string().contains(VIRTIO_ID_VAR), "{err}");
        assert_eq!(
            load_from(Some("pci:auto".into()), None, dir, Some(" 38 ".into())).unwrap(),
            vec![pci("vrdma0", None, 38)]
        );

        let text = "[[device]]\npci = \"auto\"\nvirtio_id = 38\n[[device]]\nname = \"b\"\npci = \"0000:00:06.0\"\n";
        assert_eq!(
            parse_file(text, "f").unwrap(),
            vec![pci("vrdma0", None, 38), pci("b", Some("0000:00:06.0"), 42)]
        );
        for bad in [
            "[[device]]\nsocket = \"/s\"\npci = \"auto\"\n",
            "[[device]]\nname = \"x\"\n",
            "[[device]]\nsocket = \"/s\"\nvirtio_id = 38\n",
            "[[device]]\npci = \"auto\"\nvirtio_id = 200\n",
        ] {
            let err = parse_file(bad, "f").unwrap_err();
            assert!(matches!(err, ConfigError::Invalid { .. }), "{bad}: {err}");
        }
    }

    #[test]
    fn variable_lists_devices_with_default_names() {
        assert_eq!(
            parse_list("/a.sock").unwrap(),
            vec![spec("vrdma0", "/a.sock")]
        );
        assert_eq!(
            parse_list(" x=/a.sock , /b.sock,").unwrap(),
            vec![spec("x", "/a.sock"), spec("vrdma1", "/b.sock")]
        );
        assert!(matches!(parse_list(" , "), Err(ConfigError::NotConfigured)));
        let err = parse_list("a=/x,a=/y").unwrap_err();
        assert!(err.to_string().contains("used twice"), "{err}");
        let err = parse_list("bad/name=/x").unwrap_err();
        assert!(err.to_string().contains("device name"), "{err}");
        let long = format!("/{}", "s".repeat(200));
        assert!(parse_list(&long).is_err());
    }

    #[test]
    fn file_lists_devices() {
        let text = r#"
            [[device]]
            socket = "/run/vrdma/a.sock"
            [[device]]
            name = "beta"
            socket = "/run/vrdma/b.sock"
        "#;
        assert_eq!(
            parse_file(text, "f").unwrap(),
            vec![
                spec("vrdma0", "/run/vrdma/a.sock"),
                spec("beta", "/run/vrdma/b.sock")
            ]
        );
        let err = parse_file("[[device]]\nsockt = \"/x\"\n", "f").unwrap_err();
        assert!(err.to_string().contains("invalid vrdma configuration in f"));
        assert!(matches!(
            parse_file("", "f"),
            Err(ConfigError::NotConfigured)
        ));
    }

    #[test]
    fn sources_in_order() {
        let dir = std::env::temp_dir().join(format!("vrdma-ibv-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("libibverbs.toml");
        std::fs::write(&file, "[[device]]\nsocket = \"/from/file\"\n").unwrap();
        let missing = dir.join("missing.toml");
        // The variable wins over the file.
        assert_eq!(
            load_from(Some("/from/var".into()), Some(file.clone()), &missing, None).unwrap(),
            vec![spec("vrdma0", "/from/var")]
        );
        assert_eq!(
            load_from(None, Some(file.clone()), &missing, None).unwrap(),
            vec![spec("vrdma0", "/from/file")]
        );
        assert_eq!(
            load_from(Some(String::new()), None, &file, None).unwrap(),
            vec![spec("vrdma0", "/from/file")]
        );
        // Nothing configured: a message that says how to configure.
        let err = load_from(None, None, &missing, None).unwrap_err();
        assert!(matches!(err, ConfigError::NotConfigured));
        assert!(err.to_string().contains(DEVICES_VAR));
        // A named file must exist.
        let err = load_from(None, Some(missing.clone()), &file, None).unwrap_err();
        assert!(matches!(err, ConfigError::Invalid { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
