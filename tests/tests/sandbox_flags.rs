//! vdev and hostd take the same sandbox settings — flags and `[sandbox]`
//! keys — with the same meaning and the same checks: both parse them with
//! `vrdma_isolation::config`, and here the validated results are compared
//! for the same input. Only the default open-file limit differs (each
//! daemon's needs).

use clap::Parser;
use vrdma_hostd::config::{Args as HostdArgs, Config as HostdConfig, DEFAULT_RLIMIT_NOFILE};
use vrdma_isolation::config::SandboxConfig;
use vrdma_isolation::daemon::testing::{arg, ScratchDir, EVERY_SANDBOX_FLAG};
use vrdma_vdev::config::{Args as VdevArgs, Config as VdevConfig, DEFAULT_NOFILE};

/// Every sandbox flag, alone and together.
const ACCEPTED: &[&[&str]] = &[
    &[],
    &["--seccomp", "kill"],
    &["--seccomp", "trap"],
    &["--seccomp", "log", "--landlock", "off"],
    &["--seccomp", "off", "--landlock", "on", "--sandbox", "none"],
    &["--allow-no-landlock"],
    &["--sandbox", "namespace"],
    &["--uid", "nobody"],
    &["--uid", "nobody", "--gid", "nogroup"],
    &["--uid", "4000", "--gid", "4001"],
    &["--rlimit-nofile", "4096"],
    &["--uid", "0", "--gid", "0", "--rlimit-nofile", "64"],
    EVERY_SANDBOX_FLAG,
];

/// Refused by both, by clap (a bad value) or by the check after it.
const REFUSED: &[&[&str]] = &[
    &["--seccomp", "allow"],
    &["--landlock", "maybe"],
    &["--sandbox", "chroot"],
    &["--rlimit-nofile", "3"],
    &["--rlimit-nofile", "99999999"],
    &["--uid", "no-such-user-here"],
    &["--gid", "no-such-group-here"],
];

/// `[sandbox]` tables, with the same keys as the flags.
const ACCEPTED_TABLES: &[&str] = &[
    "",
    "[sandbox]\nseccomp = \"trap\"\n",
    "[sandbox]\nmode = \"namespace\"\nlandlock = false\nallow_no_landlock = true\n",
    "[sandbox]\nuid = \"nobody\"\ngid = 65534\nrlimit_nofile = 2048\n",
];

/// Refused by both: a bad value, or a key that is not one.
const REFUSED_TABLES: &[&str] = &[
    "[sandbox]\nseccomp = \"nope\"\n",
    "[sandbox]\nmode = \"chroot\"\n",
    "[sandbox]\nrlimit_nofile = 3\n",
    "[sandbox]\nlandlok = true\n",
];

/// vdev's validated config for `flags`, `None` if it refuses them.
fn vdev(socket: &str, flags: &[&str]) -> Option<VdevConfig> {
    let line = [&["vdev", "--socket", socket][..], flags].concat();
    VdevConfig::try_from(VdevArgs::try_parse_from(line).ok()?).ok()
}

/// hostd's validated config for `flags`, `None` if it refuses them.
fn hostd(socket: &str, flags: &[&str]) -> Option<HostdConfig> {
    let line = [&["hostd", "--socket", socket][..], flags].concat();
    HostdConfig::try_from(HostdArgs::try_parse_from(line).ok()?).ok()
}

#[test]
fn both_daemons_read_the_sandbox_flags_alike() {
    for flags in ACCEPTED {
        let mut v = vdev("/tmp/v.sock", flags).expect("vdev accepts").sandbox;
        let mut h = hostd("/tmp/h.sock", flags).expect("hostd accepts").sandbox;
        if !flags.contains(&"--rlimit-nofile") {
            assert_eq!(v.rlimit_nofile, DEFAULT_NOFILE);
            assert_eq!(h.rlimit_nofile, DEFAULT_RLIMIT_NOFILE);
            (v.rlimit_nofile, h.rlimit_nofile) = (0, 0);
        }
        assert_eq!(v, h, "{flags:?}");
    }
    for flags in REFUSED {
        assert!(vdev("/tmp/v.sock", flags).is_none(), "vdev: {flags:?}");
        assert!(hostd("/tmp/h.sock", flags).is_none(), "hostd: {flags:?}");
    }
}

/// Both daemons' sandbox settings for a config file holding `table` (after
/// the daemon's socket) and the flags `extra`, `None` where one refuses.
fn both_with_table(
    scratch: &ScratchDir,
    table: &str,
    extra: &[&str],
) -> (Option<SandboxConfig>, Option<SandboxConfig>) {
    let v = scratch.write("vdev.toml", format!("socket = \"/tmp/v.sock\"\n{table}"));
    let h = scratch.write("hostd.toml", format!("socket = \"/tmp/h.sock\"\n{table}"));
    let flags = |file| [&["--config", arg(file)][..], extra].concat();
    (
        vdev("/tmp/v.sock", &flags(&v)).map(|config| config.sandbox),
        hostd("/tmp/h.sock", &flags(&h)).map(|config| config.sandbox),
    )
}

#[test]
fn both_daemons_read_the_sandbox_table_alike() {
    let scratch = ScratchDir::new("sandbox-flags");
    for table in ACCEPTED_TABLES {
        for extra in [&[][..], &["--seccomp", "log"]] {
            let (vs, hs) = both_with_table(&scratch, table, extra);
            let mut vs = vs.expect("vdev accepts");
            let mut hs = hs.expect("hostd accepts");
            if !table.contains("rlimit_nofile") {
                (vs.rlimit_nofile, hs.rlimit_nofile) = (0, 0);
            }
            assert_eq!(vs, hs, "{table:?} {extra:?}");
            // The flag wins over the table.
            if !extra.is_empty() {
                assert_eq!(vs.seccomp.to_string(), "log");
            }
        }
    }
    for bad in REFUSED_TABLES {
        assert_eq!(both_with_table(&scratch, bad, &[]), (None, None), "{bad:?}");
    }
}
