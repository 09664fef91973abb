//! The test bed's own namespaces: each route, address and probe does what the tests rely on.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use masq_testbed::{
    netns::{command_in, run},
    probe::{self, IPPROTO_ICMPV6, Observer, Proto, RawObserver},
    topology::*,
    wait_for,
};

fn ping6(ns: &str, from: Option<Ipv6Addr>, dst: Ipv6Addr) -> bool {
    let mut cmd = command_in(ns, "ping");
    cmd.args(["-6", "-c1", "-W1"]);
    if let Some(from) = from {
        cmd.args(["-I", &from.to_string()]);
    }
    cmd.arg(dst.to_string()).output().unwrap().status.success()
}

/// Over IPv6 as over IPv4, only the addresses meant to route back to the pods answer them,
/// and the probes report the real sources of both families.
#[test]
fn dual_stack_bed_routes_back_only_where_intended() {
    let topo = Topology::new(1).unwrap();
    let pod = &topo.pods[0];
    for ns in topo.namespaces() {
        let addrs = run("ip", &["-n", ns, "-6", "addr"]).unwrap();
        assert!(!addrs.contains("tentative"), "{ns}: {addrs}");
    }
    assert!(!ping6(pod, None, EXT_ADDR_V6), "ext must not route back");
    assert!(ping6(pod, None, CLUSTER_LOCAL_ADDR_V6));
    assert!(ping6(
        &topo.ext,
        Some(ROUTABLE_CLIENT_ADDR_V6),
        pod_addr_v6(0)
    ));

    let mut addrs: Vec<IpAddr> = EXT_ADDRS.iter().map(|&a| a.into()).collect();
    addrs.extend(EXT_ADDRS_V6.iter().map(|&a| IpAddr::from(a)));
    let server = Observer::start(&topo.ext, &addrs, 7777).unwrap();
    let cluster_local = SocketAddr::from((CLUSTER_LOCAL_ADDR_V6, 7777));
    let pod_v6 = SocketAddr::from((pod_addr_v6(0), 4242));
    assert_eq!(probe::udp_probe(pod, cluster_local, 4242).unwrap(), pod_v6);
    assert_eq!(probe::tcp_probe(pod, cluster_local, 4242).unwrap(), pod_v6);
    let v4 = SocketAddr::from((CLUSTER_LOCAL_ADDR, 7777));
    assert_eq!(probe::tcp_probe(pod, v4, 0).unwrap().ip(), pod_addr(0));
    assert_eq!(
        server.sources(Proto::Tcp),
        [IpAddr::from(pod_addr_v6(0)), pod_addr(0).into()]
    );

    let in_pod = Observer::start(pod, &[pod_addr_v6(0)], 9090).unwrap();
    let client = SocketAddr::from((ROUTABLE_CLIENT_ADDR_V6, 0));
    let got = probe::tcp_probe_from(&topo.ext, client, (pod_addr_v6(0), 9090).into());
    assert_eq!(got.unwrap().ip(), ROUTABLE_CLIENT_ADDR_V6);
    assert_eq!(in_pod.sources(Proto::Tcp), [ROUTABLE_CLIENT_ADDR_V6]);

    let pings = RawObserver::start_v6(&topo.ext, i32::from(IPPROTO_ICMPV6)).unwrap();
    let icmpv6 = i32::from(IPPROTO_ICMPV6);
    // An echo reply, then an echo request: only the request counts.
    probe::raw_send_v6(
        pod,
        icmpv6,
        CLUSTER_LOCAL_ADDR_V6,
        &[129, 0, 0, 0, 0, 1, 0, 1],
    )
    .unwrap();
    probe::raw_send_v6(
        pod,
        icmpv6,
        CLUSTER_LOCAL_ADDR_V6,
        &[128, 0, 0, 0, 0, 1, 0, 2],
    )
    .unwrap();
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(pings.sources(), [pod_addr_v6(0)]);
}

fn ping(ns: &str, dst: IpAddr) -> bool {
    command_in(ns, "ping")
        .args(["-c1", "-W1", &dst.to_string()])
        .output()
        .unwrap()
        .status
        .success()
}

/// The second uplink comes and goes on demand; the host behind it answers the node, and
/// not the pods, to which it has no route.
#[test]
fn second_uplink_reaches_ext2_from_the_node_only_while_connected() {
    let topo = Topology::new(1).unwrap();
    let behind = [IpAddr::from(EXT2_ADDR), IpAddr::from(EXT2_ADDR_V6)];
    assert!(!ping(&topo.node, behind[0]), "not connected yet");
    for _ in 0..2 {
        topo.connect_second_uplink().unwrap();
        for dst in behind {
            assert!(ping(&topo.node, dst), "{dst} from the node");
            assert!(!ping(&topo.pods[0], dst), "{dst} must not route back");
        }
        assert!(ping(&topo.node, EXT_SECOND_ADDR.into()), "still by eth0");
        topo.disconnect_second_uplink().unwrap();
        assert!(!ping(&topo.node, behind[0]), "disconnected");
    }
}
