//! The Debian packages (cargo-deb, `[package.metadata.deb]` of
//! vrdma-hostd and vrdma-libibverbs): built from the `deb` profile's
//! binaries, free of lintian errors, and installed with dpkg on a Debian
//! system — the VM tests' trixie root, under a throw-away overlay — where
//! the postinst creates the daemons' user, hostd and vdev start from the
//! installed configuration with the units' command lines and drop to that
//! user, and Debian's unmodified `ibv_devinfo` run through `vrdma-run`
//! sees the device while the system's own libraries stay rdma-core's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};

use vrdma_tests::daemon::TempDir;
use vrdma_tests::need;
use vrdma_tests::vm::image_for_test;
use vrdma_tests::wrapped::{dropped_everything, spawn_logged, wait_for_path};

const WORKSPACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
/// What `scripts/test` builds before the tests (`cargo build --profile deb`).
const BUILT: [&str; 4] = ["hostd", "vdev", "vrdmactl", "libibverbs.so"];

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A scratch directory with what is mounted in it unmounted (on drop)
/// before the directory goes.
struct Scratch {
    dir: TempDir,
    mounts: Vec<PathBuf>,
}

impl Scratch {
    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn mount(&mut self, args: &[&str], at: &Path) {
        run(Command::new("mount").args(args).arg(at));
        self.mounts.push(at.to_owned());
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for at in self.mounts.iter().rev() {
            let _ = Command::new("umount").arg("-l").arg(at).status();
        }
    }
}

/// Builds both packages into `out`; returns their paths (host, guest).
fn build_packages(out: &Path) -> (PathBuf, PathBuf) {
    let cargo_deb = need::which("cargo-deb")
        .unwrap_or_else(|| panic!("cargo-deb is not installed: cargo install --locked cargo-deb (`scripts/test` installs it)"));
    let deb_dir = Path::new(WORKSPACE).join("target/deb");
    for name in BUILT {
        assert!(
            deb_dir.join(name).exists(),
            "target/deb/{name} is missing: cargo build --profile deb -p vrdma-hostd -p vrdma-vdev -p vrdma-libibverbs (`scripts/test` builds it)"
        );
    }
    // The manual pages the host package ships, from the programs built.
    let man = Path::new(WORKSPACE).join("target/man");
    std::fs::create_dir_all(&man).expect("target/man");
    for program in ["hostd", "vdev", "vrdmactl"] {
        let o = run(Command::new(deb_dir.join(program)).arg("--print-manpage"));
        assert!(
            o.stdout.starts_with(b".ie"),
            "{program}'s manual page: {}",
            text(&o)
        );
        std::fs::write(man.join(format!("{program}.1")), &o.stdout).expect("write a manual page");
    }
    let mut built = Vec::new();
    for package in ["vrdma-hostd", "vrdma-libibverbs"] {
        let o = run(Command::new(&cargo_deb)
            .current_dir(WORKSPACE)
            .args(["deb", "--no-build", "--profile", "deb", "-p", package, "-o"])
            .arg(out));
        let path = String::from_utf8_lossy(&o.stdout)
            .lines()
            .rev()
            .find(|l| l.ends_with(".deb"))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("no .deb named: {}", text(&o)));
        built.push(path);
    }
    (built[0].clone(), built[1].clone())
}

fn in_root(root: &Path, script: &str) -> Output {
    Command::new("chroot")
        .arg(root)
        .args(["/bin/sh", "-c", script])
        .output()
        .expect("chroot")
}

/// A daemon started in `root` (chroot execs it: the child is the daemon).
fn daemon(root: &Path, argv: &str, log: &Path) -> Child {
    let mut cmd = Command::new("chroot");
    cmd.arg(root).args(argv.split_whitespace());
    spawn_logged(cmd, log)
}

/// The unit's ExecStart= with its instance name filled in.
fn exec_start(unit: &str, instance: &str) -> String {
    let path = Path::new(WORKSPACE).join("packaging/systemd").join(unit);
    let text = std::fs::read_to_string(&path).expect("unit");
    text.lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart")
        .replace("%i", instance)
}

#[test]
fn the_packages_are_lintian_clean_install_on_debian_and_run_there() {
    let image = image_for_test("the packages test");
    let lintian = need::program("lintian", "lintian");
    let mut scratch = Scratch {
        dir: TempDir::new("packages"),
        mounts: Vec::new(),
    };
    let (host, guest) = build_packages(scratch.path());

    // No lintian error (the warning left: the changelog closes no bug),
    // and a manual page for every program.
    let lint = Command::new(lintian)
        .args(["--fail-on", "error"])
        .arg(&host)
        .arg(&guest)
        .output()
        .expect("run lintian");
    assert!(lint.status.success(), "lintian:\n{}", text(&lint));
    assert!(!text(&lint).contains("\nE: "), "{}", text(&lint));
    for tag in ["no-manual-page", "binary-without-manpage"] {
        assert!(!text(&lint).contains(tag), "{}", text(&lint));
    }

    // The guest package keeps rdma-core's files: nothing in the system's
    // library directories, a private one and an opt-in wrapper.
    let contents = text(&run(Command::new("dpkg-deb").arg("-c").arg(&guest)));
    for wanted in [
        "./usr/lib/vrdma/libibverbs.so.1",
        "./usr/lib/vrdma/librdmacm.so.1 -> libibverbs.so.1",
        "./usr/bin/vrdma-run",
    ] {
        assert!(contents.contains(wanted), "{wanted}:\n{contents}");
    }
    assert!(
        !contents.contains("./usr/lib/x86_64-linux-gnu/"),
        "{contents}"
    );

    // A Debian system of its own: the VM tests' root under an overlay.
    let (upper, work, root) = (
        scratch.path().join("upper"),
        scratch.path().join("work"),
        scratch.path().join("root"),
    );
    for d in [&upper, &work, &root] {
        std::fs::create_dir_all(d).expect("overlay directory");
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        image.root().display(),
        upper.display(),
        work.display()
    );
    scratch.mount(&["-t", "overlay", "overlay", "-o", &options], &root);
    scratch.mount(&["-t", "proc", "proc"], &root.join("proc"));
    for deb in [&host, &guest] {
        let name = deb.file_name().expect("file name");
        std::fs::copy(deb, root.join("tmp").join(name)).expect("copy the package in");
    }
    let install = in_root(
        &root,
        "dpkg -i /tmp/vrdma-host_*.deb /tmp/vrdma-guest_*.deb && getent passwd vrdma \
         && dpkg-query -W -f='${Conffiles}\n' vrdma-host && hostd --version",
    );
    let said = text(&install);
    assert!(install.status.success(), "install:\n{said}");
    let user = said
        .lines()
        .find(|l| l.starts_with("vrdma:"))
        .unwrap_or_else(|| panic!("no vrdma user:\n{said}"));
    let uid: u32 = user
        .split(':')
        .nth(2)
        .and_then(|u| u.parse().ok())
        .expect("uid");
    assert!(uid < 1000, "a system user: {user}");
    assert!(user.ends_with(":/usr/sbin/nologin"), "{user}");
    for conffile in ["/etc/vrdma/hostd.toml", "/etc/vrdma/policy/tenants.toml"] {
        assert!(said.contains(conffile), "{conffile} is a conffile:\n{said}");
    }

    // The daemons as their units start them, from the installed files.
    std::fs::create_dir_all(root.join("run/vrdma")).expect("/run/vrdma");
    std::fs::create_dir_all(root.join("etc/vrdma/vdev")).expect("/etc/vrdma/vdev");
    std::fs::copy(
        root.join("usr/share/doc/vrdma-host/examples/vdev-device.toml"),
        root.join("etc/vrdma/vdev/blue.toml"),
    )
    .expect("the example device file");
    let hostd_log = scratch.path().join("hostd.log");
    let mut hostd = daemon(&root, &exec_start("vrdma-hostd.service", ""), &hostd_log);
    let hostd_sock = root.join("run/vrdma/hostd.sock");
    wait_for_path(&hostd_sock, "hostd", &mut hostd, &hostd_log);
    let vdev_log = scratch.path().join("vdev.log");
    let mut vdev = daemon(&root, &exec_start("vrdma-vdev@.service", "blue"), &vdev_log);
    wait_for_path(
        &root.join("run/vrdma/blue.sock"),
        "vdev",
        &mut vdev,
        &vdev_log,
    );

    // Debian's ibv_devinfo (bookworm's, copied in), unmodified, through
    // vrdma-run: the device, its port up. Without vrdma-run the same
    // program finds rdma-core's library, or none.
    std::fs::copy(
        need::program("ibv_devinfo", "ibverbs-utils"),
        root.join("usr/local/bin/ibv_devinfo"),
    )
    .expect("copy ibv_devinfo");
    let info = in_root(
        &root,
        "VRDMA_DEVICES=/run/vrdma/blue.sock vrdma-run ibv_devinfo",
    );
    let logs = || {
        format!(
            "--- hostd:\n{}\n--- vdev:\n{}",
            std::fs::read_to_string(&hostd_log).unwrap_or_default(),
            std::fs::read_to_string(&vdev_log).unwrap_or_default()
        )
    };
    assert!(info.status.success(), "{}\n{}", text(&info), logs());
    let shown = text(&info);
    assert!(shown.contains("hca_id:\tvrdma0"), "{shown}");
    assert!(shown.contains("PORT_ACTIVE"), "{shown}");
    let plain = in_root(&root, "VRDMA_DEVICES=/run/vrdma/blue.sock ibv_devinfo");
    assert!(!text(&plain).contains("vrdma0"), "{}", text(&plain));

    // Both dropped to the package's user, nothing left of root.
    for (log, name) in [(&hostd_log, "hostd"), (&vdev_log, "vdev")] {
        let dropped = dropped_everything(log, name);
        assert!(
            dropped.contains(&format!("uid={uid} ")),
            "{name}: {dropped}"
        );
    }
    assert!(
        std::fs::read_to_string(&hostd_log)
            .unwrap_or_default()
            .contains("vdev connected tenant=\"blue\""),
        "{}",
        logs()
    );
    for child in [&mut vdev, &mut hostd] {
        assert!(
            matches!(child.try_wait(), Ok(None)),
            "still running\n{}",
            logs()
        );
        let _ = child.kill();
        let _ = child.wait();
    }
}
