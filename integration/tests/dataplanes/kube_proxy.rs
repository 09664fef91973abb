//! Sharing the node's address with netfilter: kube-proxy's DNAT and its own MASQUERADE beside
//! the agent (ClusterIPs to the outside and hairpins, flows it masqueraded before the agent
//! started), and the node's own sockets on ports the programs hold. The outside host must see
//! the same whichever data plane is in force.

use std::{
    net::{IpAddr, SocketAddr, TcpStream},
    time::Duration,
};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe::{self, Observer, Proto, UdpEcho, UdpFlows},
    topology,
};

use crate::{
    Bed, Conversation, DEFAULT_CONFIG, FamilyOnTheBed, KUBE_PROXY_MASQUERADE, Plane,
    assert_masqueraded, assert_no_flow_lost_or_crossed, kube_proxy, node_ip, outside, pod_ip,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            no_reply_reaches_the_wrong_flow_beside_kube_proxys_masquerade,
            a_flow_netfilter_masqueraded_before_the_start_keeps_its_port,
            a_node_socket_on_a_port_the_programs_hold,
        );
        cases!($plane:
            a_cluster_ip_to_an_endpoint_outside_is_masqueraded,
            kube_proxys_own_masquerade_is_not_translated_twice,
            a_hairpin_cluster_ip_reaches_a_pod_on_the_same_node,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

/// A ClusterIP service whose endpoint is outside the cluster: kube-proxy DNATs it before
/// routing, and what leaves is masqueraded like any traffic to the outside.
fn a_cluster_ip_to_an_endpoint_outside_is_masqueraded(plane: Plane) {
    let (bed, _agent) = Bed::with_agent(plane, IpFamily::Ipv4);
    let endpoint = outside();
    kube_proxy(
        &bed,
        IpFamily::Ipv4,
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
    let (bed, _agent) = Bed::with_agent(plane, IpFamily::Ipv4);
    let endpoint = outside();
    kube_proxy(
        &bed,
        IpFamily::Ipv4,
        &[
            "-A PREROUTING -d 10.96.0.11/32 -p tcp --dport 80 -j MARK --set-xmark 0x4000/0x4000",
            &format!(
                "-A PREROUTING -d 10.96.0.11/32 -p tcp --dport 80 -j DNAT --to-destination {endpoint}"
            ),
            KUBE_PROXY_MASQUERADE,
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
        IpFamily::Ipv4,
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

/// kube-proxy marks everything pod 1 sends, and masquerades it as it does its services'
/// traffic.
fn kube_proxy_masquerades_pod_1(bed: &Bed, family: IpFamily) {
    let marked = family.pod(1);
    let mark = format!("-A PREROUTING -s {marked} -j MARK --set-xmark 0x4000/0x4000");
    kube_proxy(bed, family, &[&mark, KUBE_PROXY_MASQUERADE]);
}

/// kube-proxy masquerades the traffic it marks itself, on the node's address, with ports from
/// all of 1024-65535, while the programs masquerade other flows to the same destination on the
/// same address. Thousands of flows each way, live at once, programs' flows before and after
/// netfilter's: every one gets its own payload back, none another's.
fn no_reply_reaches_the_wrong_flow_beside_kube_proxys_masquerade(plane: Plane, family: IpFamily) {
    let bed = Bed::with_pods(plane, family.config(), 2);
    let _agent = bed.start_agent(family.agent_args());
    kube_proxy_masquerades_pod_1(&bed, family);
    no_reply_reaches_the_wrong_flow(&bed, family);
}

/// Thousands of UDP flows from pod 0, then from pod 1 (which netfilter translates), then from
/// pod 0 again, live at once to one server: every one gets its own payload back, none another's.
pub(crate) fn no_reply_reaches_the_wrong_flow(bed: &Bed, family: IpFamily) {
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
    for _round in 0..2 {
        assert_no_flow_lost_or_crossed(groups.iter().map(|(what, flows)| (*what, flows)));
    }
}

/// A connection netfilter masqueraded before the agent started (kube-proxy's MASQUERADE),
/// while a pod's new flow to the same server needs a port and the only one is that
/// connection's: the port is held from conntrack's table and not handed out, so the new flow
/// gets none, and the old connection goes on.
fn a_flow_netfilter_masqueraded_before_the_start_keeps_its_port(plane: Plane, family: IpFamily) {
    let bed = Bed::with_pods(plane, family.config(), 2);
    kube_proxy_masquerades_pod_1(&bed, family);
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

/// A process on the node binds the very address and port a pod's connection holds on it, and
/// connects to the same server: as conntrack does, the node gives its connection another port,
/// and both connections work.
fn a_node_socket_on_a_port_the_programs_hold(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let conversation = Conversation::open(&bed, family, 9740);
    a_node_socket_on_the_port_of(&bed, &conversation, family.node());
}

/// A process on the node binds the address and port `conversation` (a pod's, masqueraded to
/// `address`) holds, and connects to the same server: its connection keeps the address and is
/// given another port, and both connections work.
pub(crate) fn a_node_socket_on_the_port_of(
    bed: &Bed,
    conversation: &Conversation,
    address: IpAddr,
) {
    let (held, server) = (conversation.node_side, conversation.server);
    assert_eq!(held.ip(), address);
    let node = probe::tcp_connect_from(&bed.topo.node, held, server)
        .expect("the node's connection from the held port is answered");
    let (host, seen) = conversation.listener.accept().unwrap();
    assert_eq!(
        seen.ip(),
        address,
        "the node's connection keeps its address"
    );
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
