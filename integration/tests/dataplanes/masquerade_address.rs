//! A chosen masquerade address (`masqueradeAddress`, `masqueradeAddressIPv6`): masqueraded
//! traffic takes it while the node holds it, on the uplink or on any other device, and the
//! outgoing device's address while it does not; flows keep the address they started with. The
//! address stays the node's own: its services and sockets on it, ICMP errors about its flows,
//! netfilter's NAT to it, and the upgrade, resize and rollback paths work as on the device's.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::Duration,
};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    netns::within,
    probe::{self, UdpEcho, UdpFlows},
    topology::{self, Process},
    write_config,
};

use crate::{
    Bed, Conversation, FamilyOnTheBed, PacedTransfer, Plane, assert_no_flow_lost_or_crossed,
    explain_from, icmp_and_fragments, kube_proxy, nat_room, restarts,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            new_flows_take_the_chosen_address_while_the_uplink_holds_it,
            new_flows_take_the_chosen_address_held_on_another_device,
            new_flows_take_the_chosen_address_held_on_loopback,
            a_service_on_the_chosen_address_answers_from_its_own_port,
            a_node_socket_on_a_port_a_pods_flow_holds_on_the_chosen_address,
            icmp_errors_about_flows_on_the_chosen_address_go_both_ways,
            no_reply_reaches_the_wrong_flow_beside_netfilters_snat_to_the_chosen_address,
            snat_with_to_ports_loads_into_real_iptables,
            the_nodes_own_flows_keep_the_devices_address,
            editing_the_chosen_address_moves_no_connection,
        );
        cases!($plane: a_tentative_chosen_ipv6_address_is_held_once_detection_is_done);
    };
}

mod ebpf {
    common_cases!(Ebpf);
    family_cases!(Ebpf:
        the_chosen_address_through_an_upgrade_a_resize_and_a_rollback,
    );
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

// How the rules are stored differs between the backends: each must load the chain's own.
mod iptables_legacy {
    family_cases!(IptablesLegacy:
        snat_with_to_ports_loads_into_real_iptables,
        the_nodes_own_flows_keep_the_devices_address,
    );
}

/// An address of the uplink's prefix that no one holds at first.
fn chosen(family: IpFamily) -> IpAddr {
    family
        .pick("203.0.113.50", "2001:db8:1::50")
        .parse()
        .unwrap()
}

/// A device of the node's that holds nothing but what a case gives it.
const OTHER_DEVICE: &str = "masq-addr";

/// Runs `ip ARGS` in namespace `ns`.
fn ip_in(ns: &str, args: &[&str]) {
    let mut all = vec!["-n", ns];
    all.extend(args);
    masq_testbed::netns::run("ip", &all).unwrap();
}

/// Gives `device` the chosen address (`op`: `add` or `del`).
fn chosen_on(bed: &Bed, family: IpFamily, op: &str, device: &str) {
    let addr = chosen(family);
    let prefix = format!("{addr}/{}", family.pick(32, 128));
    let mut args = vec!["addr", op, prefix.as_str(), "dev", device];
    if family == IpFamily::Ipv6 && op == "add" {
        args.push("nodad");
    }
    ip_in(&bed.topo.node, &args);
}

/// Before the node holds the chosen address, new flows take the device's; once `device` holds
/// it, they take it, and once it goes, the device's again; a connection open throughout keeps
/// the address it started with.
/// `prepare` readies the node before the agent starts.
fn the_chosen_address_follows_the_node(
    plane: Plane,
    family: IpFamily,
    device: &str,
    prepare: impl Fn(&Bed),
) {
    let key = family.pick("masqueradeAddress", "masqueradeAddressIPv6");
    let config = format!("{}{key}: {}\n", family.config(), chosen(family));
    let bed = Bed::new(plane, &config);
    prepare(&bed);
    let agent = bed.start_agent(family.agent_args());
    let dst = family.outside();
    let wait = |expect: IpAddr, why: &str| {
        bed.server
            .wait_for_udp_from(bed.pod(), dst, expect)
            .unwrap_or_else(|e| panic!("{why}: {e:#}\n{}", agent.log_text()));
    };
    wait(family.node(), "not held yet: the device's address");
    assert!(
        says_not_held(&bed, family),
        "status says the node does not hold the address: {}",
        bed.status_json()
    );
    let (_, said) = explain_from(&bed, family, family.pod(0), dst.ip());
    assert_eq!(
        (
            said["masqueraded_to"].as_str(),
            said["chosen_not_held"].as_str()
        ),
        (
            Some(family.node().to_string().as_str()),
            Some(chosen(family).to_string().as_str())
        ),
        "explain says which address and why: {said}"
    );
    let open_before = Conversation::open(&bed, family, 9781);
    assert_eq!(open_before.node_side.ip(), family.node());
    chosen_on(&bed, family, "add", device);
    wait(chosen(family), "held: the chosen address");
    // Status says what is in force, once the agent has followed the change.
    masq_testbed::wait_for(|| {
        let status = bed.status_json();
        let said = match plane {
            Plane::Ebpf => status["ebpf"]["chosen_addresses"].to_string(),
            _ => status["chains"].to_string(),
        };
        Ok(said.contains(&chosen(family).to_string()))
    })
    .unwrap_or_else(|e| panic!("status never named the chosen address: {e}"));
    assert!(!says_not_held(&bed, family), "{}", bed.status_json());
    let open_while_held = Conversation::open(&bed, family, 9782);
    assert_eq!(open_while_held.node_side.ip(), chosen(family));
    open_while_held
        .exchange("replies reach the chosen address")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    open_before
        .exchange("a connection keeps the address it started with")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    chosen_on(&bed, family, "del", device);
    wait(family.node(), "gone: the device's address again");
    open_before
        .exchange("and keeps it when the chosen one goes")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    assert!(
        agent
            .log_text()
            .contains("the node does not hold the chosen masquerade address"),
        "the fallback is said"
    );
}

fn new_flows_take_the_chosen_address_while_the_uplink_holds_it(plane: Plane, family: IpFamily) {
    the_chosen_address_follows_the_node(plane, family, topology::UPLINK_IF, |_| {});
}

/// The address on a device of its own, as a VIP on a device of its own: replies still come in by
/// the uplink, where the programs translate them back.
fn new_flows_take_the_chosen_address_held_on_another_device(plane: Plane, family: IpFamily) {
    let other_device = |bed: &Bed| {
        route_the_chosen_address_to_the_node(bed, family);
        add_the_other_device(bed);
        ip_in(&bed.topo.node, &["link", "set", OTHER_DEVICE, "up"]);
    };
    the_chosen_address_follows_the_node(plane, family, OTHER_DEVICE, other_device);
}

/// The address on loopback, a common way to hold a VIP: it is the node's as much as on any
/// other device.
fn new_flows_take_the_chosen_address_held_on_loopback(plane: Plane, family: IpFamily) {
    let on_loopback = |bed: &Bed| route_the_chosen_address_to_the_node(bed, family);
    the_chosen_address_follows_the_node(plane, family, "lo", on_loopback);
}

/// An IPv6 address in duplicate address detection is not the node's yet: the kernel neither
/// accepts packets for it nor sends from it. On a device without carrier the chosen address
/// stays tentative, and new flows keep the device's address; once the link is up and the
/// detection done, they take the chosen one.
fn a_tentative_chosen_ipv6_address_is_held_once_detection_is_done(plane: Plane) {
    let family = IpFamily::Ipv6;
    let bed = Bed::new(plane, &chosen_config(family));
    route_the_chosen_address_to_the_node(&bed, family);
    add_the_other_device(&bed);
    let detecting = format!("net.ipv6.conf.{OTHER_DEVICE}.accept_dad=1");
    masq_testbed::netns::run_in(&bed.topo.node, "sysctl", &["-qw", &detecting]).unwrap();
    ip_in(&bed.topo.node, &["link", "set", OTHER_DEVICE, "up"]);
    let agent = bed.start_agent(family.agent_args());
    let prefix = format!("{}/128", chosen(family));
    ip_in(
        &bed.topo.node,
        &["addr", "add", &prefix, "dev", OTHER_DEVICE],
    );
    let shown = [
        "-n",
        &bed.topo.node,
        "-6",
        "addr",
        "show",
        "dev",
        OTHER_DEVICE,
    ];
    let shown = masq_testbed::netns::run("ip", &shown).unwrap();
    assert!(shown.contains("tentative"), "{shown}");
    // Long enough for the agent, which looks every second, to have taken it if it would.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        says_not_held(&bed, family),
        "a tentative address is not held: {}",
        bed.status_json()
    );
    wait_for_flows_from(&bed, family, &agent, family.node());
    ip_in(&bed.topo.node, &["link", "set", &other_device_peer(), "up"]);
    wait_for_flows_from(&bed, family, &agent, chosen(family));
    assert!(!says_not_held(&bed, family), "{}", bed.status_json());
}

/// The outside host's router sends the chosen address to the node, as a VIP's would: the node
/// answers neighbour discovery only for its uplink's own addresses.
fn route_the_chosen_address_to_the_node(bed: &Bed, family: IpFamily) {
    let via = family.node().to_string();
    let to = format!("{}/{}", chosen(family), family.pick(32, 128));
    ip_in(&bed.topo.ext, &["route", "add", &to, "via", &via]);
}

/// The other device's peer, which stays down unless a case brings it up: no carrier.
fn other_device_peer() -> String {
    format!("{OTHER_DEVICE}-p")
}

/// The node's other device, down: a veth whose peer carries nothing, as this kernel may have
/// no dummy devices.
fn add_the_other_device(bed: &Bed) {
    let peer = other_device_peer();
    let add = [
        "link",
        "add",
        OTHER_DEVICE,
        "type",
        "veth",
        "peer",
        "name",
        &peer,
    ];
    ip_in(&bed.topo.node, &add);
}

/// Whether `status` notes that the node does not hold the chosen address.
fn says_not_held(bed: &Bed, family: IpFamily) -> bool {
    bed.status_json()["notes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|note| note.to_string().contains(&chosen(family).to_string()))
}

/// The family's config with the chosen address.
fn chosen_config(family: IpFamily) -> String {
    let key = family.pick("masqueradeAddress", "masqueradeAddressIPv6");
    format!("{}{key}: {}\n", family.config(), chosen(family))
}

/// Waits until the pod's new flows reach the outside host from `expect`.
fn wait_for_flows_from(bed: &Bed, family: IpFamily, agent: &Process, expect: IpAddr) {
    bed.server
        .wait_for_udp_from(bed.pod(), family.outside(), expect)
        .unwrap_or_else(|e| panic!("new flows from {expect}: {e:#}\n{}", agent.log_text()));
}

/// The chosen address named in the file, then dropped from it, while transfers are under way:
/// new flows take what the file says, and each transfer keeps the address it began with, as
/// conntrack keeps a connection's NAT (a moved source would end it).
fn editing_the_chosen_address_moves_no_connection(plane: Plane, family: IpFamily) {
    let bed = Bed::new(plane, family.config());
    // On loopback: on the uplink, an IPv6 address would be MASQUERADE's own pick of the
    // device's addresses too.
    route_the_chosen_address_to_the_node(&bed, family);
    chosen_on(&bed, family, "add", "lo");
    let agent = bed.start_agent(family.agent_args());
    wait_for_flows_from(&bed, family, &agent, family.node());
    let sink = |port: u16| SocketAddr::from((family.outside().ip(), port));
    let begun_on_the_device = PacedTransfer::start(&bed, sink(9783), 300);
    write_config(&bed.config, &chosen_config(family)).unwrap();
    wait_for_flows_from(&bed, family, &agent, chosen(family));
    let begun_on_the_chosen = PacedTransfer::start(&bed, sink(9784), 300);
    write_config(&bed.config, family.config()).unwrap();
    wait_for_flows_from(&bed, family, &agent, family.node());
    begun_on_the_device.assert_complete("begun with the device's address, through both edits");
    begun_on_the_chosen.assert_complete("begun with the chosen address, through its removal");
}

/// A bed of `pods` pods whose node holds the chosen address on its uplink before its agent
/// starts (with `args` besides the family's), once new flows take the address.
fn holding_the_chosen_address(
    plane: Plane,
    family: IpFamily,
    pods: usize,
    args: &[&str],
) -> (Bed, Process) {
    let bed = Bed::with_pods(plane, &chosen_config(family), pods);
    chosen_on(&bed, family, "add", topology::UPLINK_IF);
    let mut all = family.agent_args().to_vec();
    all.extend(args);
    let agent = bed.start_agent(&all);
    wait_for_flows_from(&bed, family, &agent, chosen(family));
    (bed, agent)
}

/// With `--to-ports`, the chain SNATs to the chosen address by one rule per protocol and range
/// (beside the programs too, for what they leave to it): iptables takes the ports only from a
/// rule that names its protocol before the target, and refuses the whole chain otherwise. A
/// pod's connection leaves from the chosen address, on a port of the ranges.
fn snat_with_to_ports_loads_into_real_iptables(plane: Plane, family: IpFamily) {
    let ranges = [(1024, 29999), (32768, 65535)];
    let (bed, _agent) =
        holding_the_chosen_address(plane, family, 1, &["--to-ports=1024-29999,32768-65535"]);
    let list = ["-t", "nat", "-S", crate::CHAIN];
    let chain = match family {
        IpFamily::Ipv4 => bed.iptables(&list),
        IpFamily::Ipv6 => bed.ip6tables(&list),
    }
    .unwrap();
    let to_source = match chosen(family) {
        IpAddr::V4(addr) => addr.to_string(),
        IpAddr::V6(addr) => format!("[{addr}]"),
    };
    for (lo, hi) in ranges {
        let snat = format!("-j SNAT --to-source {to_source}:{lo}-{hi}");
        let rules: Vec<&str> = chain.lines().filter(|l| l.contains(&snat)).collect();
        assert_eq!(
            rules.len(),
            3,
            "a rule per protocol for {lo}-{hi}:\n{chain}"
        );
        for (rule, proto) in rules.iter().zip(["tcp", "udp", "sctp"]) {
            assert!(rule.contains(&format!("-p {proto} ")), "{rule}");
        }
    }
    let seen = probe::tcp_probe(bed.pod(), family.outside(), 0).unwrap();
    assert_eq!(seen.ip(), chosen(family));
    assert!(
        ranges
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&seen.port())),
        "{seen}"
    );
}

/// A TCP and a UDP service of the node's, bound to the chosen address: what the outside host
/// sends them is answered from the address and port it sent to, as conntrack answers replies,
/// never masqueraded as a pod's new flow would be.
fn a_service_on_the_chosen_address_answers_from_its_own_port(plane: Plane, family: IpFamily) {
    let (bed, agent) = holding_the_chosen_address(plane, family, 1, &[]);
    let tcp_service = SocketAddr::new(chosen(family), 9790);
    let listener = within(&bed.topo.node, move || Ok(TcpListener::bind(tcp_service)?)).unwrap();
    let client = within(&bed.topo.ext, move || {
        let stream = TcpStream::connect_timeout(&tcp_service, Duration::from_secs(3))?;
        stream.set_read_timeout(Some(Duration::from_secs(3)))?;
        Ok(stream)
    })
    .unwrap_or_else(|e| panic!("the TCP service answered: {e:#}\n{}", agent.log_text()));
    let (mut service_end, _) = listener.accept().unwrap();
    (&client).write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    service_end.read_exact(&mut buf).unwrap();
    service_end.write_all(b"pong").unwrap();
    (&client).read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong", "the TCP service's answer");

    let udp_service = SocketAddr::new(chosen(family), 9791);
    let service = within(&bed.topo.node, move || Ok(UdpSocket::bind(udp_service)?)).unwrap();
    service
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let any = family.any();
    let host = within(&bed.topo.ext, move || Ok(UdpSocket::bind((any, 0))?)).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    host.send_to(b"query", udp_service).unwrap();
    let (n, asker) = service.recv_from(&mut buf).unwrap();
    service.send_to(&buf[..n], asker).unwrap();
    let (_, answered_from) = host
        .recv_from(&mut buf)
        .unwrap_or_else(|e| panic!("the UDP service's answer: {e}\n{}", agent.log_text()));
    assert_eq!(
        answered_from, udp_service,
        "the UDP service answers from its port"
    );
}

/// The node's own connections keep the address they have while pods' take the chosen address,
/// whichever plane: a socket bound to the device's address, and one bound to none, which the
/// kernel gives an address of the device (IPv6 prefers the chosen one, the longer match).
fn the_nodes_own_flows_keep_the_devices_address(plane: Plane, family: IpFamily) {
    let (bed, agent) = holding_the_chosen_address(plane, family, 1, &[]);
    let pods = Conversation::open(&bed, family, 9787);
    assert_eq!(pods.node_side.ip(), chosen(family), "a pod's connection");
    for bound in [family.node(), family.any()] {
        let node = probe::tcp_connect_from(&bed.topo.node, SocketAddr::new(bound, 0), pods.server)
            .unwrap_or_else(|e| panic!("from {bound}: {e:#}\n{}", agent.log_text()));
        let (_, seen) = pods.listener.accept().unwrap();
        assert_eq!(
            seen.ip(),
            node.local_addr().unwrap().ip(),
            "the node's connection bound to {bound} arrives from its own address"
        );
    }
}

/// A process on the node binds the very port a pod's connection holds on the chosen address,
/// and connects to the same server: as conntrack does, the node's connection is given another
/// port, and both connections work.
fn a_node_socket_on_a_port_a_pods_flow_holds_on_the_chosen_address(plane: Plane, family: IpFamily) {
    let (bed, _agent) = holding_the_chosen_address(plane, family, 1, &[]);
    let conversation = Conversation::open(&bed, family, 9784);
    kube_proxy::a_node_socket_on_the_port_of(&bed, &conversation, chosen(family));
}

/// ICMP errors about flows on the chosen address: the pod's own port unreachable leaves from
/// the chosen address, about the datagram the outside host sent there, and the hop before a
/// narrower link tells the pod its MTU through the translation back.
fn icmp_errors_about_flows_on_the_chosen_address_go_both_ways(plane: Plane, family: IpFamily) {
    let (bed, _agent) = holding_the_chosen_address(plane, family, 1, &[]);
    icmp_and_fragments::a_pods_icmp_error_leaves_as(&bed, family, chosen(family));
    icmp_and_fragments::pod_learns_the_path_mtu(&bed, family);
}

/// netfilter translates pod 1's flows to the chosen address itself (an SNAT rule ahead of the
/// agent's, as kube-proxy's MASQUERADE is), with ports from all of 1024-65535, while pod 0's are
/// masqueraded to it: no reply reaches the wrong flow.
fn no_reply_reaches_the_wrong_flow_beside_netfilters_snat_to_the_chosen_address(
    plane: Plane,
    family: IpFamily,
) {
    let (bed, _agent) = holding_the_chosen_address(plane, family, 2, &[]);
    let mark = format!(
        "-A PREROUTING -s {} -j MARK --set-xmark 0x4000/0x4000",
        family.pod(1)
    );
    let snat = format!(
        "-I POSTROUTING 1 -m mark --mark 0x4000/0x4000 -j SNAT --to-source {} --random-fully",
        chosen(family)
    );
    kube_proxy(&bed, family, &[&mark, &snat]);
    kube_proxy::no_reply_reaches_the_wrong_flow(&bed, family);
}

/// The chosen address through the eBPF data plane's own changes: an upgrade over an older
/// agent's `interfaces` map (before the chosen address had its place there), a resize of the
/// NAT table, and a rollback to upstream's chain. A connection opened on the address goes on
/// throughout; new flows take the address after each step, and after the rollback, the chain's
/// flows on it lose nothing to the programs' flows on it.
fn the_chosen_address_through_an_upgrade_a_resize_and_a_rollback(plane: Plane, family: IpFamily) {
    let bed = Bed::with_pods(plane, &chosen_config(family), 2);
    chosen_on(&bed, family, "add", topology::UPLINK_IF);
    std::fs::create_dir_all(&bed.topo.bpffs).unwrap();
    let older = bed.topo.bpffs.join(masq_ebpf::map_names::INTERFACES);
    // The older layout: the device's two addresses, 20 bytes.
    masq_testbed::netns::run(
        "bpftool",
        &[
            "map",
            "create",
            older.to_str().unwrap(),
            "type",
            "hash",
            "key",
            "4",
            "value",
            "20",
            "entries",
            "64",
            "name",
            "interfaces",
        ],
    )
    .unwrap();
    let with_capacity = |capacity: &'static str| {
        let mut args = family.agent_args().to_vec();
        args.push(capacity);
        args
    };
    let mut agent = bed.start_agent(&with_capacity("--nat-capacity=4096"));
    assert!(
        agent.log_text().contains("incompatible layout"),
        "the older map was replaced\n{}",
        agent.log_text()
    );
    wait_for_flows_from(&bed, family, &agent, chosen(family));
    let open = Conversation::open(&bed, family, 9785);
    assert_eq!(open.node_side.ip(), chosen(family));
    let server = SocketAddr::from((family.outside().ip(), 9920));
    let _echo = UdpEcho::start(&bed.topo.ext, server).unwrap();
    let pods = &bed.topo.pods;
    let translated = UdpFlows::open(&pods[0], server, 1000, "programs").unwrap();
    assert_eq!(translated.exchange(3).unwrap().lost, 0);

    let capacity = || {
        let status = bed.status_json();
        status["ebpf"]["nat"][family.label()]["capacity"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(capacity(), nat_room(&bed, family, 4096));
    agent.stop(libc::SIGTERM).unwrap();
    let mut agent = bed.start_agent(&with_capacity("--nat-capacity=8192"));
    assert_eq!(
        capacity(),
        nat_room(&bed, family, 8192),
        "the table was resized"
    );
    open.exchange("through the bigger table")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    wait_for_flows_from(&bed, family, &agent, chosen(family));

    agent.stop(libc::SIGTERM).unwrap();
    let upstream = bed.spawn_agent(&restarts::rollback_args(&bed, family), &[]);
    open.exchange("after the rollback")
        .unwrap_or_else(|e| panic!("{e}\n{}", upstream.log_text()));
    let tcp_server = SocketAddr::from((family.outside().ip(), 9786));
    let chain_conversation = Conversation::between(&pods[1], &bed.topo.ext, tcp_server);
    assert_eq!(
        chain_conversation.node_side.ip(),
        chosen(family),
        "the chain's SNAT takes the chosen address"
    );
    let masqueraded = UdpFlows::open(&pods[1], server, 1000, "chain").unwrap();
    assert_no_flow_lost_or_crossed([
        ("the chain's", &masqueraded),
        ("the programs'", &translated),
    ]);
}
