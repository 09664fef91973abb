//! The command line as an operator uses it: exit codes, output and messages of the binary.

use std::{
    collections::BTreeSet,
    process::{Command, Output},
};

fn agent(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_masq-agent"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run masq-agent")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn config_file(text: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    file
}

#[test]
fn check_config_prints_the_effective_config_with_upstream_keys() {
    let file = config_file("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 90s\n");
    let out = agent(&["check-config", "--config", file.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "nonMasqueradeCIDRs": ["10.0.0.0/8"],
            "cidrLimit": 64,
            "masqLinkLocal": false,
            "masqLinkLocalIPv6": false,
            "resyncInterval": "1m30s",
        })
    );
}

#[test]
fn check_config_output_parses_back_to_the_same_config() {
    let file = config_file(
        "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\nmasqLinkLocal: yes\nresyncInterval: 1h30m\n",
    );
    let first = agent(&["check-config", "--config", file.path().to_str().unwrap()]);
    assert!(first.status.success(), "{}", stderr(&first));
    let again = config_file(&stdout(&first));
    let second = agent(&["check-config", "--config", again.path().to_str().unwrap()]);
    assert!(second.status.success(), "{}", stderr(&second));
    assert_eq!(stdout(&first), stdout(&second));
}

#[test]
fn check_config_missing_file_means_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent");
    let out = agent(&["check-config", "--config", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        format!("no file at {}: the defaults apply\n", path.display())
    );
    let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        json["nonMasqueradeCIDRs"],
        serde_json::json!(["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"])
    );
    let out = agent(&[
        "check-config",
        "--nomasq-all-reserved-ranges",
        "--config",
        path.to_str().unwrap(),
    ]);
    let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["nonMasqueradeCIDRs"].as_array().unwrap().len(), 11);
}

#[test]
fn check_config_rejects_an_invalid_file_on_stderr_with_exit_1() {
    let file = config_file("resyncInterval: 5s\nnonMasqueradeCIDRs:\n  - 10.0.0.1/8\n");
    let out = agent(&["check-config", "--config", file.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).is_empty());
    let err = stderr(&out);
    assert!(
        err.contains(r#"CIDR "10.0.0.1/8" is not aligned to a CIDR block, ip: "10.0.0.1" network: "10.0.0.0/8""#),
        "{err}"
    );
    assert!(
        err.contains(file.path().to_str().unwrap()),
        "names the file: {err}"
    );
    assert!(err.contains("line 3"), "names the line: {err}");
}

#[test]
fn render_iptables_default_is_upstreams_text() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent");
    let out = agent(&["render-iptables", "--config", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The installed iptables (>= 1.6.2 on any supported node) supports --random-fully.
    assert_eq!(
        stdout(&out),
        r#"*nat
:IP-MASQ-AGENT - [0:0]
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 169.254.0.0/16 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 10.0.0.0/8 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 172.16.0.0/12 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 192.168.0.0/16 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j MASQUERADE --random-fully
COMMIT
"#
    );
}

#[test]
fn render_iptables_ipv6_needs_enable_ipv6() {
    let file = config_file("nonMasqueradeCIDRs: [fc00::/7]\nmasqLinkLocalIPv6: true\n");
    let path = file.path().to_str().unwrap();
    let out = agent(&["render-iptables", "--family", "ipv6", "--config", path]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "without --enable-ipv6 the file is invalid"
    );
    let out = agent(&[
        "render-iptables",
        "--family=ipv6",
        "--enable-ipv6",
        "--random-fully=false",
        "--config",
        path,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        r#"*nat
:IP-MASQ-AGENT - [0:0]
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d fc00::/7 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j MASQUERADE
COMMIT
"#
    );
}

#[test]
fn render_iptables_ipv6_without_ipv6_enabled_is_a_usage_error() {
    let file = config_file("nonMasqueradeCIDRs: [10.0.0.0/8]\n");
    let path = file.path().to_str().unwrap();
    let out = agent(&["render-iptables", "--family", "ipv6", "--config", path]);
    assert_eq!(out.status.code(), Some(2), "a valid file, a usage error");
    assert!(stderr(&out).contains("--enable-ipv6"), "{}", stderr(&out));
    assert!(stdout(&out).is_empty());
    let file = config_file("nonMasqueradeCIDRs: [10.0.0.0/8]\nenableIPv6: true\n");
    let path = file.path().to_str().unwrap();
    let out = agent(&["render-iptables", "--family", "ipv6", "--config", path]);
    assert!(
        out.status.success(),
        "the file enables it: {}",
        stderr(&out)
    );
}

#[test]
fn invalid_to_ports_is_a_usage_error_with_a_clear_message() {
    for bad in ["2000-1000", "1024, 2000", "0-100", "1024-70000"] {
        let out = agent(&["check-config", "--to-ports", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        assert!(
            stderr(&out).contains("invalid --to-ports"),
            "{bad}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn usage_errors_exit_2_as_clap_and_go_flags_do() {
    for args in [
        &["--no-such-flag"][..],
        &["check-config", "--no-such-flag"],
        &["--random-fully=nope", "check-config"],
        &["--nat-capacity=0", "check-config"],
        &["-v=high", "check-config"],
        &["--stderrthreshold=LOUD", "check-config"],
        &["explain"],
        &["no-such-subcommand"],
    ] {
        let out = agent(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).starts_with("error: "),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    for args in [
        &["--help"][..],
        &["status", "--help"],
        &["help", "explain"],
        &["--version"],
    ] {
        let out = agent(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
}

/// Every flag upstream's binary takes from klog (`klog.InitFlags`), with a value for those
/// that are not booleans.
const KLOG_FLAGS: [(&str, Option<&str>); 13] = [
    ("v", Some("2")),
    ("vmodule", Some("sync*=4,main=2")),
    ("logtostderr", None),
    ("alsologtostderr", None),
    ("stderrthreshold", Some("WARNING")),
    ("log_dir", Some("/var/log/ip-masq-agent")),
    ("log_file", Some("/var/log/ip-masq-agent.log")),
    ("log_file_max_size", Some("1800")),
    ("skip_headers", None),
    ("skip_log_headers", None),
    ("add_dir_header", None),
    ("one_output", None),
    ("log_backtrace_at", Some("main.go:42")),
];

/// `check-config` with the defaults, and `args` before or after the subcommand's name.
fn check_config_with(args: &[&str], after: bool) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let absent = format!("--config={}", dir.path().join("absent").display());
    let mut all = vec!["check-config", absent.as_str()];
    if after {
        all.extend(args);
    } else {
        all.splice(0..0, args.iter().copied());
    }
    agent(&all)
}

#[test]
fn every_klog_flag_is_taken_in_each_of_gos_forms() {
    for (name, value) in KLOG_FLAGS {
        let forms: Vec<Vec<String>> = match value {
            // Go's booleans take no separate value.
            None => ["-", "--"]
                .iter()
                .flat_map(|dashes| {
                    ["", "=true", "=false", "=1"].map(|v| vec![format!("{dashes}{name}{v}")])
                })
                .collect(),
            Some(value) => ["-", "--"]
                .iter()
                .flat_map(|dashes| {
                    [
                        vec![format!("{dashes}{name}={value}")],
                        vec![format!("{dashes}{name}"), value.to_string()],
                    ]
                })
                .collect(),
        };
        for form in &forms {
            let form: Vec<&str> = form.iter().map(String::as_str).collect();
            for after in [false, true] {
                let out = check_config_with(&form, after);
                assert!(
                    out.status.success(),
                    "{form:?} (after the subcommand: {after}): {}",
                    stderr(&out)
                );
            }
        }
    }
    // As in Go, a boolean's value must follow `=`.
    let out = check_config_with(&["-logtostderr", "false"], false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn ignored_klog_flags_get_one_warning_that_names_them() {
    let warnings = |out: &Output| -> Vec<String> {
        stderr(out)
            .lines()
            .filter(|line| line.contains("WARN"))
            .map(String::from)
            .collect()
    };
    let out = check_config_with(
        &[
            "-logtostderr",
            "-v=2",
            "-log_dir=/tmp",
            "--skip_headers",
            "-vmodule",
            "x=1",
        ],
        false,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let said = warnings(&out);
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].ends_with(
            "klog flags ignored: --log_dir, --skip_headers, --vmodule (masq-agent logs to stderr only, at \
             the verbosity -v or RUST_LOG sets)"
        ),
        "{said:?}"
    );
    // Where the agent logs anyway, and -v, which it maps, are no cause for a warning.
    let out = check_config_with(
        &[
            "-logtostderr",
            "-alsologtostderr",
            "-stderrthreshold=INFO",
            "-v=4",
        ],
        true,
    );
    assert!(warnings(&out).is_empty(), "{}", stderr(&out));
}

#[test]
fn rust_log_decides_over_v() {
    let dir = tempfile::tempdir().unwrap();
    let absent = format!("--config={}", dir.path().join("absent").display());
    let out = Command::new(env!("CARGO_BIN_EXE_masq-agent"))
        .args(["-v=5", "-log_dir=/tmp", "check-config", &absent])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("WARN"), "{}", stderr(&out));
    let help = stdout(&agent(&["--help"]));
    assert!(
        help.contains("RUST_LOG, when set, decides instead"),
        "{help}"
    );
}

#[test]
fn metrics_addr_takes_gos_port_only_form() {
    let out = check_config_with(&["--metrics-addr", ":9830"], false);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = check_config_with(&["--metrics-addr", "9830"], false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// Every `--flag` in a help text.
fn long_flags(help: &str) -> BTreeSet<&str> {
    help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|word| word.starts_with("--") && word.len() > 2)
        .collect()
}

#[test]
fn a_subcommands_help_lists_the_flags_that_affect_it() {
    const LOGGING: [&str; 3] = ["--log-format", "--v", "--help"];
    const CONFIG: [&str; 3] = ["--config", "--nomasq-all-reserved-ranges", "--enable-ipv6"];
    const INSTALLED: [&str; 2] = ["--masq-chain", "--bpffs"];
    let render: Vec<&str> = [
        "--family",
        "--masq-chain",
        "--dataplane",
        "--interface",
        "--random-fully",
        "--to-ports",
    ]
    .into_iter()
    .chain(CONFIG)
    .collect();
    let explain: Vec<&str> = ["--src", "--proto", "--port", "--json"]
        .into_iter()
        .chain(CONFIG)
        .chain(INSTALLED)
        .collect();
    let status: Vec<&str> = ["--json"].into_iter().chain(INSTALLED).collect();
    for (subcommand, own) in [
        ("check-config", CONFIG.to_vec()),
        ("render-iptables", render),
        ("status", status),
        ("explain", explain),
        ("cleanup", INSTALLED.to_vec()),
    ] {
        let help = stdout(&agent(&[subcommand, "--help"]));
        let want: BTreeSet<&str> = own.into_iter().chain(LOGGING).collect();
        assert_eq!(long_flags(&help), want, "{subcommand}:\n{help}");
    }
}

#[test]
fn render_iptables_for_the_ebpf_data_plane_returns_its_protocols_first_and_uses_a_set() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent");
    let full = agent(&["render-iptables", "--config", path.to_str().unwrap()]);
    // The rules name the devices that would carry the programs: loopback is on every machine.
    let reduced = agent(&[
        "render-iptables",
        "--dataplane",
        "ebpf",
        "--interface",
        "lo",
        "--config",
        path.to_str().unwrap(),
    ]);
    assert!(reduced.status.success(), "{}", stderr(&reduced));
    let (full, reduced) = (stdout(&full), stdout(&reduced));
    let returns: Vec<&str> = reduced
        .lines()
        .filter(|l| l.contains("translated by the eBPF data plane"))
        .collect();
    assert_eq!(
        returns,
        [
            r#"-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -o lo -p tcp -j RETURN"#,
            r#"-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -o lo -p udp -j RETURN"#,
            r#"-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -o lo -p icmp -j RETURN"#,
        ]
    );
    // The CIDRs are matched through a set, in one rule; the MASQUERADE rule is upstream's.
    assert!(
        reduced.contains("-m set --match-set IP-MASQ-AGENT-v4 dst -j RETURN"),
        "{reduced}"
    );
    assert_eq!(reduced.lines().rev().nth(1), full.lines().rev().nth(1));
    assert_eq!(
        reduced.lines().nth(2),
        Some(returns[0]),
        "in front of every other rule"
    );
}
