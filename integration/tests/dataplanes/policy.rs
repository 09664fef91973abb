//! Which destinations keep the pod's address: link-local and `masqLinkLocal`, exceptions
//! (`masqueradeCIDRs`) inside non-masquerade ranges, allow-lists; and what a policy change does
//! to the flows already live, which it must not move, as conntrack keeps a flow's NAT for its
//! whole life.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe::{self, IPPROTO_GRE, IPPROTO_ICMP, Proto, RawObserver},
    topology, wait_for, write_config,
};

use crate::{
    Bed, DEFAULT_CONFIG, FamilyOnTheBed, PORT, Plane, assert_gre_leaves_with, bpftool_pinned,
    egress_program, host_prefix, node_ip, pod_ip, program_map, program_map_value, second_outside,
    unanswered_queries, wait_for_udp_source,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            an_exception_inside_a_non_masquerade_range_is_masqueraded,
            an_allow_list_masquerades_only_its_exceptions,
            a_policy_change_moves_no_live_flow,
            a_change_made_while_no_agent_runs_moves_no_live_flow,
        );
        cases!($plane:
            link_local_is_exempt_unless_masq_link_local,
            turning_masq_link_local_on_moves_no_live_flow,
            an_exception_inside_link_local_is_masqueraded,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
    cases!(Ebpf: a_flow_stranded_by_a_change_stays_translated);
    cases!(Ebpf: the_programs_index_holds_the_policy_in_force);
    family_cases!(Ebpf: a_change_that_finds_the_table_full_says_what_it_could_not_keep);
    family_cases!(Ebpf: ipv6s_verdict_cache_takes_its_slots_only_where_ipv6_is_translated);
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

mod iptables_legacy {
    cases!(IptablesLegacy: an_exception_inside_link_local_is_masqueraded);
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

/// An exception inside link-local masquerades that one address (a metadata server, say) and
/// leaves the rest of link-local alone.
fn an_exception_inside_link_local_is_masqueraded(plane: Plane) {
    let config = IpFamily::Ipv4.config_with(&[], &["169.254.169.254/32"]);
    let bed = Bed::new(plane, &config);
    let _agent = bed.start_agent(&[]);
    let link_local = SocketAddr::from((topology::LINK_LOCAL_ADDR, PORT));
    wait_for_udp_source(&bed, link_local, node_ip());
    write_config(&bed.config, DEFAULT_CONFIG).unwrap();
    wait_for_udp_source(&bed, link_local, pod_ip(0));
}

/// An exception inside a non-masquerade range is masqueraded and the rest of the range keeps
/// the pod's address, as the outside host sees them, for what the programs translate and for
/// what the chain beside them does (GRE); taking the exception out lets the range keep
/// addresses again.
fn an_exception_inside_a_non_masquerade_range_is_masqueraded(plane: Plane, family: IpFamily) {
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
fn an_allow_list_masquerades_only_its_exceptions(plane: Plane, family: IpFamily) {
    let (_, outside_host) = family.outside_prefixes();
    let everything = family.pick("0.0.0.0/0", "::/0");
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

/// A ping from the pod, five requests a second with one identifier, as the outside host sees
/// them; stopped when dropped.
struct LivePing {
    ping: std::process::Child,
    requests: RawObserver,
}

impl LivePing {
    fn start(bed: &Bed, family: IpFamily, dst: IpAddr) -> LivePing {
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
pub(crate) fn assert_a_change_moves_no_live_flow(
    bed: &Bed,
    family: IpFamily,
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
fn a_policy_change_moves_no_live_flow(plane: Plane, family: IpFamily) {
    let (range, _) = family.outside_prefixes();
    let dst = family.routable_client();
    let host = host_prefix(dst.ip());
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

/// A change the agent finds when it starts (the config edited while it was down, or a new
/// version rolled out with a new ConfigMap) moves no live flow either: the programs kept
/// deciding by the policy they were given, which the pinned tries still hold.
fn a_change_made_while_no_agent_runs_moves_no_live_flow(plane: Plane, family: IpFamily) {
    const PORT: u16 = 41200;
    let (range, _) = family.outside_prefixes();
    let dst = family.routable_client();
    let (pod, node) = (family.pod(0), family.node());
    let bed = Bed::new(plane, &family.config_with(&[range], &[]));
    let mut agent = bed.start_agent(family.agent_args());
    wait_for_udp_source(&bed, dst, pod);
    assert_eq!(udp_source_from(&bed, dst, PORT), pod);
    let ping = LivePing::start(&bed, family, dst.ip());
    agent.stop(libc::SIGTERM).unwrap();
    write_config(&bed.config, &family.config_with(&[], &[])).unwrap();
    let _restarted = bed.start_agent(family.agent_args());
    wait_for_udp_source(&bed, dst, node);
    assert_eq!(
        udp_source_from(&bed, dst, PORT),
        pod,
        "the live UDP flow keeps the pod's address"
    );
    ping.assert_leaves_with(pod, "the live ping");
    assert_eq!(udp_source_from(&bed, dst, PORT + 1), node, "a new flow");
}

/// A change that finds the NAT table full has no room to keep a live flow that left with the
/// pod's address: the agent says so, with how many, rather than let the flow move unsaid.
fn a_change_that_finds_the_table_full_says_what_it_could_not_keep(plane: Plane, family: IpFamily) {
    const PORT: u16 = 41300;
    let dst = family.routable_client();
    let host = host_prefix(dst.ip());
    let bed = Bed::new(plane, &family.config_with(&[&host], &[]));
    let mut args = family.agent_args().to_vec();
    args.push("--nat-capacity=64");
    let agent = bed.start_agent(&args);
    wait_for_udp_source(&bed, dst, family.pod(0));
    assert_eq!(udp_source_from(&bed, dst, PORT), family.pod(0));
    // Masqueraded and never answered: they fill the table.
    let _silent = unanswered_queries(&bed, family, 9712, 300);
    write_config(&bed.config, &family.config_with(&[], &[])).unwrap();
    wait_for(|| Ok(agent.log_text().contains("could not keep")))
        .unwrap_or_else(|e| panic!("no word of the flow not kept: {e}\n{}", agent.log_text()));
    let log = agent.log_text();
    let said = log.lines().find(|l| l.contains("could not keep")).unwrap();
    // This case's flow, and those of the probes that waited for the policy.
    let flows: usize = said
        .rsplit_once("flows=")
        .and_then(|(_, n)| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("how many is not said: {said}"));
    assert!(flows >= 1, "{said}");
}

/// `masqLinkLocal` turned on moves no live flow to link-local, and turned off again none it
/// masqueraded.
fn turning_masq_link_local_on_moves_no_live_flow(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let masquerading = format!("{DEFAULT_CONFIG}masqLinkLocal: true\n");
    let link_local = SocketAddr::from((topology::LINK_LOCAL_ADDR, PORT));
    let configs = (DEFAULT_CONFIG, masquerading.as_str());
    assert_a_change_moves_no_live_flow(&bed, IpFamily::Ipv4, link_local, configs, 41100);
}

/// IPv6's per-CPU verdict cache (`non_masq_v6_cache`, 64 KiB a CPU) takes its slots with
/// `--enable-ipv6`, and one slot a CPU without, where no IPv6 packet is translated.
fn ipv6s_verdict_cache_takes_its_slots_only_where_ipv6_is_translated(
    plane: Plane,
    family: IpFamily,
) {
    let bed = Bed::new(plane, family.config());
    let _agent = bed.start_agent(family.agent_args());
    family.assert_masqueraded(&bed);
    let cache = program_map(
        &bed,
        topology::UPLINK_IF,
        masq_ebpf::map_names::NON_MASQ_CACHE_V6,
    );
    let slots = family.pick(1, masq_ebpf::NON_MASQ_CACHE_SLOTS_V6);
    assert_eq!(cache["max_entries"], slots, "{cache}");
}

/// The running agent writes the programs' index of the IPv4 policy trie, and stamps it with the
/// policy generation in force: after its first sync, and again after a change, which the index
/// then holds.
fn the_programs_index_holds_the_policy_in_force(plane: Plane) {
    use masq_ebpf::{
        map_names::{NON_MASQ_INDEX_V4, POLICY_GENERATION},
        policy_index::{CHILD, KEEPS_ADDRESS, STAMP_CHUNK, stamp, top},
        policy_word::GENERATION_MASK,
    };
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let agent = bed.start_agent(&[]);
    let uplink = topology::UPLINK_IF;
    let word_for = |addr: std::net::Ipv4Addr| -> u64 {
        let (chunk, at) = top(u32::from(addr));
        let chunk = program_map_value(&bed, uplink, NON_MASQ_INDEX_V4, chunk);
        chunk[at].as_u64().unwrap()
    };
    // The index's stamp, and the stamp of the generation in force.
    let stamps = || -> (u64, u64) {
        let stamped = program_map_value(&bed, uplink, NON_MASQ_INDEX_V4, STAMP_CHUNK)[0].as_u64();
        let generation = bpftool_pinned(
            &bed,
            &["map", "lookup"],
            POLICY_GENERATION,
            &["key".into(), "0".into(), "0".into(), "0".into(), "0".into()],
        )["formatted"]["value"]
            .as_u64()
            .unwrap();
        let in_force = stamp(generation as u32 & GENERATION_MASK);
        (stamped.unwrap(), u64::from(in_force))
    };
    wait_for(|| Ok(agent.log_text().contains("policy applied"))).unwrap();
    wait_for(|| {
        let (stamped, in_force) = stamps();
        Ok(stamped == in_force)
    })
    .unwrap_or_else(|e| panic!("the index is not stamped: {e}\n{}", agent.log_text()));
    let ten = word_for(std::net::Ipv4Addr::new(10, 1, 0, 0));
    assert_eq!(
        ten & (CHILD | KEEPS_ADDRESS) as u64,
        KEEPS_ADDRESS as u64,
        "{ten:#x}"
    );
    let before = stamps().0;

    // A prefix longer than the top level decides: its /16's word leads below.
    write_config(
        &bed.config,
        "nonMasqueradeCIDRs: [10.0.0.0/8, 198.18.7.64/26]\nresyncInterval: 1s\n",
    )
    .unwrap();
    wait_for(|| {
        let (stamped, in_force) = stamps();
        Ok(stamped != before && stamped == in_force)
    })
    .unwrap_or_else(|e| panic!("the index is not stamped again: {e}\n{}", agent.log_text()));
    let lower = word_for(std::net::Ipv4Addr::new(198, 18, 7, 64));
    assert_eq!(lower & CHILD as u64, CHILD as u64, "{lower:#x}");
    assert_eq!(word_for(std::net::Ipv4Addr::new(10, 1, 0, 0)), ten);

    // `status` says so, of the one egress program on every device.
    let status = bed.status_json();
    let indexes = status["ebpf"]["policy_index_v4"].as_array().unwrap();
    let egress = egress_program(&bed, uplink)["id"].clone();
    assert_eq!(indexes.len(), 1, "{indexes:?}");
    assert_eq!(indexes[0]["program_id"], egress, "{indexes:?}");
    assert_eq!(indexes[0]["in_force"], true, "{indexes:?}");
    assert_eq!(indexes[0]["left_to_the_trie"], 0, "{indexes:?}");
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    let text = String::from_utf8(bed.agent_cmd(&["status", &bpffs]).stdout).unwrap();
    assert!(
        text.contains(&format!(
            "program {egress} decides IPv4 destinations by the policy trie's index\n"
        )),
        "{text}"
    );
}
