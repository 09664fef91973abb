//! What an operator reads when the kernel's verifier refuses the programs: one line naming the
//! program, the verifier's last words and a hint, the full log in a file the line names, and,
//! without the fallback, nothing left pinned; with it, the chain masquerades and `status` says
//! why, in the same line.
//!
//! The refusal is the real verifier's, of the real programs: told that the kernel has
//! `bpf_ktime_get_coarse_ns` (`MASQ_AGENT_COARSE_CLOCK=1`), the agent loads the programs that
//! call it, which kernels before 5.11 refuse. So these cases run where such a kernel runs:
//! `cargo xtask test` boots Debian 11's 5.10 for them (this target is not run by a plain
//! `cargo test`, whose kernel has the helper).

use std::{net::SocketAddr, path::Path, process::Output};

use masq_agent::dataplane::ebpf::COARSE_CLOCK_ENV;
use masq_testbed::{
    probe::{self, Observer},
    topology::{self, Topology},
    wait_for, write_config,
};

const PORT: u16 = 8080;

struct Node {
    topo: Topology,
    _server: Observer,
    config: std::path::PathBuf,
    path: String,
}

impl Node {
    fn new() -> Node {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut numbers = kernel.split(|c: char| !c.is_ascii_digit());
        let version: (u32, u32) = (
            numbers.next().unwrap().parse().unwrap(),
            numbers.next().unwrap().parse().unwrap(),
        );
        assert!(
            version < (5, 11),
            "these cases need a kernel without bpf_ktime_get_coarse_ns, before 5.11: this is \
             {kernel}; `cargo xtask test` runs them in a 5.10 VM"
        );
        let topo = Topology::new(1).unwrap();
        let server = Observer::start(&topo.ext, &[topology::EXT_ADDR], PORT).unwrap();
        let config = topo.path("ip-masq-agent");
        write_config(&config, "nonMasqueradeCIDRs: [10.0.0.0/8]\n").unwrap();
        let path = topo.path_with_iptables("nft").unwrap();
        Node {
            topo,
            _server: server,
            config,
            path,
        }
    }

    fn args(&self, fallback: bool) -> Vec<String> {
        vec![
            format!("--config={}", self.config.display()),
            format!("--bpffs={}", self.topo.bpffs.display()),
            format!("--interface={}", topology::UPLINK_IF),
            format!("--fallback-to-iptables={fallback}"),
        ]
    }

    fn agent(&self, args: &[String]) -> Output {
        self.topo
            .node_command(masq_testbed::agent_binary().to_str().unwrap())
            .args(args)
            .env("PATH", &self.path)
            .env(COARSE_CLOCK_ENV, "1")
            .output()
            .unwrap()
    }

    fn status(&self) -> serde_json::Value {
        let bpffs = format!("--bpffs={}", self.topo.bpffs.display());
        let out = self.agent(&["status".into(), "--json".into(), bpffs]);
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// The line that says the verifier refused a program, and the log file it names.
fn refusal(text: &str) -> (&str, &Path) {
    let line = text
        .lines()
        .find(|l| l.contains("refused program masq_egress"))
        .unwrap_or_else(|| panic!("no line names the refused program:\n{text}"));
    assert!(
        line.contains("invalid func unknown#160") || line.contains("unknown func"),
        "the verifier's last words: {line}"
    );
    assert!(line.contains("lacks a helper"), "and a hint: {line}");
    let log = line
        .rsplit_once("full log is in ")
        .map(|(_, path)| Path::new(path.trim()))
        .unwrap_or_else(|| panic!("the line names the log's file: {line}"));
    (line, log)
}

#[test]
fn without_the_fallback_the_agent_refuses_in_one_line_and_leaves_nothing_pinned() {
    let node = Node::new();
    let mut args = node.args(false);
    args.push("--once".into());
    let out = node.agent(&args);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let (line, log) = refusal(&stderr);
    assert!(line.len() < 600, "one line, not the log: {line}");
    let full = std::fs::read_to_string(log).unwrap();
    assert!(
        full.lines().count() > 20 && full.contains("unknown#160"),
        "the file holds the verifier's whole log:\n{full}"
    );
    assert!(
        !node.topo.bpffs.exists(),
        "nothing left pinned: {:?}",
        std::fs::read_dir(&node.topo.bpffs).map(|d| d.count())
    );
    let status = node.status();
    assert!(status["mode"].is_null(), "nothing installed: {status}");
    assert!(status["draining_flows"].is_null(), "{status}");
}

#[test]
fn with_the_fallback_the_chain_masquerades_and_status_says_why_in_one_line() {
    let node = Node::new();
    let owned = node.args(true);
    let args: Vec<&str> = owned.iter().map(String::as_str).collect();
    let agent = node
        .topo
        .spawn_in_node(
            &masq_testbed::agent_binary(),
            &args,
            &[("PATH", &node.path), (COARSE_CLOCK_ENV, "1")],
            "agent.log",
        )
        .unwrap();
    wait_for(|| Ok(agent.log_text().contains("policy applied"))).unwrap();
    let log = agent.log_text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("falling back to the full iptables chain"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    refusal(warnings[0]);
    let outside = SocketAddr::from((topology::EXT_ADDR, PORT));
    let seen = probe::tcp_probe(&node.topo.pods[0], outside, 0).unwrap();
    assert_eq!(seen.ip(), topology::NODE_UPLINK, "the chain masquerades");

    let status = node.status();
    assert_eq!(status["mode"], "iptables-fallback");
    let reason = status["mode_reason"].as_str().unwrap();
    refusal(reason);
    assert!(!reason.contains('\n'), "one line: {reason}");
    assert!(
        status["ebpf"].is_null(),
        "nothing of the eBPF data plane left: {status}"
    );
}

/// Before 5.11 the maps are charged to RLIMIT_MEMLOCK: a container whose limit is too low, and
/// that may not raise it, gets a line that says which limit to change.
#[test]
fn a_memlock_limit_too_low_for_the_maps_is_named() {
    let node = Node::new();
    let mut args = vec![
        "--memlock=65536:65536".to_string(),
        "setpriv".into(),
        "--bounding-set=-sys_resource".into(),
        "--inh-caps=-sys_resource".into(),
        masq_testbed::agent_binary().display().to_string(),
    ];
    args.extend(node.args(false));
    args.push("--once".into());
    let out = node
        .topo
        .node_command("prlimit")
        .args(&args)
        .env("PATH", &node.path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // aya's own warning names the limit too; the agent's line says what to change.
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("--fallback-to-iptables=false")
                && l.contains("RLIMIT_MEMLOCK")
                && l.contains("CAP_SYS_RESOURCE")),
        "the agent's line names the limit and what raises it:\n{stderr}"
    );
    assert!(!node.topo.bpffs.exists(), "nothing left pinned");
}
