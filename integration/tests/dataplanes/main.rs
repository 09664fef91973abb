//! Both data planes, end to end, with the same test code: the real agent in a node namespace,
//! real iptables (nft and legacy backends) or the real eBPF programs, and real TCP, UDP, ICMP
//! and GRE between namespaces the tests create.
//!
//! This file is the test bed the topics share: `Bed`, the data planes, what an address family
//! is on the bed, the helpers of more than one topic, and the macros that register cases. Each
//! topic registers its own cases beside them, in a module per data plane, so that a case runs
//! as `<topic>::<plane>::<case>`, and as `<case>::ipv4` and `<case>::ipv6` where it is written
//! once over both families. What pods see must not depend on the data plane: a topic's common
//! cases run on the eBPF data plane and on the chain (nft) alike. The legacy backend differs
//! from nft only in how rules are stored, and in taking the xtables lock: it runs the chain's
//! own cases, and a few common ones.

// The macros come before the topics: a module sees the macros defined above its declaration.

/// Cases that run once per data plane: each runs as `<case>`.
macro_rules! cases {
    ($plane:ident: $($name:ident),* $(,)?) => {
        $(#[test] fn $name() { super::$name(crate::Plane::$plane) })*
    };
}

/// Cases written once over both families: each runs as `<case>::ipv4` and `<case>::ipv6`. With
/// `ipv4 only`, as `<case>::ipv4` alone, where a data plane needs no more of the case.
macro_rules! family_cases {
    ($plane:ident: $($name:ident),* $(,)?) => {
        $(mod $name {
            use masq_agent::policy::IpFamily;
            #[test] fn ipv4() { super::super::$name(crate::Plane::$plane, IpFamily::Ipv4) }
            #[test] fn ipv6() { super::super::$name(crate::Plane::$plane, IpFamily::Ipv6) }
        })*
    };
    ($plane:ident, ipv4 only: $($name:ident),* $(,)?) => {
        $(mod $name {
            use masq_agent::policy::IpFamily;
            #[test] fn ipv4() { super::super::$name(crate::Plane::$plane, IpFamily::Ipv4) }
        })*
    };
}

mod basics;
mod capabilities;
mod chain;
mod config;
mod ebpf_lifecycle;
mod icmp_and_fragments;
mod kube_proxy;
mod masquerade_address;
mod nat_table;
mod observability;
mod policy;
mod restarts;
mod sources;
mod uplinks;

use std::{
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::PathBuf,
    process::Output,
    time::Duration,
};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe::{
        self, BulkSink, IPPROTO_GRE, IPPROTO_ICMP, IPPROTO_ICMPV6, Observer, RawObserver, UdpFlows,
    },
    topology::{self, Process, Topology},
    wait_for, write_config,
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

    /// `plane_args`, and `family`'s own flags.
    fn family_args(&self, family: IpFamily) -> Vec<String> {
        let mut args = self.plane_args();
        args.extend(family.agent_args().iter().map(|a| a.to_string()));
        args
    }

    fn start_agent(&self, extra: &[&str]) -> Process {
        let mut args = self.plane_args();
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn_agent(&args, &[])
    }

    /// The bed of a case written once for both families, its agent running. Bound as
    /// `let (bed, _agent)`, the agent stops before its topology goes.
    fn with_agent(plane: Plane, family: IpFamily) -> (Bed, Process) {
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

    /// Pings `dst` once from pod `i`, with `extra` options: the output, which says what
    /// happened when no reply came back.
    fn ping(&self, i: usize, dst: impl Into<IpAddr>, extra: &[&str]) -> Output {
        let dst: IpAddr = dst.into();
        let flag = if dst.is_ipv6() { "-6" } else { "-4" };
        let dst = dst.to_string();
        let mut args = vec![flag, "-c", "1", "-W", "2"];
        args.extend_from_slice(extra);
        args.push(&dst);
        self.ping_output(i, &args)
    }

    fn ping_output(&self, i: usize, args: &[&str]) -> Output {
        masq_testbed::netns::command_in(&self.topo.pods[i], "ping")
            .args(args)
            .output()
            .unwrap()
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

/// The pods' own prefix is exempt, as 10.0.0.0/8 holds the IPv4 pods: without it, the chain
/// would masquerade connections from outside on their way in.
const IPV6_CONFIG: &str = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fd00:10:244::/48\n  - fd00:200::/64\nresyncInterval: 1s\n";

/// What an address family is on the test bed, for the cases written once for both: the agent's
/// config and flags for it, the bed's addresses in it, and how to watch it. On the agent's own
/// `IpFamily`, so that the tests name a family as the agent does.
trait FamilyOnTheBed: Copy {
    /// `v4` for IPv4, `v6` for IPv6. Both are built: it chooses values, never actions.
    fn pick<T>(self, v4: T, v6: T) -> T;

    fn config(self) -> &'static str {
        self.pick(DEFAULT_CONFIG, IPV6_CONFIG)
    }

    fn agent_args(self) -> &'static [&'static str] {
        self.pick(&[], &["--enable-ipv6"])
    }

    /// The config of `config()`'s pods and services, with `non_masq` more non-masquerade
    /// prefixes and the exceptions `masq`.
    fn config_with(self, non_masq: &[&str], masq: &[&str]) -> String {
        self.config_resyncing_every("1s", non_masq, masq)
    }

    /// `config_with(non_masq, masq)`, with a resync every `interval`.
    fn config_resyncing_every(self, interval: &str, non_masq: &[&str], masq: &[&str]) -> String {
        let base: &[&str] = self.pick(
            &["10.0.0.0/8"],
            &["10.0.0.0/8", "fd00:10:244::/48", "fd00:200::/64"],
        );
        let list =
            |cidrs: &[&str]| -> String { cidrs.iter().map(|c| format!("  - {c}\n")).collect() };
        format!(
            "nonMasqueradeCIDRs:\n{}{}masqueradeCIDRs:\n{}resyncInterval: {interval}\n",
            list(base),
            list(non_masq),
            list(masq)
        )
    }

    /// The server on the outside host, behind the first uplink.
    fn outside(self) -> SocketAddr {
        self.pick(outside(), (topology::EXT_ADDR_V6, PORT).into())
    }

    /// The server's address in another prefix of the outside host.
    fn second_outside(self) -> SocketAddr {
        self.pick(
            second_outside(),
            (topology::EXT_SECOND_ADDR_V6, PORT).into(),
        )
    }

    /// The outside host's prefix on the first uplink, and the outside host itself as a prefix
    /// of one address.
    fn outside_prefixes(self) -> (&'static str, &'static str) {
        self.pick(
            ("203.0.113.0/24", "203.0.113.10/32"),
            ("2001:db8:1::/64", "2001:db8:1::10/128"),
        )
    }

    /// Another address of the outside host in that prefix, with a route back to the pods.
    fn routable_client(self) -> SocketAddr {
        self.pick(
            (topology::ROUTABLE_CLIENT_ADDR, PORT).into(),
            (topology::ROUTABLE_CLIENT_ADDR_V6, PORT).into(),
        )
    }

    /// The node's address on the first uplink, which masqueraded flows leave with.
    fn node(self) -> IpAddr {
        self.pick(node_ip(), topology::NODE_UPLINK_V6.into())
    }

    /// Pod `i`'s address.
    fn pod(self, i: usize) -> IpAddr {
        self.pick(pod_ip(i), topology::pod_addr_v6(i).into())
    }

    /// The unspecified address, to bind a socket to any of the family's.
    fn any(self) -> IpAddr {
        self.pick(
            std::net::Ipv4Addr::UNSPECIFIED.into(),
            std::net::Ipv6Addr::UNSPECIFIED.into(),
        )
    }

    /// What `status --json` names the family by.
    fn status_key(self) -> &'static str {
        self.pick("ipv4", "ipv6")
    }

    /// A raw observer of `protocol` in `ns`, `IPPROTO_ICMP` meaning the family's ICMP.
    fn observe(self, ns: &str, protocol: u8) -> RawObserver {
        let protocol = match protocol {
            IPPROTO_ICMP => self.pick(IPPROTO_ICMP, IPPROTO_ICMPV6),
            other => other,
        };
        type Start = fn(&str, i32) -> anyhow::Result<RawObserver>;
        let start: Start = self.pick(RawObserver::start, RawObserver::start_v6);
        start(ns, i32::from(protocol)).unwrap()
    }

    /// A TCP connection from the pod to the outside arrives from the node's address.
    fn assert_masqueraded(self, bed: &Bed) {
        let seen = probe::tcp_probe(bed.pod(), self.outside(), 0).unwrap();
        assert_eq!(seen.ip(), self.node(), "TCP to the outside is masqueraded");
    }
}

impl FamilyOnTheBed for IpFamily {
    fn pick<T>(self, v4: T, v6: T) -> T {
        match self {
            IpFamily::Ipv4 => v4,
            IpFamily::Ipv6 => v6,
        }
    }
}

/// A TCP connection from the pod to the outside arrives from the node's address.
fn assert_masqueraded(bed: &Bed) {
    IpFamily::Ipv4.assert_masqueraded(bed);
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

/// `addr` as a prefix of that one address.
fn host_prefix(addr: IpAddr) -> String {
    match addr {
        IpAddr::V4(ip) => format!("{ip}/32"),
        IpAddr::V6(ip) => format!("{ip}/128"),
    }
}

/// This bed's flags, with each flag of `replace` given its new value.
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
    fn open(bed: &Bed, family: IpFamily, port: u16) -> Conversation {
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

/// `masq-agent explain DST --src SRC --json` with the agent's flags: whether every data plane
/// agreed with the config, and what it said.
fn explain_from(
    bed: &Bed,
    family: IpFamily,
    src: IpAddr,
    dst: IpAddr,
) -> (bool, serde_json::Value) {
    let mut args = vec![
        "explain".to_string(),
        dst.to_string(),
        format!("--src={src}"),
        "--proto=udp".to_string(),
        "--json".to_string(),
    ];
    args.extend(bed.family_args(family));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bed.agent_cmd(&args);
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), json)
}

/// Each group of UDP flows (`what` it is, and its flows) exchanges again: every flow gets its
/// own payload back, none is lost, none gets another's.
fn assert_no_flow_lost_or_crossed<'a>(groups: impl IntoIterator<Item = (&'a str, &'a UdpFlows)>) {
    for (what, flows) in groups {
        let tally = flows.exchange(3).unwrap();
        assert_eq!(
            (tally.lost, tally.crossed),
            (0, 0),
            "{what} flows: {tally:?}"
        );
    }
}

/// The nat table of the node's namespace, through the data plane's iptables backend, as
/// kube-proxy would write it: one rule per call.
fn kube_proxy(bed: &Bed, family: IpFamily, rules: &[&str]) {
    for rule in rules {
        let args: Vec<&str> = ["-w", "-t", "nat"]
            .into_iter()
            .chain(rule.split_whitespace())
            .collect();
        match family {
            IpFamily::Ipv4 => bed.iptables(&args),
            IpFamily::Ipv6 => bed.ip6tables(&args),
        }
        .unwrap();
    }
}

/// kube-proxy's masquerade of the traffic it marked, ahead of the agent's jump: on the node's
/// address, with ports from the whole range, NAT's among them.
const KUBE_PROXY_MASQUERADE: &str =
    "-I POSTROUTING 1 -m mark --mark 0x4000/0x4000 -j MASQUERADE --random-fully";

/// `count` queries from the pod, each from a fresh port, to `port` of the outside host, where a
/// server reads nothing and, its socket bound, sends no port unreachable either: flows never
/// answered. The server, to keep while it should stay silent.
fn unanswered_queries(bed: &Bed, family: IpFamily, port: u16, count: usize) -> UdpSocket {
    let silent = SocketAddr::from((family.outside().ip(), port));
    let server =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(UdpSocket::bind(silent)?)).unwrap();
    queries_from_fresh_ports(bed.pod(), family, silent, count);
    server
}

/// `count` queries from namespace `pod` to `server`, each from a fresh port, sent by
/// `QUERYING_THREADS` at once, so that CPUs meet in a full table as a busy pod's do.
fn queries_from_fresh_ports(pod: &str, family: IpFamily, server: SocketAddr, count: usize) {
    const QUERYING_THREADS: usize = 4;
    let any = family.any();
    let queriers: Vec<_> = (0..QUERYING_THREADS)
        .map(|thread| {
            let share = count / QUERYING_THREADS + usize::from(thread < count % QUERYING_THREADS);
            let pod = pod.to_string();
            std::thread::spawn(move || {
                masq_testbed::netns::within(&pod, move || {
                    for _ in 0..share {
                        UdpSocket::bind((any, 0))?.send_to(b"query", server)?;
                    }
                    Ok(())
                })
            })
        })
        .collect();
    for querier in queriers {
        querier.join().unwrap().unwrap();
    }
}

const METRICS_ADDR: &str = "127.0.0.1:9830";

fn http_get(bed: &Bed, path: &str) -> (u16, String) {
    probe::http_get(&bed.topo.node, METRICS_ADDR.parse().unwrap(), path)
        .unwrap_or_else(|e| panic!("GET {path}: {e:#}"))
}

/// The decisions `status` reports for the entry `prefix` (`None`: no such entry, or no slot),
/// and the totals per action.
fn decisions_of(status: &serde_json::Value, prefix: &str) -> Option<u64> {
    let entries = status["ebpf"]["decisions"]["entries"].as_array()?;
    let entry = entries.iter().find(|e| e["prefix"] == prefix)?;
    entry["decisions"].as_u64()
}

/// `bpftool map dump` of the map pinned as `name`: as bpftool prints it, and without whitespace,
/// where a field can be looked for whatever the layout bpftool chose.
fn dump_pinned(bed: &Bed, name: &str) -> (String, String) {
    let pin = bed.topo.bpffs.join(name);
    let dump =
        masq_testbed::netns::run("bpftool", &["map", "dump", "pinned", pin.to_str().unwrap()])
            .unwrap();
    let compact = dump.split_whitespace().collect();
    (dump, compact)
}

/// Whether a NAT table that `status --json` reads as `nat` (its `ebpf.nat.<family>`) is as full
/// as pods find it: it holds at least the entries it says it has room for, which is every
/// entry of a hash table. The slot table has more room than it says (`nat_room`), and a half
/// finds its two buckets full before all of it is.
fn reads_full(nat: &serde_json::Value) -> bool {
    let (entries, capacity) = (nat["entries"].as_u64(), nat["capacity"].as_u64());
    let (Some(entries), Some(capacity)) = (entries, capacity) else {
        return false;
    };
    entries >= capacity
}

/// The entries `family`'s NAT table says it has room for at `--nat-capacity=flows`: two a flow,
/// rounded up to whole buckets in the family's slot table, where the agent keeps its halves
/// there (`slot_table::rated_halves`).
fn nat_room(bed: &Bed, family: IpFamily, flows: u32) -> u64 {
    use masq_ebpf::slot_table::{buckets_for, rated_halves};
    let halves = 2 * flows;
    if slot_seed(bed, family).is_some() {
        rated_halves(buckets_for(halves))
    } else {
        u64::from(halves)
    }
}

/// The halves `family`'s NAT table holds, as bpftool formats them with the maps' BTF: each a
/// `NatKey` and its `NatEntry`, from the hash table's elements, or, where the table is the slot
/// table (its words array holds buckets, where a table not in use keeps one word), from the
/// slots whose byte in their bucket's word says they are held (a freed slot keeps its old
/// bytes).
fn nat_halves(bed: &Bed, family: IpFamily) -> Vec<(serde_json::Value, serde_json::Value)> {
    use masq_ebpf::{map_names, slot_table};
    let bpftool = |args: &[&str], name: &str| bpftool_pinned(bed, args, name, &[]);
    let (hash, slots, words) = family.pick(
        (
            map_names::NAT_V4,
            map_names::NAT_SLOTS_V4,
            map_names::NAT_SLOT_WORDS_V4,
        ),
        (
            map_names::NAT_V6,
            map_names::NAT_SLOTS_V6,
            map_names::NAT_SLOT_WORDS_V6,
        ),
    );
    let formatted = |dump: serde_json::Value| -> Vec<serde_json::Value> {
        let elements = dump.as_array().cloned().unwrap_or_default();
        elements
            .into_iter()
            .map(|e| e["formatted"].clone())
            .collect()
    };
    let word_count = bpftool(&["map", "show"], words)["max_entries"].as_u64();
    let Some((buckets, _)) = word_count.and_then(|n| slot_table::buckets_in(n as u32)) else {
        return formatted(bpftool(&["map", "dump"], hash))
            .into_iter()
            .map(|e| (e["key"].clone(), e["value"].clone()))
            .collect();
    };
    let held: Vec<u64> = formatted(bpftool(&["map", "dump"], words))
        .iter()
        // The word after the buckets' is the seed.
        .filter(|e| e["key"].as_u64().unwrap() < u64::from(buckets))
        .flat_map(|e| {
            let (bucket, word) = (e["key"].as_u64().unwrap(), e["value"].as_u64().unwrap());
            (0..u64::from(slot_table::BUCKET_SLOTS))
                .filter(move |&i| slot_table::held_slots(word) >> (8 * i) & 0x80 != 0)
                .map(move |i| bucket * u64::from(slot_table::BUCKET_SLOTS) + i)
        })
        .collect();
    let half = |slot: &serde_json::Value| (slot["key"].clone(), slot["entry"].clone());
    // A slot at a time where few are held: bpftool takes a minute to format the whole array at
    // the default size.
    if held.len() <= 500 {
        return held
            .iter()
            .map(|&slot| {
                let key = key_args(u32::try_from(slot).unwrap());
                let lookup = bpftool_pinned(bed, &["map", "lookup"], slots, &key);
                half(&lookup["formatted"]["value"])
            })
            .collect();
    }
    let held: std::collections::HashSet<u64> = held.into_iter().collect();
    formatted(bpftool(&["map", "dump"], slots))
        .into_iter()
        .filter(|e| held.contains(&e["key"].as_u64().unwrap()))
        .map(|e| half(&e["value"]))
        .collect()
}

/// The arguments that name the element at `key` of an array for `bpftool map lookup`.
fn key_args(key: u32) -> Vec<String> {
    std::iter::once("key".to_string())
        .chain(key.to_le_bytes().map(|byte| byte.to_string()))
        .collect()
}

/// What `bpftool -j <args> pinned <the map name pinned by bed's agent> <after>` prints.
fn bpftool_pinned(bed: &Bed, args: &[&str], name: &str, after: &[String]) -> serde_json::Value {
    let pin = bed.topo.bpffs.join(name);
    let mut args = args.to_vec();
    args.extend(["pinned", pin.to_str().unwrap()]);
    args.extend(after.iter().map(String::as_str));
    let out = masq_testbed::netns::run("bpftool", &[&["-j"][..], &args].concat()).unwrap();
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("bpftool {args:?}: {e}: {out}"))
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

/// What bpftool says, as JSON.
fn bpftool_json(args: &[&str]) -> serde_json::Value {
    let out = masq_testbed::netns::run("bpftool", &[&["-j"], args].concat()).unwrap();
    serde_json::from_str(&out).unwrap()
}

/// The egress program on `device`, as `bpftool prog show` says.
fn egress_program(bed: &Bed, device: &str) -> serde_json::Value {
    let link = links_of(bed, device)
        .into_iter()
        .find(|pin| pin.to_string_lossy().ends_with("-egress"))
        .expect("the egress program's link is pinned");
    let link = bpftool_json(&["link", "show", "pinned", link.to_str().unwrap()]);
    bpftool_json(&["prog", "show", "id", &link["prog_id"].to_string()])
}

/// The value at `key` of the map `name` of the egress program on `device`, as bpftool formats
/// it from the map's BTF: a map of the program object's own, which is not pinned.
fn program_map_value(bed: &Bed, device: &str, name: &str, key: u32) -> serde_json::Value {
    let id = program_map_id(bed, device, name);
    let key: Vec<String> = key.to_ne_bytes().iter().map(u8::to_string).collect();
    let key: Vec<&str> = key.iter().map(String::as_str).collect();
    let found = bpftool_json(&[&["map", "lookup", "id", &id, "key"], &key[..]].concat());
    found["formatted"]["value"].clone()
}

/// What bpftool shows of the map `name` of the egress program on `device` (one that is not
/// pinned): its type, sizes and flags.
fn program_map(bed: &Bed, device: &str, name: &str) -> serde_json::Value {
    bpftool_json(&["map", "show", "id", &program_map_id(bed, device, name)])
}

/// The id of the map `name` of the egress program on `device`.
fn program_map_id(bed: &Bed, device: &str, name: &str) -> String {
    let program = egress_program(bed, device)["id"].as_u64().unwrap() as u32;
    masq_testbed::program_map_id(program, name)
        .unwrap()
        .unwrap_or_else(|| panic!("the program has no map {name}"))
        .to_string()
}

/// The seed of `family`'s slot table the bed's agent pinned, as bpftool reads it: the word after
/// its buckets'. `None` where the halves are in the hash table.
fn slot_seed(bed: &Bed, family: IpFamily) -> Option<u64> {
    use masq_ebpf::{map_names, slot_table};
    let name = family.pick(map_names::NAT_SLOT_WORDS_V4, map_names::NAT_SLOT_WORDS_V6);
    let words = bpftool_pinned(bed, &["map", "show"], name, &[]);
    let (buckets, seeded) = slot_table::buckets_in(words["max_entries"].as_u64()? as u32)?;
    assert!(seeded, "a new slot table without its seed: {words}");
    let key = key_args(slot_table::seed_at(buckets));
    let lookup = bpftool_pinned(bed, &["map", "lookup"], name, &key);
    lookup["formatted"]["value"].as_u64()
}

/// What `status --json` says masquerades `family` leaving by `device`; `None` when it lists no
/// such device.
fn coverage(status: &serde_json::Value, device: &str, family: IpFamily) -> Option<String> {
    let devices = status["devices"].as_array()?;
    let entry = devices.iter().find(|d| d["device"] == device)?;
    entry[family.status_key()].as_str().map(String::from)
}

/// Waits until `status --json` says `family` leaving by `device` is masqueraded by `by`.
fn wait_for_coverage(bed: &Bed, agent: &Process, device: &str, family: IpFamily, by: &str) {
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
