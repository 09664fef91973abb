//! Both data planes, end to end, with the same test code: the real agent in a node namespace,
//! real iptables (nft and legacy backends) or the real eBPF programs, and real TCP, UDP, ICMP
//! and GRE between namespaces the tests create.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::PathBuf,
    process::Output,
    time::Duration,
};

use masq_agent::dataplane::ebpf::attach;
use masq_testbed::{
    deploy,
    packet::{ACK, RST, Tcp},
    probe::{
        self, BulkSink, BulkSource, IPPROTO_GRE, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP,
        Observer, Proto, RawObserver, UdpEcho, UdpFlows,
    },
    topology::{self, Process, Topology},
    wait_for, wait_for_long, write_config,
};

const PORT: u16 = 8080;
const CHAIN: &str = "IP-MASQ-AGENT";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Plane {
    Ebpf,
    IptablesNft,
    IptablesLegacy,
}

impl Plane {
    /// The iptables backend: the eBPF data plane's reduced chain goes through nft.
    fn backend(self) -> &'static str {
        match self {
            Plane::IptablesLegacy => "legacy",
            _ => "nft",
        }
    }
}

/// A topology with a server on the outside host, the agent's config in a scratch directory,
/// and `iptables` on the agent's PATH pointing at the chosen backend.
struct Bed {
    topo: Topology,
    plane: Plane,
    server: Observer,
    config: PathBuf,
    /// The agent's PATH: `iptables` and friends run the chosen backend.
    path: String,
}

impl Bed {
    fn new(plane: Plane, config_text: &str) -> Bed {
        Bed::with_pods(plane, config_text, 1)
    }

    fn with_pods(plane: Plane, config_text: &str, pods: usize) -> Bed {
        let topo = Topology::new(pods).expect("topology");
        let addrs: Vec<IpAddr> = topology::EXT_ADDRS
            .iter()
            .map(|a| IpAddr::from(*a))
            .chain(topology::EXT_ADDRS_V6.iter().map(|a| IpAddr::from(*a)))
            .collect();
        let server = Observer::start(&topo.ext, &addrs, PORT).expect("server");
        let config_dir = topo.path("config");
        std::fs::create_dir_all(&config_dir).unwrap();
        let config = config_dir.join("ip-masq-agent");
        write_config(&config, config_text).unwrap();
        let path = topo.path_with_iptables(plane.backend()).unwrap();
        Bed {
            topo,
            plane,
            server,
            config,
            path,
        }
    }

    /// The flags that select this bed's data plane, its config and its bpffs directory.
    fn plane_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--config={}", self.config.display()),
            format!("--bpffs={}", self.topo.bpffs.display()),
        ];
        match self.plane {
            Plane::Ebpf => args.extend([
                "--dataplane=ebpf".to_string(),
                format!("--interface={}", topology::UPLINK_IF),
                // A test of the eBPF data plane must fail rather than quietly use iptables.
                "--fallback-to-iptables=false".to_string(),
            ]),
            _ => args.push("--dataplane=iptables".to_string()),
        }
        args
    }

    fn start_agent(&self, extra: &[&str]) -> Process {
        let mut args = self.plane_args();
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn_agent(&args, &[])
    }

    /// The agent, reading every `ip-masq*` file of the config's directory (`--config=DIR`).
    fn start_agent_on_config_dir(&self, extra: &[&str]) -> Process {
        let file = format!("--config={}", self.config.display());
        let dir = format!("--config={}", self.config.parent().unwrap().display());
        let mut args: Vec<String> = self
            .plane_args()
            .into_iter()
            .map(|arg| if arg == file { dir.clone() } else { arg })
            .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn_agent(&args, &[])
    }

    /// The bed of a case written once for both families, its agent running. Bound as
    /// `let (bed, _agent)`, the agent stops before its topology goes.
    fn with_agent(plane: Plane, family: Family) -> (Bed, Process) {
        let bed = Bed::new(plane, family.config());
        let agent = bed.start_agent(family.agent_args());
        (bed, agent)
    }

    /// The programs' counter `name` reads `expected`; the chain counts nothing of its own.
    fn assert_ebpf_counter(&self, name: &str, expected: u64, why: &str) {
        if self.plane == Plane::Ebpf {
            let counters = &self.status_json()["ebpf"]["counters"];
            assert_eq!(counters[name], expected, "{why}: {counters}");
        }
    }

    /// Starts the agent in the node namespace, without waiting for it to sync.
    fn launch_agent(&self, args: &[String], env: &[(&str, &str)]) -> Process {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut envs = vec![("PATH", self.path.as_str())];
        envs.extend_from_slice(env);
        self.topo
            .spawn_in_node(&masq_testbed::agent_binary(), &args, &envs, "agent.log")
            .expect("start agent")
    }

    fn spawn_agent(&self, args: &[String], env: &[(&str, &str)]) -> Process {
        let agent = self.launch_agent(args, env);
        // The log line comes once everything is in place; the chain alone appears before its
        // POSTROUTING jump, and a flow started in between would stay unmasqueraded.
        wait_for(|| Ok(agent.log_text().contains("policy applied")))
            .unwrap_or_else(|e| panic!("agent never synced: {e}\n{}", agent.log_text()));
        agent
    }

    /// Runs the agent once (`--once`), with this bed's data plane and `extra` flags.
    fn sync_once(&self, extra: &[&str]) -> Output {
        let mut args = self.plane_args();
        args.push("--once".into());
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        self.agent_cmd(&refs)
    }

    /// Runs the agent binary to completion in the node namespace.
    fn agent_cmd(&self, args: &[&str]) -> Output {
        self.topo
            .node_command(masq_testbed::agent_binary().to_str().unwrap())
            .args(args)
            .env("PATH", &self.path)
            .output()
            .unwrap()
    }

    fn status_json(&self) -> serde_json::Value {
        let bpffs = format!("--bpffs={}", self.topo.bpffs.display());
        let out = self.agent_cmd(&["status", "--json", &bpffs]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `masq-agent flows` with `args`: its text, or with `--json` its flows.
    fn flows(&self, args: &[&str]) -> String {
        let bpffs = format!("--bpffs={}", self.topo.bpffs.display());
        let mut all = vec!["flows", &bpffs];
        all.extend_from_slice(args);
        let out = self.agent_cmd(&all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn flows_json(&self, args: &[&str]) -> Vec<serde_json::Value> {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        serde_json::from_str(&self.flows(&all)).unwrap()
    }

    fn iptables(&self, args: &[&str]) -> anyhow::Result<String> {
        self.topo
            .node_run(&format!("iptables-{}", self.plane.backend()), args)
    }

    fn ip6tables(&self, args: &[&str]) -> anyhow::Result<String> {
        self.topo
            .node_run(&format!("ip6tables-{}", self.plane.backend()), args)
    }

    fn chain(&self) -> Option<String> {
        self.iptables(&["-t", "nat", "-S", CHAIN]).ok()
    }

    fn nat_table(&self) -> String {
        self.topo
            .node_run(
                &format!("iptables-{}-save", self.plane.backend()),
                &["-t", "nat"],
            )
            .unwrap()
    }

    fn pod(&self) -> &str {
        &self.topo.pods[0]
    }

    /// Pings `dst` once from pod `i`; true if a reply came back.
    fn ping(&self, i: usize, dst: std::net::Ipv4Addr) -> bool {
        self.ping_output(i, &["-c", "1", "-W", "2", &dst.to_string()])
            .status
            .success()
    }

    fn ping_output(&self, i: usize, args: &[&str]) -> Output {
        masq_testbed::netns::command_in(&self.topo.pods[i], "ping")
            .args(args)
            .output()
            .unwrap()
    }

    fn ethtool_tx(&self, on: bool) {
        let state = if on { "on" } else { "off" };
        let set = |ns: &str, dev: &str| {
            masq_testbed::netns::run_in(ns, "ethtool", &["-K", dev, "tx", state]).unwrap();
        };
        set(self.pod(), "eth0");
        set(&self.topo.node, "pod0");
        set(&self.topo.node, topology::UPLINK_IF);
        set(&self.topo.ext, "eth0");
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

fn pod_ip(i: usize) -> IpAddr {
    topology::pod_addr(i).into()
}

const DEFAULT_CONFIG: &str = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 1s\n";

/// A TCP connection from the pod to the outside arrives from the node's address.
fn assert_masqueraded(bed: &Bed) {
    Family::V4.assert_masqueraded(bed);
}

/// Waits until UDP from the pod to `dst` reaches the server with source `expect`.
fn wait_for_udp_source(bed: &Bed, dst: SocketAddr, expect: IpAddr) {
    bed.server
        .wait_for_udp_from(bed.pod(), dst, expect)
        .unwrap_or_else(|e| panic!("{e:#}"));
}

fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---- cases for every data plane ---------------------------------------------------------

fn masquerades_outside_traffic_only(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let pings = RawObserver::start(&bed.topo.ext, i32::from(IPPROTO_ICMP)).unwrap();
    let _agent = bed.start_agent(&[]);
    let seen = probe::tcp_probe(bed.pod(), outside(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip(), "TCP to the outside is masqueraded");
    let seen = probe::udp_probe(bed.pod(), outside(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip(), "UDP to the outside is masqueraded");
    assert!(
        bed.ping(0, topology::EXT_ADDR),
        "ping to the outside gets its reply"
    );
    // The observer records on its own thread: give it a moment after ping returns.
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    assert_eq!(
        pings.sources(),
        [node_ip()],
        "and left with the node's address"
    );

    let cluster_local = SocketAddr::from((topology::CLUSTER_LOCAL_ADDR, PORT));
    let seen = probe::tcp_probe(bed.pod(), cluster_local, 0).unwrap();
    assert_eq!(seen.ip(), pod_ip(0), "cluster-local keeps the pod address");
    let seen = probe::udp_probe(bed.pod(), cluster_local, 0).unwrap();
    assert_eq!(seen.ip(), pod_ip(0));
    assert!(bed.ping(0, topology::CLUSTER_LOCAL_ADDR));
    wait_for(|| Ok(pings.sources().len() == 2)).unwrap();
    assert_eq!(
        pings.sources()[1],
        pod_ip(0),
        "ping to cluster-local keeps the pod address"
    );
}

/// A ping carrying an IP option (record route) is masqueraded like any other: the reply only
/// comes back to a pod the outside host cannot route to if it left with the node's address.
fn packets_with_ip_options_are_masqueraded(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let pings = RawObserver::start(&bed.topo.ext, i32::from(IPPROTO_ICMP)).unwrap();
    let _agent = bed.start_agent(&[]);
    let dst = topology::EXT_ADDR.to_string();
    let out = bed.ping_output(0, &["-4", "-R", "-c", "1", "-W", "2", &dst]);
    assert_success(&out);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("RR:"),
        "the reply carried the option back:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    assert_eq!(pings.sources(), [node_ip()], "left with the node's address");
}

fn two_pods_with_one_source_port_share_the_node_address(plane: Plane) {
    let bed = Bed::with_pods(plane, DEFAULT_CONFIG, 2);
    let _agent = bed.start_agent(&[]);
    let pods = &bed.topo.pods;
    let a = probe::tcp_probe(&pods[0], outside(), 40000).unwrap();
    let b = probe::tcp_probe(&pods[1], outside(), 40000).unwrap();
    assert_eq!((a.ip(), b.ip()), (node_ip(), node_ip()));
    assert_ne!(
        a.port(),
        b.port(),
        "TCP: two pods, one port each on the node"
    );
    let a = probe::udp_probe(&pods[0], outside(), 40001).unwrap();
    let b = probe::udp_probe(&pods[1], outside(), 40001).unwrap();
    assert_eq!((a.ip(), b.ip()), (node_ip(), node_ip()));
    assert_ne!(
        a.port(),
        b.port(),
        "UDP: two pods, one port each on the node"
    );
    assert!(bed.ping(0, topology::EXT_ADDR) && bed.ping(1, topology::EXT_ADDR));
}

fn link_local_is_exempt_unless_masq_link_local(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let link_local = SocketAddr::from((topology::LINK_LOCAL_ADDR, PORT));
    wait_for_udp_source(&bed, link_local, pod_ip(0));
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n",
    )
    .unwrap();
    wait_for_udp_source(&bed, link_local, node_ip());
}

/// Once no flow outlived the policy, packets it leaves alone skip the NAT table; a change that
/// strands a flow (its destination now left alone) makes the programs look every packet up
/// again, and the stranded flow stays translated, while new flows to it keep their address.
fn a_flow_stranded_by_a_change_stays_translated(plane: Plane) {
    let left_alone =
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nresyncInterval: 1m\n";
    let bed = Bed::new(plane, left_alone);
    let mut agent = bed.start_agent(&[]);
    let cleared = |bed: &Bed| bed.status_json()["ebpf"]["strays_cleared"] == true;
    wait_for(|| Ok(cleared(&bed))).expect("no flow to outlive the policy at the start");
    // An agent that leaves leaves the next one, of whatever version, to check again.
    agent.stop(libc::SIGTERM).unwrap();
    assert!(!cleared(&bed), "cleared by the agent that left");
    let _agent = bed.start_agent(&[]);
    let source = |port| udp_source_from(&bed, second_outside(), port);
    wait_for(|| Ok(cleared(&bed))).expect("no flow to outlive the policy at the start");
    assert_eq!(source(40122), pod_ip(0), "left alone, without a lookup");

    // A flow masqueraded under the default policy; none outlives that one either.
    // (A flow that began before the change would keep its address: a new one, once it applies.)
    write_config(&bed.config, DEFAULT_CONFIG).unwrap();
    wait_for_udp_source(&bed, second_outside(), node_ip());
    assert_eq!(source(40123), node_ip(), "masqueraded after the change");
    wait_for(|| Ok(cleared(&bed))).expect("masqueraded flows do not stray");

    // Back: the flow's destination is left alone now, and it stays translated, checked again
    // and again, while a new flow keeps the pod's address.
    write_config(&bed.config, left_alone).unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    assert!(!cleared(&bed), "the change may strand flows");
    assert_eq!(
        source(40123),
        node_ip(),
        "the stranded flow stays translated"
    );
    std::thread::sleep(masq_agent::dataplane::ebpf::strays::GRACE * 3);
    assert!(!cleared(&bed), "a check found the stranded flow");
    assert_eq!(source(40123), node_ip());
}

/// The source the outside host sees on the UDP flow from the pod's `port` to `dst`.
fn udp_source_from(bed: &Bed, dst: SocketAddr, port: u16) -> IpAddr {
    udp_source_of(bed, dst, port, b"probe\n")
}

/// The source the outside host sees on a datagram of `payload` that the pod sends from `port`.
fn udp_source_of(bed: &Bed, dst: SocketAddr, port: u16, payload: &[u8]) -> IpAddr {
    bed.server.clear();
    wait_for(|| {
        probe::udp_send_payload_from(bed.pod(), dst, port, payload)?;
        std::thread::sleep(Duration::from_millis(50));
        Ok(!bed.server.sources(Proto::Udp).is_empty())
    })
    .unwrap();
    bed.server.sources(Proto::Udp)[0]
}

/// A ping from the pod, five requests a second with one identifier, as the outside host sees
/// them; stopped when dropped.
struct LivePing {
    ping: std::process::Child,
    requests: RawObserver,
}

impl LivePing {
    fn start(bed: &Bed, family: Family, dst: IpAddr) -> LivePing {
        let requests = family.observe(&bed.topo.ext, IPPROTO_ICMP);
        let ping = masq_testbed::netns::command_in(bed.pod(), "ping")
            .args(["-i", "0.2", "-w", "60", &dst.to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_for(|| Ok(!requests.sources().is_empty())).unwrap();
        LivePing { ping, requests }
    }

    /// The requests sent from now on, for a second, all leave with `source`.
    fn assert_leaves_with(&self, source: IpAddr, what: &str) {
        let before = self.requests.sources().len();
        std::thread::sleep(Duration::from_secs(1));
        let after = &self.requests.sources()[before..];
        assert!(after.len() >= 3, "{what}: the ping went on ({after:?})");
        assert!(after.iter().all(|s| *s == source), "{what}: {after:?}");
    }
}

impl Drop for LivePing {
    fn drop(&mut self) {
        let _ = self.ping.kill();
        let _ = self.ping.wait();
    }
}

/// A UDP flow and a ping that left with the pod's address under `left_alone` keep it when the
/// config becomes `masquerading`, while new flows to `dst` take the node's; a UDP flow and a
/// ping masqueraded under `masquerading` stay so when the config is `left_alone` again. As
/// conntrack keeps a flow's NAT for its whole life. `port` and `port + 1`: the flows' ports.
fn assert_a_change_moves_no_live_flow(
    bed: &Bed,
    family: Family,
    dst: SocketAddr,
    (left_alone, masquerading): (&str, &str),
    port: u16,
) {
    let (pod, node) = (family.pod(0), family.node());
    write_config(&bed.config, left_alone).unwrap();
    wait_for_udp_source(bed, dst, pod);
    assert_eq!(udp_source_from(bed, dst, port), pod);
    let ping = LivePing::start(bed, family, dst.ip());
    write_config(&bed.config, masquerading).unwrap();
    wait_for_udp_source(bed, dst, node);
    let change = format!("{left_alone:?} to {masquerading:?}");
    assert_eq!(
        udp_source_from(bed, dst, port),
        pod,
        "{change}: the live UDP flow keeps the pod's address"
    );
    ping.assert_leaves_with(pod, &format!("{change}: the live ping"));
    drop(ping);
    assert_eq!(
        udp_source_of(bed, dst, port, &FRAGMENTED_DATAGRAM),
        pod,
        "{change}: the live UDP flow's fragments keep the pod's address"
    );

    assert_eq!(udp_source_from(bed, dst, port + 1), node);
    let ping = LivePing::start(bed, family, dst.ip());
    write_config(&bed.config, left_alone).unwrap();
    wait_for_udp_source(bed, dst, pod);
    assert_eq!(
        udp_source_from(bed, dst, port + 1),
        node,
        "back from {change}: the masqueraded UDP flow stays so"
    );
    ping.assert_leaves_with(node, &format!("back from {change}: the masqueraded ping"));
    assert_eq!(
        udp_source_of(bed, dst, port + 1, &FRAGMENTED_DATAGRAM),
        node,
        "back from {change}: the masqueraded UDP flow's fragments stay so"
    );
}

/// A datagram larger than any link's MTU in the topology, so that it leaves the pod in fragments.
const FRAGMENTED_DATAGRAM: [u8; 4000] = [0x5a; 4000];

/// No policy change moves a live flow, in either direction: the destination's prefix dropped
/// from nonMasqueradeCIDRs, moved to masqueradeCIDRs, or covered by a new exception.
fn a_policy_change_moves_no_live_flow(plane: Plane, family: Family) {
    let (range, _) = family.outside_prefixes();
    let dst = family.routable_client();
    let host = match dst.ip() {
        IpAddr::V4(ip) => format!("{ip}/32"),
        IpAddr::V6(ip) => format!("{ip}/128"),
    };
    let left_alone = family.config_with(&[range], &[]);
    let bed = Bed::new(plane, &left_alone);
    let _agent = bed.start_agent(family.agent_args());
    let changes = [
        family.config_with(&[], &[]),
        family.config_with(&[], &[range]),
        family.config_with(&[range], &[&host]),
    ];
    for (i, masquerading) in changes.iter().enumerate() {
        let port = 41000 + 2 * i as u16;
        assert_a_change_moves_no_live_flow(&bed, family, dst, (&left_alone, masquerading), port);
    }
}

/// `masqLinkLocal` turned on moves no live flow to link-local, and turned off again none it
/// masqueraded.
fn turning_masq_link_local_on_moves_no_live_flow(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let masquerading = format!("{DEFAULT_CONFIG}masqLinkLocal: true\n");
    let link_local = SocketAddr::from((topology::LINK_LOCAL_ADDR, PORT));
    let configs = (DEFAULT_CONFIG, masquerading.as_str());
    assert_a_change_moves_no_live_flow(&bed, Family::V4, link_local, configs, 41100);
}

fn applies_a_config_change_live(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    wait_for_udp_source(&bed, second_outside(), node_ip());
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nresyncInterval: 1m\n",
    )
    .unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    write_config(&bed.config, DEFAULT_CONFIG).unwrap();
    wait_for_udp_source(&bed, second_outside(), node_ip());
}

fn keeps_the_last_good_policy_on_an_invalid_config(plane: Plane) {
    let bed = Bed::new(
        plane,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nresyncInterval: 1s\n",
    );
    let agent = bed.start_agent(&[]);
    let before = bed.chain().unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - abcdefg\n",
    )
    .unwrap();
    wait_for(|| Ok(agent.log_text().contains("abcdefg"))).expect("the error is logged");
    // Several resync ticks later, the policy is unchanged and the error was logged once.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(bed.chain().unwrap(), before);
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    let log = agent.log_text();
    assert_eq!(
        log.matches("could not be parsed").count(),
        1,
        "logged once, not every tick: {log}"
    );
}

/// The config file turns into a directory, then into a symlink loop, then back into a file: the
/// last good policy stays in force throughout, each problem is logged, and the file's return is
/// picked up.
fn keeps_the_policy_while_the_config_file_cannot_be_read(plane: Plane) {
    let bed = Bed::new(
        plane,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nresyncInterval: 1s\n",
    );
    let agent = bed.start_agent(&[]);
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    // A directory at the path is read as config files: one of them a looping link.
    std::fs::remove_file(&bed.config).unwrap();
    std::fs::create_dir(&bed.config).unwrap();
    let inner = bed.config.join("ip-masq-agent");
    std::os::unix::fs::symlink(&inner, &inner).unwrap();
    wait_for(|| Ok(agent.log_text().contains(&*inner.to_string_lossy()))).unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));

    std::fs::remove_file(&inner).unwrap();
    std::fs::remove_dir(&bed.config).unwrap();
    std::os::unix::fs::symlink(&bed.config, &bed.config).unwrap();
    wait_for(|| Ok(agent.log_text().contains("symbolic links"))).unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));

    std::fs::remove_file(&bed.config).unwrap();
    write_config(&bed.config, DEFAULT_CONFIG).unwrap();
    wait_for_udp_source(&bed, second_outside(), node_ip());
}

/// For a minute the config file flips between valid and invalid every 100 ms: outside traffic
/// stays masqueraded and cluster traffic not, at every probe, and the agent stays live and takes
/// the config that comes to rest.
fn survives_a_config_flipping_between_valid_and_invalid(plane: Plane) {
    const VALID: [&str; 2] = [
        "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 1s\n",
        "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 2s\n",
    ];
    const INVALID: &str = "nonMasqueradeCIDRs: [10.0.0.0/8, bogus]\n";
    let bed = Bed::new(plane, VALID[0]);
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    let agent = bed.start_agent(&[&metrics_addr]);
    let config = bed.config.clone();
    let flipper = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        let mut flips = 0;
        while started.elapsed() < Duration::from_secs(60) {
            let text = if flips % 2 == 0 {
                INVALID
            } else {
                VALID[flips / 2 % 2]
            };
            write_config(&config, text).unwrap();
            flips += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        flips
    });
    let cluster_local = SocketAddr::from((topology::CLUSTER_LOCAL_ADDR, PORT));
    let mut probes = 0;
    while !flipper.is_finished() {
        let out = probe::tcp_probe(bed.pod(), outside(), 0).unwrap();
        assert_eq!(
            out.ip(),
            node_ip(),
            "probe {probes}: outside is masqueraded"
        );
        let local = probe::tcp_probe(bed.pod(), cluster_local, 0).unwrap();
        assert_eq!(
            local.ip(),
            pod_ip(0),
            "probe {probes}: cluster-local is not"
        );
        probes += 1;
    }
    let flips = flipper.join().unwrap();
    assert!(flips > 500 && probes > 50, "{flips} flips, {probes} probes");
    assert_eq!(http_get(&bed, "/healthz").0, 200, "{}", agent.log_text());
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs: [10.0.0.0/8, 198.51.100.0/24]\n",
    )
    .unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
}

/// The uplink's address changes under the agent: new flows leave with the new one within
/// seconds, and (eBPF) the flows on the old address are forgotten, as MASQUERADE forgets its
/// connections when their address goes.
fn new_flows_take_the_uplink_s_new_address(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let agent = bed.start_agent(&[]);
    assert_masqueraded(&bed);
    let uplink = topology::UPLINK_IF;
    let promote = format!("net.ipv4.conf.{uplink}.promote_secondaries=1");
    bed.topo.node_run("sysctl", &["-qw", &promote]).unwrap();
    let old = format!("{}/24", topology::NODE_UPLINK);
    assert_new_flows_take_the_new_address(&bed, &agent, outside(), &old, "203.0.113.2/24");
}

/// The uplink's address `old` gives way to `new`: new flows leave with the new one, and on the
/// eBPF data plane no flow is left on the old one.
fn assert_new_flows_take_the_new_address(
    bed: &Bed,
    agent: &Process,
    server: SocketAddr,
    old: &str,
    new: &str,
) {
    let uplink = topology::UPLINK_IF;
    let family = if server.is_ipv6() { "-6" } else { "-4" };
    let new_address: IpAddr = new.split('/').next().unwrap().parse().unwrap();
    bed.topo
        .node_run("ip", &[family, "addr", "add", new, "dev", uplink, "nodad"])
        .unwrap();
    bed.topo
        .node_run("ip", &[family, "addr", "del", old, "dev", uplink])
        .unwrap();
    wait_for(|| Ok(probe::tcp_probe(bed.pod(), server, 0)?.ip() == new_address))
        .unwrap_or_else(|e| panic!("still the old address: {e}\n{}", agent.log_text()));
    if bed.plane == Plane::Ebpf {
        assert!(
            agent
                .log_text()
                .contains("flows on the old address forgotten")
        );
        let table = if server.is_ipv6() {
            masq_ebpf::map_names::NAT_V6
        } else {
            masq_ebpf::map_names::NAT_V4
        };
        let pin = bed.topo.bpffs.join(table);
        let dump =
            masq_testbed::netns::run("bpftool", &["map", "dump", "pinned", pin.to_str().unwrap()])
                .unwrap();
        let compact: String = dump.split_whitespace().collect();
        let bytes = |addr: IpAddr| {
            let octets: Vec<String> = match addr {
                IpAddr::V4(a) => a.octets().iter().map(u8::to_string).collect(),
                IpAddr::V6(a) => a.octets().iter().map(u8::to_string).collect(),
            };
            format!(r#""addr":[{}]"#, octets.join(","))
        };
        let old_address: IpAddr = old.split('/').next().unwrap().parse().unwrap();
        assert!(compact.contains(&bytes(new_address)), "{dump}");
        assert!(
            !compact.contains(&bytes(old_address)),
            "nothing is left on the old address:\n{dump}"
        );
    }
}

/// The uplink goes down for a few upkeep ticks and comes back: masquerading resumes with no
/// help, once the node has its default route again (which a down link takes with it).
fn survives_the_uplink_going_down_and_up(plane: Plane) {
    uplink_goes_down_and_up(plane, Family::V4);
}

/// The uplink goes down for a few upkeep ticks and comes back, with its routes (which a down
/// link takes with it) and, for IPv6, its address (which the kernel drops with the link).
fn uplink_goes_down_and_up(plane: Plane, family: Family) {
    let (bed, agent) = Bed::with_agent(plane, family);
    family.assert_masqueraded(&bed);
    let uplink = topology::UPLINK_IF;
    bed.topo
        .node_run("ip", &["link", "set", uplink, "down"])
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    bed.topo
        .node_run("ip", &["link", "set", uplink, "up"])
        .unwrap();
    if family == Family::V6 {
        let address = format!("{}/64", topology::NODE_UPLINK_V6);
        bed.topo
            .node_run(
                "ip",
                &["-6", "addr", "replace", &address, "dev", uplink, "nodad"],
            )
            .unwrap();
    }
    let (flag, gateway) = match family {
        Family::V4 => ("-4", topology::EXT_ADDR.to_string()),
        Family::V6 => ("-6", topology::EXT_ADDR_V6.to_string()),
    };
    bed.topo
        .node_run(
            "ip",
            &[flag, "route", "replace", "default", "via", &gateway],
        )
        .unwrap();
    wait_for(|| Ok(probe::tcp_probe(bed.pod(), family.outside(), 0)?.ip() == family.node()))
        .unwrap_or_else(|e| panic!("not masquerading again: {e}\n{}", agent.log_text()));
    if plane == Plane::Ebpf {
        let status = bed.status_json();
        assert_eq!(status["ebpf"]["attachments"].as_array().unwrap().len(), 2);
    }
}

/// The uplink is deleted and created again (a driver reload, a recreated bond): masquerading
/// resumes on the new device, and (eBPF) the programs are attached to it.
fn survives_the_uplink_being_deleted_and_recreated(plane: Plane) {
    uplink_is_deleted_and_recreated(plane, Family::V4);
}

fn uplink_is_deleted_and_recreated(plane: Plane, family: Family) {
    let (bed, agent) = Bed::with_agent(plane, family);
    family.assert_masqueraded(&bed);
    bed.topo
        .node_run("ip", &["link", "del", topology::UPLINK_IF])
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    bed.topo.connect_uplink().unwrap();
    wait_for(|| Ok(probe::tcp_probe(bed.pod(), family.outside(), 0)?.ip() == family.node()))
        .unwrap_or_else(|e| panic!("not masquerading again: {e}\n{}", agent.log_text()));
    if plane == Plane::Ebpf {
        // The chain masquerades the new device until the programs are on it.
        wait_for_coverage(&bed, &agent, topology::UPLINK_IF, family, "ebpf");
        let status = bed.status_json();
        assert_eq!(
            status["ebpf"]["attachments"].as_array().unwrap().len(),
            2,
            "{status}"
        );
    }
}

fn fragmented_datagrams_arrive_whole_both_ways(plane: Plane) {
    fragments_arrive_whole_both_ways(plane, Family::V4);
}

/// Datagrams larger than the links' MTU travel as fragments: a 4 000-byte UDP datagram goes out
/// and comes back whole, and so does a 4 000-byte ping.
fn fragments_arrive_whole_both_ways(plane: Plane, family: Family) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    assert_fragments_arrive_whole(&bed, family.outside().ip());
    bed.assert_ebpf_counter("dropped_fragment", 0, "no fragment was dropped");
}

/// A 4 000-byte UDP datagram goes out to `server` in fragments, and its echo comes back in
/// fragments from the outside host; a 4 000-byte ping does the same.
fn assert_fragments_arrive_whole(bed: &Bed, server: IpAddr) {
    let server = SocketAddr::from((server, 9500));
    let echo = masq_testbed::netns::within(&bed.topo.ext, move || {
        Ok(std::net::UdpSocket::bind(server)?)
    })
    .unwrap();
    let echoer = std::thread::spawn(move || {
        let mut buf = vec![0u8; 8192];
        echo.set_read_timeout(Some(Duration::from_secs(5))).ok();
        if let Ok((n, from)) = echo.recv_from(&mut buf) {
            let _ = echo.send_to(&buf[..n], from);
        }
    });
    let payload: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
    let sent = payload.clone();
    let echoed = masq_testbed::netns::within(bed.pod(), move || {
        let any: IpAddr = match server {
            SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
        };
        let socket = std::net::UdpSocket::bind((any, 0))?;
        socket.set_read_timeout(Some(Duration::from_secs(3)))?;
        socket.send_to(&sent, server)?;
        let mut buf = vec![0u8; 8192];
        let (n, _) = socket.recv_from(&mut buf)?;
        buf.truncate(n);
        Ok(buf)
    })
    .unwrap();
    echoer.join().unwrap();
    assert!(echoed == payload, "{} bytes came back", echoed.len());
    let family = if server.is_ipv6() { "-6" } else { "-4" };
    let dst = server.ip().to_string();
    let ping = bed.ping_output(0, &[family, "-c", "1", "-W", "2", "-s", "4000", &dst]);
    assert_success(&ping);
}

fn connections_from_outside_keep_the_pod_address(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let in_pod = Observer::start(bed.pod(), &[topology::pod_addr(0)], 9090).unwrap();
    let client = SocketAddr::from((topology::ROUTABLE_CLIENT_ADDR, 0));
    // The handshake only completes if the pod's SYN-ACK leaves with the pod's own address.
    let seen =
        probe::tcp_probe_from(&bed.topo.ext, client, (topology::pod_addr(0), 9090).into()).unwrap();
    assert_eq!(seen.ip(), IpAddr::from(topology::ROUTABLE_CLIENT_ADDR));
    assert_eq!(
        in_pod.sources(Proto::Tcp),
        [IpAddr::from(topology::ROUTABLE_CLIENT_ADDR)]
    );
    // The pod's own connections to the same host are still masqueraded.
    assert_masqueraded(&bed);
}

fn path_mtu_discovery_works_through_the_translation(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    assert_path_mtu_discovery(&bed, topology::FAR_ADDR.into());
}

/// A pod learns the narrower path's MTU toward `far` from the ICMP error (frag-needed, or
/// packet-too-big) that the hop before it sends to the node, and a bulk transfer completes.
fn assert_path_mtu_discovery(bed: &Bed, far: IpAddr) {
    let family = if far.is_ipv6() { "-6" } else { "-4" };
    let dst = far.to_string();
    let out = bed.ping_output(
        0,
        &[
            family, "-M", "do", "-s", "1400", "-c", "2", "-i", "0.3", "-W", "2", &dst,
        ],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let mtu = topology::FAR_LINK_MTU;
    assert!(
        text.contains(&format!("mtu = {mtu}")) || text.contains(&format!("mtu={mtu}")),
        "the pod must learn the path MTU from the translated ICMP error:\n{text}"
    );
    let sink = BulkSink::start(&bed.topo.far, 9000).unwrap();
    let sent =
        probe::tcp_bulk(bed.pod(), (far, 9000).into(), 64 * 1024, 32, Duration::ZERO).unwrap();
    assert_eq!(
        sent,
        32 * 64 * 1024,
        "a bulk transfer over the narrower path completes"
    );
    drop(sink);
}

fn a_killed_agent_does_not_break_a_transfer(plane: Plane) {
    killed_agent_does_not_break_a_transfer(plane, Family::V4);
}

/// A transfer from the pod to `server` on the outside host, paced (32 KiB every 50 ms, for
/// `chunks` of them) so that it is still running when a case restarts the agent, on a thread of
/// its own.
struct PacedTransfer {
    _sink: BulkSink,
    sender: std::thread::JoinHandle<anyhow::Result<u64>>,
    bytes: u64,
}

impl PacedTransfer {
    const CHUNK: usize = 32 * 1024;

    fn start(bed: &Bed, server: SocketAddr, chunks: usize) -> PacedTransfer {
        let sink = BulkSink::start(&bed.topo.ext, server.port()).unwrap();
        let pod = bed.pod().to_string();
        let sender = std::thread::spawn(move || {
            probe::tcp_bulk(&pod, server, Self::CHUNK, chunks, Duration::from_millis(50))
        });
        PacedTransfer {
            _sink: sink,
            sender,
            bytes: (chunks * Self::CHUNK) as u64,
        }
    }

    /// Every byte arrived, whatever happened meanwhile.
    fn assert_complete(self, why: &str) {
        let sent = self.sender.join().unwrap().unwrap();
        assert_eq!(sent, self.bytes, "{why}");
    }
}

fn killed_agent_does_not_break_a_transfer(plane: Plane, family: Family) {
    let (bed, mut agent) = Bed::with_agent(plane, family);
    let transfer = PacedTransfer::start(&bed, (family.outside().ip(), 9001).into(), 40);
    std::thread::sleep(Duration::from_millis(700));
    agent.stop(libc::SIGKILL).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let _restarted = bed.start_agent(family.agent_args());
    transfer.assert_complete("the transfer survived the kill and the restart");
    family.assert_masqueraded(&bed);
}

fn checksums_hold_with_tx_offload_on_and_off(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    assert_checksums_hold_with_tx_offload_on_and_off(&bed, outside(), node_ip());
}

/// A reply only comes back if every checksum on the way was right: TCP, UDP, ping and a bulk
/// transfer (segmentation offload) to `server`, with the devices' checksum offload off, then on.
fn assert_checksums_hold_with_tx_offload_on_and_off(bed: &Bed, server: SocketAddr, node: IpAddr) {
    let family = if server.is_ipv6() { "-6" } else { "-4" };
    let dst = server.ip().to_string();
    for on in [false, true] {
        bed.ethtool_tx(on);
        let tcp = probe::tcp_probe(bed.pod(), server, 0).unwrap();
        assert_eq!(tcp.ip(), node, "TCP, tx {on}");
        let udp = probe::udp_probe(bed.pod(), server, 0).unwrap();
        assert_eq!(udp.ip(), node, "UDP, tx {on}");
        let ping = bed.ping_output(0, &[family, "-c", "1", "-W", "2", &dst]);
        assert_success(&ping);
        let port = 9002 + u16::from(on);
        let _sink = BulkSink::start(&bed.topo.ext, port).unwrap();
        let sent = probe::tcp_bulk(
            bed.pod(),
            (server.ip(), port).into(),
            64 * 1024,
            16,
            Duration::ZERO,
        )
        .unwrap();
        assert_eq!(sent, 16 * 64 * 1024, "bulk TCP, tx {on}");
    }
}

fn other_protocols_are_masqueraded_by_the_chain(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let gre = RawObserver::start(&bed.topo.ext, i32::from(IPPROTO_GRE)).unwrap();
    let _agent = bed.start_agent(&[]);
    assert_gre_leaves_with(&bed, &gre, topology::EXT_ADDR.into(), node_ip());
}

/// GRE from the pod to `dst`, which the programs leave to the chain, reaches the outside host
/// (where `gre` listens) from `node`.
fn assert_gre_leaves_with(bed: &Bed, gre: &RawObserver, dst: IpAddr, node: IpAddr) {
    let gre_payload = [0, 0, 0x08, 0, 1, 2, 3, 4];
    wait_for(|| {
        match dst {
            IpAddr::V4(dst) => {
                probe::raw_send(bed.pod(), i32::from(IPPROTO_GRE), dst, &gre_payload)?
            }
            IpAddr::V6(dst) => {
                probe::raw_send_v6(bed.pod(), i32::from(IPPROTO_GRE), dst, &gre_payload)?
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        Ok(!gre.sources().is_empty())
    })
    .unwrap();
    assert_eq!(gre.sources()[0], node, "GRE leaves with the node's address");
}

fn sigterm_leaves_everything_and_cleanup_leaves_no_trace(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
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

    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    assert_success(&bed.agent_cmd(&["cleanup", &bpffs]));
    assert!(bed.chain().is_none());
    let rules = |t: &str| {
        t.lines()
            .filter(|l| !l.starts_with('#'))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        rules(&bed.nat_table()),
        rules(&before),
        "nat table back to its original state"
    );
    assert!(!bed.topo.bpffs.exists(), "no pins left");
    let tc = bed
        .topo
        .node_run(
            "bpftool",
            &["-j", "net", "show", "dev", topology::UPLINK_IF],
        )
        .unwrap();
    assert!(!tc.contains("masq_"), "no program attached: {tc}");
    assert!(
        probe::tcp_probe(bed.pod(), outside(), 0).is_err(),
        "without masquerading the server cannot answer"
    );
    assert_success(&bed.agent_cmd(&["cleanup", &bpffs]));
}

fn once_applies_and_exits_and_status_reports(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    assert_success(&bed.sync_once(&[]));
    assert_masqueraded(&bed);

    let status = bed.status_json();
    let v4 = status["chains"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["family"] == "ipv4")
        .unwrap();
    assert_eq!(v4["jump_installed"], true);
    // The full chain lists them in rule order; the eBPF data plane's set lists them sorted.
    let expected = match plane {
        Plane::Ebpf => ["10.0.0.0/8", "169.254.0.0/16"],
        _ => ["169.254.0.0/16", "10.0.0.0/8"],
    };
    assert_eq!(v4["non_masquerade"], serde_json::json!(expected));
    if plane == Plane::Ebpf {
        assert_eq!(status["mode"], "ebpf");
        let ebpf = &status["ebpf"];
        let hooks: Vec<&str> = ebpf["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["hook"].as_str().unwrap())
            .collect();
        assert_eq!(hooks, ["egress", "ingress"]);
        assert_eq!(
            ebpf["non_masquerade_v4"],
            serde_json::json!(["10.0.0.0/8", "169.254.0.0/16"])
        );
        assert_eq!(ebpf["nat_pod_flows"], 1, "the probe's flow");
        assert!(ebpf["counters"]["masqueraded"].as_u64().unwrap() >= 2);
        assert!(ebpf["counters"]["reverse_translated"].as_u64().unwrap() >= 2);
        assert_eq!(
            v4["ebpf_protocols_returned"],
            serde_json::json!(["tcp", "udp", "icmp"])
        );
    } else {
        assert_eq!(status["mode"], "iptables");
        assert_eq!(v4["masquerade_rules"], 1);
    }

    // An invalid config with --once exits 1 and changes nothing.
    let before = bed.chain().unwrap();
    write_config(
        &bed.config,
        "cidrLimit: 1\nnonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n",
    )
    .unwrap();
    let out = bed.sync_once(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the daemon can only accept up to 1 CIDRs")
    );
    assert_eq!(bed.chain().unwrap(), before);
    assert_masqueraded(&bed);
}

// ---- eBPF only ---------------------------------------------------------------------------

fn args_with(bed: &Bed, replace: &[(&str, &str)]) -> Vec<String> {
    bed.plane_args()
        .into_iter()
        .map(|arg| {
            replace
                .iter()
                .find(|(flag, _)| arg.starts_with(&format!("{flag}=")))
                .map_or(arg, |(flag, value)| format!("{flag}={value}"))
        })
        .collect()
}

fn falls_back_to_iptables_when_ebpf_cannot_run(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    // No BPF filesystem can be mounted under /proc: the maps have nowhere to be pinned.
    let id = bed.topo.dir.file_name().unwrap().to_string_lossy();
    let bpffs = format!("/proc/self/{id}/ip-masq-agent");
    let mut args = args_with(
        &bed,
        &[("--bpffs", &bpffs), ("--fallback-to-iptables", "false")],
    );
    args.push("--once".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bed.agent_cmd(&refs);
    assert_eq!(
        out.status.code(),
        Some(1),
        "--fallback-to-iptables=false: exit with the reason"
    );
    let why = "is not on a BPF filesystem";
    assert!(String::from_utf8_lossy(&out.stderr).contains(why));
    assert!(bed.chain().is_none(), "and nothing installed");

    let args = args_with(
        &bed,
        &[("--bpffs", &bpffs), ("--fallback-to-iptables", "true")],
    );
    let agent = bed.spawn_agent(&args, &[]);
    let log = agent.log_text();
    assert_eq!(
        log.matches("falling back to the full iptables chain")
            .count(),
        1,
        "{log}"
    );
    assert!(log.contains(why), "the line says why: {log}");
    assert!(
        !bed.chain().unwrap().contains("eBPF"),
        "the full chain, not the reduced one"
    );
    assert_masqueraded(&bed);
    assert!(bed.ping(0, topology::EXT_ADDR));
    let out = bed.agent_cmd(&["status", "--json", &format!("--bpffs={bpffs}")]);
    assert_success(&out);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["mode"], "iptables-fallback");
    assert!(status["mode_reason"].as_str().unwrap().contains(why));
    assert!(
        status["ebpf"].is_null(),
        "nothing of the eBPF data plane is left installed"
    );
}

/// The names pinned under `dir`, with their inodes: a new object pinned under an old name has
/// another.
fn pinned(dir: &std::path::Path) -> BTreeSet<(String, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        e.metadata().unwrap().ino(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A load that fails once the maps are pinned (here, no ports are left for NAT) takes back
/// what it pinned, and only that: on a fresh node nothing is left to read as a data plane to
/// drain; after a crashed agent, its programs and pinned maps go on translating its flows.
fn a_failed_load_takes_back_what_it_pinned(plane: Plane) {
    let (bed, mut agent) = Bed::with_agent(plane, Family::V4);
    let transfer = PacedTransfer::start(&bed, (topology::EXT_ADDR, 9001).into(), 40);
    std::thread::sleep(Duration::from_millis(500));
    agent.stop(libc::SIGKILL).unwrap();
    let before = pinned(&bed.topo.bpffs);
    assert!(
        before.iter().any(|(name, _)| name == "nat_v4"),
        "{before:?}"
    );
    // Every port ephemeral: none is left for the programs' NAT.
    bed.topo
        .node_run(
            "sysctl",
            &["-qw", "net.ipv4.ip_local_port_range=1024 65535"],
        )
        .unwrap();
    let out = bed.sync_once(&[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no ports left for NAT"), "{stderr}");
    assert_eq!(
        pinned(&bed.topo.bpffs),
        before,
        "the crashed agent's pins are all there, none replaced"
    );
    transfer.assert_complete("its programs went on translating the transfer");

    let fresh = bed.topo.bpffs.join("fresh");
    let fresh_arg = format!("--bpffs={}", fresh.display());
    let mut args = args_with(&bed, &[("--bpffs", &fresh.display().to_string())]);
    args.push("--once".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bed.agent_cmd(&refs);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        !fresh.exists(),
        "nothing pinned on a fresh node: {:?}",
        pinned(&fresh)
    );
    let out = bed.agent_cmd(&["status", "--json", &fresh_arg]);
    assert_success(&out);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(status["draining_flows"].is_null(), "{status}");
}

/// `status` says what is really installed: the full chain an agent that fell back and exited
/// left, with the reason it fell back; and, where the chain leaves traffic to programs it
/// cannot find under `--bpffs`, that it cannot tell.
fn status_says_what_an_exited_agent_left_and_when_it_cannot_tell(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let range = |range: &str| {
        let setting = format!("net.ipv4.ip_local_port_range={range}");
        bed.topo.node_run("sysctl", &["-qw", &setting]).unwrap();
    };
    range("1024 65535");
    let mut args = args_with(&bed, &[("--fallback-to-iptables", "true")]);
    args.push("--once".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_success(&bed.agent_cmd(&refs));
    let status = bed.status_json();
    assert_eq!(status["mode"], "iptables-fallback", "{status}");
    let reason = status["mode_reason"].as_str().unwrap();
    assert!(reason.contains("no ports left for NAT"), "{reason}");
    assert!(
        status["notes"][0]
            .as_str()
            .unwrap()
            .contains("no agent runs"),
        "{status}"
    );

    range("32768 60999");
    assert_success(&bed.sync_once(&[]));
    let wrong = format!("--bpffs={}-elsewhere", bed.topo.bpffs.display());
    let out = bed.agent_cmd(&["status", &wrong]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("data plane: ebpf\n"), "{text}");
    assert!(
        text.contains("nothing is pinned under") && text.contains("cannot be told from here"),
        "{text}"
    );
}

fn reattaches_a_program_someone_detached(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let agent = bed.start_agent(&[]);
    let egress_link = |status: &serde_json::Value| {
        status["ebpf"]["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["hook"] == "egress")
            .map(|a| a["link_id"].as_u64().unwrap())
    };
    let old = egress_link(&bed.status_json()).unwrap();
    bed.topo
        .node_run("bpftool", &["link", "detach", "id", &old.to_string()])
        .unwrap();
    wait_for(|| Ok(egress_link(&bed.status_json()).is_some_and(|id| id != old))).unwrap_or_else(
        |e| {
            panic!(
                "not re-attached: {e}
{}",
                agent.log_text()
            )
        },
    );
    assert!(agent.log_text().contains("re-attaching"));
    assert_masqueraded(&bed);
}

const METRICS_ADDR: &str = "127.0.0.1:9830";

fn http_get(bed: &Bed, path: &str) -> (u16, String) {
    probe::http_get(&bed.topo.node, METRICS_ADDR.parse().unwrap(), path)
        .unwrap_or_else(|e| panic!("GET {path}: {e:#}"))
}

/// The value of the series whose line starts with `series` (name and labels).
fn metric(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(series)?.strip_prefix(' ')?;
        rest.parse().ok()
    })
}

fn serves_metrics_health_and_readiness(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    let agent = bed.start_agent(&[&metrics_addr]);
    assert_eq!(http_get(&bed, "/readyz"), (200, "ok\n".into()));
    assert_eq!(http_get(&bed, "/healthz"), (200, "ok\n".into()));
    assert_eq!(http_get(&bed, "/nothing-here").0, 404);
    assert_masqueraded(&bed);

    let (status, metrics) = http_get(&bed, "/metrics");
    assert_eq!(status, 200);
    assert!(metrics.ends_with("# EOF\n"), "OpenMetrics text:\n{metrics}");
    let series = |s: &str| metric(&metrics, s);
    assert!(series("masq_agent_config_reloads_total{result=\"success\"}") >= Some(1.0));
    // DEFAULT_CONFIG's 10/8, and link-local.
    assert_eq!(
        series("masq_agent_non_masquerade_prefixes{family=\"ipv4\"}"),
        Some(2.0)
    );
    let mode = match plane {
        Plane::Ebpf => "ebpf",
        _ => "iptables",
    };
    assert_eq!(
        series(&format!("masq_agent_dataplane_mode{{mode=\"{mode}\"}}")),
        Some(1.0)
    );
    assert_eq!(series("masq_agent_fallback_events_total"), Some(0.0));
    assert!(series("masq_agent_apply_duration_seconds_count") >= Some(1.0));
    assert!(series("process_open_fds") >= Some(3.0));
    assert!(series("process_resident_memory_bytes") > Some(1e6));
    assert_eq!(
        series("masq_agent_ebpf_counter_read_errors_total"),
        Some(0.0)
    );
    if plane == Plane::Ebpf {
        assert!(series("masq_agent_packets_masqueraded_total") >= Some(1.0));
        assert!(series("masq_agent_packets_reverse_translated_total{kind=\"reply\"}") >= Some(1.0));
        assert_eq!(
            series("masq_agent_packets_dropped_total{reason=\"nat_table_full\"}"),
            Some(0.0)
        );
        assert_eq!(
            series("masq_agent_nat_capacity_entries"),
            Some(2.0 * 262_144.0)
        );
        // Counters that cannot be read raise the error metric and a warning, rather than
        // leaving the alerts on them without data.
        let pin = bed.topo.bpffs.join("counters");
        let pin = pin.to_str().unwrap();
        let shown = masq_testbed::netns::run("bpftool", &["-j", "map", "show", "pinned", pin]);
        let shown: serde_json::Value = serde_json::from_str(&shown.unwrap()).unwrap();
        let id = shown["id"].to_string();
        std::fs::remove_file(pin).unwrap();
        let (_, metrics) = http_get(&bed, "/metrics");
        masq_testbed::netns::run("bpftool", &["map", "pin", "id", &id, pin]).unwrap();
        let errors = metric(&metrics, "masq_agent_ebpf_counter_read_errors_total");
        assert!(errors >= Some(1.0), "{metrics}");
        assert!(metric(&metrics, "masq_agent_packets_masqueraded_total").is_none());
        let warned = agent.log_text();
        assert!(
            warned.contains("WARN") && warned.contains("reading the eBPF counters"),
            "{warned}"
        );
    } else {
        assert_eq!(
            series("masq_agent_packets_masqueraded_total"),
            None,
            "the chain's packets are counted by iptables, not here"
        );
    }
    drop(agent);
}

/// The capabilities deploy/daemonset.yaml gives the agent's container, which must not be
/// privileged.
fn manifest_capabilities() -> Vec<String> {
    let context = &deploy::agent_container()["securityContext"];
    assert_eq!(context["privileged"], false, "{context:?}");
    deploy::agent_capabilities()
}

/// `setpriv`, its arguments and the agent binary: the agent with only `capabilities`.
fn with_only(capabilities: &[String]) -> Vec<String> {
    let mut command = deploy::with_only(capabilities);
    command.push(masq_testbed::agent_binary().display().to_string());
    command
}

/// The effective capability mask of process `pid`.
fn effective_capabilities(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap();
    u64::from_str_radix(hex.trim(), 16).unwrap()
}

impl Bed {
    /// The agent with only `capabilities`, run with `args`, once it has synced.
    fn start_agent_with_only(&self, capabilities: &[String], args: &[String]) -> Process {
        let mut command = with_only(capabilities);
        command.extend_from_slice(args);
        let args: Vec<&str> = command[1..].iter().map(String::as_str).collect();
        let agent = self
            .topo
            .spawn_in_node(
                std::path::Path::new("setpriv"),
                &args,
                &[("PATH", self.path.as_str())],
                "agent-capabilities.log",
            )
            .expect("start agent");
        wait_for(|| Ok(agent.log_text().contains("policy applied")))
            .unwrap_or_else(|e| panic!("agent never synced: {e}\n{}", agent.log_text()));
        agent
    }

    /// The agent binary with only `capabilities`, run to completion with `args`.
    fn agent_cmd_with_only(&self, capabilities: &[String], args: &[String]) -> Output {
        let mut command = with_only(capabilities);
        command.extend_from_slice(args);
        self.topo
            .node_command("setpriv")
            .args(&command[1..])
            .env("PATH", &self.path)
            .output()
            .unwrap()
    }
}

/// The bed's arguments, with the manifest's default of falling back to the chain.
fn as_the_manifest_runs_it(bed: &Bed, replace: &[(&str, &str)]) -> Vec<String> {
    let mut replace = replace.to_vec();
    replace.push(("--fallback-to-iptables", "true"));
    args_with(bed, &replace)
}

/// The agent runs with exactly the capabilities the manifest gives its container: it
/// masquerades, pins, takes its pins over after a restart, and falls back to the chain when
/// eBPF cannot run.
fn runs_with_only_the_manifest_s_capabilities(plane: Plane) {
    let capabilities = manifest_capabilities();
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let args = as_the_manifest_runs_it(&bed, &[]);
    let mut agent = bed.start_agent_with_only(&capabilities, &args);
    let wanted = capabilities.iter().fold(0u64, |mask, name| {
        let number = match name.as_str() {
            "NET_ADMIN" => 12,
            "NET_RAW" => 13,
            "PERFMON" => 38,
            "BPF" => 39,
            other => panic!("a capability the test does not know: {other}"),
        };
        mask | 1 << number
    });
    assert_eq!(effective_capabilities(agent.child.id()), wanted);
    assert_masqueraded(&bed);
    // What an operator runs with `kubectl exec`, in the same container.
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    let status = bed.agent_cmd_with_only(&capabilities, &["status".into(), "--json".into(), bpffs]);
    assert!(status.status.success(), "{status:?}");
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["mode"], "ebpf", "{status:#}");
    let running = |a: &serde_json::Value| a["running"] == true;
    let attachments = status["ebpf"]["attachments"].as_array().unwrap();
    assert_eq!(
        attachments.iter().filter(|a| running(a)).count(),
        2,
        "{status:#}"
    );
    let mut explain = vec!["explain".to_string(), topology::EXT_ADDR.to_string()];
    explain.extend(args.iter().cloned());
    let explained = bed.agent_cmd_with_only(&capabilities, &explain);
    assert!(explained.status.success(), "{explained:?}");

    // A restart takes the pins over, and a connection open across it goes on.
    let transfer = PacedTransfer::start(&bed, (topology::EXT_ADDR, 9001).into(), 20);
    std::thread::sleep(Duration::from_millis(300));
    agent.stop(libc::SIGTERM).unwrap();
    let agent = bed.start_agent_with_only(&capabilities, &args);
    assert!(
        agent.log_text().contains("mode=ebpf"),
        "{}",
        agent.log_text()
    );
    transfer.assert_complete("the transfer survived the restart");
    assert_masqueraded(&bed);
    drop(agent);

    // Where eBPF cannot run, the chain masquerades everything.
    let id = bed.topo.dir.file_name().unwrap().to_string_lossy();
    let nowhere = format!("/proc/self/{id}/ip-masq-agent");
    let args = as_the_manifest_runs_it(&bed, &[("--bpffs", &nowhere)]);
    let fallback = bed.start_agent_with_only(&capabilities, &args);
    let log = fallback.log_text();
    assert!(
        log.contains("falling back to the full iptables chain"),
        "{log}"
    );
    assert_masqueraded(&bed);
}

/// With one of the manifest's capabilities missing, the agent says which: without one the
/// programs need, it falls back to the chain and says why; without one the chain needs, it
/// cannot run, and exits saying so.
fn a_missing_capability_is_named(plane: Plane) {
    let capabilities = manifest_capabilities();
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    for missing in &capabilities {
        let fewer: Vec<String> = capabilities
            .iter()
            .filter(|c| *c != missing)
            .cloned()
            .collect();
        let mut args = as_the_manifest_runs_it(&bed, &[]);
        args.push("--once".into());
        let out = bed.agent_cmd_with_only(&fewer, &args);
        let said = String::from_utf8_lossy(&out.stderr);
        let name = format!("CAP_{missing}");
        let line = said
            .lines()
            .find(|l| l.contains(&name))
            .unwrap_or_else(|| panic!("without {name}: nothing names it:\n{said}"));
        match missing.as_str() {
            "BPF" | "PERFMON" => {
                assert!(out.status.success(), "{said}");
                assert!(
                    line.contains("falling back to the full iptables chain"),
                    "{line}"
                );
                assert_masqueraded(&bed);
            }
            _ => {
                assert_eq!(out.status.code(), Some(1), "{said}");
                assert!(line.contains("iptables"), "{line}");
            }
        }
    }
}

/// Someone detaches the uplink's egress program, and it cannot be attached again (a directory
/// stands where its link is pinned): liveness says so, and meanwhile the chain masquerades what
/// leaves the uplink. (A device that merely goes away is followed, not a failure.)
fn liveness_fails_when_the_data_plane_is_gone(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    let agent = bed.start_agent(&[&metrics_addr]);
    assert_eq!(http_get(&bed, "/healthz").0, 200);
    let egress = format!("{}-egress", topology::UPLINK_IF);
    let link = bed.status_json()["ebpf"]["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["hook"] == "egress")
        .map(|a| a["link_id"].to_string())
        .unwrap();
    let pin = bed.topo.bpffs.join("links").join(&egress);
    std::fs::remove_file(&pin).unwrap();
    std::fs::create_dir(&pin).unwrap();
    bed.topo
        .node_run("bpftool", &["link", "detach", "id", &link])
        .unwrap();
    wait_for_long(Duration::from_secs(30), || {
        Ok(http_get(&bed, "/healthz").0 == 503)
    })
    .unwrap_or_else(|e| panic!("still healthy: {e}\n{}", agent.log_text()));
    let (_, why) = http_get(&bed, "/healthz");
    assert!(why.contains(&egress), "{why}");
    wait_for_coverage(&bed, &agent, topology::UPLINK_IF, Family::V4, "iptables");
    assert_masqueraded(&bed);
}

fn bpftool_shows_the_prefixes_with_named_fields(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    assert_success(&bed.sync_once(&[]));
    let pin = bed.topo.bpffs.join("non_masq_v4");
    let dump =
        masq_testbed::netns::run("bpftool", &["map", "dump", "pinned", pin.to_str().unwrap()])
            .unwrap();
    let compact: String = dump.split_whitespace().collect();
    for expected in [
        r#""prefix_len":8,"data":[10,0,0,0]"#,
        r#""prefix_len":16,"data":[169,254,0,0]"#,
    ] {
        assert!(compact.contains(expected), "{expected} in:\n{dump}");
    }
}

/// With the NAT table full of assured flows (streams, answered twice), the flows in it keep
/// working; new ones are dropped and counted, never sent with the pod's address.
fn a_full_nat_table_keeps_its_flows_and_drops_new_ones(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&["--nat-capacity=2"]);
    let stream = |pod_port| {
        let first = probe::udp_probe(bed.pod(), outside(), pod_port).unwrap();
        let again = probe::udp_probe(bed.pod(), outside(), pod_port).unwrap();
        assert_eq!(first, again);
        first
    };
    let first = stream(5001);
    let second = stream(5002);
    assert_eq!((first.ip(), second.ip()), (node_ip(), node_ip()));
    assert!(
        probe::udp_probe(bed.pod(), outside(), 5003).is_err(),
        "a third flow finds no room"
    );
    let status = bed.status_json();
    assert!(status["ebpf"]["counters"]["dropped_nat_table_full"].as_u64() >= Some(1));
    assert_eq!(status["ebpf"]["nat_pod_flows"], 2);
    assert_eq!(
        probe::udp_probe(bed.pod(), outside(), 5001).unwrap(),
        first,
        "the first flow keeps its translation"
    );
    assert!(
        bed.server
            .sources(Proto::Udp)
            .iter()
            .all(|s| *s != pod_ip(0)),
        "nothing left with the pod's address"
    );
}

/// No BPF filesystem where `--bpffs` points: the agent mounts one, or says clearly why it
/// cannot. Run in a private mount namespace whose /sys/fs/bpf is a plain tmpfs.
fn mounts_a_missing_bpffs_or_says_why_not(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let config = format!("--config={}", bed.config.display());
    let interface = format!("--interface={}", topology::UPLINK_IF);
    let agent = masq_testbed::agent_binary();
    let agent = agent.display();
    let run = |bpffs: &str| {
        let script = format!(
            "mount -t tmpfs masq-test /sys/fs/bpf && exec {agent} --once {config} {interface} \
             --fallback-to-iptables=false --bpffs={bpffs}"
        );
        bed.topo
            .node_command("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .env("PATH", &bed.path)
            .output()
            .unwrap()
    };
    let out = run("/sys/fs/bpf/masq/ip-masq-agent");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("mounted a BPF filesystem"), "{log}");
    assert!(log.contains("policy applied"), "{log}");

    let out = run("/proc/self/masq/ip-masq-agent");
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    let error = log
        .lines()
        .find(|l| l.contains("ERROR"))
        .unwrap_or_default();
    assert!(
        error.contains("/proc/self/masq is not on a BPF filesystem"),
        "the error says where and why: {log}"
    );
}

/// The prefixes in `text`'s policy, as the trie keys them.
fn policy_keys(text: &str) -> BTreeSet<(u32, [u8; 4])> {
    let opts = masq_agent::config::ConfigOptions {
        nomasq_all_reserved_ranges: false,
        enable_ipv6: false,
    };
    let loaded = masq_agent::config::parse(text.as_bytes(), "test", &opts).unwrap();
    masq_agent::policy::Policy::from_config(&loaded.config, masq_agent::policy::IpFamilies::IPV4)
        .non_masq_v4
        .iter()
        .map(|net| (u32::from(net.prefix_len()), net.network().octets()))
        .collect()
}

/// The agent is killed half-way through applying a large change. Prefixes in both the old and
/// the new policy are never missing from the trie, and the restarted agent leaves it exactly as
/// the file says.
fn sigkill_mid_apply_loses_no_prefix(plane: Plane) {
    let all = masq_testbed::prefixes::random(60_000);
    let text = |prefixes: &[String]| {
        let list: String = prefixes.iter().map(|p| format!("  - {p}\n")).collect();
        format!("cidrLimit: 100000\nnonMasqueradeCIDRs:\n{list}")
    };
    // 10/8 and link-local, then 30 000 prefixes; the new policy keeps 10 000 of them.
    let old = text(&all[..30_002]);
    let new = text(&[&all[..2], &all[20_002..]].concat());
    let bed = Bed::new(plane, &old);
    let mut agent = bed.start_agent(&[]);
    // A trie lookup matches the longest covering prefix: sample only prefixes that nothing else
    // in either policy covers, so that a match means the prefix itself is there.
    let everything: BTreeSet<_> = policy_keys(&old)
        .union(&policy_keys(&new))
        .copied()
        .collect();
    let alone = |(len, data): &(u32, [u8; 4])| {
        (0..*len).all(|shorter| {
            let mask = u32::MAX.checked_shl(32 - shorter).unwrap_or(0);
            let network = (u32::from_be_bytes(*data) & mask).to_be_bytes();
            !everything.contains(&(shorter, network))
        })
    };
    let sample = |keys: Vec<(u32, [u8; 4])>, every: usize| -> Vec<(u32, [u8; 4])> {
        keys.into_iter().filter(alone).step_by(every).collect()
    };
    let (old_keys, new_keys) = (policy_keys(&old), policy_keys(&new));
    let kept = sample(old_keys.intersection(&new_keys).copied().collect(), 25);
    let arriving = sample(new_keys.difference(&old_keys).copied().collect(), 250);
    let pin = bed.topo.bpffs.join("non_masq_v4");
    let trie: aya::maps::LpmTrie<aya::maps::MapData, [u8; 4], masq_ebpf::PolicyEntry> =
        aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(&pin).unwrap())
            .unwrap()
            .try_into()
            .unwrap();
    let missing = |trie: &aya::maps::LpmTrie<_, [u8; 4], masq_ebpf::PolicyEntry>| {
        kept.iter()
            .filter(|(len, data)| {
                trie.get(&aya::maps::lpm_trie::Key::new(*len, *data), 0)
                    .is_err()
            })
            .count()
    };
    assert_eq!(missing(&trie), 0);

    assert!(kept.len() > 50 && arriving.len() > 10);
    write_config(&bed.config, &new).unwrap();
    // Kill the agent as soon as the new prefixes start arriving: it adds them all before it
    // removes any old one.
    let started = std::time::Instant::now();
    let mut samples = 0;
    while !arriving.iter().any(|(len, data)| {
        trie.get(&aya::maps::lpm_trie::Key::new(*len, *data), 0)
            .is_ok()
    }) {
        assert_eq!(missing(&trie), 0, "a kept prefix went missing mid-apply");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the change never started"
        );
        samples += 1;
    }
    agent.stop(libc::SIGKILL).unwrap();
    assert!(samples > 0);
    assert_eq!(missing(&trie), 0, "a kept prefix is missing after the kill");

    let restarted = bed.start_agent(&[]);
    let keys: BTreeSet<(u32, [u8; 4])> = trie
        .keys()
        .map(|k| {
            let k = k.unwrap();
            (k.prefix_len(), k.data())
        })
        .collect();
    assert!(
        keys == policy_keys(&new),
        "the trie holds exactly the file's policy ({} keys, want {})\n{}",
        keys.len(),
        policy_keys(&new).len(),
        restarted.log_text()
    );
}

/// A change of the file is applied as the difference from what the agent installed; what
/// someone else changes behind its back is put back at the next resync: a prefix deleted from
/// the trie, a member deleted from the set.
fn a_change_is_applied_as_a_difference_and_a_resync_repairs_the_rest(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let agent = bed.start_agent(&[]);
    let trie = bed.topo.bpffs.join("non_masq_v4");
    let exempt = |a: [u8; 4]| masq_testbed::keeps_address_v4(&trie, a.into()).unwrap();
    let set = |args: &[&str]| masq_testbed::netns::run_in(&bed.topo.node, "ipset", args);
    let members = || set(&["list", "IP-MASQ-AGENT-v4"]).unwrap();

    let added = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.18.0.0/15\nresyncInterval: 1s\n";
    write_config(&bed.config, added).unwrap();
    wait_for(|| Ok(exempt([198, 18, 1, 1]))).unwrap();
    wait_for(|| Ok(members().contains("198.18.0.0/15"))).unwrap();
    assert!(exempt([10, 1, 2, 3]));

    // Behind the agent's back: out of the trie and out of the set.
    let key: Vec<String> = 15u32
        .to_ne_bytes()
        .into_iter()
        .chain([198, 18, 0, 0])
        .map(|b| b.to_string())
        .collect();
    let pin = trie.to_str().unwrap();
    let mut args = vec!["map", "delete", "pinned", pin, "key"];
    args.extend(key.iter().map(String::as_str));
    masq_testbed::netns::run("bpftool", &args).unwrap();
    set(&["del", "IP-MASQ-AGENT-v4", "10.0.0.0/8"]).unwrap();
    assert!(!exempt([198, 18, 1, 1]));
    // Both back within a resync (1s), or a few.
    wait_for_long(Duration::from_secs(5), || {
        Ok(exempt([198, 18, 1, 1]) && members().contains("10.0.0.0/8"))
    })
    .unwrap_or_else(|e| panic!("not repaired: {e}\n{}\n{}", members(), agent.log_text()));
    assert_masqueraded(&bed);
}

/// A prefix removed from the non-masquerade CIDRs drains for as long as a TCP connection may
/// stay idle; a restarted agent must carry that on, not start from an empty draining trie.
fn draining_survives_an_agent_restart(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    assert_success(&bed.sync_once(&[]));
    write_config(&bed.config, "nonMasqueradeCIDRs: [192.168.0.0/16]\n").unwrap();
    assert_success(&bed.sync_once(&[]));
    // The agent that removed 10/8 is gone; the next one finds the trie already without it.
    assert_success(&bed.sync_once(&[]));
    let pin = bed.topo.bpffs.join("non_masq_draining_v4");
    let dump =
        masq_testbed::netns::run("bpftool", &["map", "dump", "pinned", pin.to_str().unwrap()])
            .unwrap();
    let compact: String = dump.split_whitespace().collect();
    assert!(
        compact.contains(r#""prefix_len":8,"data":[10,0,0,0]"#),
        "10/8 still drains:\n{dump}"
    );
}

/// Maps an older agent pinned with other layouts: a NAT table of another entry size, a policy
/// trie whose value was the action alone, and decision counters of another size. Each is
/// replaced, not misread.
fn replaces_an_incompatible_pinned_map(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    std::fs::create_dir_all(&bed.topo.bpffs).unwrap();
    let create = |name: &str, spec: &[&str]| {
        let pin = bed.topo.bpffs.join(name);
        let mut args = vec!["map", "create", pin.to_str().unwrap()];
        args.extend_from_slice(spec);
        args.extend(["name", name]);
        masq_testbed::netns::run("bpftool", &args).unwrap();
    };
    let nat = ["type", "hash", "key", "8", "value", "8", "entries", "16"];
    create("nat_v4", &nat);
    let trie = [
        "type", "lpm_trie", "key", "8", "value", "1", "entries", "16", "flags", "1",
    ];
    create("non_masq_v4", &trie);
    let counters = [
        "type",
        "percpu_array",
        "key",
        "4",
        "value",
        "8",
        "entries",
        "4",
    ];
    create("policy_decisions", &counters);
    let agent = bed.start_agent(&[]);
    let replaced = agent
        .log_text()
        .matches("replacing a pinned map with an incompatible layout")
        .count();
    assert_eq!(replaced, 3, "{}", agent.log_text());
    assert_masqueraded(&bed);
    let status = bed.status_json();
    assert_eq!(status["ebpf"]["nat_capacity"], 2 * 262_144);
    assert_eq!(status["ebpf"]["decisions"]["slots"], 1024, "{status:#}");
    assert!(decisions_of(&status, "10.0.0.0/8").is_some(), "{status:#}");
    assert!(status["ebpf"]["decisions"]["totals"]["masquerade"].as_u64() >= Some(1));
}

fn attaches_through_netlink_without_tcx(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let agent = bed.spawn_agent(&bed.plane_args(), &[(attach::FORCE_NETLINK_ENV, "1")]);
    let filters = bed
        .topo
        .node_run(
            "tc",
            &["filter", "show", "dev", topology::UPLINK_IF, "egress"],
        )
        .unwrap();
    assert!(
        filters.contains("masq_egress"),
        "a clsact filter, not a TCX link: {filters}\n{}",
        agent.log_text()
    );
    assert_masqueraded(&bed);
    assert!(bed.ping(0, topology::EXT_ADDR));
    drop(agent);
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    assert_success(&bed.agent_cmd(&["cleanup", &bpffs]));
    let filters = bed
        .topo
        .node_run(
            "tc",
            &["filter", "show", "dev", topology::UPLINK_IF, "egress"],
        )
        .unwrap();
    assert!(
        !filters.contains("masq_egress"),
        "cleanup removes the filter: {filters}"
    );
}

/// The clsact filters at the node's uplink hook, as `tc` lists them.
fn clsact_filters(bed: &Bed, hook: &str) -> String {
    bed.topo
        .node_run("tc", &["filter", "show", "dev", topology::UPLINK_IF, hook])
        .unwrap()
}

/// Where there is no TCX (before 6.6), the programs are clsact filters at a priority and handle
/// of the agent's own. A restarted agent replaces the program in them in one step: a stream of
/// packets through the restart never leaves with a pod's address. A filter someone removed is
/// put back, and `status` lists them.
fn netlink_filters_are_replaced_in_place_and_put_back(plane: Plane) {
    const NETLINK: [(&str, &str); 1] = [(attach::FORCE_NETLINK_ENV, "1")];
    let (pref, handle) = (
        attach::NETLINK_PRIORITY.to_string(),
        format!("{:#x}", attach::NETLINK_HANDLE),
    );
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let mut agent = bed.spawn_agent(&bed.plane_args(), &NETLINK);
    for hook in ["egress", "ingress"] {
        let filters = clsact_filters(&bed, hook);
        assert_eq!(
            filters.lines().filter(|l| l.contains("masq_")).count(),
            1,
            "one filter at {hook}: {filters}"
        );
        assert!(
            filters.contains(&format!("pref {pref} "))
                && filters.contains(&format!("handle {handle} ")),
            "at the agent's priority and handle: {filters}"
        );
    }
    let status = bed.status_json();
    let attachments = status["ebpf"]["attachments"].as_array().unwrap();
    assert_eq!(attachments.len(), 2, "{status}");
    for attachment in attachments {
        assert!(
            attachment["link_id"].is_null(),
            "a filter has no link: {attachment}"
        );
        let id = attachment["program_id"].as_u64().unwrap();
        let hook = attachment["hook"].as_str().unwrap();
        assert!(
            clsact_filters(&bed, hook).contains(&format!(" id {id} ")),
            "status names the program the filter runs: {attachment}"
        );
    }

    // Packets of one flow leave all through the restart, never with the pod's address.
    let leaving = RawObserver::start(&bed.topo.ext, libc::IPPROTO_UDP).unwrap();
    let pod = bed.pod().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sending = stop.clone();
    let sender = std::thread::spawn(move || {
        let socket =
            masq_testbed::netns::within(&pod, || Ok(UdpSocket::bind("0.0.0.0:0")?)).unwrap();
        let mut sent = 0u64;
        while !sending.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = socket.send_to(b"stream", (topology::EXT_ADDR, 9));
            sent += 1;
            std::thread::sleep(Duration::from_micros(100));
        }
        sent
    });
    std::thread::sleep(Duration::from_millis(300));
    agent.stop(libc::SIGKILL).unwrap();
    let agent = bed.spawn_agent(&bed.plane_args(), &NETLINK);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = sender.join().unwrap();
    wait_for(|| Ok(!leaving.packets().is_empty())).unwrap();
    let sources: BTreeSet<IpAddr> = leaving.packets().iter().map(|p| p.src).collect();
    assert_eq!(
        sources,
        BTreeSet::from([node_ip()]),
        "{sent} packets sent, {} seen",
        leaving.packets().len()
    );
    let filters = clsact_filters(&bed, "egress");
    assert_eq!(
        filters.lines().filter(|l| l.contains("masq_")).count(),
        1,
        "replaced, not stacked: {filters}"
    );

    bed.topo
        .node_run(
            "tc",
            &[
                "filter",
                "del",
                "dev",
                topology::UPLINK_IF,
                "egress",
                "pref",
                &pref,
                "handle",
                &handle,
                "bpf",
            ],
        )
        .unwrap();
    wait_for(|| Ok(clsact_filters(&bed, "egress").contains("masq_egress")))
        .unwrap_or_else(|e| panic!("not put back: {e}\n{}", agent.log_text()));
    assert!(agent.log_text().contains("re-attaching"));
    assert_masqueraded(&bed);
}

// ---- iptables only ----------------------------------------------------------------------

fn restores_a_flushed_chain(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
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
    assert_masqueraded(&bed);
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

fn to_ports_rules_load_into_real_iptables(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
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

/// Beside the programs, the IPv6 chain too is reduced to the protocols they leave alone, and
/// what they translate they count; GRE over IPv6 is masqueraded by the chain.
fn ipv6_is_translated_by_the_programs_and_the_rest_by_the_chain(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let gre = RawObserver::start_v6(&bed.topo.ext, i32::from(IPPROTO_GRE)).unwrap();
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    let v6 = bed.ip6tables(&["-t", "nat", "-S", CHAIN]).unwrap();
    let rules: Vec<&str> = v6.lines().filter(|l| l.starts_with("-A")).collect();
    for (rule, proto) in rules.iter().zip(["tcp", "udp", "ipv6-icmp"]) {
        assert!(
            rule.contains(&format!("-p {proto}")) && rule.contains("-j RETURN"),
            "{v6}"
        );
    }
    assert!(
        rules[3].contains("--match-set") && rules[4].contains("-j MASQUERADE"),
        "{v6}"
    );

    let counted = || -> u64 {
        let counters = bed.status_json()["ebpf"]["counters"].clone();
        counters["masqueraded"].as_u64().unwrap() + counters["reverse_translated"].as_u64().unwrap()
    };
    let before = counted();
    let seen = probe::tcp_probe(bed.pod(), outside_v6(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip_v6());
    assert!(
        counted() >= before + 2,
        "the programs translated the connection both ways"
    );
    let status = bed.status_json();
    assert_eq!(
        status["ebpf"]["interfaces_v6"]
            .as_object()
            .unwrap()
            .values()
            .next(),
        Some(&serde_json::json!(topology::NODE_UPLINK_V6.to_string())),
        "{status}"
    );

    assert_gre_leaves_with(&bed, &gre, topology::EXT_ADDR_V6.into(), node_ip_v6());
}

/// Without a global IPv6 address on the uplink the programs have nothing to give IPv6 flows,
/// so IPv6 keeps upstream's full chain until the address is there.
fn ipv6_keeps_the_full_chain_while_the_uplink_has_no_ipv6_address(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let uplink_v6 = format!("{}/64", topology::NODE_UPLINK_V6);
    let uplink = topology::UPLINK_IF;
    bed.topo
        .node_run("ip", &["-6", "addr", "del", &uplink_v6, "dev", uplink])
        .unwrap();
    let reduced = || {
        assert_success(&bed.sync_once(&["--enable-ipv6"]));
        let v6 = bed.ip6tables(&["-t", "nat", "-S", CHAIN]).unwrap();
        assert!(v6.contains("-j MASQUERADE"), "{v6}");
        v6.contains("translated by the eBPF data plane")
    };
    assert!(!reduced(), "no address: the full chain");
    bed.topo
        .node_run(
            "ip",
            &["-6", "addr", "add", &uplink_v6, "dev", uplink, "nodad"],
        )
        .unwrap();
    assert!(
        reduced(),
        "with the address: the programs, and the reduced chain"
    );
}

/// Another program holds the xtables lock for longer than iptables waits for it (upstream's
/// issue #23): the apply fails, is logged once, and is retried with backoff, well before the
/// resync interval, until the lock is free.
fn retries_while_the_xtables_lock_is_held(plane: Plane) {
    let bed = Bed::new(
        plane,
        "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 60s\n",
    );
    let lock = bed.topo.path("xtables.lock");
    std::fs::write(&lock, "").unwrap();
    // Longer than the 5 s iptables waits for the lock.
    let mut holder = std::process::Command::new("flock")
        .arg(&lock)
        .args(["sleep", "8"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let agent = bed.launch_agent(
        &bed.plane_args(),
        &[("XTABLES_LOCKFILE", lock.to_str().unwrap())],
    );
    wait_for_long(Duration::from_secs(30), || {
        Ok(agent.log_text().contains("policy applied"))
    })
    .unwrap_or_else(|e| panic!("never applied: {e}\n{}", agent.log_text()));
    let _ = holder.wait();
    let log = agent.log_text();
    assert_eq!(
        log.matches("error syncing masquerade rules").count(),
        1,
        "the held lock is logged once:\n{log}"
    );
    assert!(log.contains("xtables lock"), "{log}");
    assert!(bed.chain().is_some_and(|c| c.contains("-d 10.0.0.0/8")));
}

fn ipv6_chain_follows_enable_ipv6(plane: Plane) {
    let bed = Bed::new(plane, "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]\n");
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
    assert_success(&out);
    let v6 = bed.ip6tables(&["-t", "nat", "-S", CHAIN]).unwrap();
    let returns: Vec<&str> = v6
        .lines()
        .filter(|l| l.contains("-j RETURN"))
        .map(|l| l.split_whitespace().nth(3).unwrap())
        .collect();
    assert_eq!(returns, ["fe80::/10", "fc00::/7"], "{v6}");
    assert!(v6.contains("-j MASQUERADE"), "{v6}");
    assert!(
        !bed.chain().unwrap().contains("fc00"),
        "IPv6 CIDRs stay out of the IPv4 chain"
    );
    assert!(
        bed.ip6tables(&["-t", "nat", "-S", "POSTROUTING"])
            .unwrap()
            .contains(&format!("-j {CHAIN}"))
    );

    assert_success(&bed.agent_cmd(&["cleanup"]));
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

// ---- masqueradeCIDRs: exceptions decided by the longest prefix ------------------------------

impl Family {
    /// The config of `family.config()`'s pods and services, with `non_masq` more
    /// non-masquerade prefixes and the exceptions `masq`.
    fn config_with(self, non_masq: &[&str], masq: &[&str]) -> String {
        let base: &[&str] = match self {
            Family::V4 => &["10.0.0.0/8"],
            Family::V6 => &["10.0.0.0/8", "fd00:10:244::/48", "fd00:200::/64"],
        };
        let list =
            |cidrs: &[&str]| -> String { cidrs.iter().map(|c| format!("  - {c}\n")).collect() };
        format!(
            "nonMasqueradeCIDRs:\n{}{}masqueradeCIDRs:\n{}resyncInterval: 1s\n",
            list(base),
            list(non_masq),
            list(masq)
        )
    }

    /// The outside host's prefix on the first uplink, and the outside host itself as a prefix
    /// of one address.
    fn outside_prefixes(self) -> (&'static str, &'static str) {
        match self {
            Family::V4 => ("203.0.113.0/24", "203.0.113.10/32"),
            Family::V6 => ("2001:db8:1::/64", "2001:db8:1::10/128"),
        }
    }

    /// Another address of the outside host in that prefix, with a route back to the pods.
    fn routable_client(self) -> SocketAddr {
        match self {
            Family::V4 => (topology::ROUTABLE_CLIENT_ADDR, PORT).into(),
            Family::V6 => (topology::ROUTABLE_CLIENT_ADDR_V6, PORT).into(),
        }
    }

    fn second_outside(self) -> SocketAddr {
        match self {
            Family::V4 => second_outside(),
            Family::V6 => (topology::EXT_SECOND_ADDR_V6, PORT).into(),
        }
    }
}

/// An exception inside a non-masquerade range is masqueraded and the rest of the range keeps
/// the pod's address, as the outside host sees them, for what the programs translate and for
/// what the chain beside them does (GRE); taking the exception out lets the range keep
/// addresses again.
fn an_exception_inside_a_non_masquerade_range_is_masqueraded(plane: Plane, family: Family) {
    let (range, outside_host) = family.outside_prefixes();
    let bed = Bed::new(plane, &family.config_with(&[range], &[outside_host]));
    let gre = family.observe(&bed.topo.ext, IPPROTO_GRE);
    let _agent = bed.start_agent(family.agent_args());
    family.assert_masqueraded(&bed);
    wait_for_udp_source(&bed, family.outside(), family.node());
    assert_gre_leaves_with(&bed, &gre, family.outside().ip(), family.node());
    let seen = probe::tcp_probe(bed.pod(), family.routable_client(), 0).unwrap();
    assert_eq!(
        seen.ip(),
        family.pod(0),
        "the rest of the range keeps the pod's address"
    );

    write_config(&bed.config, &family.config_with(&[range], &[])).unwrap();
    wait_for_udp_source(&bed, family.outside(), family.pod(0));
}

/// `nonMasqueradeCIDRs: [0.0.0.0/0]` with exceptions is an allow-list: only the exceptions are
/// masqueraded, by the programs and by the chain beside them.
fn an_allow_list_masquerades_only_its_exceptions(plane: Plane, family: Family) {
    let (_, outside_host) = family.outside_prefixes();
    let everything = match family {
        Family::V4 => "0.0.0.0/0",
        Family::V6 => "::/0",
    };
    let bed = Bed::new(plane, &family.config_with(&[everything], &[outside_host]));
    let gre = family.observe(&bed.topo.ext, IPPROTO_GRE);
    let _agent = bed.start_agent(family.agent_args());
    family.assert_masqueraded(&bed);
    assert_gre_leaves_with(&bed, &gre, family.outside().ip(), family.node());
    wait_for_udp_source(&bed, family.second_outside(), family.pod(0));
    let gre_elsewhere = family.observe(&bed.topo.ext, IPPROTO_GRE);
    let elsewhere = family.second_outside().ip();
    assert_gre_leaves_with(&bed, &gre_elsewhere, elsewhere, family.pod(0));
}

/// An exception inside link-local masquerades that one address (a metadata server, say) and
/// leaves the rest of link-local alone.
fn an_exception_inside_link_local_is_masqueraded(plane: Plane) {
    let bed = Bed::new(plane, &Family::V4.config_with(&[], &["169.254.169.254/32"]));
    let _agent = bed.start_agent(&[]);
    let link_local = SocketAddr::from((topology::LINK_LOCAL_ADDR, PORT));
    wait_for_udp_source(&bed, link_local, node_ip());
    write_config(&bed.config, DEFAULT_CONFIG).unwrap();
    wait_for_udp_source(&bed, link_local, pod_ip(0));
}

/// A directory of config files, as kubelet projects a cloud provider's ConfigMap beside the
/// user's: merged; one of them made invalid keeps the last good merged policy in force, with
/// an error that names the file; the file gone, its prefixes go.
fn several_config_files_are_merged_and_an_invalid_one_changes_nothing(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let cloud = bed.config.with_file_name("ip-masq-cloud");
    write_config(
        &cloud,
        "nonMasqueradeCIDRs: [198.51.100.0/24]\nresyncInterval: 1s\n",
    )
    .unwrap();
    let agent = bed.start_agent_on_config_dir(&[]);
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    Family::V4.assert_masqueraded(&bed);

    write_config(&cloud, "nonMasqueradeCIDRs: [abcdefg]\n").unwrap();
    wait_for(|| {
        let log = agent.log_text();
        Ok(log.contains("ip-masq-cloud") && log.contains("abcdefg"))
    })
    .expect("the error names the file");
    std::thread::sleep(Duration::from_millis(2500));
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    Family::V4.assert_masqueraded(&bed);

    std::fs::remove_file(&cloud).unwrap();
    wait_for_udp_source(&bed, second_outside(), node_ip());
}

impl Bed {
    /// `masq-agent explain DST --json` with the agent's own flags: its exit status, and what it
    /// printed.
    fn explain(&self, dst: IpAddr, family: Family) -> (bool, serde_json::Value) {
        let dst = dst.to_string();
        let mut args = vec!["explain".to_string(), dst, "--json".to_string()];
        args.extend(self.plane_args());
        args.extend(family.agent_args().iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.agent_cmd(&args);
        let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&out.stderr));
        });
        (out.status.success(), json)
    }
}

/// Where IPv6 is turned on by the file (`enableIPv6: true`) rather than by the flag, `explain`
/// names the IPv6 entry that decides, with its file and line, as it does under the flag.
fn explain_names_the_entry_when_the_file_turns_ipv6_on(plane: Plane) {
    let (range, outside_host) = Family::V6.outside_prefixes();
    let config = Family::V6.config_with(&[range], &[outside_host]) + "enableIPv6: true\n";
    let bed = Bed::new(plane, &config);
    let _agent = bed.start_agent(&[]);
    let dst = Family::V6.outside().ip().to_string();
    let mut args = vec!["explain".to_string(), dst, "--json".to_string()];
    args.extend(bed.plane_args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bed.agent_cmd(&args);
    let said: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(said["decision"], "masquerade", "{said:#}");
    assert_eq!(said["entry"]["prefix"], outside_host, "{said:#}");
    assert_eq!(said["entry"]["list"], "masqueradeCIDRs", "{said:#}");
    let line = config
        .lines()
        .position(|l| l.contains(outside_host))
        .unwrap()
        + 1;
    assert_eq!(said["entry"]["line"], line, "{said:#}");
    assert_eq!(said["entry"]["file"], bed.config.display().to_string());
}

/// Sources no one has, off the outside host's links, so that the node's answers go out by its
/// uplink (where the programs see them) and reach no one.
fn spoofed(family: Family, i: u16) -> IpAddr {
    match family {
        Family::V4 => std::net::Ipv4Addr::new(192, 0, 2, 100 + (i % 100) as u8).into(),
        Family::V6 => std::net::Ipv6Addr::new(0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 1 + i).into(),
    }
}

/// SYNs from `count` spoofed sources to the node's `port`.
fn spoofed_syns(family: Family, port: u16, count: u16) -> Vec<Vec<u8>> {
    use masq_testbed::packet::{SYN, tcp};
    (0..count)
        .map(|i| match (spoofed(family, i), family.node()) {
            (IpAddr::V4(src), IpAddr::V4(node)) => tcp(src, 40000 + i, node, port, SYN),
            (IpAddr::V6(src), IpAddr::V6(node)) => tcp(src, 40000 + i, node, port, SYN),
            _ => unreachable!("one family"),
        })
        .collect()
}

/// Connections from outside to the node's own services, real or spoofed, to a port it listens
/// on or to a closed one, and the node's own clients' churn (a DNS forwarder's fresh port per
/// query) take nothing from the NAT table that the pods' flows need: with room for 64 flows, a
/// pod's new connections keep succeeding after hundreds of them.
fn connections_to_the_nodes_services_leave_the_pods_their_nat_table(plane: Plane, family: Family) {
    const SERVICE: u16 = 20080;
    const CLOSED: u16 = 20081;
    let bed = Bed::new(plane, family.config());
    // A node service, listening before the agent starts, that holds every connection open.
    let listener =
        masq_testbed::netns::within(&bed.topo.node, || Ok(TcpListener::bind(("::", SERVICE))?))
            .unwrap();
    let accepted = std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(200) {
            held.push(stream);
        }
        held
    });
    let agent = bed.start_agent(&family.small_table_args());
    family.assert_masqueraded(&bed);

    // Real connections from outside, held open.
    let node = SocketAddr::from((family.node(), SERVICE));
    let clients: Vec<TcpStream> = (0..200)
        .map(|_| {
            masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpStream::connect(node)?))
                .unwrap()
        })
        .collect();
    assert_eq!(accepted.join().unwrap().len(), 200);
    family.assert_masqueraded(&bed);
    // Spoofed SYNs to the service (the node answers each with a SYN-ACK) and to a closed port
    // (with a reset).
    let mut flood = spoofed_syns(family, SERVICE, 300);
    flood.extend(spoofed_syns(family, CLOSED, 300));
    probe::send_frames(&bed.topo.ext, flood).unwrap();
    for _ in 0..3 {
        family.assert_masqueraded(&bed);
    }
    // The node's clients, each from a fresh port of its ephemeral range.
    let outside = family.outside();
    masq_testbed::netns::within(&bed.topo.node, move || {
        for _ in 0..300 {
            let unspecified: IpAddr = match outside {
                SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
            };
            UdpSocket::bind((unspecified, 0))?.send_to(b"query", outside)?;
        }
        Ok(())
    })
    .unwrap();
    family.assert_masqueraded(&bed);
    if plane == Plane::Ebpf {
        let status = bed.status_json();
        let node_flows = status["ebpf"]["nat_node_flows"].as_u64().unwrap();
        assert!(
            node_flows < 10,
            "{node_flows} node flows held: {}",
            agent.log_text()
        );
        assert_eq!(status["ebpf"]["counters"]["dropped_nat_table_full"], 0);
    }
    drop(clients);
}

/// kube-proxy's NodePort in the tests.
const NODE_PORT: u16 = 30080;

/// `count` established connections from outside to a NodePort whose endpoint is on another node
/// (the outside host, for want of one), each as the client's end and the endpoint's: kube-proxy
/// DNATs them and masquerades them to the node's address with ports from the whole range
/// (`--random-fully`), so that most take ports NAT hands out too and hold them in the NAT table.
fn nodeport_connections_to_another_node(
    bed: &Bed,
    family: Family,
    count: usize,
) -> Vec<(TcpStream, TcpStream)> {
    let endpoint = SocketAddr::from((family.outside().ip(), 9706));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(endpoint)?))
            .unwrap();
    let node = family.node();
    let host = match family {
        Family::V4 => format!("{node}/32"),
        Family::V6 => format!("{node}/128"),
    };
    let mark = format!(
        "-A PREROUTING -d {host} -p tcp --dport {NODE_PORT} -j MARK --set-xmark 0x4000/0x4000"
    );
    let dnat = format!(
        "-A PREROUTING -d {host} -p tcp --dport {NODE_PORT} -j DNAT --to-destination {endpoint}"
    );
    kube_proxy(
        bed,
        family,
        &[
            &mark,
            &dnat,
            "-I POSTROUTING 1 -m mark --mark 0x4000/0x4000 -j MASQUERADE --random-fully",
        ],
    );
    let service = SocketAddr::from((node, NODE_PORT));
    let clients: Vec<TcpStream> = (0..count)
        .map(|_| {
            masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpStream::connect(service)?))
                .unwrap()
        })
        .collect();
    let served = listener.incoming().take(count).map(|s| s.unwrap());
    let mut connections: Vec<(TcpStream, TcpStream)> = clients.into_iter().zip(served).collect();
    // Past the handshake both ways: established flows, each with a reservation.
    for (client, server) in &mut connections {
        exchange_a_byte(client, server);
    }
    connections
}

/// NodePort connections to an endpoint on another node take ports NAT hands out, and hold them
/// in the NAT table. Established or spoofed, however many, they never cost a pod its new
/// connections: a full table gives up the node's reservations first, and the connections keep
/// working.
fn nodeport_connections_to_another_node_leave_the_pods_their_nat_table(
    plane: Plane,
    family: Family,
) {
    let bed = Bed::new(plane, family.config());
    let _agent = bed.start_agent(&family.small_table_args());
    family.assert_masqueraded(&bed);
    let mut connections = nodeport_connections_to_another_node(&bed, family, 100);
    probe::send_frames(&bed.topo.ext, spoofed_syns(family, NODE_PORT, 300)).unwrap();

    for _ in 0..5 {
        family.assert_masqueraded(&bed);
    }
    // The node's connections keep working.
    for (client, server) in &mut connections {
        exchange_a_byte(client, server);
    }
    assert_made_room(&bed, "nat_node_flow_dropped");
}

/// A byte from `client` to `server` and one back, within three seconds each.
fn exchange_a_byte(client: &mut TcpStream, server: &mut TcpStream) {
    use std::io::{Read, Write};
    let one_way = |from: &mut TcpStream, to: &mut TcpStream| {
        let mut byte = [0u8; 1];
        to.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        from.write_all(b"x").unwrap();
        to.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"x");
    };
    one_way(client, server);
    one_way(server, client);
}

/// On the eBPF plane: the NAT table was full, and made room for every new flow of a pod by
/// dropping flows that `dropped` counts.
fn assert_made_room(bed: &Bed, dropped: &str) {
    if bed.plane == Plane::Ebpf {
        let counters = &bed.status_json()["ebpf"]["counters"];
        assert!(counters[dropped].as_u64().unwrap() > 0, "{counters:#}");
        assert_eq!(counters["dropped_nat_table_full"], 0, "{counters:#}");
    }
}

/// `masq-agent flows` says which port a pod's flow got and why it is still held, as `conntrack
/// -L` would: the pod's tuple, the node's, whose flow it is, its state and when it expires;
/// filtered by pod, destination, kind and protocol.
fn flows_says_which_port_a_pod_got_and_why_it_is_held(plane: Plane, family: Family) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let udp = probe::udp_probe(bed.pod(), family.outside(), 5353).unwrap();
    let tcp = probe::tcp_probe(bed.pod(), family.outside(), 0).unwrap();
    let pod = family.pod(0).to_string();

    let flows = bed.flows_json(&["--pod", &pod, "--proto", "udp"]);
    let [flow] = flows.as_slice() else {
        panic!("the UDP flow alone: {flows:#?}");
    };
    assert_eq!(flow["proto"], "udp", "{flow:#}");
    assert_eq!(flow["kind"], "pod", "{flow:#}");
    assert_eq!(flow["source"]["addr"], pod, "{flow:#}");
    assert_eq!(flow["source"]["port"], 5353, "{flow:#}");
    assert_eq!(
        flow["destination"]["addr"],
        family.outside().ip().to_string()
    );
    assert_eq!(flow["destination"]["port"], family.outside().port());
    assert_eq!(flow["translated_to"]["addr"], udp.ip().to_string());
    assert_eq!(
        flow["translated_to"]["port"],
        udp.port(),
        "the port the host saw"
    );
    assert_eq!(flow["state"], "replied", "answered once, as a query");
    let left = flow["expires_in_seconds"].as_u64().unwrap();
    assert!((1..=30).contains(&left), "a query's 30 s: {flow:#}");

    let flows = bed.flows_json(&["--proto", "tcp", "--kind", "pod"]);
    assert!(
        flows
            .iter()
            .any(|f| f["translated_to"]["port"] == tcp.port() && f["source"]["addr"] == pod),
        "{flows:#?}"
    );
    let elsewhere = match family {
        Family::V4 => "192.0.2.0/24",
        Family::V6 => "2001:db8:99::/64",
    };
    assert!(bed.flows_json(&["--destination", elsewhere]).is_empty());
    assert!(bed.flows_json(&["--kind", "kept"]).is_empty());

    let text = bed.flows(&["--pod", &pod, "--proto", "udp"]);
    let translated = match udp {
        SocketAddr::V4(_) => format!("as {udp} replied"),
        SocketAddr::V6(_) => format!("as [{}]:{} replied", udp.ip(), udp.port()),
    };
    assert!(text.contains(&translated), "{text}");
    assert!(text.ends_with("\n1 flow\n"), "{text}");
}

/// `count` queries from the pod, each from a fresh port, to `port` of the outside host, where a
/// server reads nothing and, its socket bound, sends no port unreachable either: flows never
/// answered. The server, to keep while it should stay silent.
fn unanswered_queries(bed: &Bed, family: Family, port: u16, count: usize) -> UdpSocket {
    let silent = SocketAddr::from((family.outside().ip(), port));
    let server =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(UdpSocket::bind(silent)?)).unwrap();
    let any = family.any();
    masq_testbed::netns::within(bed.pod(), move || {
        for _ in 0..count {
            UdpSocket::bind((any, 0))?.send_to(b"query", silent)?;
        }
        Ok(())
    })
    .unwrap();
    server
}

/// An agent restarted over a NAT table that pods filled with flows never answered: its programs
/// find those flows to drop (the agent hands them the table's flows when it loads them), and
/// pods keep connecting.
fn a_table_filled_before_a_restart_still_makes_room(plane: Plane, family: Family) {
    let bed = Bed::new(plane, family.config());
    let args = family.small_table_args();
    let mut agent = bed.start_agent(&args);
    family.assert_masqueraded(&bed);
    let _server = unanswered_queries(&bed, family, 9707, 100);
    agent.stop(libc::SIGKILL).unwrap();
    let _restarted = bed.start_agent(&args);
    for _ in 0..5 {
        family.assert_masqueraded(&bed);
    }
    if plane == Plane::Ebpf {
        let status = bed.status_json();
        assert_eq!(
            status["ebpf"]["nat_entries"], 128,
            "the test filled the table: {status:#}"
        );
    }
}

/// A NAT table that the node's flows fill, replaced by a smaller one (another
/// `--nat-capacity`): the pods' flows are carried first, so that every pod connection survives,
/// and pods keep connecting.
fn a_smaller_table_carries_the_pods_flows_first(plane: Plane, family: Family) {
    let bed = Bed::new(plane, family.config());
    let mut agent = bed.start_agent(&family.small_table_args());
    let held = SocketAddr::from((family.outside().ip(), 9708));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(held)?)).unwrap();
    let mut pods_connections: Vec<(TcpStream, TcpStream)> = (0..4)
        .map(|_| {
            let pod_end =
                masq_testbed::netns::within(bed.pod(), move || Ok(TcpStream::connect(held)?))
                    .unwrap();
            (pod_end, listener.accept().unwrap().0)
        })
        .collect();
    for (pod_end, host_end) in &mut pods_connections {
        exchange_a_byte(pod_end, host_end);
    }
    let _node_connections = nodeport_connections_to_another_node(&bed, family, 100);
    agent.stop(libc::SIGTERM).unwrap();
    let mut args = family.agent_args().to_vec();
    args.push("--nat-capacity=16");
    let _smaller = bed.start_agent(&args);
    for (pod_end, host_end) in &mut pods_connections {
        exchange_a_byte(pod_end, host_end);
    }
    family.assert_masqueraded(&bed);
    if plane == Plane::Ebpf {
        let counters = &bed.status_json()["ebpf"]["counters"];
        assert!(
            counters["nat_flows_not_carried"].as_u64().unwrap() > 0,
            "the node's flows did not all fit: {counters:#}"
        );
    }
}

/// A pod's resolver retrying against a server that never answers, each query from a fresh
/// port, fills a small NAT table with flows no one will use again. As conntrack's early drop
/// does, those make room for the pods' next flows: with room for 64 flows, after 300 unanswered
/// queries a pod still connects, and a connection established before them still carries data.
fn a_pods_unanswered_queries_leave_room_for_new_flows(plane: Plane, family: Family) {
    const SILENT: u16 = 9702;
    const HELD: u16 = 9703;
    let bed = Bed::new(plane, family.config());
    let _agent = bed.start_agent(&family.small_table_args());
    family.assert_masqueraded(&bed);

    let outside = family.outside().ip();
    let held = SocketAddr::from((outside, HELD));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(held)?)).unwrap();
    let mut pod_end =
        masq_testbed::netns::within(bed.pod(), move || Ok(TcpStream::connect(held)?)).unwrap();
    let (mut host_end, _) = listener.accept().unwrap();
    host_end
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    pod_end
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    exchange_a_byte(&mut pod_end, &mut host_end);

    let _server = unanswered_queries(&bed, family, SILENT, 300);

    family.assert_masqueraded(&bed);
    exchange_a_byte(&mut pod_end, &mut host_end);
    assert_made_room(&bed, "nat_early_dropped");
}

/// `explain` says what the outside host sees, with the entry that decides it, and the data
/// plane installed agrees; with the data plane tampered with (the agent stopped, so that it
/// does not repair it first), it disagrees and exits 1.
fn explain_says_what_the_outside_host_sees(plane: Plane, family: Family) {
    let (range, outside_host) = family.outside_prefixes();
    let config = family.config_with(&[range], &[outside_host]);
    let bed = Bed::new(plane, &config);
    let mut agent = bed.start_agent(family.agent_args());
    family.assert_masqueraded(&bed);
    let (agrees, said) = bed.explain(family.outside().ip(), family);
    assert!(agrees, "{said:#}");
    assert_eq!(said["decision"], "masquerade", "{said:#}");
    assert_eq!(
        said["masqueraded_to"],
        family.node().to_string(),
        "{said:#}"
    );
    assert_eq!(said["entry"]["prefix"], outside_host, "{said:#}");
    assert_eq!(said["entry"]["list"], "masqueradeCIDRs", "{said:#}");
    let line = config
        .lines()
        .position(|l| l.contains(outside_host))
        .unwrap()
        + 1;
    assert_eq!(said["entry"]["line"], line, "{said:#}");
    assert_eq!(said["entry"]["file"], bed.config.display().to_string());
    let installed = said["installed"].as_array().unwrap();
    assert_eq!(installed.len(), 1, "{said:#}");

    // Run as `kubectl exec` runs it, without the daemon's flags: the running agent's are used.
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    let dst = family.outside().ip().to_string();
    let bare = bed.agent_cmd(&["explain", &dst, "--json", &bpffs]);
    let said: serde_json::Value = serde_json::from_slice(&bare.stdout).unwrap();
    assert!(bare.status.success(), "{said:#}");
    assert_eq!(said["entry"]["list"], "masqueradeCIDRs", "{said:#}");

    let client = family.routable_client();
    let seen = probe::tcp_probe(bed.pod(), client, 0).unwrap();
    assert_eq!(seen.ip(), family.pod(0));
    let (agrees, said) = bed.explain(client.ip(), family);
    assert!(agrees, "{said:#}");
    assert_eq!(said["decision"], "keeps-address", "{said:#}");
    assert_eq!(said["entry"]["prefix"], range, "{said:#}");

    agent.stop(libc::SIGTERM).unwrap();
    match plane {
        // The exception out of the trie: the programs would keep the pod's address.
        Plane::Ebpf => {
            let host = family.outside().ip();
            let (bits, octets) = match host {
                IpAddr::V4(a) => (32u32, a.octets().to_vec()),
                IpAddr::V6(a) => (128u32, a.octets().to_vec()),
            };
            let map = match family {
                Family::V4 => "non_masq_v4",
                Family::V6 => "non_masq_v6",
            };
            let pin = bed.topo.bpffs.join(map).display().to_string();
            let key: Vec<String> = bits
                .to_ne_bytes()
                .into_iter()
                .chain(octets)
                .map(|b| b.to_string())
                .collect();
            let mut args = vec!["map", "delete", "pinned", &pin, "key"];
            args.extend(key.iter().map(String::as_str));
            bed.topo.node_run("bpftool", &args).unwrap();
        }
        // The chain flushed down to one rule that returns everything.
        _ => {
            let table = |args: &[&str]| match family {
                Family::V4 => bed.iptables(args),
                Family::V6 => bed.ip6tables(args),
            };
            table(&["-t", "nat", "-F", CHAIN]).unwrap();
            table(&["-t", "nat", "-A", CHAIN, "-j", "RETURN"]).unwrap();
        }
    }
    let (agrees, said) = bed.explain(family.outside().ip(), family);
    assert!(!agrees, "a tampered data plane must disagree: {said:#}");
    assert_eq!(
        said["installed"][0]["decision"], "keeps-address",
        "{said:#}"
    );
}

/// The decisions `status` reports for the entry `prefix` (`None`: no such entry, or no slot),
/// and the totals per action.
fn decisions_of(status: &serde_json::Value, prefix: &str) -> Option<u64> {
    let entries = status["ebpf"]["decisions"]["entries"].as_array()?;
    let entry = entries.iter().find(|e| e["prefix"] == prefix)?;
    entry["decisions"].as_u64()
}

/// Each entry counts what it decides, as `status`, `explain` and the metrics read it: a new
/// flow to an exception once, every packet of a flow that keeps its address, and an entry no
/// traffic reaches never; the counts survive an agent restart.
fn the_entries_that_decide_traffic_are_counted(plane: Plane, family: Family) {
    let (range, outside_host) = family.outside_prefixes();
    let unused = match family {
        Family::V4 => "198.18.0.0/15",
        Family::V6 => "2001:db8:ffff::/48",
    };
    let config = family.config_with(&[range, unused], &[outside_host]);
    let bed = Bed::new(plane, &config);
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    let mut args = vec![metrics_addr.as_str()];
    args.extend(family.agent_args());
    let mut agent = bed.start_agent(&args);
    let before = bed.status_json();
    let exception_before = decisions_of(&before, outside_host).expect("the exception's count");
    let range_before = decisions_of(&before, range).expect("the range's count");

    const NEW_FLOWS: u64 = 3;
    for _ in 0..NEW_FLOWS {
        family.assert_masqueraded(&bed);
    }
    let seen = probe::tcp_probe(bed.pod(), family.routable_client(), 0).unwrap();
    assert_eq!(seen.ip(), family.pod(0));

    let status = bed.status_json();
    assert_eq!(
        decisions_of(&status, outside_host),
        Some(exception_before + NEW_FLOWS),
        "one decision per new masqueraded flow: {status:#}"
    );
    let range_now = decisions_of(&status, range).unwrap();
    assert!(
        range_now >= range_before + 3,
        "a connection that keeps its address is decided at each of its packets: {status:#}"
    );
    assert_eq!(decisions_of(&status, unused), Some(0));
    let text = bed.agent_cmd(&["status", &format!("--bpffs={}", bed.topo.bpffs.display())]);
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    let never = text
        .lines()
        .find(|l| l.contains("never matched:"))
        .unwrap_or("");
    assert!(never.contains(unused), "{text}");
    let busiest = text.lines().find(|l| l.contains("busiest:")).unwrap_or("");
    assert!(
        busiest.contains(range) || busiest.contains(outside_host),
        "{text}"
    );

    let (agrees, said) = bed.explain(family.outside().ip(), family);
    assert!(agrees, "{said:#}");
    assert_eq!(
        said["installed"][0]["decisions"].as_u64(),
        decisions_of(&status, outside_host),
        "{said:#}"
    );

    let (_, metrics) = http_get(&bed, "/metrics");
    let total = |action: &str| {
        let series = format!("masq_agent_policy_decisions_total{{action=\"{action}\"}}");
        metric(&metrics, &series).unwrap_or_else(|| panic!("{series} in:\n{metrics}")) as u64
    };
    let totals = &status["ebpf"]["decisions"]["totals"];
    assert!(total("masquerade") >= totals["masquerade"].as_u64().unwrap());
    assert!(total("masquerade") >= exception_before + NEW_FLOWS);
    assert!(total("non-masquerade") >= totals["non_masquerade"].as_u64().unwrap());
    assert!(
        !metrics.contains(&format!("prefix=\"{range}\"")),
        "no series per prefix"
    );

    agent.stop(libc::SIGTERM).unwrap();
    let _agent = bed.start_agent(&args);
    let after = bed.status_json();
    assert_eq!(
        decisions_of(&after, outside_host),
        decisions_of(&status, outside_host),
        "a restart keeps the counts: {after:#}"
    );
    assert!(decisions_of(&after, range) >= Some(range_now));
}

/// `enableIPv6` in the file switches IPv6 masquerading live, over the flag: on (on the eBPF
/// plane, loaded without IPv6, by the chain beside the programs), then off again (the chain
/// goes, and new IPv6 flows keep the pod's address).
fn enable_ipv6_in_the_file_switches_ipv6_live(plane: Plane) {
    let off = format!("{DEFAULT_CONFIG}enableIPv6: false\n");
    let bed = Bed::new(plane, &off);
    let agent = bed.start_agent(&[]);
    wait_for_udp_source(&bed, outside_v6(), pod_ip_v6(0));

    write_config(&bed.config, &format!("{IPV6_CONFIG}enableIPv6: true\n")).unwrap();
    wait_for_udp_source(&bed, outside_v6(), node_ip_v6());
    Family::V6.assert_masqueraded(&bed);
    if plane == Plane::Ebpf {
        wait_for(|| {
            Ok(agent
                .log_text()
                .contains("ip6tables chain masquerades IPv6"))
        })
        .expect("the switch is said");
    }

    write_config(&bed.config, &off).unwrap();
    wait_for_udp_source(&bed, outside_v6(), pod_ip_v6(0));
    let chain = bed.ip6tables(&["-t", "nat", "-S", CHAIN]).unwrap();
    assert!(
        !chain.contains("MASQUERADE"),
        "the ip6tables chain masquerades nothing: {chain}"
    );
}

/// `enableIPv6: false` in the file, over `--enable-ipv6`, live: a connection already
/// masqueraded goes on, and new IPv6 flows keep the pod's address.
fn enable_ipv6_off_in_the_file_keeps_what_is_open(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    let conversation = Conversation::open(&bed, Family::V6, 9750);
    assert_eq!(conversation.node_side.ip(), node_ip_v6(), "masqueraded");

    write_config(&bed.config, &format!("{DEFAULT_CONFIG}enableIPv6: false\n")).unwrap();
    wait_for_udp_source(&bed, outside_v6(), pod_ip_v6(0));
    conversation
        .exchange("still there")
        .expect("the connection masqueraded before goes on");
}

// ---- IPv6 (--enable-ipv6), on every data plane --------------------------------------------

/// The pods' own prefix is exempt, as 10.0.0.0/8 holds the IPv4 pods: without it, the chain
/// would masquerade connections from outside on their way in.
const IPV6_CONFIG: &str = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fd00:10:244::/48\n  - fd00:200::/64\nresyncInterval: 1s\n";

/// The address family a case runs over, for the cases written once for both.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn config(self) -> &'static str {
        match self {
            Family::V4 => DEFAULT_CONFIG,
            Family::V6 => IPV6_CONFIG,
        }
    }

    fn agent_args(self) -> &'static [&'static str] {
        match self {
            Family::V4 => &[],
            Family::V6 => &["--enable-ipv6"],
        }
    }

    fn outside(self) -> SocketAddr {
        match self {
            Family::V4 => outside(),
            Family::V6 => outside_v6(),
        }
    }

    fn node(self) -> IpAddr {
        match self {
            Family::V4 => node_ip(),
            Family::V6 => node_ip_v6(),
        }
    }

    /// The agent's arguments, with room for 64 flows in the NAT table: tests of a full table
    /// fill it in a moment.
    fn small_table_args(self) -> Vec<&'static str> {
        let mut args = self.agent_args().to_vec();
        args.push("--nat-capacity=64");
        args
    }

    /// A TCP connection from the pod to the outside arrives from the node's address.
    fn assert_masqueraded(self, bed: &Bed) {
        let seen = probe::tcp_probe(bed.pod(), self.outside(), 0).unwrap();
        assert_eq!(seen.ip(), self.node(), "TCP to the outside is masqueraded");
    }
}

fn ipv6_survives_the_uplink_going_down_and_up(plane: Plane) {
    uplink_goes_down_and_up(plane, Family::V6);
}

fn ipv6_survives_the_uplink_being_deleted_and_recreated(plane: Plane) {
    uplink_is_deleted_and_recreated(plane, Family::V6);
}

fn ipv6_a_killed_agent_does_not_break_a_transfer(plane: Plane) {
    killed_agent_does_not_break_a_transfer(plane, Family::V6);
}

fn outside_v6() -> SocketAddr {
    (topology::EXT_ADDR_V6, PORT).into()
}

fn node_ip_v6() -> IpAddr {
    topology::NODE_UPLINK_V6.into()
}

fn pod_ip_v6(i: usize) -> IpAddr {
    topology::pod_addr_v6(i).into()
}

/// Pings `dst` over IPv6 from pod `i`, with `extra` options first.
fn ping6(bed: &Bed, i: usize, extra: &[&str], dst: std::net::Ipv6Addr) -> Output {
    let dst = dst.to_string();
    let mut args = vec!["-6", "-c", "1", "-W", "2"];
    args.extend_from_slice(extra);
    args.push(&dst);
    bed.ping_output(i, &args)
}

fn ipv6_masquerades_outside_traffic_only(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let pings = RawObserver::start_v6(&bed.topo.ext, i32::from(IPPROTO_ICMPV6)).unwrap();
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    let seen = probe::tcp_probe(bed.pod(), outside_v6(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip_v6(), "TCP to the outside is masqueraded");
    let seen = probe::udp_probe(bed.pod(), outside_v6(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip_v6(), "UDP to the outside is masqueraded");
    let out = ping6(&bed, 0, &[], topology::EXT_ADDR_V6);
    assert_success(&out);
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    assert_eq!(
        pings.sources(),
        [node_ip_v6()],
        "and left with the node's address"
    );

    let cluster_local = SocketAddr::from((topology::CLUSTER_LOCAL_ADDR_V6, PORT));
    let seen = probe::tcp_probe(bed.pod(), cluster_local, 0).unwrap();
    assert_eq!(
        seen.ip(),
        pod_ip_v6(0),
        "cluster-local keeps the pod address"
    );
    let seen = probe::udp_probe(bed.pod(), cluster_local, 0).unwrap();
    assert_eq!(seen.ip(), pod_ip_v6(0));
    assert_success(&ping6(&bed, 0, &[], topology::CLUSTER_LOCAL_ADDR_V6));
    wait_for(|| Ok(pings.sources().len() == 2)).unwrap();
    assert_eq!(
        pings.sources()[1],
        pod_ip_v6(0),
        "ping to cluster-local keeps the pod address"
    );
    // IPv4 is masqueraded as before, beside it.
    assert_masqueraded(&bed);
}

fn ipv6_two_pods_with_one_source_port_share_the_node_address(plane: Plane) {
    let bed = Bed::with_pods(plane, IPV6_CONFIG, 2);
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    let pods = &bed.topo.pods;
    for probe in [probe::tcp_probe, probe::udp_probe] {
        let a = probe(&pods[0], outside_v6(), 40000).unwrap();
        let b = probe(&pods[1], outside_v6(), 40000).unwrap();
        assert_eq!((a.ip(), b.ip()), (node_ip_v6(), node_ip_v6()));
        assert_ne!(a.port(), b.port(), "two pods, one port each on the node");
    }
}

fn ipv6_applies_a_config_change_live(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    let second = SocketAddr::from((topology::EXT_SECOND_ADDR_V6, PORT));
    wait_for_udp_source(&bed, second, node_ip_v6());
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00:10:244::/48', 'fd00:200::/64', '2001:db8:2::/64']\nresyncInterval: 1s\n",
    )
    .unwrap();
    wait_for_udp_source(&bed, second, pod_ip_v6(0));
    write_config(&bed.config, IPV6_CONFIG).unwrap();
    wait_for_udp_source(&bed, second, node_ip_v6());
}

fn ipv6_connections_from_outside_keep_the_pod_address(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    let pod = topology::pod_addr_v6(0);
    let in_pod = Observer::start(bed.pod(), &[pod], 9090).unwrap();
    let client = SocketAddr::from((topology::ROUTABLE_CLIENT_ADDR_V6, 0));
    // The handshake only completes if the pod's SYN-ACK leaves with the pod's own address.
    let seen = probe::tcp_probe_from(&bed.topo.ext, client, (pod, 9090).into()).unwrap();
    assert_eq!(seen.ip(), IpAddr::from(topology::ROUTABLE_CLIENT_ADDR_V6));
    assert_eq!(
        in_pod.sources(Proto::Tcp),
        [IpAddr::from(topology::ROUTABLE_CLIENT_ADDR_V6)]
    );
    let seen = probe::tcp_probe(bed.pod(), outside_v6(), 0).unwrap();
    assert_eq!(
        seen.ip(),
        node_ip_v6(),
        "the pod's own connections are still masqueraded"
    );
}

/// Packet-too-big errors from beyond the node reach the pod, which learns the path MTU.
fn ipv6_path_mtu_discovery_works_through_the_translation(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    assert_path_mtu_discovery(&bed, topology::FAR_ADDR_V6.into());
}

fn ipv6_checksums_hold_with_tx_offload_on_and_off(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let _agent = bed.start_agent(&["--enable-ipv6"]);
    assert_checksums_hold_with_tx_offload_on_and_off(&bed, outside_v6(), node_ip_v6());
}

fn ipv6_new_flows_take_the_uplink_s_new_address(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let agent = bed.start_agent(&["--enable-ipv6"]);
    let seen = probe::tcp_probe(bed.pod(), outside_v6(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip_v6());
    let old = format!("{}/64", topology::NODE_UPLINK_V6);
    assert_new_flows_take_the_new_address(&bed, &agent, outside_v6(), &old, "2001:db8:1::2/64");
}

fn ipv6_fragmented_datagrams_arrive_whole_both_ways(plane: Plane) {
    fragments_arrive_whole_both_ways(plane, Family::V6);
}

// ---- every device: a second uplink beside eth0 ------------------------------------------

/// When the node's second uplink `up1` comes to exist, relative to the agent's start.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SecondUplink {
    BeforeTheAgent,
    AfterTheAgent,
}

impl Family {
    /// The host behind the second uplink.
    fn behind_second_uplink(self) -> IpAddr {
        match self {
            Family::V4 => topology::EXT2_ADDR.into(),
            Family::V6 => topology::EXT2_ADDR_V6.into(),
        }
    }

    /// The node's address on the second uplink.
    fn second_uplink_node(self) -> IpAddr {
        match self {
            Family::V4 => topology::NODE_SECOND_UPLINK.into(),
            Family::V6 => topology::NODE_SECOND_UPLINK_V6.into(),
        }
    }

    fn ping_flag(self) -> &'static str {
        match self {
            Family::V4 => "-4",
            Family::V6 => "-6",
        }
    }

    /// What `status --json` names the family by.
    fn status_key(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// A TCP and UDP server on `ext2`, behind the second uplink (which must be connected).
fn serve_behind_second_uplink(bed: &Bed) -> Observer {
    let addrs = [Family::V4, Family::V6].map(Family::behind_second_uplink);
    Observer::start(&bed.topo.ext2, &addrs, PORT).expect("server behind up1")
}

/// A pod's TCP, UDP and ping to the host behind the second uplink arrive from the node's
/// address on that uplink, and get their answers: `ext2` has no route back to the pods.
fn assert_second_uplink_masquerades(bed: &Bed, family: Family) {
    let pings = family.observe(&bed.topo.ext2, IPPROTO_ICMP);
    let server = SocketAddr::from((family.behind_second_uplink(), PORT));
    let node = family.second_uplink_node();
    let seen = probe::tcp_probe(bed.pod(), server, 0).unwrap();
    assert_eq!(seen.ip(), node, "TCP by up1 is masqueraded");
    let seen = probe::udp_probe(bed.pod(), server, 0).unwrap();
    assert_eq!(seen.ip(), node, "UDP by up1 is masqueraded");
    let dst = server.ip().to_string();
    let ping = bed.ping_output(0, &[family.ping_flag(), "-c", "1", "-W", "2", &dst]);
    assert_success(&ping);
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    assert_eq!(pings.sources(), [node], "ping by up1 is masqueraded");
}

fn second_uplink_is_masqueraded(plane: Plane, family: Family, when: SecondUplink) {
    let bed = Bed::new(plane, family.config());
    if when == SecondUplink::BeforeTheAgent {
        bed.topo.connect_second_uplink().unwrap();
    }
    let _agent = bed.start_agent(family.agent_args());
    if when == SecondUplink::AfterTheAgent {
        bed.topo.connect_second_uplink().unwrap();
    }
    let _server = serve_behind_second_uplink(&bed);
    assert_second_uplink_masquerades(&bed, family);
    family.assert_masqueraded(&bed);
}

fn masquerades_traffic_leaving_by_a_second_uplink(plane: Plane) {
    second_uplink_is_masqueraded(plane, Family::V4, SecondUplink::BeforeTheAgent);
}

fn masquerades_traffic_leaving_by_a_second_uplink_added_later(plane: Plane) {
    second_uplink_is_masqueraded(plane, Family::V4, SecondUplink::AfterTheAgent);
}

fn ipv6_masquerades_traffic_leaving_by_a_second_uplink(plane: Plane) {
    second_uplink_is_masqueraded(plane, Family::V6, SecondUplink::BeforeTheAgent);
}

fn ipv6_masquerades_traffic_leaving_by_a_second_uplink_added_later(plane: Plane) {
    second_uplink_is_masqueraded(plane, Family::V6, SecondUplink::AfterTheAgent);
}

/// This bed's flags without `--interface`: the agent follows the default routes.
fn args_following_default_routes(bed: &Bed) -> Vec<String> {
    bed.plane_args()
        .into_iter()
        .filter(|arg| !arg.starts_with("--interface="))
        .collect()
}

/// What `status --json` says masquerades `family` leaving by `device`; `None` when it lists no
/// such device.
fn coverage(status: &serde_json::Value, device: &str, family: Family) -> Option<String> {
    let devices = status["devices"].as_array()?;
    let entry = devices.iter().find(|d| d["device"] == device)?;
    entry[family.status_key()].as_str().map(String::from)
}

/// Waits until `status --json` says `family` leaving by `device` is masqueraded by `by`.
fn wait_for_coverage(bed: &Bed, agent: &Process, device: &str, family: Family, by: &str) {
    wait_for(|| Ok(coverage(&bed.status_json(), device, family).as_deref() == Some(by)))
        .unwrap_or_else(|e| {
            panic!(
                "{device} {} never covered by {by}: {e}\n{}\n{}",
                family.status_key(),
                bed.status_json(),
                agent.log_text()
            )
        });
}

/// The devices with programs attached, as `status --json` lists them (each once per hook);
/// a link whose program no longer runs (its device is gone) is listed as `<device> (gone)`.
fn attached_devices(status: &serde_json::Value) -> Vec<String> {
    status["ebpf"]["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let device = a["device"].as_str().unwrap();
            match a["running"].as_bool().unwrap() {
                true => device.to_string(),
                false => format!("{device} (gone)"),
            }
        })
        .collect()
}

fn masqueraded_packets(bed: &Bed) -> u64 {
    bed.status_json()["ebpf"]["counters"]["masqueraded"]
        .as_u64()
        .unwrap()
}

/// Without `--interface`, a device that gains a default route gets the programs, and keeps them
/// while the flows through it drain when it loses the route; `status` says per device, per
/// family, what masquerades it.
fn follows_a_device_that_gains_a_default_route(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    bed.topo.connect_second_uplink().unwrap();
    let _server = serve_behind_second_uplink(&bed);
    let mut args = args_following_default_routes(&bed);
    args.push("--enable-ipv6".into());
    let agent = bed.spawn_agent(&args, &[]);
    let up1 = topology::SECOND_UPLINK_IF;
    let status = bed.status_json();
    for family in [Family::V4, Family::V6] {
        assert_eq!(
            coverage(&status, "eth0", family).unwrap(),
            "ebpf",
            "{status}"
        );
        assert_eq!(
            coverage(&status, up1, family).unwrap(),
            "iptables",
            "{status}"
        );
    }
    assert_eq!(attached_devices(&status), ["eth0", "eth0"], "{status}");
    let text = bed.agent_cmd(&["status", &format!("--bpffs={}", bed.topo.bpffs.display())]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("  eth0: ipv4 ebpf, ipv6 ebpf\n"), "{text}");
    assert!(
        text.contains("  up1: ipv4 iptables, ipv6 iptables\n"),
        "{text}"
    );
    for family in [Family::V4, Family::V6] {
        assert_second_uplink_masquerades(&bed, family);
    }

    let ext2 = topology::EXT2_ADDR.to_string();
    let route = ["route", "add", "default", "via", &ext2, "metric", "100"];
    bed.topo.node_run("ip", &route).unwrap();
    for family in [Family::V4, Family::V6] {
        wait_for_coverage(&bed, &agent, up1, family, "ebpf");
    }
    let status = bed.status_json();
    assert_eq!(
        attached_devices(&status),
        ["eth0", "eth0", up1, up1],
        "{status}"
    );
    assert!(agent.log_text().contains("programs attached to the device"));
    let before = masqueraded_packets(&bed);
    for family in [Family::V4, Family::V6] {
        let server = SocketAddr::from((family.behind_second_uplink(), PORT));
        let seen = probe::tcp_probe(bed.pod(), server, 0).unwrap();
        assert_eq!(seen.ip(), family.second_uplink_node(), "by up1's programs");
    }
    assert!(
        masqueraded_packets(&bed) >= before + 2,
        "the programs on up1 translated both connections"
    );

    bed.topo
        .node_run("ip", &["route", "del", "default", "via", &ext2])
        .unwrap();
    // Without its route, up1 leaves the chain's early returns, but keeps the programs while
    // the flows they translate through it drain; new flows through it are the chain's.
    wait_for_coverage(&bed, &agent, up1, Family::V4, "iptables");
    let status = bed.status_json();
    let draining = status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == up1)
        .map(|d| d["draining_flows"].clone());
    assert_eq!(draining, Some(2.into()), "{status}");
    assert_eq!(
        attached_devices(&status),
        ["eth0", "eth0", up1, up1],
        "{status}"
    );
    assert_second_uplink_masquerades(&bed, Family::V4);
}

/// With `--interface`, the named devices carry the programs whenever they exist with an IPv4
/// address; before any does, the chain alone masquerades everything.
fn follows_named_interfaces_as_they_appear_and_vanish(plane: Plane) {
    let bed = Bed::new(plane, IPV6_CONFIG);
    let up1 = topology::SECOND_UPLINK_IF;
    let mut args = args_with(&bed, &[("--interface", up1)]);
    args.push("--enable-ipv6".into());
    let agent = bed.spawn_agent(&args, &[]);
    assert!(
        agent
            .log_text()
            .contains("no device carries the eBPF programs"),
        "{}",
        agent.log_text()
    );
    let status = bed.status_json();
    assert_eq!(status["mode"], "ebpf");
    assert_eq!(coverage(&status, "eth0", Family::V4).unwrap(), "iptables");
    assert!(attached_devices(&status).is_empty(), "{status}");
    Family::V4.assert_masqueraded(&bed);
    Family::V6.assert_masqueraded(&bed);

    for round in 0..2 {
        bed.topo.connect_second_uplink().unwrap();
        let _server = serve_behind_second_uplink(&bed);
        for family in [Family::V4, Family::V6] {
            wait_for_coverage(&bed, &agent, up1, family, "ebpf");
            assert_second_uplink_masquerades(&bed, family);
        }
        assert_eq!(
            coverage(&bed.status_json(), "eth0", Family::V4).unwrap(),
            "iptables"
        );
        if round == 0 {
            assert_a_device_without_ipv4_is_left_to_the_chain(&bed, &agent);
        }
        bed.topo.disconnect_second_uplink().unwrap();
        wait_for(|| Ok(attached_devices(&bed.status_json()).is_empty())).unwrap();
        let status = bed.status_json();
        assert_eq!(coverage(&status, up1, Family::V4), None, "{status}");
        let returned: Vec<&serde_json::Value> = status["chains"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| c["ebpf_devices_returned"].as_array().unwrap())
            .collect();
        assert!(
            returned.is_empty(),
            "nothing left to vanished programs: {status}"
        );
        assert!(status["ebpf"]["interfaces"].as_object().unwrap().is_empty());
    }
}

/// up1 loses its IPv4 address: its programs go, and the chain masquerades what leaves it,
/// which the agent says once; with the address back, the programs come back.
fn assert_a_device_without_ipv4_is_left_to_the_chain(bed: &Bed, agent: &Process) {
    let up1 = topology::SECOND_UPLINK_IF;
    let address = format!("{}/25", topology::NODE_SECOND_UPLINK);
    bed.topo
        .node_run("ip", &["addr", "del", &address, "dev", up1])
        .unwrap();
    wait_for_coverage(bed, agent, up1, Family::V4, "iptables");
    wait_for_coverage(bed, agent, up1, Family::V6, "iptables");
    std::thread::sleep(Duration::from_millis(2500));
    let said = "device has no IPv4 address";
    assert_eq!(
        agent.log_text().matches(said).count(),
        1,
        "{}",
        agent.log_text()
    );
    bed.topo
        .node_run("ip", &["addr", "add", &address, "dev", up1])
        .unwrap();
    wait_for_coverage(bed, agent, up1, Family::V4, "ebpf");
}

// ---- a node like a real one: errors leaving it, hostile packets, kube-proxy -----------------
//
// What upstream's chain (conntrack's NAT) gets right on a real node, run the same way on every
// data plane: the outside host must see the same thing whichever is in force.

impl Family {
    fn any(self) -> IpAddr {
        match self {
            Family::V4 => std::net::Ipv4Addr::UNSPECIFIED.into(),
            Family::V6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
        }
    }

    /// Pod `i`'s address.
    fn pod(self, i: usize) -> IpAddr {
        match self {
            Family::V4 => pod_ip(i),
            Family::V6 => pod_ip_v6(i),
        }
    }

    /// A raw observer of `protocol` in `ns`, `IPPROTO_ICMP` meaning the family's ICMP.
    fn observe(self, ns: &str, protocol: u8) -> RawObserver {
        match (self, protocol) {
            (Family::V4, _) => RawObserver::start(ns, i32::from(protocol)),
            (Family::V6, IPPROTO_ICMP) => RawObserver::start_v6(ns, i32::from(IPPROTO_ICMPV6)),
            (Family::V6, _) => RawObserver::start_v6(ns, i32::from(protocol)),
        }
        .unwrap()
    }

    /// ICMP's destination unreachable type.
    fn unreachable(self) -> u8 {
        match self {
            Family::V4 => 3,
            Family::V6 => 1,
        }
    }
}

/// A pod closes its UDP socket; the outside host's late reply is restored to the pod, which
/// answers it with port unreachable. The host must get that error as conntrack translates it:
/// from the node's address, about the datagram the host sent to the node's port, so that the
/// host's own socket takes it (ECONNREFUSED). Untranslated, it carries the pod's address and
/// quotes a packet the host never sent.
fn a_pods_icmp_error_reaches_the_outside_host(plane: Plane, family: Family) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let server = SocketAddr::from((family.outside().ip(), 9600));
    let host =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(UdpSocket::bind(server)?)).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let any = family.any();
    masq_testbed::netns::within(bed.pod(), move || {
        UdpSocket::bind((any, 0))?.send_to(b"hello", server)?;
        Ok(())
    })
    .unwrap();
    let mut buf = [0u8; 64];
    let (_, node_side) = host.recv_from(&mut buf).unwrap();
    assert_eq!(node_side.ip(), family.node(), "masqueraded");
    let errors = family.observe(&bed.topo.ext, IPPROTO_ICMP);
    host.connect(node_side).unwrap();
    host.send(b"late reply").unwrap();
    assert_eq!(
        host.recv(&mut buf).map_err(|e| e.kind()).err(),
        Some(ErrorKind::ConnectionRefused),
        "the host's socket must take the pod's port unreachable as about its own datagram"
    );
    wait_for(|| {
        Ok(errors
            .packets()
            .iter()
            .any(|p| p.l4.first() == Some(&family.unreachable())))
    })
    .unwrap();
    let sources: Vec<IpAddr> = errors.packets().iter().map(|p| p.src).collect();
    assert!(
        sources.iter().all(|&src| src == family.node()),
        "the error left with the node's address: {sources:?}"
    );
    bed.assert_ebpf_counter(
        "icmp_error_masqueraded",
        1,
        "the programs translated the error",
    );
}

/// Pods behind a smaller MTU than the uplink (an overlay's): the node answers a reply too big
/// for the pod's route with fragmentation needed (packet too big), which must reach the
/// outside sender as about the segment it sent, or path-MTU discovery black-holes the download.
fn path_mtu_discovery_toward_a_pod_behind_a_narrower_route(plane: Plane, family: Family) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    bed.topo.narrow_pod_route(0, 1400).unwrap();
    const DOWNLOAD: usize = 20 << 20;
    let _source = BulkSource::start(&bed.topo.ext, 9800, DOWNLOAD).unwrap();
    let server = SocketAddr::from((family.outside().ip(), 9800));
    let got = probe::tcp_download(bed.pod(), server, Duration::from_secs(5)).unwrap();
    assert_eq!(
        got, DOWNLOAD as u64,
        "a 20 MB download into a pod behind a 1400-byte route"
    );
}

/// A TCP connection from the pod to the outside host, with the host's end of it.
struct Conversation {
    pod: TcpStream,
    host: TcpStream,
    /// The host's listening socket, for more connections to the same server.
    listener: TcpListener,
    /// The connection's address and port as the host sees them: the node's, masqueraded.
    node_side: SocketAddr,
    server: SocketAddr,
}

impl Conversation {
    fn open(bed: &Bed, family: Family, port: u16) -> Conversation {
        let server = SocketAddr::from((family.outside().ip(), port));
        Conversation::open_to(bed, &bed.topo.ext, server)
    }

    /// With the server at `server` in namespace `host`.
    fn open_to(bed: &Bed, host: &str, server: SocketAddr) -> Conversation {
        Conversation::between(bed.pod(), host, server)
    }

    /// From namespace `pod` to the server at `server` in namespace `host`.
    fn between(pod: &str, host: &str, server: SocketAddr) -> Conversation {
        let listener =
            masq_testbed::netns::within(host, move || Ok(TcpListener::bind(server)?)).unwrap();
        let pod = masq_testbed::netns::within(pod, move || {
            Ok(TcpStream::connect_timeout(&server, Duration::from_secs(3))?)
        })
        .unwrap();
        let (host, node_side) = listener.accept().unwrap();
        for stream in [&pod, &host] {
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
        }
        let conversation = Conversation {
            pod,
            host,
            listener,
            node_side,
            server,
        };
        conversation.exchange("hello").unwrap();
        conversation
    }

    /// The pod says `what`, the host answers it back: both ways still work.
    fn exchange(&self, what: &str) -> std::io::Result<()> {
        use std::io::{Read as _, Write as _};
        let line = format!("{what}\n");
        let mut buf = vec![0u8; line.len()];
        (&self.pod).write_all(line.as_bytes())?;
        (&self.host).read_exact(&mut buf)?;
        (&self.host).write_all(&buf)?;
        (&self.pod).read_exact(&mut buf)?;
        if buf != line.as_bytes() {
            return Err(std::io::Error::other(format!("got {buf:?}")));
        }
        Ok(())
    }
}

/// An outside host sends one RST with the connection's addresses and ports and a sequence
/// number far outside the window. The pod's kernel ignores it, and so must the NAT: well past
/// the reset timeout and a sweep of the NAT table, the connection still carries data both ways.
fn a_blind_rst_does_not_end_an_established_connection(plane: Plane, family: Family) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let segments = family.observe(&bed.topo.ext, IPPROTO_TCP);
    let conversation = Conversation::open(&bed, family, 9700);
    let node_side = conversation.node_side;
    assert_eq!(node_side.ip(), family.node(), "masqueraded");
    // An acknowledgment the node sent: the host's sequence numbers lie near it, and a quarter
    // of the sequence space away from it is far outside any window. The observer records on
    // a thread of its own: wait for it.
    let port_of = |l4: &[u8], at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
    let node_ack = || {
        segments
            .packets()
            .iter()
            .rev()
            .find(|p| p.src == node_side.ip() && port_of(&p.l4, 0) == node_side.port())
            .map(|p| u32::from_be_bytes([p.l4[8], p.l4[9], p.l4[10], p.l4[11]]))
    };
    wait_for(|| Ok(node_ack().is_some())).expect("the host saw the node's segments");
    let acked = node_ack().unwrap();
    let rst = Tcp {
        sport: conversation.server.port(),
        dport: node_side.port(),
        flags: RST,
        seq: acked.wrapping_add(1 << 30),
        ack: 0,
        payload: &[],
    }
    .segment_between(conversation.server.ip(), node_side.ip());
    probe::raw_send_from(
        &bed.topo.ext,
        i32::from(IPPROTO_TCP),
        conversation.server.ip(),
        node_side.ip(),
        &rst,
    )
    .unwrap();
    // Past the reset timeout (10 s) and the next sweep of the NAT table (every 10 s).
    std::thread::sleep(Duration::from_secs(25));
    conversation
        .exchange("still there")
        .expect("the connection outlived a blind RST");
    bed.assert_ebpf_counter(
        "tcp_rst_not_acceptable",
        1,
        "the programs judged the RST blind",
    );
}

/// Established means both directions seen: a pod's lone ACK toward a host that never answers
/// leaves the flow's reply half unseen, so it goes with the transitory timeout (60 s), not the
/// established one (2 h).
fn a_lone_ack_opens_no_established_flow(plane: Plane, family: Family) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    // Beyond the outside host, on its narrow link, where no host answers: the node sends it
    // on through the uplink (an address on the uplink's own subnet would wait for a neighbour
    // that never answers, and never leave).
    let nowhere: IpAddr = match family {
        Family::V4 => "192.0.2.99".parse().unwrap(),
        Family::V6 => "2001:db8:3::99".parse().unwrap(),
    };
    let ack = Tcp {
        sport: 41000,
        dport: 443,
        flags: ACK,
        ..Tcp::default()
    }
    .segment_between(family.pod(0), nowhere);
    probe::raw_send_from(
        bed.pod(),
        i32::from(IPPROTO_TCP),
        family.pod(0),
        nowhere,
        &ack,
    )
    .unwrap();
    let table = match family {
        Family::V4 => "nat_v4",
        Family::V6 => "nat_v6",
    };
    let pin = bed.topo.bpffs.join(table);
    let halves = || -> Vec<(u64, u64)> {
        let dump = masq_testbed::netns::run(
            "bpftool",
            &["-j", "map", "dump", "pinned", pin.to_str().unwrap()],
        )
        .unwrap();
        let entries: Vec<serde_json::Value> = serde_json::from_str(&dump).unwrap();
        entries
            .iter()
            .map(|e| &e["formatted"])
            .map(|e| {
                (
                    e["key"]["direction"].as_u64().unwrap(),
                    e["value"]["tcp_seen"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    wait_for(|| Ok(halves().len() == 2)).unwrap();
    let mut seen = halves();
    seen.sort();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_ne!(seen[0].1, 0, "the pod's half saw its ACK: {seen:?}");
    assert_eq!(seen[1].1, 0, "no reply crossed the other half: {seen:?}");
}

/// The nat table of the node's namespace, through the data plane's iptables backend, as
/// kube-proxy would write it: one rule per call.
fn kube_proxy(bed: &Bed, family: Family, rules: &[&str]) {
    for rule in rules {
        let args: Vec<&str> = ["-w", "-t", "nat"]
            .into_iter()
            .chain(rule.split_whitespace())
            .collect();
        match family {
            Family::V4 => bed.iptables(&args),
            Family::V6 => bed.ip6tables(&args),
        }
        .unwrap();
    }
}

/// A ClusterIP service whose endpoint is outside the cluster: kube-proxy DNATs it before
/// routing, and what leaves is masqueraded like any traffic to the outside.
fn a_cluster_ip_to_an_endpoint_outside_is_masqueraded(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let endpoint = format!("{}:{PORT}", topology::EXT_ADDR);
    kube_proxy(
        &bed,
        Family::V4,
        &[&format!(
            "-A PREROUTING -d 10.96.0.10/32 -p tcp --dport 80 -j DNAT --to-destination {endpoint}"
        )],
    );
    let seen = probe::tcp_probe(bed.pod(), "10.96.0.10:80".parse().unwrap(), 0).unwrap();
    assert_eq!(seen.ip(), node_ip(), "the endpoint saw the node's address");
}

/// kube-proxy masquerades the traffic it marks itself, ahead of the agent's jump: such a
/// connection must leave translated once, by kube-proxy's rule, and keep working.
fn kube_proxys_own_masquerade_is_not_translated_twice(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let endpoint = format!("{}:{PORT}", topology::EXT_ADDR);
    kube_proxy(
        &bed,
        Family::V4,
        &[
            "-A PREROUTING -d 10.96.0.11/32 -p tcp --dport 80 -j MARK --set-xmark 0x4000/0x4000",
            &format!(
                "-A PREROUTING -d 10.96.0.11/32 -p tcp --dport 80 -j DNAT --to-destination {endpoint}"
            ),
            "-I POSTROUTING 1 -m mark --mark 0x4000/0x4000 -j MASQUERADE --random-fully",
        ],
    );
    for _ in 0..3 {
        let seen = probe::tcp_probe(bed.pod(), "10.96.0.11:80".parse().unwrap(), 0).unwrap();
        assert_eq!(seen.ip(), node_ip());
    }
    bed.assert_ebpf_counter(
        "masqueraded",
        0,
        "kube-proxy's translation is not translated again",
    );
    assert_masqueraded(&bed);
}

/// A ClusterIP to a pod on the same node, from another pod (kept unmasqueraded: a pod
/// destination) and from the endpoint itself (the hairpin, which kube-proxy masquerades).
fn a_hairpin_cluster_ip_reaches_a_pod_on_the_same_node(plane: Plane) {
    let bed = Bed::with_pods(plane, DEFAULT_CONFIG, 2);
    let _agent = bed.start_agent(&[]);
    let endpoint = topology::pod_addr(1);
    let in_pod = Observer::start(&bed.topo.pods[1], &[endpoint], 9090).unwrap();
    kube_proxy(
        &bed,
        Family::V4,
        &[
            &format!(
                "-A PREROUTING -s {endpoint}/32 -d 10.96.0.12/32 -p tcp --dport 80 -j MARK --set-xmark 0x4000/0x4000"
            ),
            &format!(
                "-A PREROUTING -d 10.96.0.12/32 -p tcp --dport 80 -j DNAT --to-destination {endpoint}:9090"
            ),
            "-I POSTROUTING 1 -m mark --mark 0x4000/0x4000 -j MASQUERADE",
        ],
    );
    let service: SocketAddr = "10.96.0.12:80".parse().unwrap();
    let seen = probe::tcp_probe(&bed.topo.pods[0], service, 0).unwrap();
    assert_eq!(seen.ip(), pod_ip(0), "another pod keeps its address");
    let seen = probe::tcp_probe(&bed.topo.pods[1], service, 0).unwrap();
    assert_eq!(
        seen.ip(),
        IpAddr::from([10, 244, 2, 1]),
        "the hairpin comes back from the node's side of the pod's link"
    );
    assert_eq!(in_pod.sources(Proto::Tcp).len(), 2);
}

/// Replacing upstream's chain (the `iptables` data plane is byte for byte upstream's) with this
/// data plane while a connection is open: the connection goes on, and new ones are masqueraded.
fn migrating_from_upstreams_chain_keeps_an_open_connection(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let mut upstream = bed.spawn_agent(&rollback_args(&bed, Family::V4), &[]);
    let conversation = Conversation::open(&bed, Family::V4, 9710);
    assert_eq!(conversation.node_side.ip(), node_ip());
    upstream.stop(libc::SIGTERM).unwrap();
    let _agent = bed.start_agent(&[]);
    conversation
        .exchange("after the switch")
        .expect("the open connection goes on");
    assert_masqueraded(&bed);
}

/// `conntrack -F` while flows are live. The eBPF data plane's NAT table keeps them, so an open
/// connection goes on; upstream's chain keeps its translations in conntrack alone, so it cannot
/// (operations.md says so). New connections are masqueraded after it on both.
fn a_conntrack_flush_during_live_flows(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let conversation = Conversation::open(&bed, Family::V4, 9720);
    bed.topo.node_run("conntrack", &["-F"]).unwrap();
    if plane == Plane::Ebpf {
        conversation
            .exchange("after the flush")
            .expect("the NAT table kept the connection");
    }
    assert_masqueraded(&bed);
}

/// CLOCK_MONOTONIC in nanoseconds: the clock NAT entries are stamped with.
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec it is given.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) },
        0
    );
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// `bytes` as the words `bpftool map update ... hex` takes.
fn hex_words(bytes: &[u8]) -> Vec<String> {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An agent from before NAT entries recorded TCP sequence numbers left its table pinned, with a
/// live flow in it. The new agent carries the flow into its table: the pod's datagrams keep the
/// node port the old agent gave them.
fn an_upgrade_carries_the_flows_of_an_older_nat_table(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    std::fs::create_dir_all(&bed.topo.bpffs).unwrap();
    let pin = bed.topo.bpffs.join("nat_v4");
    let pin = pin.to_str().unwrap();
    let run = |args: &[&str]| masq_testbed::netns::run("bpftool", args).unwrap();
    run(&[
        "map", "create", pin, "type", "hash", "key", "16", "value", "16", "entries", "4096",
        "name", "nat_v4",
    ]);
    let (pod_port, node_port) = (40500u16, 45678u16);
    let key = |src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, dir: u8| {
        [
            &src[..],
            &dst,
            &sport.to_be_bytes(),
            &dport.to_be_bytes(),
            &[17, dir, 0, 0],
        ]
        .concat()
    };
    // The old layout: last seen (8 bytes), address, port, kind (1: SNAT), TCP flags.
    let entry = |addr: [u8; 4], port: u16| {
        [
            &monotonic_ns().to_ne_bytes()[..],
            &addr,
            &port.to_be_bytes(),
            &[1, 0],
        ]
        .concat()
    };
    let (pod, ext, node) = (
        topology::pod_addr(0).octets(),
        topology::EXT_ADDR.octets(),
        topology::NODE_UPLINK.octets(),
    );
    for (k, v) in [
        (key(pod, ext, pod_port, PORT, 0), entry(node, node_port)),
        (key(ext, node, PORT, node_port, 1), entry(pod, pod_port)),
    ] {
        let (k, v) = (hex_words(&k), hex_words(&v));
        let mut args = vec!["map", "update", "pinned", pin, "key", "hex"];
        args.extend(k.iter().map(String::as_str));
        args.extend(["value", "hex"]);
        args.extend(v.iter().map(String::as_str));
        run(&args);
    }
    let agent = bed.start_agent(&[]);
    let seen = probe::udp_probe(bed.pod(), outside(), pod_port).unwrap();
    assert_eq!(
        seen,
        SocketAddr::from((node_ip(), node_port)),
        "the old agent's translation goes on\n{}",
        agent.log_text()
    );
    assert!(
        agent.log_text().contains("flows carried"),
        "{}",
        agent.log_text()
    );
    assert_masqueraded(&bed);
}

/// `--nat-capacity` changes between two runs of the agent: the new table is of another size,
/// and the open connection goes on through it.
fn a_new_nat_capacity_keeps_open_connections(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let mut agent = bed.start_agent(&["--nat-capacity=4096"]);
    let conversation = Conversation::open(&bed, Family::V4, 9730);
    let capacity = || bed.status_json()["ebpf"]["nat_capacity"].as_u64().unwrap();
    let before = capacity();
    agent.stop(libc::SIGTERM).unwrap();
    let _agent = bed.start_agent(&["--nat-capacity=8192"]);
    assert_eq!(capacity(), 2 * before, "the table was resized");
    conversation
        .exchange("through the bigger table")
        .expect("the connection outlived the resize");
}

/// A transfer runs while the agent restarts with a smaller `--nat-capacity`: every byte arrives.
fn a_capacity_change_during_a_transfer_loses_nothing(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let mut agent = bed.start_agent(&["--nat-capacity=8192"]);
    let transfer = PacedTransfer::start(&bed, (topology::EXT_ADDR, 9770).into(), 40);
    std::thread::sleep(Duration::from_millis(700));
    agent.stop(libc::SIGTERM).unwrap();
    let agent = bed.start_agent(&["--nat-capacity=2048"]);
    transfer.assert_complete(&agent.log_text());
    assert!(
        agent.log_text().contains("flows carried"),
        "{}",
        agent.log_text()
    );
}

/// kube-proxy masquerades the traffic it marks itself, on the node's address, with ports from
/// all of 1024-65535, while the programs masquerade other flows to the same destination on the
/// same address. Thousands of flows each way, live at once, programs' flows before and after
/// netfilter's: every one gets its own payload back, none another's.
fn no_reply_reaches_the_wrong_flow_beside_kube_proxys_masquerade(plane: Plane, family: Family) {
    let bed = Bed::with_pods(plane, family.config(), 2);
    let _agent = bed.start_agent(family.agent_args());
    let marked = family.pod(1);
    kube_proxy(
        &bed,
        family,
        &[
            &format!("-A PREROUTING -s {marked} -j MARK --set-xmark 0x4000/0x4000"),
            "-I POSTROUTING 1 -m mark --mark 0x4000/0x4000 -j MASQUERADE --random-fully",
        ],
    );
    let server = SocketAddr::from((family.outside().ip(), 9900));
    let _echo = UdpEcho::start(&bed.topo.ext, server).unwrap();
    let pods = &bed.topo.pods;
    let open = |pod: &str, count, tag| UdpFlows::open(pod, server, count, tag).unwrap();
    let groups = [
        (
            "the programs' first flows",
            open(&pods[0], 2000, "programs-a"),
        ),
        (
            "kube-proxy's masqueraded flows",
            open(&pods[1], 1000, "netfilter"),
        ),
        (
            "the programs' later flows",
            open(&pods[0], 2000, "programs-b"),
        ),
    ];
    for round in 0..2 {
        for (what, flows) in &groups {
            let tally = flows.exchange(3).unwrap();
            assert_eq!(
                (tally.lost, tally.crossed),
                (0, 0),
                "{what}, round {round}: {tally:?}"
            );
        }
    }
}

/// A process on the node binds the very address and port a pod's connection holds on it, and
/// connects to the same server: as conntrack does, the node gives its connection another port,
/// and both connections work.
fn a_node_socket_on_a_port_the_programs_hold(plane: Plane, family: Family) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let conversation = Conversation::open(&bed, family, 9740);
    let (held, server) = (conversation.node_side, conversation.server);
    assert_eq!(held.ip(), family.node());
    let node = probe::tcp_connect_from(&bed.topo.node, held, server)
        .expect("the node's connection from the held port is answered");
    let (host, seen) = conversation.listener.accept().unwrap();
    assert_ne!(seen, held, "the node's connection was given another port");
    let node_conversation = Conversation {
        pod: node,
        host,
        listener: conversation.listener.try_clone().unwrap(),
        node_side: seen,
        server,
    };
    for stream in [&node_conversation.pod, &node_conversation.host] {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
    }
    node_conversation
        .exchange("from the node")
        .expect("the node's connection works");
    conversation
        .exchange("from the pod")
        .expect("the pod's connection goes on");
}

/// The flags of this bed's agent with `--dataplane iptables` instead: upstream's chain.
fn rollback_args(bed: &Bed, family: Family) -> Vec<String> {
    bed.plane_args()
        .into_iter()
        .filter(|a| !a.starts_with("--dataplane") && !a.starts_with("--interface"))
        .filter(|a| !a.starts_with("--fallback"))
        .chain(["--dataplane=iptables".to_string()])
        .chain(family.agent_args().iter().map(|a| a.to_string()))
        .collect()
}

/// Rolling back to `--dataplane iptables` with thousands of flows the programs translate: they
/// go on, `status` says they are draining, and the new flows the full chain masquerades on the
/// same address lose nothing to the programs' entries.
fn a_rollback_keeps_the_programs_flows_and_loses_no_new_one(plane: Plane, family: Family) {
    let bed = Bed::with_pods(plane, family.config(), 2);
    let mut agent = bed.start_agent(family.agent_args());
    let server = SocketAddr::from((family.outside().ip(), 9910));
    let _echo = UdpEcho::start(&bed.topo.ext, server).unwrap();
    let pods = &bed.topo.pods;
    let translated = UdpFlows::open(&pods[0], server, 3000, "programs").unwrap();
    assert_eq!(translated.exchange(3).unwrap().lost, 0);
    let conversation = Conversation::open(&bed, family, 9750);
    agent.stop(libc::SIGTERM).unwrap();
    let _upstream = bed.spawn_agent(&rollback_args(&bed, family), &[]);
    let status = bed.status_json();
    let draining = status["draining_flows"].as_u64().unwrap_or(0);
    assert!(draining >= 3001, "draining {draining}: {status}");
    let masqueraded = UdpFlows::open(&pods[1], server, 1000, "chain").unwrap();
    for (what, flows) in [
        ("the chain's", &masqueraded),
        ("the programs'", &translated),
    ] {
        let tally = flows.exchange(3).unwrap();
        assert_eq!(
            (tally.lost, tally.crossed),
            (0, 0),
            "{what} flows: {tally:?}"
        );
    }
    conversation
        .exchange("after the rollback")
        .expect("the programs' connection goes on");
}

/// Rolling back with no flow left for the programs to translate: they and their pins go.
fn a_rollback_with_nothing_to_drain_removes_the_programs(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let mut agent = bed.start_agent(&[]);
    assert!(bed.topo.bpffs.join("nat_v4").exists());
    agent.stop(libc::SIGTERM).unwrap();
    let upstream = bed.spawn_agent(&rollback_args(&bed, Family::V4), &[]);
    wait_for(|| Ok(!bed.topo.bpffs.join("nat_v4").exists()))
        .unwrap_or_else(|e| panic!("{e}\n{}", upstream.log_text()));
    let status = bed.status_json();
    assert!(status["ebpf"].is_null(), "{status}");
    assert!(
        upstream
            .log_text()
            .contains("programs and pins are removed")
    );
    assert_masqueraded(&bed);
}

/// The pinned links of the programs on `device`.
fn links_of(bed: &Bed, device: &str) -> Vec<std::path::PathBuf> {
    ["egress", "ingress"]
        .iter()
        .map(|hook| {
            bed.topo
                .bpffs
                .join("links")
                .join(format!("{device}-{hook}"))
        })
        .filter(|pin| pin.exists())
        .collect()
}

/// A restart with a device fewer in `--interface`: the programs stay on it while the flows
/// they translate through it drain (and `status` says how many are left), new flows leaving
/// by it are the chain's; a device through which none is left is released at once.
fn a_shrinking_device_set_drains_before_it_detaches(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    bed.topo.connect_second_uplink().unwrap();
    let up1 = format!("--interface={}", topology::SECOND_UPLINK_IF);
    let mut agent = bed.start_agent(&[&up1]);
    let server = SocketAddr::from((topology::EXT2_ADDR, 9760));
    let conversation = Conversation::open_to(&bed, &bed.topo.ext2, server);
    assert_eq!(
        conversation.node_side.ip(),
        IpAddr::from(topology::NODE_SECOND_UPLINK)
    );
    agent.stop(libc::SIGTERM).unwrap();
    let agent = bed.start_agent(&[]);
    let status = bed.status_json();
    let up1_status = status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == topology::SECOND_UPLINK_IF)
        .cloned()
        .unwrap();
    assert_eq!(up1_status["ipv4"], "iptables", "{status}");
    assert_eq!(up1_status["draining_flows"], 1, "{status}");
    assert_eq!(links_of(&bed, topology::SECOND_UPLINK_IF).len(), 2);
    conversation
        .exchange("through the draining device")
        .expect("the programs' flow through it goes on");
    // A new flow through up1 is the chain's, masqueraded all the same.
    let _ext2 = Observer::start(&bed.topo.ext2, &[topology::EXT2_ADDR], 9761).unwrap();
    let seen = probe::tcp_probe(bed.pod(), (topology::EXT2_ADDR, 9761).into(), 0).unwrap();
    assert_eq!(seen.ip(), IpAddr::from(topology::NODE_SECOND_UPLINK));
    assert!(
        agent
            .log_text()
            .contains("its programs stay while the flows"),
        "{}",
        agent.log_text()
    );

    // Without a flow through it, a device dropped from --interface is released at once.
    drop(conversation);
    let mut agent = agent;
    agent.stop(libc::SIGTERM).unwrap();
    let bed2 = Bed::new(plane, DEFAULT_CONFIG);
    bed2.topo.connect_second_uplink().unwrap();
    let mut first = bed2.start_agent(&[&up1]);
    first.stop(libc::SIGTERM).unwrap();
    let _agent = bed2.start_agent(&[]);
    wait_for(|| Ok(links_of(&bed2, topology::SECOND_UPLINK_IF).is_empty())).unwrap();
    let status = bed2.status_json();
    assert!(
        status["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["draining_flows"].is_null()),
        "{status}"
    );
}

/// A connection netfilter masqueraded before the agent started (kube-proxy's MASQUERADE),
/// while a pod's new flow to the same server needs a port and the only one is that
/// connection's: the port is held from conntrack's table and not handed out, so the new flow
/// gets none, and the old connection goes on.
fn a_flow_netfilter_masqueraded_before_the_start_keeps_its_port(plane: Plane, family: Family) {
    let bed = Bed::with_pods(plane, family.config(), 2);
    let marked = family.pod(1);
    kube_proxy(
        &bed,
        family,
        &[
            &format!("-A PREROUTING -s {marked} -j MARK --set-xmark 0x4000/0x4000"),
            "-I POSTROUTING 1 -m mark --mark 0x4000/0x4000 -j MASQUERADE --random-fully",
        ],
    );
    let server = SocketAddr::from((family.outside().ip(), 9780));
    let old = Conversation::between(&bed.topo.pods[1], &bed.topo.ext, server);
    assert_eq!(old.node_side.ip(), family.node());
    let only_port = format!("--to-ports={}", old.node_side.port());
    let mut args = vec![only_port.as_str()];
    args.extend(family.agent_args());
    let agent = bed.start_agent(&args);
    let refused = masq_testbed::netns::within(bed.pod(), move || {
        Ok(TcpStream::connect_timeout(&server, Duration::from_secs(2))?)
    });
    assert!(
        refused.is_err(),
        "the pod's flow was given netfilter's port"
    );
    old.exchange("still mine")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
}

macro_rules! cases {
    ($plane:ident: $($name:ident),* $(,)?) => {
        $(#[test] fn $name() { super::$name(super::Plane::$plane) })*
    };
}

/// Cases written once over both families: each runs as `<case>::ipv4` and `<case>::ipv6`.
macro_rules! family_cases {
    ($plane:ident: $($name:ident),* $(,)?) => {
        $(mod $name {
            use super::super::{Family, Plane};
            #[test] fn ipv4() { super::super::$name(Plane::$plane, Family::V4) }
            #[test] fn ipv6() { super::super::$name(Plane::$plane, Family::V6) }
        })*
    };
}

/// What pods see must not depend on the data plane: these run against every one of them.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            a_pods_icmp_error_reaches_the_outside_host,
            path_mtu_discovery_toward_a_pod_behind_a_narrower_route,
            a_blind_rst_does_not_end_an_established_connection,
            no_reply_reaches_the_wrong_flow_beside_kube_proxys_masquerade,
            a_node_socket_on_a_port_the_programs_hold,
            a_flow_netfilter_masqueraded_before_the_start_keeps_its_port,
            an_exception_inside_a_non_masquerade_range_is_masqueraded,
            an_allow_list_masquerades_only_its_exceptions,
            explain_says_what_the_outside_host_sees,
            connections_to_the_nodes_services_leave_the_pods_their_nat_table,
            a_pods_unanswered_queries_leave_room_for_new_flows,
            nodeport_connections_to_another_node_leave_the_pods_their_nat_table,
            a_table_filled_before_a_restart_still_makes_room,
            a_smaller_table_carries_the_pods_flows_first,
            a_policy_change_moves_no_live_flow,
        );
        cases!($plane:
            masquerades_outside_traffic_only,
            packets_with_ip_options_are_masqueraded,
            two_pods_with_one_source_port_share_the_node_address,
            link_local_is_exempt_unless_masq_link_local,
            turning_masq_link_local_on_moves_no_live_flow,
            applies_a_config_change_live,
            keeps_the_last_good_policy_on_an_invalid_config,
            keeps_the_policy_while_the_config_file_cannot_be_read,
            new_flows_take_the_uplink_s_new_address,
            survives_the_uplink_going_down_and_up,
            survives_the_uplink_being_deleted_and_recreated,
            fragmented_datagrams_arrive_whole_both_ways,
            connections_from_outside_keep_the_pod_address,
            path_mtu_discovery_works_through_the_translation,
            a_killed_agent_does_not_break_a_transfer,
            checksums_hold_with_tx_offload_on_and_off,
            other_protocols_are_masqueraded_by_the_chain,
            sigterm_leaves_everything_and_cleanup_leaves_no_trace,
            once_applies_and_exits_and_status_reports,
            serves_metrics_health_and_readiness,
            ipv6_masquerades_outside_traffic_only,
            ipv6_two_pods_with_one_source_port_share_the_node_address,
            ipv6_applies_a_config_change_live,
            ipv6_connections_from_outside_keep_the_pod_address,
            ipv6_path_mtu_discovery_works_through_the_translation,
            ipv6_fragmented_datagrams_arrive_whole_both_ways,
            ipv6_checksums_hold_with_tx_offload_on_and_off,
            ipv6_new_flows_take_the_uplink_s_new_address,
            ipv6_survives_the_uplink_going_down_and_up,
            ipv6_survives_the_uplink_being_deleted_and_recreated,
            ipv6_a_killed_agent_does_not_break_a_transfer,
            masquerades_traffic_leaving_by_a_second_uplink,
            masquerades_traffic_leaving_by_a_second_uplink_added_later,
            ipv6_masquerades_traffic_leaving_by_a_second_uplink,
            ipv6_masquerades_traffic_leaving_by_a_second_uplink_added_later,
            a_cluster_ip_to_an_endpoint_outside_is_masqueraded,
            kube_proxys_own_masquerade_is_not_translated_twice,
            a_hairpin_cluster_ip_reaches_a_pod_on_the_same_node,
            migrating_from_upstreams_chain_keeps_an_open_connection,
            a_conntrack_flush_during_live_flows,
            an_exception_inside_link_local_is_masqueraded,
            several_config_files_are_merged_and_an_invalid_one_changes_nothing,
            enable_ipv6_in_the_file_switches_ipv6_live,
            enable_ipv6_off_in_the_file_keeps_what_is_open,
            explain_names_the_entry_when_the_file_turns_ipv6_on,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
    family_cases!(Ebpf:
        a_lone_ack_opens_no_established_flow,
        flows_says_which_port_a_pod_got_and_why_it_is_held,
        the_entries_that_decide_traffic_are_counted,
        a_rollback_keeps_the_programs_flows_and_loses_no_new_one,
    );
    cases!(Ebpf:
        liveness_fails_when_the_data_plane_is_gone,
        ipv6_is_translated_by_the_programs_and_the_rest_by_the_chain,
        ipv6_keeps_the_full_chain_while_the_uplink_has_no_ipv6_address,
        draining_survives_an_agent_restart,
        a_full_nat_table_keeps_its_flows_and_drops_new_ones,
        sigkill_mid_apply_loses_no_prefix,
        mounts_a_missing_bpffs_or_says_why_not,
        survives_a_config_flipping_between_valid_and_invalid,
        falls_back_to_iptables_when_ebpf_cannot_run,
        a_failed_load_takes_back_what_it_pinned,
        status_says_what_an_exited_agent_left_and_when_it_cannot_tell,
        runs_with_only_the_manifest_s_capabilities,
        a_missing_capability_is_named,
        a_change_is_applied_as_a_difference_and_a_resync_repairs_the_rest,
        reattaches_a_program_someone_detached,
        bpftool_shows_the_prefixes_with_named_fields,
        replaces_an_incompatible_pinned_map,
        attaches_through_netlink_without_tcx,
        netlink_filters_are_replaced_in_place_and_put_back,
        follows_a_device_that_gains_a_default_route,
        follows_named_interfaces_as_they_appear_and_vanish,
        an_upgrade_carries_the_flows_of_an_older_nat_table,
        a_new_nat_capacity_keeps_open_connections,
        a_capacity_change_during_a_transfer_loses_nothing,
        a_rollback_with_nothing_to_drain_removes_the_programs,
        a_shrinking_device_set_drains_before_it_detaches,
        a_flow_stranded_by_a_change_stays_translated,
    );
}

mod iptables_nft {
    common_cases!(IptablesNft);
    cases!(IptablesNft:
        restores_a_flushed_chain,
        to_ports_rules_load_into_real_iptables,
        ipv6_chain_follows_enable_ipv6,
    );
}

/// The legacy backend differs from nft only in how rules are stored, and in taking the xtables
/// lock: the chain's own cases.
mod iptables_legacy {
    cases!(IptablesLegacy:
        retries_while_the_xtables_lock_is_held,
        masquerades_outside_traffic_only,
        ipv6_masquerades_outside_traffic_only,
        applies_a_config_change_live,
        keeps_the_last_good_policy_on_an_invalid_config,
        sigterm_leaves_everything_and_cleanup_leaves_no_trace,
        once_applies_and_exits_and_status_reports,
        restores_a_flushed_chain,
        to_ports_rules_load_into_real_iptables,
        ipv6_chain_follows_enable_ipv6,
        an_exception_inside_link_local_is_masqueraded,
    );
}
