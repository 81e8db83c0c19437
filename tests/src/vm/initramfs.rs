//! [`Initramfs`]: the guest's initramfs, built here as a newc cpio:
//! busybox, kernel modules in dependency order, host binaries with their
//! shared libraries, Debian programs from the prepared guest tree with
//! theirs, and the caller's init script.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::elf;
use super::{io_err, VmError, VmImage, VERDICT};

/// One file of the initramfs.
#[derive(Debug, Clone)]
enum Entry {
    Dir,
    File { data: Source, mode: u32 },
    Symlink(String),
    CharDev { major: u32, minor: u32 },
}

#[derive(Debug, Clone)]
enum Source {
    Bytes(Vec<u8>),
    Host(PathBuf),
    /// A `.ko.xz` decompressed while building.
    Xz(PathBuf),
    /// A host ELF file without its debug sections (`strip --strip-debug`).
    Stripped(PathBuf),
    /// A file of the prepared guest tree (a trixie program or library):
    /// packed as it is, never given to the host's `ldd` or `strip`.
    Guest(PathBuf),
    /// A host-built ELF file linked against the guest tree's libraries
    /// ([`Initramfs::guest_linked`]): stripped like a host binary, never
    /// given to the host's `ldd`.
    Linked(PathBuf),
}

/// Where shared libraries go in the guest (a directory the guest's
/// loader searches, exported as LD_LIBRARY_PATH too).
pub const GUEST_LIB_DIR: &str = "/lib/x86_64-linux-gnu";
/// Where kernel modules go in the guest.
const GUEST_MODULE_DIR: &str = "/lib/modules";
/// Where the guest tree's programs look for shared libraries (Debian's
/// multiarch directory first, as its loader does), relative to the tree.
const GUEST_TREE_LIB_DIRS: &[&str] = &["usr/lib/x86_64-linux-gnu", "usr/lib"];

/// Builds a guest initramfs: busybox as the userland, kernel modules
/// loaded by `/init` in dependency order, host binaries with the shared
/// libraries they need, and the caller's init script. The archive is
/// deterministic (sorted entries, zero times, uncompressed).
#[derive(Debug, Clone)]
pub struct Initramfs {
    entries: BTreeMap<String, Entry>,
    modules_dir: PathBuf,
    modules: Vec<String>,
    library_path: Vec<PathBuf>,
    script: String,
    strip_debug: bool,
    /// The prepared guest tree (`<root>/guest`).
    guest_tree: PathBuf,
    /// Guest-tree programs and libraries to pack with what they need.
    guest_programs: Vec<String>,
    /// Host-built programs and libraries linked against the guest tree's
    /// libraries: (host file, guest path).
    guest_linked: Vec<(PathBuf, String)>,
    /// eth0's address (CIDR) and default gateway.
    eth0: (String, Option<String>),
}

/// Modules every guest loads: uio_pci_generic to take the vrdma function
/// from virtio-pci, virtio_net (with its failover dependencies) for the
/// NIC of QEMU's user networking.
const BASE_MODULES: &[&str] = &["uio_pci_generic", "virtio_net"];

impl Initramfs {
    pub(super) fn new(image: &VmImage) -> Self {
        let mut fs = Initramfs {
            entries: BTreeMap::new(),
            modules_dir: image.modules.clone(),
            modules: Vec::new(),
            library_path: Vec::new(),
            script: String::new(),
            strip_debug: false,
            guest_tree: image.guest.clone(),
            guest_programs: Vec::new(),
            guest_linked: Vec::new(),
            eth0: ("10.0.2.15/24".into(), Some("10.0.2.2".into())),
        };
        for dir in [
            "/bin", "/dev", "/etc", "/proc", "/sys", "/tmp", "/lib64", "/root",
        ] {
            fs.add(dir, Entry::Dir);
        }
        fs.add("/dev/console", Entry::CharDev { major: 5, minor: 1 });
        fs.add(
            "/bin/busybox",
            Entry::File {
                data: Source::Host(image.busybox.clone()),
                mode: 0o755,
            },
        );
        fs.add("/bin/sh", Entry::Symlink("busybox".into()));
        fs
    }

    fn add(&mut self, path: &str, entry: Entry) {
        for dir in Path::new(path).ancestors().skip(1) {
            let dir = dir.to_string_lossy();
            if dir == "/" || dir.is_empty() {
                break;
            }
            self.entries.entry(dir.into_owned()).or_insert(Entry::Dir);
        }
        self.entries.insert(path.into(), entry);
    }
}

impl Initramfs {
    /// Loads kernel module `name` (and what it depends on) in `/init`.
    pub fn module(mut self, name: &str) -> Self {
        self.modules.push(name.into());
        self
    }

    /// Places host binary `host` at `guest` (an absolute path), with the
    /// shared libraries it needs as the host's loader resolves them (with
    /// the directories of [`Initramfs::library_dir`] searched first).
    pub fn binary(mut self, host: &Path, guest: &str) -> Self {
        self.add(
            guest,
            Entry::File {
                data: Source::Host(host.into()),
                mode: 0o755,
            },
        );
        self
    }

    /// Searches `dir` first for the shared libraries of [`Initramfs::binary`]
    /// (like LD_LIBRARY_PATH): how the guest gets vrdma's libibverbs.so.1
    /// instead of the host's.
    pub fn library_dir(mut self, dir: &Path) -> Self {
        self.library_path.push(dir.into());
        self
    }

    /// Packs host binaries and their shared libraries without debug
    /// information: the workspace's debug builds are tens of MB each, which
    /// the guest would unpack into its RAM.
    pub fn strip_debug(mut self) -> Self {
        self.strip_debug = true;
        self
    }

    /// Places program (or shared library) `path` of the prepared guest
    /// tree — Debian trixie's, e.g. `/usr/bin/ibv_devinfo` — at the same
    /// path, with its loader and every shared library it needs (read from
    /// its ELF dynamic section, recursively) from the same tree, the
    /// libraries under `/usr/lib/x86_64-linux-gnu`. A shell script is
    /// packed alone. Building fails if a host binary of
    /// [`Initramfs::binary`] needs a different loader or library at the
    /// same path: a guest runs one glibc.
    pub fn guest_program(mut self, path: &str) -> Self {
        self.guest_programs.push(path.into());
        self
    }

    /// Places every file under directory `path` of the prepared guest tree
    /// (e.g. UCX's transport modules, `/usr/lib/x86_64-linux-gnu/ucx`) as
    /// [`Initramfs::guest_program`] places one: plug-ins a program loads
    /// at run time, which its ELF header does not name. A missing
    /// directory fails the build.
    pub fn guest_dir(mut self, path: &str) -> Self {
        let root = resolve_in_tree(&self.guest_tree, path);
        let mut pending = vec![(path.trim_end_matches('/').to_owned(), root)];
        while let Some((guest, host)) = pending.pop() {
            match std::fs::read_dir(&host) {
                Ok(entries) => {
                    for entry in entries.flatten() {
                        let name = entry.file_name().to_string_lossy().into_owned();
                        let host = resolve_in_tree(&self.guest_tree, &format!("{guest}/{name}"));
                        pending.push((format!("{guest}/{name}"), host));
                    }
                }
                // A file (or a link to one), or nothing: guest_program
                // packs it or fails the build naming it.
                Err(_) => self.guest_programs.push(guest),
            }
        }
        self
    }

    /// Places host-built ELF file `host` (a program or shared library, e.g.
    /// one compiled from tests/c) at `guest`, linked in the guest against
    /// the guest tree's loader and libraries, as [`Initramfs::guest_program`]
    /// packs them, except those found in a [`Initramfs::library_dir`]
    /// (vrdma's libibverbs.so.1), which are packed the same way into
    /// [`GUEST_LIB_DIR`], first on the guest's library path. For guests
    /// that run trixie programs and host-built ones together.
    pub fn guest_linked(mut self, host: &Path, guest: &str) -> Self {
        self.guest_linked.push((host.into(), guest.into()));
        self
    }

    /// Places file `path` of the prepared guest tree (e.g.
    /// `/etc/libibverbs.d/rxe.driver`) at the same path.
    pub fn guest_file(mut self, path: &str) -> Self {
        let host = resolve_in_tree(&self.guest_tree, path);
        self.add(
            path,
            Entry::File {
                data: Source::Guest(host),
                mode: 0o644,
            },
        );
        self
    }

    /// Configures eth0 with `address` (CIDR, e.g. `10.99.0.2/24`) and,
    /// if given, a default route via `gateway`, instead of QEMU user
    /// networking's 10.0.2.15/24 via 10.0.2.2.
    pub fn eth0(mut self, address: &str, gateway: Option<&str>) -> Self {
        self.eth0 = (address.into(), gateway.map(str::to_owned));
        self
    }

    /// Places `data` at `guest` with permission bits `mode`.
    pub fn file(mut self, guest: &str, data: &[u8], mode: u32) -> Self {
        self.add(
            guest,
            Entry::File {
                data: Source::Bytes(data.into()),
                mode,
            },
        );
        self
    }

    /// The shell script `/init` runs (sourced, so it can call `pass NAME`
    /// and `fail NAME REASON`) once the system is up: /proc, /sys and /dev
    /// mounted, modules loaded, `eth0` at 10.0.2.15/24 with the host at
    /// 10.0.2.2. The guest powers off when it returns.
    pub fn script(mut self, script: &str) -> Self {
        self.script = script.into();
        self
    }

    /// Writes the archive to `out`.
    pub fn build(mut self, out: &Path) -> Result<(), VmError> {
        let modules = self.resolve_modules()?;
        for (name, path) in &modules {
            let data = if path.extension().is_some_and(|e| e == "xz") {
                Source::Xz(path.clone())
            } else {
                Source::Host(path.clone())
            };
            self.add(
                &format!("{GUEST_MODULE_DIR}/{name}.ko"),
                Entry::File { data, mode: 0o644 },
            );
        }
        let binaries: Vec<PathBuf> = self
            .entries
            .values()
            .filter_map(|e| match e {
                Entry::File {
                    data: Source::Host(path),
                    mode,
                } if mode & 0o111 != 0 && !path.ends_with("busybox") => Some(path.clone()),
                _ => None,
            })
            .collect();
        for binary in binaries {
            for (guest, host) in shared_libraries(&binary, &self.library_path)? {
                self.add(
                    &guest,
                    Entry::File {
                        data: Source::Host(host),
                        mode: 0o755,
                    },
                );
            }
        }
        for (host, guest) in std::mem::take(&mut self.guest_linked) {
            self.add_guest_linked(&host, &guest)?;
        }
        for program in std::mem::take(&mut self.guest_programs) {
            self.add_guest_program(&program)?;
        }
        let names: Vec<&str> = modules.iter().map(|(n, _)| n.as_str()).collect();
        let init = init_script(&names, &self.eth0.0, self.eth0.1.as_deref());
        let script = std::mem::take(&mut self.script);
        self.add(
            "/init",
            Entry::File {
                data: Source::Bytes(init.into_bytes()),
                mode: 0o755,
            },
        );
        self.add(
            "/vrdma/test.sh",
            Entry::File {
                data: Source::Bytes(script.into_bytes()),
                mode: 0o644,
            },
        );
        if self.strip_debug {
            for entry in self.entries.values_mut() {
                if let Entry::File {
                    data: data @ (Source::Host(_) | Source::Linked(_)),
                    mode,
                } = entry
                {
                    if *mode & 0o111 != 0 {
                        if let Source::Host(path) | Source::Linked(path) =
                            std::mem::replace(data, Source::Bytes(Vec::new()))
                        {
                            *data = Source::Stripped(path);
                        }
                    }
                }
            }
        }
        let file = std::fs::File::create(out).map_err(io_err(out))?;
        let mut writer = CpioWriter::new(std::io::BufWriter::new(file));
        for (path, entry) in &self.entries {
            writer.entry(path, entry).map_err(io_err(out))?;
        }
        writer.finish().map_err(io_err(out))
    }

    /// Adds guest-tree program `path`, its loader and its libraries
    /// (transitively).
    fn add_guest_program(&mut self, path: &str) -> Result<(), VmError> {
        let mut pending = vec![(path.to_owned(), resolve_in_tree(&self.guest_tree, path))];
        let mut seen = BTreeSet::new();
        while let Some((guest, host)) = pending.pop() {
            if !seen.insert(guest.clone()) {
                continue;
            }
            let data = std::fs::read(&host).map_err(io_err(&host))?;
            self.add_guest_entry(&guest, &host)?;
            if !elf::is_elf(&data) {
                continue;
            }
            let dynamic = elf::dynamic(&data).map_err(|e| VmError::GuestTree {
                path: guest.clone(),
                reason: e.to_string(),
            })?;
            if let Some(interp) = dynamic.interp {
                let file = resolve_in_tree(&self.guest_tree, &interp);
                pending.push((interp, file));
            }
            // Plug-ins (UCX's transport modules) find their siblings
            // through `$ORIGIN`: the file's own directory comes last.
            let origin = Path::new(&guest)
                .parent()
                .map(|d| d.to_string_lossy().trim_start_matches('/').to_owned());
            for soname in dynamic.needed {
                let (lib_guest, lib_host) = self
                    .tree_library(&soname, origin.as_deref())
                    .ok_or_else(|| VmError::GuestTree {
                        path: guest.clone(),
                        reason: format!("needs {soname}, which the guest tree lacks"),
                    })?;
                pending.push((lib_guest, lib_host));
            }
        }
        Ok(())
    }

    /// Where the guest tree has shared library `soname`, as (guest path,
    /// host file): the first of Debian's library directories that holds
    /// it, then `extra` (a directory relative to the tree's root).
    fn tree_library(&self, soname: &str, extra: Option<&str>) -> Option<(String, PathBuf)> {
        GUEST_TREE_LIB_DIRS
            .iter()
            .copied()
            .chain(extra)
            .map(|dir| {
                let guest = format!("/{dir}/{soname}");
                let host = resolve_in_tree(&self.guest_tree, &guest);
                (guest, host)
            })
            .find(|(_, host)| host.is_file())
    }

    /// Adds host-built ELF file `host` at `guest` with what it needs: from
    /// the library directories first (packed the same way), else from the
    /// guest tree.
    fn add_guest_linked(&mut self, host: &Path, guest: &str) -> Result<(), VmError> {
        let mut pending = vec![(host.to_owned(), guest.to_owned())];
        let mut seen = BTreeSet::new();
        while let Some((host, guest)) = pending.pop() {
            if !seen.insert(guest.clone()) {
                continue;
            }
            let data = std::fs::read(&host).map_err(io_err(&host))?;
            let dynamic = elf::dynamic(&data).map_err(|e| VmError::GuestTree {
                path: host.display().to_string(),
                reason: e.to_string(),
            })?;
            self.add(
                &guest,
                Entry::File {
                    data: Source::Linked(host.clone()),
                    mode: 0o755,
                },
            );
            if let Some(interp) = dynamic.interp {
                self.guest_programs.push(interp);
            }
            for soname in dynamic.needed {
                match self
                    .library_path
                    .iter()
                    .map(|dir| dir.join(&soname))
                    .find(|lib| lib.is_file())
                {
                    Some(lib) => pending.push((lib, format!("{GUEST_LIB_DIR}/{soname}"))),
                    None => {
                        let (lib, _) =
                            self.tree_library(&soname, None)
                                .ok_or_else(|| VmError::GuestTree {
                                    path: host.display().to_string(),
                                    reason: format!("needs {soname}, which the guest tree lacks"),
                                })?;
                        self.guest_programs.push(lib);
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds guest-tree file `host` at `guest`, refusing to replace a
    /// different file there (a host binary's loader or library).
    fn add_guest_entry(&mut self, guest: &str, host: &Path) -> Result<(), VmError> {
        match self.entries.get(guest) {
            None => {}
            Some(Entry::File {
                data: Source::Guest(existing),
                ..
            }) if existing == host => return Ok(()),
            Some(other) => {
                return Err(VmError::GuestTree {
                    path: guest.into(),
                    reason: format!(
                        "the initramfs already holds {other:?} there (host binaries and guest-tree programs need one loader and libc)"
                    ),
                })
            }
        }
        self.add(
            guest,
            Entry::File {
                data: Source::Guest(host.into()),
                mode: 0o755,
            },
        );
        Ok(())
    }

    /// The modules to load, dependencies first: (name, file).
    fn resolve_modules(&self) -> Result<Vec<(String, PathBuf)>, VmError> {
        let dep_file = self.modules_dir.join("modules.dep");
        let text = std::fs::read_to_string(&dep_file).map_err(io_err(&dep_file))?;
        let mut table: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
        for line in text.lines() {
            let Some((module, deps)) = line.split_once(':') else {
                continue;
            };
            table.insert(
                module_name(module),
                (
                    module.into(),
                    deps.split_whitespace().map(module_name).collect(),
                ),
            );
        }
        let mut order = Vec::new();
        let mut seen = BTreeSet::new();
        let wanted: Vec<String> = BASE_MODULES
            .iter()
            .map(|m| m.to_string())
            .chain(self.modules.iter().cloned())
            .map(|m| m.replace('-', "_"))
            .collect();
        for name in wanted {
            visit(&name, &table, &mut seen, &mut order)?;
        }
        Ok(order
            .into_iter()
            .map(|name| {
                let file = self.modules_dir.join(&table[&name].0);
                (name, file)
            })
            .collect())
    }
}

fn visit(
    name: &str,
    table: &BTreeMap<String, (String, Vec<String>)>,
    seen: &mut BTreeSet<String>,
    order: &mut Vec<String>,
) -> Result<(), VmError> {
    if !seen.insert(name.into()) {
        return Ok(());
    }
    let (_, deps) = table
        .get(name)
        .ok_or_else(|| VmError::UnknownModule(name.into()))?;
    for dep in deps {
        visit(dep, table, seen, order)?;
    }
    order.push(name.into());
    Ok(())
}

/// The file that guest path `path` names in the guest tree `tree`,
/// following symbolic links inside the tree (an absolute link target is
/// taken from the tree's root, as the guest would see it; `..` stops at
/// the root). A missing file resolves to where it would be.
fn resolve_in_tree(tree: &Path, path: &str) -> PathBuf {
    let mut done: Vec<String> = Vec::new();
    let mut todo: Vec<String> = path
        .split('/')
        .rev()
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect();
    let mut hops = 0;
    while let Some(part) = todo.pop() {
        match part.as_str() {
            "." => continue,
            ".." => {
                done.pop();
                continue;
            }
            _ => {}
        }
        done.push(part);
        let here = tree.join(done.join("/"));
        let Ok(target) = std::fs::read_link(&here) else {
            continue;
        };
        hops += 1;
        if hops > 40 {
            break;
        }
        done.pop();
        let target = target.to_string_lossy().into_owned();
        if target.starts_with('/') {
            done.clear();
        }
        todo.extend(
            target
                .split('/')
                .rev()
                .filter(|c| !c.is_empty())
                .map(str::to_owned),
        );
    }
    tree.join(done.join("/"))
}

/// `kernel/drivers/uio/uio_pci_generic.ko.xz` -> `uio_pci_generic`.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// The shared libraries `binary` needs, as (guest path, host file): the
/// loader at its own path, every other library in [`GUEST_LIB_DIR`] under
/// the name the binary asks for. A static binary needs none.
fn shared_libraries(binary: &Path, search: &[PathBuf]) -> Result<Vec<(String, PathBuf)>, VmError> {
    let mut ldd = Command::new("ldd");
    ldd.arg(binary);
    if !search.is_empty() {
        let joined = std::env::join_paths(search).map_err(|e| VmError::Ldd {
            binary: binary.into(),
            output: e.to_string(),
        })?;
        ldd.env("LD_LIBRARY_PATH", joined);
    }
    let out = ldd.output().map_err(|source| VmError::Spawn {
        what: "ldd".into(),
        source,
    })?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        if text.contains("not a dynamic executable") || err.contains("not a dynamic executable") {
            return Ok(Vec::new());
        }
        return Err(VmError::Ldd {
            binary: binary.into(),
            output: format!("{text}{err}"),
        });
    }
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.contains("not found") {
            return Err(VmError::Ldd {
                binary: binary.into(),
                output: text.clone(),
            });
        }
        let before_addr = line.split(" (0x").next().unwrap_or(line);
        match before_addr.split_once(" => ") {
            Some((name, path)) if path.starts_with('/') => {
                libs.push((format!("{GUEST_LIB_DIR}/{name}"), PathBuf::from(path)));
            }
            Some(_) => {}
            // The loader is listed by its absolute path; the vDSO by name.
            None if before_addr.starts_with('/') => {
                libs.push((before_addr.to_owned(), PathBuf::from(before_addr)));
            }
            None => {}
        }
    }
    Ok(libs)
}

/// The guest's `/init`.
fn init_script(modules: &[&str], address: &str, gateway: Option<&str>) -> String {
    let modules = modules.join(" ");
    let route = gateway
        .map(|g| format!(" && ip route add default via {g}"))
        .unwrap_or_default();
    format!(
        r#"#!/bin/sh
# Generated by vrdma-tests (tests/src/vm.rs).
export PATH=/bin:/usr/bin:/usr/sbin
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in {modules}; do
    insmod {GUEST_MODULE_DIR}/$m.ko || echo "VRDMA-INIT insmod $m failed"
done
ip link set lo up
if [ -e /sys/class/net/eth0 ]; then
    ip link set eth0 up && ip addr add {address} dev eth0{route} \
        || echo "VRDMA-INIT eth0 setup failed"
fi
export LD_LIBRARY_PATH={GUEST_LIB_DIR}
pass() {{ echo "{VERDICT} $1 PASS"; }}
fail() {{ n=$1; shift; echo "{VERDICT} $n FAIL $*"; }}
echo "VRDMA-INIT ready"
( . /vrdma/test.sh )
echo "VRDMA-INIT script exited with $?"
poweroff -f
"#
    )
}

/// A newc ("070701") cpio writer, as the kernel's initramfs unpacker reads.
struct CpioWriter<W: Write> {
    out: W,
    ino: u32,
}

impl<W: Write> CpioWriter<W> {
    fn new(out: W) -> Self {
        CpioWriter { out, ino: 1 }
    }

    fn entry(&mut self, path: &str, entry: &Entry) -> std::io::Result<()> {
        let name = path.trim_start_matches('/');
        let (mode, data, rdev) = match entry {
            Entry::Dir => (0o040_755, Vec::new(), (0, 0)),
            Entry::Symlink(target) => (0o120_777, target.clone().into_bytes(), (0, 0)),
            Entry::CharDev { major, minor } => (0o020_600, Vec::new(), (*major, *minor)),
            Entry::File { data, mode } => (0o100_000 | mode, read_source(data)?, (0, 0)),
        };
        self.raw(name, mode, rdev, &data)
    }

    fn raw(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> std::io::Result<()> {
        let size = u32::try_from(data.len())
            .map_err(|_| std::io::Error::other(format!("{name} is larger than 4 GiB")))?;
        let namesize = name.len() + 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0,
            0,
            nlink,
            0,
            size,
            0,
            0,
            rdev.0,
            rdev.1,
            namesize as u32,
            0,
        ];
        self.ino += 1;
        let mut header = String::from("070701");
        for f in fields {
            header.push_str(&format!("{f:08x}"));
        }
        self.out.write_all(header.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.pad(110 + namesize)?;
        self.out.write_all(data)?;
        self.pad(data.len())
    }

    fn pad(&mut self, len: usize) -> std::io::Result<()> {
        let pad = (4 - len % 4) % 4;
        self.out.write_all(&[0u8; 3][..pad])
    }

    fn finish(mut self) -> std::io::Result<()> {
        self.raw("TRAILER!!!", 0, (0, 0), &[])?;
        self.out.flush()
    }
}

fn read_source(source: &Source) -> std::io::Result<Vec<u8>> {
    match source {
        Source::Bytes(bytes) => Ok(bytes.clone()),
        Source::Host(path) | Source::Guest(path) | Source::Linked(path) => std::fs::read(path)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
        Source::Xz(path) => {
            let out = Command::new("xz").arg("-dc").arg(path).output()?;
            if !out.status.success() {
                return Err(std::io::Error::other(format!(
                    "xz -dc {}: {}",
                    path.display(),
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            Ok(out.stdout)
        }
        Source::Stripped(path) => {
            // Unique per call: tests build initramfs images in parallel.
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let copy = std::env::temp_dir().join(format!(
                "vrdma-strip-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let out = Command::new("strip")
                .arg("--strip-debug")
                .arg("-o")
                .arg(&copy)
                .arg(path)
                .output()?;
            let data = if out.status.success() {
                std::fs::read(&copy)
            } else {
                Err(std::io::Error::other(format!(
                    "strip --strip-debug {}: {}",
                    path.display(),
                    String::from_utf8_lossy(&out.stderr)
                )))
            };
            let _ = std::fs::remove_file(&copy);
            data
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths_resolve_through_links_inside_the_tree() {
        let tree = crate::daemon::TempDir::new("guest-tree");
        let root = tree.path();
        let lib = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).expect("mkdir");
        std::fs::create_dir_all(root.join("usr/lib64")).expect("mkdir");
        std::fs::write(lib.join("libfoo.so.1.2"), b"foo").expect("write");
        std::fs::write(lib.join("ld.so"), b"ld").expect("write");
        let link = |target: &str, at: &str| {
            std::os::unix::fs::symlink(target, root.join(at)).expect("symlink")
        };
        link("usr/lib", "lib");
        link("usr/lib64", "lib64");
        link("libfoo.so.1.2", "usr/lib/x86_64-linux-gnu/libfoo.so.1");
        link("../lib/x86_64-linux-gnu/ld.so", "usr/lib64/ld-linux.so");
        // Absolute targets mean the guest's root, never the host's.
        link("/usr/lib/x86_64-linux-gnu/libfoo.so.1", "usr/lib/abs.so");
        let foo = lib.join("libfoo.so.1.2");
        assert_eq!(
            resolve_in_tree(root, "/lib/x86_64-linux-gnu/libfoo.so.1"),
            foo
        );
        assert_eq!(resolve_in_tree(root, "/usr/lib/abs.so"), foo);
        assert_eq!(
            resolve_in_tree(root, "/lib64/ld-linux.so"),
            lib.join("ld.so")
        );
        assert_eq!(
            resolve_in_tree(root, "/../../lib/x86_64-linux-gnu/ld.so"),
            lib.join("ld.so")
        );
        assert_eq!(
            resolve_in_tree(root, "/usr/missing"),
            root.join("usr/missing")
        );
    }
}
