//! Masquerading itself: what a pod sends to the outside leaves with the node's address and gets
//! its replies, what it sends within the cluster and what comes in from outside keep the pod's
//! address; two pods on one source port, IP options, and checksums with offload on and off.

use std::net::SocketAddr;

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe::{self, BulkSink, IPPROTO_ICMP, Observer, Proto},
    topology, wait_for,
};

use crate::{
    Bed, DEFAULT_CONFIG, FamilyOnTheBed, PORT, Plane, assert_masqueraded, assert_success, node_ip,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            masquerades_outside_traffic_only,
            two_pods_with_one_source_port_share_the_node_address,
            connections_from_outside_keep_the_pod_address,
            checksums_hold_with_tx_offload_on_and_off,
        );
        cases!($plane: packets_with_ip_options_are_masqueraded);
    };
}

mod ebpf {
    common_cases!(Ebpf);
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

mod iptables_legacy {
    family_cases!(IptablesLegacy: masquerades_outside_traffic_only);
}

fn masquerades_outside_traffic_only(plane: Plane, family: IpFamily) {
    let bed = Bed::new(plane, family.config());
    let pings = family.observe(&bed.topo.ext, IPPROTO_ICMP);
    let _agent = bed.start_agent(family.agent_args());
    let (node, pod) = (family.node(), family.pod(0));
    let seen = probe::tcp_probe(bed.pod(), family.outside(), 0).unwrap();
    assert_eq!(seen.ip(), node, "TCP to the outside is masqueraded");
    let seen = probe::udp_probe(bed.pod(), family.outside(), 0).unwrap();
    assert_eq!(seen.ip(), node, "UDP to the outside is masqueraded");
    assert_success(&bed.ping(0, family.outside().ip(), &[]));
    // The observer records on its own thread: give it a moment after ping returns.
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    assert_eq!(pings.sources(), [node], "and left with the node's address");

    let cluster_local = family.pick(
        topology::CLUSTER_LOCAL_ADDR.into(),
        topology::CLUSTER_LOCAL_ADDR_V6.into(),
    );
    let cluster_local = SocketAddr::new(cluster_local, PORT);
    let seen = probe::tcp_probe(bed.pod(), cluster_local, 0).unwrap();
    assert_eq!(seen.ip(), pod, "cluster-local keeps the pod address");
    let seen = probe::udp_probe(bed.pod(), cluster_local, 0).unwrap();
    assert_eq!(seen.ip(), pod);
    assert_success(&bed.ping(0, cluster_local.ip(), &[]));
    wait_for(|| Ok(pings.sources().len() == 2)).unwrap();
    assert_eq!(
        pings.sources()[1],
        pod,
        "ping to cluster-local keeps the pod address"
    );
    if family == IpFamily::Ipv6 {
        // IPv4 is masqueraded as before, beside it.
        assert_masqueraded(&bed);
    }
}

/// A ping carrying an IP option (record route) is masqueraded like any other: the reply only
/// comes back to a pod the outside host cannot route to if it left with the node's address.
fn packets_with_ip_options_are_masqueraded(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let pings = IpFamily::Ipv4.observe(&bed.topo.ext, IPPROTO_ICMP);
    let _agent = bed.start_agent(&[]);
    let out = bed.ping(0, topology::EXT_ADDR, &["-R"]);
    assert_success(&out);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("RR:"),
        "the reply carried the option back:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    assert_eq!(pings.sources(), [node_ip()], "left with the node's address");
}

fn two_pods_with_one_source_port_share_the_node_address(plane: Plane, family: IpFamily) {
    let bed = Bed::with_pods(plane, family.config(), 2);
    let _agent = bed.start_agent(family.agent_args());
    let (pods, node, server) = (&bed.topo.pods, family.node(), family.outside());
    type Probe = fn(&str, SocketAddr, u16) -> anyhow::Result<SocketAddr>;
    let probes: [(&str, Probe, u16); 2] = [
        ("TCP", probe::tcp_probe, 40000),
        ("UDP", probe::udp_probe, 40001),
    ];
    for (proto, send, port) in probes {
        let a = send(&pods[0], server, port).unwrap();
        let b = send(&pods[1], server, port).unwrap();
        assert_eq!((a.ip(), b.ip()), (node, node));
        assert_ne!(
            a.port(),
            b.port(),
            "{proto}: two pods, one port each on the node"
        );
    }
    for pod in 0..2 {
        assert_success(&bed.ping(pod, server.ip(), &[]));
    }
}

fn connections_from_outside_keep_the_pod_address(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let pod = family.pod(0);
    let in_pod = Observer::start(bed.pod(), &[pod], 9090).unwrap();
    let client = SocketAddr::new(family.routable_client().ip(), 0);
    // The handshake only completes if the pod's SYN-ACK leaves with the pod's own address.
    let seen = probe::tcp_probe_from(&bed.topo.ext, client, (pod, 9090).into()).unwrap();
    assert_eq!(seen.ip(), client.ip());
    assert_eq!(in_pod.sources(Proto::Tcp), [client.ip()]);
    // The pod's own connections to the same host are still masqueraded.
    family.assert_masqueraded(&bed);
}

/// A reply only comes back if every checksum on the way was right: TCP, UDP, ping and a bulk
/// transfer (segmentation offload) to the outside host, with the devices' checksum offload
/// off, then on.
fn checksums_hold_with_tx_offload_on_and_off(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let (server, node) = (family.outside(), family.node());
    for on in [false, true] {
        ethtool_tx(&bed, on);
        let tcp = probe::tcp_probe(bed.pod(), server, 0).unwrap();
        assert_eq!(tcp.ip(), node, "TCP, tx {on}");
        let udp = probe::udp_probe(bed.pod(), server, 0).unwrap();
        assert_eq!(udp.ip(), node, "UDP, tx {on}");
        assert_success(&bed.ping(0, server.ip(), &[]));
        let port = 9002 + u16::from(on);
        let _sink = BulkSink::start(&bed.topo.ext, port).unwrap();
        let sent = probe::tcp_bulk(
            bed.pod(),
            (server.ip(), port).into(),
            64 * 1024,
            16,
            std::time::Duration::ZERO,
        )
        .unwrap();
        assert_eq!(sent, 16 * 64 * 1024, "bulk TCP, tx {on}");
    }
}

/// Turns checksum offload on or off on every device between the pod and the outside host.
fn ethtool_tx(bed: &Bed, on: bool) {
    let state = if on { "on" } else { "off" };
    let set = |ns: &str, dev: &str| {
        masq_testbed::netns::run_in(ns, "ethtool", &["-K", dev, "tx", state]).unwrap();
    };
    set(bed.pod(), "eth0");
    set(&bed.topo.node, "pod0");
    set(&bed.topo.node, topology::UPLINK_IF);
    set(&bed.topo.ext, "eth0");
}
