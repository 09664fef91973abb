//! The node's devices: the uplink's address changing, the uplink going down or being recreated,
//! a second uplink beside it, and (eBPF) which devices carry the programs as default routes and
//! named interfaces come and go, with the flows through a device they leave drained first.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe::{self, IPPROTO_ICMP, Observer},
    topology::{self, Process},
    wait_for,
};

use crate::{
    Bed, Conversation, DEFAULT_CONFIG, FamilyOnTheBed, IPV6_CONFIG, PORT, Plane, args_with,
    assert_success, coverage, links_of, nat_halves, program_map_value, wait_for_coverage,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            new_flows_take_the_uplink_s_new_address,
            survives_the_uplink_going_down_and_up,
            survives_the_uplink_being_deleted_and_recreated,
            masquerades_traffic_leaving_by_a_second_uplink,
            masquerades_traffic_leaving_by_a_second_uplink_added_later,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
    cases!(Ebpf:
        a_link_scope_address_listed_first_is_not_the_masquerade_source,
        follows_a_device_that_gains_a_default_route,
        follows_named_interfaces_as_they_appear_and_vanish,
        a_shrinking_device_set_drains_before_it_detaches,
    );
}

mod iptables_nft {
    common_cases!(IptablesNft);
    cases!(IptablesNft: a_link_scope_address_listed_first_is_not_the_masquerade_source);
}

const BOTH_FAMILIES: [IpFamily; 2] = [IpFamily::Ipv4, IpFamily::Ipv6];

/// A link-scope address a network manager adds to the uplink (169.254/16) comes first in the
/// kernel's list of the uplink's addresses, before the global one: masqueraded traffic leaves
/// with the global one all the same, which MASQUERADE picks for a packet bound elsewhere.
fn a_link_scope_address_listed_first_is_not_the_masquerade_source(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let uplink = topology::UPLINK_IF;
    bed.topo
        .node_run(
            "ip",
            &[
                "addr",
                "add",
                "169.254.7.7/16",
                "scope",
                "link",
                "dev",
                uplink,
            ],
        )
        .unwrap();
    let listed = bed
        .topo
        .node_run("ip", &["-4", "-o", "addr", "show", "dev", uplink])
        .unwrap();
    assert!(
        listed.find("169.254.7.7") < listed.find(&topology::NODE_UPLINK.to_string()),
        "the kernel lists the link-scope address first: {listed}"
    );
    let _agent = bed.start_agent(&[]);
    let source = probe::tcp_probe(bed.pod(), IpFamily::Ipv4.outside(), 0)
        .unwrap()
        .ip();
    assert_eq!(source, IpAddr::from(topology::NODE_UPLINK));
}

/// The uplink's address changes under the agent: new flows leave with the new one within
/// seconds, and (eBPF) the flows on the old address are forgotten, as MASQUERADE forgets its
/// connections when their address goes.
fn new_flows_take_the_uplink_s_new_address(plane: Plane, family: IpFamily) {
    let (bed, agent) = Bed::with_agent(plane, family);
    family.assert_masqueraded(&bed);
    let uplink = topology::UPLINK_IF;
    let (old, new) = family.pick(
        (format!("{}/24", topology::NODE_UPLINK), "203.0.113.2/24"),
        (
            format!("{}/64", topology::NODE_UPLINK_V6),
            "2001:db8:1::2/64",
        ),
    );
    if family == IpFamily::Ipv4 {
        // The new address is a secondary one of the old one's subnet, which would go with it.
        let promote = format!("net.ipv4.conf.{uplink}.promote_secondaries=1");
        bed.topo.node_run("sysctl", &["-qw", &promote]).unwrap();
    }
    let flag = family.pick("-4", "-6");
    let address = |prefix: &str| -> IpAddr { prefix.split('/').next().unwrap().parse().unwrap() };
    let new_address = address(new);
    bed.topo
        .node_run("ip", &[flag, "addr", "add", new, "dev", uplink, "nodad"])
        .unwrap();
    bed.topo
        .node_run("ip", &[flag, "addr", "del", &old, "dev", uplink])
        .unwrap();
    wait_for(|| Ok(probe::tcp_probe(bed.pod(), family.outside(), 0)?.ip() == new_address))
        .unwrap_or_else(|e| panic!("still the old address: {e}\n{}", agent.log_text()));
    if bed.plane == Plane::Ebpf {
        // The agent gives the programs the new address before it forgets the old one's flows:
        // a probe may see the one before the log says the other.
        wait_for(|| {
            Ok(agent
                .log_text()
                .contains("flows on the old address forgotten"))
        })
        .unwrap_or_else(|e| panic!("the old address's flows kept: {e}\n{}", agent.log_text()));
        let halves = nat_halves(&bed, family);
        let bytes = |addr: IpAddr| -> serde_json::Value {
            match addr {
                IpAddr::V4(a) => a.octets().to_vec(),
                IpAddr::V6(a) => a.octets().to_vec(),
            }
            .into()
        };
        let on = |addr: IpAddr| halves.iter().any(|(_, entry)| entry["addr"] == bytes(addr));
        assert!(on(new_address), "{halves:?}");
        assert!(
            !on(address(&old)),
            "nothing is left on the old address:\n{halves:?}"
        );
        // The agent rewrote the uplink's element in the programs' array, and left it in use.
        let element = indexed_interface(&bed, uplink);
        assert_eq!(element["in_use"], 1, "{element}");
        assert_eq!(
            element["iface"][family.pick("ipv4", "ipv6")],
            bytes(new_address),
            "{element}"
        );
    }
}

/// The element of `device` in the array of devices of the programs on it
/// (`map_names::INTERFACES_BY_IFINDEX`), as bpftool formats it from the map's BTF.
fn indexed_interface(bed: &Bed, device: &str) -> serde_json::Value {
    let shown = bed
        .topo
        .node_run("ip", &["-j", "link", "show", "dev", device]);
    let shown: serde_json::Value = serde_json::from_str(&shown.unwrap()).unwrap();
    let ifindex = shown[0]["ifindex"].as_u64().unwrap() as u32;
    assert!(
        ifindex < masq_ebpf::INTERFACES_BY_IFINDEX_ENTRIES,
        "{device}'s ifindex {ifindex} is one the array holds"
    );
    let name = masq_ebpf::map_names::INTERFACES_BY_IFINDEX;
    program_map_value(bed, device, name, ifindex)
}

/// The uplink goes down for a few upkeep ticks and comes back, with its routes (which a down
/// link takes with it) and, for IPv6, its address (which the kernel drops with the link):
/// masquerading resumes with no help.
fn survives_the_uplink_going_down_and_up(plane: Plane, family: IpFamily) {
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
    if family == IpFamily::Ipv6 {
        let address = format!("{}/64", topology::NODE_UPLINK_V6);
        bed.topo
            .node_run(
                "ip",
                &["-6", "addr", "replace", &address, "dev", uplink, "nodad"],
            )
            .unwrap();
    }
    let (flag, gateway) = (family.pick("-4", "-6"), family.outside().ip().to_string());
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
fn survives_the_uplink_being_deleted_and_recreated(plane: Plane, family: IpFamily) {
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

/// The host behind the second uplink.
fn behind_second_uplink(family: IpFamily) -> IpAddr {
    family.pick(topology::EXT2_ADDR.into(), topology::EXT2_ADDR_V6.into())
}

/// The node's address on the second uplink.
fn second_uplink_node(family: IpFamily) -> IpAddr {
    family.pick(
        topology::NODE_SECOND_UPLINK.into(),
        topology::NODE_SECOND_UPLINK_V6.into(),
    )
}

/// A TCP and UDP server on `ext2`, behind the second uplink (which must be connected).
fn serve_behind_second_uplink(bed: &Bed) -> Observer {
    let addrs = BOTH_FAMILIES.map(behind_second_uplink);
    Observer::start(&bed.topo.ext2, &addrs, PORT).expect("server behind up1")
}

/// A pod's TCP, UDP and ping to the host behind the second uplink arrive from the node's
/// address on that uplink, and get their answers: `ext2` has no route back to the pods.
fn assert_second_uplink_masquerades(bed: &Bed, family: IpFamily) {
    let pings = family.observe(&bed.topo.ext2, IPPROTO_ICMP);
    let server = SocketAddr::from((behind_second_uplink(family), PORT));
    let node = second_uplink_node(family);
    let seen = probe::tcp_probe(bed.pod(), server, 0).unwrap();
    assert_eq!(seen.ip(), node, "TCP by up1 is masqueraded");
    let seen = probe::udp_probe(bed.pod(), server, 0).unwrap();
    assert_eq!(seen.ip(), node, "UDP by up1 is masqueraded");
    assert_success(&bed.ping(0, server.ip(), &[]));
    wait_for(|| Ok(!pings.sources().is_empty())).unwrap();
    assert_eq!(pings.sources(), [node], "ping by up1 is masqueraded");
}

/// When the node's second uplink `up1` comes to exist, relative to the agent's start.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SecondUplink {
    BeforeTheAgent,
    AfterTheAgent,
}

fn second_uplink_is_masqueraded(plane: Plane, family: IpFamily, when: SecondUplink) {
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

fn masquerades_traffic_leaving_by_a_second_uplink(plane: Plane, family: IpFamily) {
    second_uplink_is_masqueraded(plane, family, SecondUplink::BeforeTheAgent);
}

fn masquerades_traffic_leaving_by_a_second_uplink_added_later(plane: Plane, family: IpFamily) {
    second_uplink_is_masqueraded(plane, family, SecondUplink::AfterTheAgent);
}

/// This bed's flags without `--interface`: the agent follows the default routes.
fn args_following_default_routes(bed: &Bed) -> Vec<String> {
    bed.plane_args()
        .into_iter()
        .filter(|arg| !arg.starts_with("--interface="))
        .collect()
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
    for family in BOTH_FAMILIES {
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
    for family in BOTH_FAMILIES {
        assert_second_uplink_masquerades(&bed, family);
    }

    let ext2 = topology::EXT2_ADDR.to_string();
    let route = ["route", "add", "default", "via", &ext2, "metric", "100"];
    bed.topo.node_run("ip", &route).unwrap();
    for family in BOTH_FAMILIES {
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
    for family in BOTH_FAMILIES {
        let server = SocketAddr::from((behind_second_uplink(family), PORT));
        let seen = probe::tcp_probe(bed.pod(), server, 0).unwrap();
        assert_eq!(seen.ip(), second_uplink_node(family), "by up1's programs");
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
    wait_for_coverage(&bed, &agent, up1, IpFamily::Ipv4, "iptables");
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
    assert_second_uplink_masquerades(&bed, IpFamily::Ipv4);
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
    assert_eq!(
        coverage(&status, "eth0", IpFamily::Ipv4).unwrap(),
        "iptables"
    );
    assert!(attached_devices(&status).is_empty(), "{status}");
    for family in BOTH_FAMILIES {
        family.assert_masqueraded(&bed);
    }

    for round in 0..2 {
        bed.topo.connect_second_uplink().unwrap();
        let _server = serve_behind_second_uplink(&bed);
        for family in BOTH_FAMILIES {
            wait_for_coverage(&bed, &agent, up1, family, "ebpf");
            assert_second_uplink_masquerades(&bed, family);
        }
        assert_eq!(
            coverage(&bed.status_json(), "eth0", IpFamily::Ipv4).unwrap(),
            "iptables"
        );
        if round == 0 {
            assert_a_device_without_ipv4_is_left_to_the_chain(&bed, &agent);
        }
        bed.topo.disconnect_second_uplink().unwrap();
        wait_for(|| Ok(attached_devices(&bed.status_json()).is_empty())).unwrap();
        let status = bed.status_json();
        assert_eq!(coverage(&status, up1, IpFamily::Ipv4), None, "{status}");
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
    for family in BOTH_FAMILIES {
        wait_for_coverage(bed, agent, up1, family, "iptables");
    }
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
    wait_for_coverage(bed, agent, up1, IpFamily::Ipv4, "ebpf");
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
