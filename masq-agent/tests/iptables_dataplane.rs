//! The iptables data plane against real iptables (both the nft and the legacy backend), in
//! namespaces the tests create, with real TCP and UDP from a pod to an outside server.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use xtask::{
    probe::{self, Observer, Proto},
    topology::{self, Process, Topology},
    wait_for, write_config,
};

const PORT: u16 = 8080;
const CHAIN: &str = "IP-MASQ-AGENT";

#[derive(Clone, Copy)]
enum Backend {
    Nft,
    Legacy,
}

impl Backend {
    fn suffix(self) -> &'static str {
        match self {
            Backend::Nft => "nft",
            Backend::Legacy => "legacy",
        }
    }
}

/// A topology with a server on the outside host and the agent's config in a scratch directory.
struct Bed {
    topo: Topology,
    backend: Backend,
    server: Observer,
    config: PathBuf,
    /// `iptables` and friends, pointing at the chosen backend, first on the agent's PATH.
    bin_dir: PathBuf,
}

impl Bed {
    fn new(backend: Backend, config_text: &str) -> Bed {
        let topo = Topology::new(1).expect("topology");
        let server = Observer::start(&topo.ext, &topology::EXT_ADDRS, PORT).expect("server");
        let config_dir = topo.path("config");
        std::fs::create_dir_all(&config_dir).unwrap();
        let config = config_dir.join("ip-masq-agent");
        write_config(&config, config_text).unwrap();
        let bin_dir = topo.path("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        for tool in [
            "iptables",
            "iptables-restore",
            "iptables-save",
            "ip6tables",
            "ip6tables-restore",
            "ip6tables-save",
        ] {
            let (base, rest) = tool.split_once('-').map_or((tool, ""), |(b, r)| (b, r));
            let target = if rest.is_empty() {
                format!("/usr/sbin/{base}-{}", backend.suffix())
            } else {
                format!("/usr/sbin/{base}-{}-{rest}", backend.suffix())
            };
            std::os::unix::fs::symlink(target, bin_dir.join(tool)).unwrap();
        }
        Bed {
            topo,
            backend,
            server,
            config,
            bin_dir,
        }
    }

    fn path_env(&self) -> String {
        format!(
            "{}:{}",
            self.bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        )
    }

    fn agent_args<'a>(&'a self, config_arg: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["--dataplane=iptables", config_arg];
        args.extend_from_slice(extra);
        args
    }

    fn start_agent(&self, extra: &[&str]) -> Process {
        let config_arg = format!("--config={}", self.config.display());
        let path = self.path_env();
        let agent = self
            .topo
            .spawn_in_node(
                Path::new(env!("CARGO_BIN_EXE_masq-agent")),
                &self.agent_args(&config_arg, extra),
                &[("PATH", &path)],
                "agent.log",
            )
            .expect("start agent");
        wait_for(|| Ok(self.chain().is_some_and(|c| c.contains("MASQUERADE")))).unwrap_or_else(
            |e| panic!("agent never installed its chain: {e}\n{}", agent.log_text()),
        );
        agent
    }

    /// Runs the agent binary to completion in the node namespace (subcommands, `--once`).
    fn agent_cmd(&self, args: &[&str]) -> std::process::Output {
        self.topo
            .node_command(env!("CARGO_BIN_EXE_masq-agent"))
            .args(args)
            .env("PATH", self.path_env())
            .output()
            .unwrap()
    }

    fn iptables(&self, args: &[&str]) -> anyhow::Result<String> {
        self.topo
            .node_run(&format!("iptables-{}", self.backend.suffix()), args)
    }

    fn ip6tables(&self, args: &[&str]) -> anyhow::Result<String> {
        self.topo
            .node_run(&format!("ip6tables-{}", self.backend.suffix()), args)
    }

    fn chain(&self) -> Option<String> {
        self.iptables(&["-t", "nat", "-S", CHAIN]).ok()
    }

    fn nat_table(&self) -> String {
        self.topo
            .node_run(
                &format!("iptables-{}-save", self.backend.suffix()),
                &["-t", "nat"],
            )
            .unwrap()
    }

    fn pod(&self) -> &str {
        &self.topo.pods[0]
    }
}

fn outside() -> SocketAddr {
    (topology::EXT_ADDR, PORT).into()
}

fn second_outside() -> SocketAddr {
    (topology::EXT_SECOND_ADDR, PORT).into()
}

fn node_ip() -> IpAddr {
    topology::NODE_UPLINK.into()
}

fn pod_ip() -> IpAddr {
    topology::pod_addr(0).into()
}

const DEFAULT_CONFIG: &str = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 1s\n";

/// Waits until UDP from the pod to `dst` reaches the server with source `expect`.
fn wait_for_udp_source(bed: &Bed, dst: SocketAddr, expect: IpAddr) {
    bed.server.clear();
    wait_for(|| {
        probe::udp_send(bed.pod(), dst)?;
        std::thread::sleep(Duration::from_millis(50));
        Ok(bed.server.sources(Proto::Udp).contains(&expect))
    })
    .unwrap_or_else(|e| {
        panic!(
            "UDP to {dst} never arrived from {expect}: {e}; saw {:?}",
            bed.server.seen()
        )
    });
}

fn masquerades_outside_traffic_only(backend: Backend) {
    let bed = Bed::new(backend, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    assert_eq!(
        probe::tcp_probe(bed.pod(), outside(), 0).unwrap().ip(),
        node_ip(),
        "TCP to the outside is masqueraded"
    );
    assert_eq!(
        probe::udp_probe(bed.pod(), outside(), 0).unwrap().ip(),
        node_ip(),
        "UDP to the outside is masqueraded"
    );
    let cluster_local = SocketAddr::from((topology::CLUSTER_LOCAL_ADDR, PORT));
    assert_eq!(
        probe::tcp_probe(bed.pod(), cluster_local, 0).unwrap().ip(),
        pod_ip(),
        "cluster-local keeps the pod address"
    );
    assert_eq!(
        probe::udp_probe(bed.pod(), cluster_local, 0).unwrap().ip(),
        pod_ip()
    );
    // The installed rules are upstream's: the jump from POSTROUTING, and the chain's content.
    let table = bed.nat_table();
    assert!(
        table.contains(r#"-A POSTROUTING -m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom IP-MASQ-AGENT chain" -m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT"#),
        "{table}"
    );
    assert_eq!(
        table.matches("-A POSTROUTING").count(),
        1,
        "the jump is appended once: {table}"
    );
}

fn applies_a_config_change_live(backend: Backend) {
    let bed = Bed::new(backend, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    wait_for_udp_source(&bed, second_outside(), node_ip());
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nresyncInterval: 1m\n",
    )
    .unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip());
    // And back: the change is symmetric.
    write_config(&bed.config, DEFAULT_CONFIG).unwrap();
    wait_for_udp_source(&bed, second_outside(), node_ip());
}

fn keeps_the_last_good_policy_on_an_invalid_config(backend: Backend) {
    let bed = Bed::new(
        backend,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nresyncInterval: 1s\n",
    );
    let agent = bed.start_agent(&[]);
    let before = bed.chain().unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip());
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - abcdefg\n",
    )
    .unwrap();
    wait_for(|| Ok(agent.log_text().contains("abcdefg"))).expect("the error is logged");
    // Several resync ticks later, the rules are unchanged and the error was logged once.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(bed.chain().unwrap(), before);
    wait_for_udp_source(&bed, second_outside(), pod_ip());
    let log = agent.log_text();
    assert_eq!(
        log.matches("could not be parsed").count(),
        1,
        "logged once, not every tick: {log}"
    );
}

fn restores_a_flushed_chain(backend: Backend) {
    let bed = Bed::new(backend, DEFAULT_CONFIG);
    let agent = bed.start_agent(&[]);
    let before = bed.chain().unwrap();
    bed.iptables(&["-t", "nat", "-F", CHAIN]).unwrap();
    assert_eq!(
        bed.chain().unwrap().lines().count(),
        1,
        "flushed down to the -N line"
    );
    wait_for(|| Ok(bed.chain().as_deref() == Some(before.as_str())))
        .unwrap_or_else(|e| panic!("chain not restored: {e}\n{}", agent.log_text()));
    // A deleted jump is put back too.
    let jump_args = [
        "-t",
        "nat",
        "-D",
        "POSTROUTING",
        "-m",
        "comment",
        "--comment",
        "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom IP-MASQ-AGENT chain",
        "-m",
        "addrtype",
        "!",
        "--dst-type",
        "LOCAL",
        "-j",
        CHAIN,
    ];
    bed.iptables(&jump_args).unwrap();
    wait_for(|| Ok(bed.nat_table().contains("-A POSTROUTING"))).expect("jump restored");
    assert_eq!(
        probe::tcp_probe(bed.pod(), outside(), 0).unwrap().ip(),
        node_ip()
    );
}

fn sigterm_leaves_rules_and_cleanup_leaves_no_trace(backend: Backend) {
    let bed = Bed::new(backend, DEFAULT_CONFIG);
    let before = bed.nat_table();
    let mut agent = bed.start_agent(&[]);
    let status = agent.stop(libc::SIGTERM).unwrap();
    assert!(
        status.success(),
        "clean exit on SIGTERM: {status}\n{}",
        agent.log_text()
    );
    assert!(bed.chain().is_some(), "rules stay after SIGTERM");
    assert_eq!(
        probe::tcp_probe(bed.pod(), outside(), 0).unwrap().ip(),
        node_ip(),
        "and keep working"
    );

    let out = bed.agent_cmd(&["cleanup"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(bed.chain().is_none());
    assert_eq!(
        bed.nat_table()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>(),
        before
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>(),
        "nat table back to its original state"
    );
    assert!(
        probe::tcp_probe(bed.pod(), outside(), 0).is_err(),
        "without masquerading the server cannot answer"
    );
    let out = bed.agent_cmd(&["cleanup"]);
    assert!(out.status.success(), "cleanup is idempotent");
}

fn once_applies_and_exits_and_status_reports(backend: Backend) {
    let bed = Bed::new(backend, DEFAULT_CONFIG);
    let config_arg = format!("--config={}", bed.config.display());
    let out = bed.agent_cmd(&["--dataplane=iptables", &config_arg, "--once"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        probe::tcp_probe(bed.pod(), outside(), 0).unwrap().ip(),
        node_ip()
    );

    let out = bed.agent_cmd(&["status", "--json"]);
    assert!(out.status.success());
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["mode"], "iptables");
    let v4 = status["chains"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["family"] == "ipv4")
        .unwrap();
    assert_eq!(v4["installed"], true);
    assert_eq!(v4["jump_installed"], true);
    assert_eq!(
        v4["non_masquerade"],
        serde_json::json!(["169.254.0.0/16", "10.0.0.0/8"])
    );
    assert_eq!(v4["masquerade_rules"], 1);
    let text = bed.agent_cmd(&["status"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("not masqueraded: 10.0.0.0/8"));

    // An invalid config with --once exits 1 and changes nothing.
    let before = bed.chain().unwrap();
    write_config(
        &bed.config,
        "cidrLimit: 1\nnonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n",
    )
    .unwrap();
    let out = bed.agent_cmd(&["--dataplane=iptables", &config_arg, "--once"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the daemon can only accept up to 1 CIDRs")
    );
    assert_eq!(bed.chain().unwrap(), before);
}

fn to_ports_rules_load_into_real_iptables(backend: Backend) {
    let bed = Bed::new(backend, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&["--to-ports=1024-29999,32768-65535"]);
    let chain = bed.chain().unwrap();
    assert_eq!(chain.matches("--to-ports 1024-29999").count(), 3, "{chain}");
    assert_eq!(
        chain.matches("--to-ports 32768-65535").count(),
        3,
        "{chain}"
    );
    let seen = probe::tcp_probe(bed.pod(), outside(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip());
    assert!(
        (1024..=29999).contains(&seen.port()) || (32768..=65535).contains(&seen.port()),
        "{seen}"
    );
}

fn ipv6_chain_follows_enable_ipv6(backend: Backend) {
    let bed = Bed::new(backend, "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]\n");
    let config_arg = format!("--config={}", bed.config.display());
    let out = bed.agent_cmd(&["--dataplane=iptables", &config_arg, "--once"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "an IPv6 CIDR needs --enable-ipv6"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("ipv6 is not enabled, but ipv6 cidr fc00::/7 provided")
    );
    assert!(
        bed.chain().is_none(),
        "nothing applied from an invalid file"
    );

    let out = bed.agent_cmd(&[
        "--dataplane=iptables",
        &config_arg,
        "--once",
        "--enable-ipv6",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v6 = bed.ip6tables(&["-t", "nat", "-S", CHAIN]).unwrap();
    let returns: Vec<&str> = v6
        .lines()
        .filter(|l| l.contains("-j RETURN"))
        .map(|l| l.split_whitespace().nth(3).unwrap())
        .collect();
    assert_eq!(returns, ["fe80::/10", "fc00::/7"], "{v6}");
    assert!(v6.contains("-j MASQUERADE"), "{v6}");
    let v4 = bed.chain().unwrap();
    assert!(
        !v4.contains("fc00"),
        "IPv6 CIDRs stay out of the IPv4 chain: {v4}"
    );
    assert!(
        bed.ip6tables(&["-t", "nat", "-S", "POSTROUTING"])
            .unwrap()
            .contains(&format!("-j {CHAIN}"))
    );

    let out = bed.agent_cmd(&["cleanup"]);
    assert!(out.status.success());
    assert!(
        bed.ip6tables(&["-t", "nat", "-S", CHAIN]).is_err(),
        "cleanup removes the IPv6 chain too"
    );
    assert!(
        !bed.ip6tables(&["-t", "nat", "-S", "POSTROUTING"])
            .unwrap()
            .contains(CHAIN)
    );
}

macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod nft {
            $(#[test] fn $name() { super::$name(super::Backend::Nft) })*
        }
        mod legacy {
            $(#[test] fn $name() { super::$name(super::Backend::Legacy) })*
        }
    };
}

on_both_backends!(
    masquerades_outside_traffic_only,
    applies_a_config_change_live,
    keeps_the_last_good_policy_on_an_invalid_config,
    restores_a_flushed_chain,
    sigterm_leaves_rules_and_cleanup_leaves_no_trace,
    once_applies_and_exits_and_status_reports,
    to_ports_rules_load_into_real_iptables,
    ipv6_chain_follows_enable_ipv6,
);
