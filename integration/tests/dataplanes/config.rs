//! The config file and how its changes are applied: live, without a restart; an invalid,
//! unreadable or flipping file keeps the last good policy; several files merged; `enableIPv6`
//! in the file; and what someone else changes behind the agent's back is repaired.

use std::{net::SocketAddr, time::Duration};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe,
    topology::{self, Process},
    wait_for, wait_for_long, write_config,
};

use crate::{
    Bed, CHAIN, Conversation, DEFAULT_CONFIG, FamilyOnTheBed, IPV6_CONFIG, METRICS_ADDR, PORT,
    Plane, assert_masqueraded, http_get, node_ip, outside, pod_ip, second_outside,
    wait_for_udp_source,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane: applies_a_config_change_live);
        cases!($plane:
            keeps_the_last_good_policy_on_an_invalid_config,
            keeps_the_policy_while_the_config_file_cannot_be_read,
            several_config_files_are_merged_and_an_invalid_one_changes_nothing,
            enable_ipv6_in_the_file_switches_ipv6_live,
            enable_ipv6_off_in_the_file_keeps_what_is_open,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
    cases!(Ebpf:
        survives_a_config_flipping_between_valid_and_invalid,
        a_change_is_applied_as_a_difference_and_a_resync_repairs_the_rest,
    );
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

mod iptables_legacy {
    family_cases!(IptablesLegacy, ipv4 only: applies_a_config_change_live);
    cases!(IptablesLegacy: keeps_the_last_good_policy_on_an_invalid_config);
}

/// A change of the file applies within seconds, with no resync due for a minute: the agent
/// watches the file.
fn applies_a_config_change_live(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let second = family.second_outside();
    wait_for_udp_source(&bed, second, family.node());
    let second_prefix = family.pick("198.51.100.0/24", "2001:db8:2::/64");
    let left_alone = family.config_resyncing_every("1m", &[second_prefix], &[]);
    write_config(&bed.config, &left_alone).unwrap();
    wait_for_udp_source(&bed, second, family.pod(0));
    write_config(&bed.config, family.config()).unwrap();
    wait_for_udp_source(&bed, second, family.node());
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
    // Each change replaces what is at the path in one rename, as kubelet swaps a ConfigMap's
    // link: a path missing for a moment is no config file, whose defaults the agent would
    // rightly apply.
    let replace_with_link_to = |target: &std::path::Path| {
        let link = bed.config.with_extension("link");
        std::os::unix::fs::symlink(target, &link).unwrap();
        std::fs::rename(&link, &bed.config).unwrap();
    };
    // A directory at the path is read as config files: one of them a looping link.
    let inner = bed.config.join("ip-masq-agent");
    let staged = bed.config.with_extension("staged");
    std::fs::create_dir(&staged).unwrap();
    std::os::unix::fs::symlink(&inner, staged.join("ip-masq-agent")).unwrap();
    replace_with_link_to(&staged);
    wait_for(|| Ok(agent.log_text().contains(&*inner.to_string_lossy()))).unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));

    // The path a link to itself.
    replace_with_link_to(&bed.config);
    wait_for(|| Ok(agent.log_text().contains("symbolic links"))).unwrap();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));

    write_config(&bed.config, DEFAULT_CONFIG).unwrap();
    wait_for_udp_source(&bed, second_outside(), node_ip());
    std::fs::remove_dir_all(&staged).unwrap();
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

impl Bed {
    /// The agent, reading every `ip-masq*` file of the config's directory (`--config=DIR`).
    fn start_agent_on_config_dir(&self) -> Process {
        let file = format!("--config={}", self.config.display());
        let dir = format!("--config={}", self.config.parent().unwrap().display());
        let args: Vec<String> = self
            .plane_args()
            .into_iter()
            .map(|arg| if arg == file { dir.clone() } else { arg })
            .collect();
        self.spawn_agent(&args, &[])
    }
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
    let agent = bed.start_agent_on_config_dir();
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    assert_masqueraded(&bed);

    write_config(&cloud, "nonMasqueradeCIDRs: [abcdefg]\n").unwrap();
    wait_for(|| {
        let log = agent.log_text();
        Ok(log.contains("ip-masq-cloud") && log.contains("abcdefg"))
    })
    .expect("the error names the file");
    std::thread::sleep(Duration::from_millis(2500));
    wait_for_udp_source(&bed, second_outside(), pod_ip(0));
    assert_masqueraded(&bed);

    std::fs::remove_file(&cloud).unwrap();
    wait_for_udp_source(&bed, second_outside(), node_ip());
}

/// `enableIPv6` in the file switches IPv6 masquerading live, over the flag: on (on the eBPF
/// plane, loaded without IPv6, by the chain beside the programs), then off again (the chain
/// goes, and new IPv6 flows keep the pod's address).
fn enable_ipv6_in_the_file_switches_ipv6_live(plane: Plane) {
    let v6 = IpFamily::Ipv6;
    let off = format!("{DEFAULT_CONFIG}enableIPv6: false\n");
    let bed = Bed::new(plane, &off);
    let agent = bed.start_agent(&[]);
    wait_for_udp_source(&bed, v6.outside(), v6.pod(0));

    write_config(&bed.config, &format!("{IPV6_CONFIG}enableIPv6: true\n")).unwrap();
    wait_for_udp_source(&bed, v6.outside(), v6.node());
    v6.assert_masqueraded(&bed);
    if plane == Plane::Ebpf {
        wait_for(|| {
            Ok(agent
                .log_text()
                .contains("ip6tables chain masquerades IPv6"))
        })
        .expect("the switch is said");
    }

    write_config(&bed.config, &off).unwrap();
    wait_for_udp_source(&bed, v6.outside(), v6.pod(0));
    let chain = bed.ip6tables(&["-t", "nat", "-S", CHAIN]).unwrap();
    assert!(
        !chain.contains("MASQUERADE"),
        "the ip6tables chain masquerades nothing: {chain}"
    );
}

/// `enableIPv6: false` in the file, over `--enable-ipv6`, live: a connection already
/// masqueraded goes on, and new IPv6 flows keep the pod's address.
fn enable_ipv6_off_in_the_file_keeps_what_is_open(plane: Plane) {
    let v6 = IpFamily::Ipv6;
    let (bed, _agent) = Bed::with_agent(plane, v6);
    let conversation = Conversation::open(&bed, v6, 9750);
    assert_eq!(conversation.node_side.ip(), v6.node(), "masqueraded");

    write_config(&bed.config, &format!("{DEFAULT_CONFIG}enableIPv6: false\n")).unwrap();
    wait_for_udp_source(&bed, v6.outside(), v6.pod(0));
    conversation
        .exchange("still there")
        .expect("the connection masqueraded before goes on");
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
