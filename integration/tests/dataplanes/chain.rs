//! The iptables chain's own cases: upstream's full chain in real iptables (restored when
//! flushed, `--to-ports`, the IPv6 chain, the xtables lock), and the reduced chain beside the
//! programs, which masquerades what they leave to it.

use std::time::Duration;

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe::{self, IPPROTO_GRE},
    topology, wait_for, wait_for_long,
};

use crate::{
    Bed, CHAIN, DEFAULT_CONFIG, FamilyOnTheBed, IPV6_CONFIG, Plane, assert_gre_leaves_with,
    assert_masqueraded, assert_success, node_ip, outside,
};

// The chain beside the programs masquerades other protocols as the full chain does: on every
// data plane.
mod ebpf {
    family_cases!(Ebpf: other_protocols_are_masqueraded_by_the_chain);
    cases!(Ebpf:
        the_ipv6_chain_beside_the_programs_leaves_them_what_they_translate,
        ipv6_keeps_the_full_chain_while_the_uplink_has_no_ipv6_address,
    );
}

mod iptables_nft {
    family_cases!(IptablesNft: other_protocols_are_masqueraded_by_the_chain);
    cases!(IptablesNft:
        restores_a_flushed_chain,
        to_ports_rules_load_into_real_iptables,
        ipv6_chain_follows_enable_ipv6,
    );
}

mod iptables_legacy {
    cases!(IptablesLegacy:
        retries_while_the_xtables_lock_is_held,
        restores_a_flushed_chain,
        to_ports_rules_load_into_real_iptables,
        ipv6_chain_follows_enable_ipv6,
    );
}

/// GRE, which the programs leave alone, leaves masqueraded by the chain: the full chain, or
/// the one beside the programs.
fn other_protocols_are_masqueraded_by_the_chain(plane: Plane, family: IpFamily) {
    let bed = Bed::new(plane, family.config());
    let gre = family.observe(&bed.topo.ext, IPPROTO_GRE);
    let _agent = bed.start_agent(family.agent_args());
    assert_gre_leaves_with(&bed, &gre, family.outside().ip(), family.node());
}

/// Beside the programs, the IPv6 chain too is reduced to the protocols they leave alone, and
/// what they translate they count.
fn the_ipv6_chain_beside_the_programs_leaves_them_what_they_translate(plane: Plane) {
    let v6 = IpFamily::Ipv6;
    let bed = Bed::new(plane, IPV6_CONFIG);
    let _agent = bed.start_agent(v6.agent_args());
    let chain = bed.ip6tables(&["-t", "nat", "-S", CHAIN]).unwrap();
    let rules: Vec<&str> = chain.lines().filter(|l| l.starts_with("-A")).collect();
    for (rule, proto) in rules.iter().zip(["tcp", "udp", "ipv6-icmp"]) {
        assert!(
            rule.contains(&format!("-p {proto}")) && rule.contains("-j RETURN"),
            "{chain}"
        );
    }
    assert!(
        rules[3].contains("--match-set") && rules[4].contains("-j MASQUERADE"),
        "{chain}"
    );

    let counted = || -> u64 {
        let counters = bed.status_json()["ebpf"]["counters"].clone();
        counters["masqueraded"].as_u64().unwrap() + counters["reverse_translated"].as_u64().unwrap()
    };
    let before = counted();
    let seen = probe::tcp_probe(bed.pod(), v6.outside(), 0).unwrap();
    assert_eq!(seen.ip(), v6.node());
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
    let jump = masq_agent::dataplane::iptables::jump_rule(CHAIN);
    let mut delete_jump = vec!["-t", "nat", "-D", "POSTROUTING"];
    delete_jump.extend(jump.iter().map(String::as_str));
    bed.iptables(&delete_jump).unwrap();
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
