//! The agent's own life and the flows across it: killed, stopped and cleaned up, restarted
//! mid-apply, upgraded over an older NAT table or with another capacity, migrated to from
//! upstream's chain and rolled back to it; and a conntrack flush under live flows.

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

use masq_agent::{dataplane::ebpf::SLOT_TABLE_ENV, policy::IpFamily};
use masq_testbed::{
    probe::{self, UdpEcho, UdpFlows},
    topology, wait_for, write_config,
};

use crate::{
    Bed, Conversation, DEFAULT_CONFIG, FamilyOnTheBed, PORT, PacedTransfer, Plane,
    assert_masqueraded, assert_no_flow_lost_or_crossed, assert_success, dump_pinned, nat_room,
    node_ip, outside, slot_seed,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane: a_killed_agent_does_not_break_a_transfer);
        cases!($plane:
            sigterm_leaves_everything_and_cleanup_leaves_no_trace,
            migrating_from_upstreams_chain_keeps_an_open_connection,
            a_conntrack_flush_during_live_flows,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
    family_cases!(Ebpf: a_rollback_keeps_the_programs_flows_and_loses_no_new_one);
    cases!(Ebpf:
        sigkill_mid_apply_loses_no_prefix,
        draining_survives_an_agent_restart,
        an_upgrade_carries_the_flows_of_an_older_nat_table,
        a_new_nat_capacity_keeps_open_connections,
        a_capacity_change_during_a_transfer_loses_nothing,
        a_rollback_with_nothing_to_drain_removes_the_programs,
    );
    family_cases!(Ebpf:
        the_halves_move_between_the_tables_during_a_transfer_and_lose_nothing,
        the_slot_table_keeps_its_seed_across_restarts,
    );
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

mod iptables_legacy {
    cases!(IptablesLegacy: sigterm_leaves_everything_and_cleanup_leaves_no_trace);
}

fn a_killed_agent_does_not_break_a_transfer(plane: Plane, family: IpFamily) {
    let (bed, mut agent) = Bed::with_agent(plane, family);
    let transfer = PacedTransfer::start(&bed, (family.outside().ip(), 9001).into(), 40);
    std::thread::sleep(Duration::from_millis(700));
    agent.stop(libc::SIGKILL).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let _restarted = bed.start_agent(family.agent_args());
    transfer.assert_complete("the transfer survived the kill and the restart");
    family.assert_masqueraded(&bed);
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
    let cleaned = bed.agent_cmd(&["cleanup", &bpffs]);
    assert_success(&cleaned);
    // It reports on stdout what it found and removed.
    let said = String::from_utf8_lossy(&cleaned.stdout);
    assert!(
        said.contains("removed") && said.contains("chain"),
        "cleanup's report: {said}"
    );
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
    // On a node with nothing installed it says so, and removes nothing.
    let again = bed.agent_cmd(&["cleanup", &bpffs]);
    assert_success(&again);
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(said.starts_with("nothing to remove"), "{said}");
}

/// The prefixes in `text`'s policy, as the trie keys them.
fn policy_keys(text: &str) -> BTreeSet<(u32, [u8; 4])> {
    let opts = masq_agent::config::ConfigOptions {
        nomasq_all_reserved_ranges: false,
        families: masq_agent::families::IpFamilies::IPV4,
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

/// A prefix removed from the non-masquerade CIDRs drains for as long as a TCP connection may
/// stay idle; a restarted agent must carry that on, not start from an empty draining trie.
fn draining_survives_an_agent_restart(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    assert_success(&bed.sync_once(&[]));
    write_config(&bed.config, "nonMasqueradeCIDRs: [192.168.0.0/16]\n").unwrap();
    assert_success(&bed.sync_once(&[]));
    // The agent that removed 10/8 is gone; the next one finds the trie already without it.
    assert_success(&bed.sync_once(&[]));
    let (dump, compact) = dump_pinned(&bed, "non_masq_draining_v4");
    assert!(
        compact.contains(r#""prefix_len":8,"data":[10,0,0,0]"#),
        "10/8 still drains:\n{dump}"
    );
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
    let conversation = Conversation::open(&bed, IpFamily::Ipv4, 9730);
    let capacity = || {
        let status = bed.status_json();
        status["ebpf"]["nat"]["ipv4"]["capacity"].as_u64().unwrap()
    };
    assert_eq!(capacity(), nat_room(&bed, IpFamily::Ipv4, 4096));
    agent.stop(libc::SIGTERM).unwrap();
    let _agent = bed.start_agent(&["--nat-capacity=8192"]);
    assert_eq!(
        capacity(),
        nat_room(&bed, IpFamily::Ipv4, 8192),
        "the table was resized"
    );
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

/// A transfer runs while the agent restarts with the halves in the slot tables, and again with
/// them back in the hash tables: every byte arrives, and each agent carried the flows of the
/// table the other left.
fn the_halves_move_between_the_tables_during_a_transfer_and_lose_nothing(
    plane: Plane,
    family: IpFamily,
) {
    let bed = Bed::new(plane, family.config());
    let args = bed.family_args(family);
    // The hash table first, whatever the tests' environment asks for.
    let mut agent = bed.spawn_agent(&args, &[(SLOT_TABLE_ENV, "0")]);
    let transfer = PacedTransfer::start(&bed, (family.outside().ip(), 9780).into(), 60);
    for slot_table in ["1", "0"] {
        std::thread::sleep(Duration::from_millis(500));
        agent.stop(libc::SIGTERM).unwrap();
        agent = bed.spawn_agent(&args, &[(SLOT_TABLE_ENV, slot_table)]);
        assert!(
            agent.log_text().contains("flows carried"),
            "{SLOT_TABLE_ENV}={slot_table}: {}",
            agent.log_text()
        );
    }
    transfer.assert_complete(&agent.log_text());
}

/// The slot table's seed: not 0 (the unseeded hash, which anyone can reckon), and the same
/// after a restart that keeps the table, so that its flows are found where they are; the table
/// a new `--nat-capacity` makes takes it too, and the open connection's halves, carried there,
/// are found by it.
fn the_slot_table_keeps_its_seed_across_restarts(plane: Plane, family: IpFamily) {
    let bed = Bed::new(plane, family.config());
    let with = |capacity: &str| {
        let mut args = bed.family_args(family);
        args.push(format!("--nat-capacity={capacity}"));
        bed.spawn_agent(&args, &[(SLOT_TABLE_ENV, "1")])
    };
    let mut agent = with("4096");
    let conversation = Conversation::open(&bed, family, 9790);
    let seed = slot_seed(&bed, family).expect("the halves in the slot table");
    assert_ne!(seed, 0, "an unseeded slot table");
    for (capacity, table) in [("4096", "the same table"), ("8192", "the new table")] {
        agent.stop(libc::SIGTERM).unwrap();
        agent = with(capacity);
        assert_eq!(
            slot_seed(&bed, family),
            Some(seed),
            "{table}: {}",
            agent.log_text()
        );
        conversation
            .exchange(&format!("through {table}"))
            .unwrap_or_else(|err| panic!("the connection through {table}: {err}"));
    }
    assert!(
        agent.log_text().contains("flows carried"),
        "{}",
        agent.log_text()
    );
}

/// The flags of this bed's agent with `--dataplane iptables` instead: upstream's chain.
pub(crate) fn rollback_args(bed: &Bed, family: IpFamily) -> Vec<String> {
    bed.plane_args()
        .into_iter()
        .filter(|a| !a.starts_with("--dataplane") && !a.starts_with("--interface"))
        .filter(|a| !a.starts_with("--fallback"))
        .chain(["--dataplane=iptables".to_string()])
        .chain(family.agent_args().iter().map(|a| a.to_string()))
        .collect()
}

/// Replacing upstream's chain (the `iptables` data plane is byte for byte upstream's) with this
/// data plane while a connection is open: the connection goes on, and new ones are masqueraded.
fn migrating_from_upstreams_chain_keeps_an_open_connection(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let mut upstream = bed.spawn_agent(&rollback_args(&bed, IpFamily::Ipv4), &[]);
    let conversation = Conversation::open(&bed, IpFamily::Ipv4, 9710);
    assert_eq!(conversation.node_side.ip(), node_ip());
    upstream.stop(libc::SIGTERM).unwrap();
    let _agent = bed.start_agent(&[]);
    conversation
        .exchange("after the switch")
        .expect("the open connection goes on");
    assert_masqueraded(&bed);
}

/// Rolling back to `--dataplane iptables` with thousands of flows the programs translate: they
/// go on, `status` says they are draining, and the new flows the full chain masquerades on the
/// same address lose nothing to the programs' entries.
fn a_rollback_keeps_the_programs_flows_and_loses_no_new_one(plane: Plane, family: IpFamily) {
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
    assert_no_flow_lost_or_crossed([
        ("the chain's", &masqueraded),
        ("the programs'", &translated),
    ]);
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
    let upstream = bed.spawn_agent(&rollback_args(&bed, IpFamily::Ipv4), &[]);
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

/// `conntrack -F` while flows are live. The eBPF data plane's NAT table keeps them, so an open
/// connection goes on; upstream's chain keeps its translations in conntrack alone, so it cannot
/// (operations.md says so). New connections are masqueraded after it on both.
fn a_conntrack_flush_during_live_flows(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[]);
    let conversation = Conversation::open(&bed, IpFamily::Ipv4, 9720);
    bed.topo.node_run("conntrack", &["-F"]).unwrap();
    if plane == Plane::Ebpf {
        conversation
            .exchange("after the flush")
            .expect("the NAT table kept the connection");
    }
    assert_masqueraded(&bed);
}
