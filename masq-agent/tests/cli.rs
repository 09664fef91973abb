//! The command line as an operator uses it: exit codes, output and messages of the binary.

use std::process::{Command, Output};

fn agent(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_masq-agent"))
        .args(args)
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
fn invalid_to_ports_exits_1_with_a_clear_message() {
    for bad in ["2000-1000", "1024, 2000", "0-100", "1024-70000"] {
        let out = agent(&["check-config", "--to-ports", bad]);
        assert_eq!(out.status.code(), Some(1), "{bad}");
        assert!(
            stderr(&out).contains("invalid --to-ports"),
            "{bad}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn unknown_flag_exits_1() {
    let out = agent(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(1));
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
