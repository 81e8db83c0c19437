//! The policy file: what parses, what is refused, and where errors point.

use super::*;

const FILE: &str = "/etc/vrdma/policy.toml";

/// Two valid tenants (lines 1-8) the error cases are appended to.
const BASE: &str = r#"[[tenant]]
name = "blue"
network = "net-1"

[[tenant]]
name = "green"
network = "net-2"

"#;

fn parse(text: &str) -> Result<Policy, PolicyError> {
    Policy::parse(text, Path::new(FILE))
}

/// Asserts `text` is refused at `line` for `key`, naming the file, the
/// line and the key, with a message containing `fragment`.
#[track_caller]
fn refused(text: &str, key: &str, line: usize, fragment: &str) {
    let err = parse(text).expect_err("must be refused");
    let shown = err.to_string();
    let prefix = format!("{FILE}:{line}: key `{key}`: ");
    assert!(
        shown.starts_with(&prefix),
        "{shown:?} should start with {prefix:?}"
    );
    assert!(
        shown.contains(fragment),
        "{shown:?} should contain {fragment:?}"
    );
    match err {
        PolicyError::Invalid {
            path,
            line: l,
            key: k,
            message,
        } => {
            assert_eq!(path, Path::new(FILE));
            assert_eq!(l, line);
            assert_eq!(k, key);
            assert!(message.starts_with(&format!("key `{key}`: ")));
        }
        PolicyError::Read { .. } => panic!("not a read error"),
    }
}

/// `BASE` with a third tenant (`[[tenant]]` at line 9) of these lines.
fn third(lines: &str) -> String {
    format!("{BASE}[[tenant]]\nname = \"red\"\n{lines}")
}

const FULL: &str = r#"
[[tenant]]
name = "blue"
network = "net-1"
reachable = ["net-2"]
uid = 1001
physical_queues = 4
max_devices = 2
priority = { class = "realtime", weight = 10 }
quotas = { max_qp = 64, max_total_mr_bytes = 1073741824, max_mr_bytes = 1048576, max_srq = 0 }
rate.send = { ops_per_sec = 100000, ops_burst = 1000 }
rate.read = { bytes_per_sec = 1000000000, bytes_burst = 1048576 }

[[tenant]]
name = "green"
network = "net-2"
priority.class = "priority"
priority.weight = 1000

[tenant.quotas]
max_cq = 8
max_srq = 16

[tenant.rate.send]
bytes_per_sec = 500

[[tenant]]
name = "gray"
"#;

/// Tenant `name` in `network` with every other key at its default.
fn tenant_with_defaults(name: &str, network: Option<&str>) -> TenantPolicy {
    TenantPolicy {
        name: name.into(),
        network: network.map(Into::into),
        reachable: vec![],
        uid: None,
        physical_queues: 2,
        max_devices: 4,
        priority: Priority::default(),
        quotas: Limits::default(),
        rate: Rates::default(),
    }
}

fn full_expected() -> Policy {
    Policy {
        tenants: vec![
            TenantPolicy {
                name: "blue".into(),
                network: Some("net-1".into()),
                reachable: vec!["net-2".into()],
                uid: Some(1001),
                physical_queues: 4,
                max_devices: 2,
                priority: Priority {
                    class: PriorityClass::Realtime,
                    weight: 10,
                },
                quotas: Limits {
                    max_qp: 64,
                    max_total_mr_bytes: 1 << 30,
                    max_mr_bytes: 1 << 20,
                    max_srq: 0,
                    ..Limits::default()
                },
                rate: Rates {
                    send: RateLimit {
                        ops_per_sec: Some(100_000),
                        ops_burst: Some(1000),
                        ..RateLimit::default()
                    },
                    read: RateLimit {
                        bytes_per_sec: Some(1_000_000_000),
                        bytes_burst: Some(1 << 20),
                        ..RateLimit::default()
                    },
                },
            },
            TenantPolicy {
                priority: Priority {
                    class: PriorityClass::Priority,
                    weight: 1000,
                },
                quotas: Limits {
                    max_cq: 8,
                    max_srq: 16,
                    ..Limits::default()
                },
                rate: Rates {
                    send: RateLimit {
                        bytes_per_sec: Some(500),
                        ..RateLimit::default()
                    },
                    read: RateLimit::default(),
                },
                ..tenant_with_defaults("green", Some("net-2"))
            },
            tenant_with_defaults("gray", None),
        ],
    }
}

#[test]
fn full_example_parses_into_the_expected_policy() {
    let policy = parse(FULL).expect("valid");
    assert_eq!(policy, full_expected());
    // And back: serialized and parsed again, it is the same policy.
    let text = toml::to_string(&policy).expect("serializes");
    assert_eq!(parse(&text).expect("re-parses"), policy);

    let gray = policy.tenant("gray").expect("gray");
    assert_eq!(gray.network(), "gray");
    assert!(gray.may_reach("gray") && !gray.may_reach("net-1"));
    let blue = policy.tenant("blue").expect("blue");
    assert!(blue.may_reach("net-1") && blue.may_reach("net-2") && !blue.may_reach("gray"));
    assert!(policy.tenant("nobody").is_none());
}

#[test]
fn effective_rates_fill_in_bursts() {
    let policy = parse(FULL).expect("valid");
    let blue = &policy.tenants[0].rate;
    assert_eq!(
        blue.send.effective(),
        EffectiveRate {
            ops: Some((100_000, 1000)),
            bytes: None
        }
    );
    assert_eq!(
        blue.read.effective(),
        EffectiveRate {
            ops: None,
            bytes: Some((1_000_000_000, 1 << 20))
        }
    );
    // Bytes burst: a tenth of a second, at least 64 KiB.
    assert_eq!(
        policy.tenants[1].rate.send.effective().bytes,
        Some((500, MIN_DEFAULT_BYTES_BURST))
    );
    let r = RateLimit {
        ops_per_sec: Some(5),
        bytes_per_sec: Some(10_000_000),
        ..RateLimit::default()
    };
    // Ops burst: a tenth of a second, at least 1.
    assert_eq!(
        r.effective(),
        EffectiveRate {
            ops: Some((5, 1)),
            bytes: Some((10_000_000, 1_000_000))
        }
    );
    let r = RateLimit {
        ops_per_sec: Some(1_000_000),
        ..RateLimit::default()
    };
    assert_eq!(r.effective().ops, Some((1_000_000, 100_000)));
    assert_eq!(RateLimit::default().effective(), EffectiveRate::default());
}

#[test]
fn default_policy_parses() {
    let policy = Policy::default_policy();
    assert_eq!(policy.tenants.len(), 2);
    for (tenant, name) in policy.tenants.iter().zip(["alpha", "beta"]) {
        assert_eq!(*tenant, tenant_with_defaults(name, Some("demo")));
    }
    let alpha = policy.tenant("alpha").expect("alpha");
    assert!(alpha.may_reach(policy.tenant("beta").expect("beta").network()));
}

#[test]
fn documented_example_parses() {
    let text = include_str!("../../../docs/policy.example.toml");
    let policy = Policy::parse(text, Path::new("docs/policy.example.toml"))
        .unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<_> = policy.tenants.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["blue", "green", "gray"]);
}

#[test]
fn empty_policy_is_valid() {
    assert_eq!(parse("# nobody yet\n").expect("valid"), Policy::default());
}

#[test]
fn missing_file_is_a_read_error() {
    let path = Path::new("/nonexistent/vrdma/policy.toml");
    let err = Policy::load(path).expect_err("missing");
    assert!(
        matches!(&err, PolicyError::Read { path: p, source } if p == path && source.kind() == std::io::ErrorKind::NotFound),
        "{err:?}"
    );
    assert!(err.to_string().contains("/nonexistent/vrdma/policy.toml"));
}

#[test]
fn load_reads_and_validates() {
    let dir = std::env::temp_dir().join(format!("vrdma-policy-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let good = dir.join("good.toml");
    std::fs::write(&good, FULL).expect("write");
    assert_eq!(Policy::load(&good).expect("valid"), full_expected());
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, third("weight = 3\n")).expect("write");
    let err = Policy::load(&bad).expect_err("invalid");
    assert!(
        err.to_string().starts_with(&format!(
            "{}:11: key `tenant[2].weight`: unknown field",
            bad.display()
        )),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn syntax_errors() {
    refused(
        &third("quotas = { max_qp = }\n"),
        "tenant[2].quotas.max_qp",
        11,
        "invalid string",
    );
    refused(
        &third("max_qp 5\n"),
        "tenant[2].max_qp",
        11,
        "expected `.`, `=`",
    );
    refused(
        &third("name = \"red2\"\n"),
        "tenant[2].name",
        11,
        "duplicate key `name`",
    );
    refused(
        &format!("{BASE}[[tenant]\n"),
        "tenant",
        9,
        "invalid table header",
    );
    refused(
        &format!("{BASE}[[tenant]]\nname = \"red\n"),
        "tenant[2].name",
        10,
        "invalid basic string",
    );
}

#[test]
fn unknown_keys() {
    refused(
        &third("networks = [\"a\"]\n"),
        "tenant[2].networks",
        11,
        "unknown field `networks`",
    );
    refused(
        &third("quotas = { max_qps = 1 }\n"),
        "tenant[2].quotas.max_qps",
        11,
        "unknown field `max_qps`",
    );
    refused(
        &third("[tenant.rate.write]\nops_per_sec = 5\n"),
        "tenant[2].rate.write",
        11,
        "unknown field `write`",
    );
    refused(
        &third("\n[tenant.rate.send]\nops_per_second = 5\n"),
        "tenant[2].rate.send.ops_per_second",
        13,
        "unknown field `ops_per_second`",
    );
    refused(
        &third("priority = { class = \"normal\", wieght = 2 }\n"),
        "tenant[2].priority.wieght",
        11,
        "unknown field `wieght`",
    );
    refused(
        &format!("tenants = []\n{BASE}"),
        "tenants",
        1,
        "unknown field `tenants`",
    );
    // A date-time (which nothing accepts) in an unknown key.
    refused(
        &third("since = 1979-05-27\n"),
        "tenant[2].since",
        11,
        "unknown field `since`",
    );
}

#[test]
fn wrong_types_and_negative_numbers() {
    refused(
        &third("uid = \"root\"\n"),
        "tenant[2].uid",
        11,
        "invalid type: string",
    );
    refused(
        &third("physical_queues = -1\n"),
        "tenant[2].physical_queues",
        11,
        "-1",
    );
    refused(
        &third("[tenant.quotas]\nmax_cq = 8\nmax_qp = -4\n"),
        "tenant[2].quotas.max_qp",
        13,
        "invalid value: integer `-4`, expected u32",
    );
    refused(
        &third("rate.read.bytes_per_sec = -5\n"),
        "tenant[2].rate.read.bytes_per_sec",
        11,
        "expected u64",
    );
    refused(
        &third("reachable = [\"net-1\", 7]\n"),
        "tenant[2].reachable[1]",
        11,
        "expected a string",
    );
    refused(
        &third("reachable = \"net-1\"\n"),
        "tenant[2].reachable",
        11,
        "expected a sequence",
    );
    refused(
        &third("priority = { class = \"urgent\" }\n"),
        "tenant[2].priority.class",
        11,
        "unknown variant `urgent`",
    );
    refused(
        &third("quotas.max_mr = 1.5\n"),
        "tenant[2].quotas.max_mr",
        11,
        "floating point",
    );
    refused(
        &third("uid = 4294967296\n"),
        "tenant[2].uid",
        11,
        "expected u32",
    );
    refused(
        &format!("{BASE}[[tenant]]\nnetwork = \"net-3\"\n"),
        "tenant[2].name",
        9,
        "missing field `name`",
    );
}

#[test]
fn uid_minus_one_is_refused() {
    refused(
        &third("uid = 4294967295\n"),
        "tenant[2].uid",
        11,
        "4294967295",
    );
    parse(&third("uid = 4294967294\n")).expect("largest uid is valid");
    parse(&third("uid = 0\n")).expect("root is a uid");
}

#[test]
fn absurd_quotas() {
    refused(
        &third("quotas = { max_qp = 0 }\n"),
        "tenant[2].quotas.max_qp",
        11,
        "must be at least 1",
    );
    refused(
        &third("[tenant.quotas]\nmax_sge = 65\n"),
        "tenant[2].quotas.max_sge",
        12,
        "65 exceeds the device maximum 64",
    );
    refused(
        &third("quotas.max_srq = 1048577\n"),
        "tenant[2].quotas.max_srq",
        11,
        "exceeds the device maximum 1048576",
    );
    refused(
        &third("quotas = { max_mr_bytes = 2048, max_total_mr_bytes = 1024 }\n"),
        "tenant[2].quotas.max_mr_bytes",
        11,
        "2048 exceeds `max_total_mr_bytes` = 1024",
    );
    refused(
        &third("[tenant.quotas]\nmax_qp = 1\nmax_total_mr_bytes = 1024\n"),
        "tenant[2].quotas.max_total_mr_bytes",
        13,
        "1024 is below `max_mr_bytes` = 4294967296",
    );
    parse(&third("quotas.max_srq = 0\n")).expect("no SRQs is valid");
}

#[test]
fn absurd_weights_and_queues() {
    refused(
        &third("priority.weight = 0\n"),
        "tenant[2].priority.weight",
        11,
        "0 is outside 1..=1000",
    );
    refused(
        &third("priority = { weight = 1001 }\n"),
        "tenant[2].priority.weight",
        11,
        "1001 is outside 1..=1000",
    );
    refused(
        &third("physical_queues = 0\n"),
        "tenant[2].physical_queues",
        11,
        "outside 1..=64",
    );
    refused(
        &third("physical_queues = 65\n"),
        "tenant[2].physical_queues",
        11,
        "65 is outside 1..=64",
    );
    refused(
        &third("max_devices = 0\n"),
        "tenant[2].max_devices",
        11,
        "0 is outside 1..=64",
    );
    refused(
        &third("max_devices = -3\n"),
        "tenant[2].max_devices",
        11,
        "-3",
    );
    parse(&third(
        "physical_queues = 64\nmax_devices = 64\npriority.weight = 1000\n",
    ))
    .expect("limits are inclusive");
}

#[test]
fn absurd_rates() {
    refused(
        &third("rate.send = { ops_per_sec = 0 }\n"),
        "tenant[2].rate.send.ops_per_sec",
        11,
        "must be at least 1",
    );
    refused(
        &third("[tenant.rate.read]\nbytes_per_sec = 0\n"),
        "tenant[2].rate.read.bytes_per_sec",
        12,
        "must be at least 1",
    );
    refused(
        &third("rate.send.ops_per_sec = 1000000000001\n"),
        "tenant[2].rate.send.ops_per_sec",
        11,
        "1000000000001 is outside 1..=1000000000000",
    );
    refused(
        &third("rate.read = { bytes_per_sec = 10000000000001 }\n"),
        "tenant[2].rate.read.bytes_per_sec",
        11,
        "outside 1..=10000000000000",
    );
    refused(
        &third("rate.send = { ops_per_sec = 10, ops_burst = 0 }\n"),
        "tenant[2].rate.send.ops_burst",
        11,
        "0 is outside 1..",
    );
    refused(
        &third("rate.read = { bytes_per_sec = 10, bytes_burst = 0 }\n"),
        "tenant[2].rate.read.bytes_burst",
        11,
        "0 is outside 1..",
    );
    parse(&third(
        "rate.send = { ops_per_sec = 1000000000000, bytes_per_sec = 10000000000000 }\n",
    ))
    .expect("ceilings are inclusive");
}

#[test]
fn bursts_need_their_rate() {
    refused(
        &third("rate.send = { ops_burst = 10 }\n"),
        "tenant[2].rate.send.ops_burst",
        11,
        "a burst needs its rate: `ops_per_sec` is not set",
    );
    refused(
        &third("[tenant.rate.read]\nops_per_sec = 5\n\nbytes_burst = 65536\n"),
        "tenant[2].rate.read.bytes_burst",
        14,
        "`bytes_per_sec` is not set",
    );
}

#[test]
fn bad_names() {
    refused(
        &format!("{BASE}[[tenant]]\nname = \"red team\"\n"),
        "tenant[2].name",
        10,
        "\"red team\" is not a valid name",
    );
    refused(
        &format!("{BASE}[[tenant]]\nname = \"\"\n"),
        "tenant[2].name",
        10,
        "not a valid name",
    );
    // A tenant name becomes part of paths and labels: `..` would climb.
    for name in ["..", ".", ".hidden", "-rf"] {
        refused(
            &format!("{BASE}[[tenant]]\nname = \"{name}\"\n"),
            "tenant[2].name",
            10,
            "not a valid name",
        );
    }
    let long = "x".repeat(65);
    refused(
        &format!("{BASE}[[tenant]]\nname = \"{long}\"\n"),
        "tenant[2].name",
        10,
        "not a valid name",
    );
    parse(&format!(
        "{BASE}[[tenant]]\nname = \"{}\"\n",
        "x".repeat(64)
    ))
    .expect("64 is fine");
    refused(
        &third("network = \"net/1\"\n"),
        "tenant[2].network",
        11,
        "\"net/1\" is not a valid name",
    );
    refused(
        &third("reachable = [\n  \"net-1\",\n  \"net 2\",\n]\n"),
        "tenant[2].reachable[1]",
        13,
        "\"net 2\" is not a valid name",
    );
}

#[test]
fn duplicate_tenants() {
    refused(
        &format!("{BASE}[[tenant]]\nnetwork = \"net-1\"\nname = \"blue\"\n"),
        "tenant[2].name",
        11,
        "duplicate tenant \"blue\": already defined at line 2 (tenant[0])",
    );
}

#[test]
fn dangling_references() {
    refused(
        &third("reachable = [\"net-2\", \"net-9\"]\n"),
        "tenant[2].reachable[1]",
        11,
        "network \"net-9\" is not the network of any tenant",
    );
    // A tenant without `network` is in the network of its name.
    parse(&third("reachable = [\"red\", \"blue\", \"net-1\"]\n")).expect_err("blue is in net-1");
    parse(&third("reachable = [\"red\", \"net-1\"]\n")).expect("both exist");
    // A reference may point forwards.
    parse("[[tenant]]\nname = \"a\"\nreachable = [\"later\"]\n[[tenant]]\nname = \"b\"\nnetwork = \"later\"\n")
    .expect("forward reference");
}

#[test]
fn a_class_name_is_its_name_in_policy_files() {
    #[derive(serde::Serialize)]
    struct Entry {
        class: PriorityClass,
    }
    for class in PriorityClass::ALL {
        let text = toml::to_string(&Entry { class }).expect("serialize");
        assert_eq!(text.trim(), format!("class = \"{}\"", class.name()));
    }
}
