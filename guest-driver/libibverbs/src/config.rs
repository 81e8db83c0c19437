//! Which vrdma devices the library offers: from the environment or a small
//! config file (documented in docs/compat.md).
//!
//! The first source that is set wins:
//! 1. `VRDMA_DEVICES`: a comma-separated list of `[name=]socket` entries,
//!    e.g. `VRDMA_DEVICES=/run/vrdma/a.sock` or
//!    `VRDMA_DEVICES=mlx_a=/run/vrdma/a.sock,mlx_b=/run/vrdma/b.sock`.
//! 2. `VRDMA_CONFIG`: the path of a TOML file (below).
//! 3. [`DEFAULT_CONFIG_FILE`], if it exists.
//!
//! ```toml
//! [[device]]
//! socket = "/run/vrdma/tenant-a.sock"   # vdev's vhost-user socket
//! name = "vrdma0"                       # optional: vrdma<index> by default
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The config file read when neither variable is set.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/vrdma/libibverbs.toml";
/// The device-list variable.
pub const DEVICES_VAR: &str = "VRDMA_DEVICES";
/// The config-file variable.
pub const CONFIG_VAR: &str = "VRDMA_CONFIG";

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
    /// vdev's vhost-user socket.
    pub socket: PathBuf,
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
    socket: PathBuf,
    name: Option<String>,
}

/// Reads the configuration from this process's environment.
pub fn load() -> Result<Vec<DeviceSpec>, ConfigError> {
    load_from(
        std::env::var_os(DEVICES_VAR).map(|v| v.to_string_lossy().into_owned()),
        std::env::var_os(CONFIG_VAR).map(PathBuf::from),
        Path::new(DEFAULT_CONFIG_FILE),
    )
}

/// [`load`] with its inputs given.
pub fn load_from(
    devices_var: Option<String>,
    config_var: Option<PathBuf>,
    default_file: &Path,
) -> Result<Vec<DeviceSpec>, ConfigError> {
    if let Some(list) = devices_var.filter(|v| !v.trim().is_empty()) {
        return parse_list(&list);
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

/// Parses a `VRDMA_DEVICES` value.
pub fn parse_list(list: &str) -> Result<Vec<DeviceSpec>, ConfigError> {
    let entries = list
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| match e.split_once('=') {
            Some((name, socket)) => (Some(name.trim().to_owned()), PathBuf::from(socket.trim())),
            None => (None, PathBuf::from(e)),
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
            .map(|d| (d.name, d.socket))
            .collect(),
        source,
    )
}

fn validate(
    entries: Vec<(Option<String>, PathBuf)>,
    source: &str,
) -> Result<Vec<DeviceSpec>, ConfigError> {
    let invalid = |reason: String| ConfigError::Invalid {
        origin: source.to_owned(),
        reason,
    };
    if entries.is_empty() {
        return Err(ConfigError::NotConfigured);
    }
    let mut out: Vec<DeviceSpec> = Vec::with_capacity(entries.len());
    for (i, (name, socket)) in entries.into_iter().enumerate() {
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
        let len = socket.as_os_str().len();
        if len == 0 || len > MAX_SOCKET {
            return Err(invalid(format!(
                "device {name:?}: socket path must have 1 to {MAX_SOCKET} bytes"
            )));
        }
        out.push(DeviceSpec { name, socket });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, socket: &str) -> DeviceSpec {
        DeviceSpec {
            name: name.into(),
            socket: socket.into(),
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
            load_from(Some("/from/var".into()), Some(file.clone()), &missing).unwrap(),
            vec![spec("vrdma0", "/from/var")]
        );
        assert_eq!(
            load_from(None, Some(file.clone()), &missing).unwrap(),
            vec![spec("vrdma0", "/from/file")]
        );
        assert_eq!(
            load_from(Some(String::new()), None, &file).unwrap(),
            vec![spec("vrdma0", "/from/file")]
        );
        // Nothing configured: a message that says how to configure.
        let err = load_from(None, None, &missing).unwrap_err();
        assert!(matches!(err, ConfigError::NotConfigured));
        assert!(err.to_string().contains(DEVICES_VAR));
        // A named file must exist.
        let err = load_from(None, Some(missing.clone()), &file).unwrap_err();
        assert!(matches!(err, ConfigError::Invalid { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
