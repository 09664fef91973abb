//! The eBPF programs' own life on a node: loading them or falling back to the chain, what they
//! pin and what a failed load takes back, a missing BPF filesystem, pins an older agent left in
//! another layout, attaching by TCX or by netlink (clsact filters), re-attaching what someone
//! detached, and what `status` and liveness say about all that.

use std::{
    collections::BTreeSet,
    net::{IpAddr, UdpSocket},
    time::Duration,
};

use masq_agent::{
    dataplane::{ebpf::attach, state::STATE_DIR},
    policy::IpFamily,
};
use masq_testbed::{probe::RawObserver, topology, wait_for, wait_for_long};

use crate::{
    Bed, DEFAULT_CONFIG, METRICS_ADDR, PacedTransfer, Plane, args_with, assert_masqueraded,
    assert_success, decisions_of, dump_pinned, http_get, nat_room, node_ip, wait_for_coverage,
};

mod ebpf {
    cases!(Ebpf:
        falls_back_to_iptables_when_ebpf_cannot_run,
        a_failed_load_takes_back_what_it_pinned,
        status_says_what_an_exited_agent_left_and_when_it_cannot_tell,
        mounts_a_missing_bpffs_or_says_why_not,
        replaces_an_incompatible_pinned_map,
        bpftool_shows_the_prefixes_with_named_fields,
        reattaches_a_program_someone_detached,
        attaches_through_netlink_without_tcx,
        netlink_filters_are_replaced_in_place_and_put_back,
        liveness_fails_when_the_data_plane_is_gone,
    );
}

fn falls_back_to_iptables_when_ebpf_cannot_run(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    // No BPF filesystem can be mounted under /proc: the maps have nowhere to be pinned.
    let id = bed.topo.dir.file_name().unwrap().to_string_lossy();
    let bpffs = format!("/proc/self/{id}/ip-masq-agent");
    let mut args = args_with(
        &bed,
        &[("--bpffs", &bpffs), ("--fallback-to-iptables", "false")],
    );
    args.push("--once".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bed.agent_cmd(&refs);
    assert_eq!(
        out.status.code(),
        Some(1),
        "--fallback-to-iptables=false: exit with the reason"
    );
    let why = "is not on a BPF filesystem";
    assert!(String::from_utf8_lossy(&out.stderr).contains(why));
    assert!(bed.chain().is_none(), "and nothing installed");

    let args = args_with(
        &bed,
        &[("--bpffs", &bpffs), ("--fallback-to-iptables", "true")],
    );
    let agent = bed.spawn_agent(&args, &[]);
    let log = agent.log_text();
    assert_eq!(
        log.matches("falling back to the full iptables chain")
            .count(),
        1,
        "{log}"
    );
    assert!(log.contains(why), "the line says why: {log}");
    assert!(
        !bed.chain().unwrap().contains("eBPF"),
        "the full chain, not the reduced one"
    );
    assert_masqueraded(&bed);
    assert_success(&bed.ping(0, topology::EXT_ADDR, &[]));
    let out = bed.agent_cmd(&["status", "--json", &format!("--bpffs={bpffs}")]);
    assert_success(&out);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["mode"], "iptables-fallback");
    assert!(status["mode_reason"].as_str().unwrap().contains(why));
    assert!(
        status["ebpf"].is_null(),
        "nothing of the eBPF data plane is left installed"
    );
}

/// The names pinned under `dir`, with their inodes: a new object pinned under an old name has
/// another.
fn pinned(dir: &std::path::Path) -> BTreeSet<(String, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        e.metadata().unwrap().ino(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A load that fails once the maps are pinned (here, no ports are left for NAT) takes back
/// what it pinned, and only that: on a fresh node nothing is left to read as a data plane to
/// drain; after a crashed agent, its programs and pinned maps go on translating its flows.
fn a_failed_load_takes_back_what_it_pinned(plane: Plane) {
    let (bed, mut agent) = Bed::with_agent(plane, IpFamily::Ipv4);
    let transfer = PacedTransfer::start(&bed, (topology::EXT_ADDR, 9001).into(), 40);
    std::thread::sleep(Duration::from_millis(500));
    agent.stop(libc::SIGKILL).unwrap();
    let before = pinned(&bed.topo.bpffs);
    assert!(
        before.iter().any(|(name, _)| name == "nat_v4"),
        "{before:?}"
    );
    // Every port ephemeral: none is left for the programs' NAT.
    bed.topo
        .node_run(
            "sysctl",
            &["-qw", "net.ipv4.ip_local_port_range=1024 65535"],
        )
        .unwrap();
    let out = bed.sync_once(&[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no ports left for NAT"), "{stderr}");
    assert_eq!(
        pinned(&bed.topo.bpffs),
        before,
        "the crashed agent's pins are all there, none replaced"
    );
    transfer.assert_complete("its programs went on translating the transfer");

    let fresh = bed.topo.bpffs.join("fresh");
    let fresh_arg = format!("--bpffs={}", fresh.display());
    let mut args = args_with(&bed, &[("--bpffs", &fresh.display().to_string())]);
    args.push("--once".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bed.agent_cmd(&refs);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        !fresh.exists(),
        "nothing pinned on a fresh node: {:?}",
        pinned(&fresh)
    );
    let out = bed.agent_cmd(&["status", "--json", &fresh_arg]);
    assert_success(&out);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(status["draining_flows"].is_null(), "{status}");
}

/// `status` says what is really installed: the full chain an agent that fell back and exited
/// left, with the reason it fell back; and, where the chain leaves traffic to programs it
/// cannot find under `--bpffs`, that it cannot tell.
fn status_says_what_an_exited_agent_left_and_when_it_cannot_tell(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let range = |range: &str| {
        let setting = format!("net.ipv4.ip_local_port_range={range}");
        bed.topo.node_run("sysctl", &["-qw", &setting]).unwrap();
    };
    range("1024 65535");
    let mut args = args_with(&bed, &[("--fallback-to-iptables", "true")]);
    args.push("--once".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_success(&bed.agent_cmd(&refs));
    let status = bed.status_json();
    assert_eq!(status["mode"], "iptables-fallback", "{status}");
    let reason = status["mode_reason"].as_str().unwrap();
    assert!(reason.contains("no ports left for NAT"), "{reason}");
    assert!(
        status["notes"][0]
            .as_str()
            .unwrap()
            .contains("no agent runs"),
        "{status}"
    );

    range("32768 60999");
    assert_success(&bed.sync_once(&[]));
    let wrong = format!("--bpffs={}-elsewhere", bed.topo.bpffs.display());
    let out = bed.agent_cmd(&["status", &wrong]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("data plane: ebpf\n"), "{text}");
    assert!(
        text.contains("nothing is pinned under") && text.contains("cannot be told from here"),
        "{text}"
    );
    // The device's line says as much, rather than that nothing masquerades it.
    let uplink = format!("  {}: ipv4 unknown,", topology::UPLINK_IF);
    assert!(text.contains(&uplink), "{text}");
}

/// No BPF filesystem where `--bpffs` points: the agent mounts one, or says clearly why it
/// cannot. Run in a private mount namespace whose /sys/fs/bpf is a plain tmpfs, and whose
/// agent state directory is one too: the record of that `--bpffs`, no topology's name, would
/// stay in the node's own, where no test bed's drop removes it.
fn mounts_a_missing_bpffs_or_says_why_not(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let config = format!("--config={}", bed.config.display());
    let interface = format!("--interface={}", topology::UPLINK_IF);
    let agent = masq_testbed::agent_binary();
    let agent = agent.display();
    let run = |bpffs: &str| {
        let script = format!(
            "mkdir -p {STATE_DIR} && mount -t tmpfs masq-test {STATE_DIR} \
             && mount -t tmpfs masq-test /sys/fs/bpf && exec {agent} --once {config} {interface} \
             --fallback-to-iptables=false --bpffs={bpffs}"
        );
        bed.topo
            .node_command("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .env("PATH", &bed.path)
            .output()
            .unwrap()
    };
    let out = run("/sys/fs/bpf/masq/ip-masq-agent");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("mounted a BPF filesystem"), "{log}");
    assert!(log.contains("policy applied"), "{log}");

    let out = run("/proc/self/masq/ip-masq-agent");
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    let error = log
        .lines()
        .find(|l| l.contains("ERROR"))
        .unwrap_or_default();
    assert!(
        error.contains("/proc/self/masq is not on a BPF filesystem"),
        "the error says where and why: {log}"
    );
}

/// Maps an older agent pinned with other layouts: a NAT table of another entry size, a policy
/// trie whose value was the action alone, and decision counters of another size. Each is
/// replaced, not misread.
fn replaces_an_incompatible_pinned_map(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    std::fs::create_dir_all(&bed.topo.bpffs).unwrap();
    let create = |name: &str, spec: &[&str]| {
        let pin = bed.topo.bpffs.join(name);
        let mut args = vec!["map", "create", pin.to_str().unwrap()];
        args.extend_from_slice(spec);
        args.extend(["name", name]);
        masq_testbed::netns::run("bpftool", &args).unwrap();
    };
    let nat = ["type", "hash", "key", "8", "value", "8", "entries", "16"];
    create("nat_v4", &nat);
    let trie = [
        "type", "lpm_trie", "key", "8", "value", "1", "entries", "16", "flags", "1",
    ];
    create("non_masq_v4", &trie);
    let counters = [
        "type",
        "percpu_array",
        "key",
        "4",
        "value",
        "8",
        "entries",
        "4",
    ];
    create("policy_decisions", &counters);
    let agent = bed.start_agent(&[]);
    let replaced = agent
        .log_text()
        .matches("replacing a pinned map with an incompatible layout")
        .count();
    assert_eq!(replaced, 3, "{}", agent.log_text());
    assert_masqueraded(&bed);
    let status = bed.status_json();
    assert_eq!(
        status["ebpf"]["nat"]["ipv4"]["capacity"],
        nat_room(&bed, IpFamily::Ipv4, 262_144)
    );
    assert_eq!(status["ebpf"]["decisions"]["slots"], 1024, "{status:#}");
    assert!(decisions_of(&status, "10.0.0.0/8").is_some(), "{status:#}");
    assert!(status["ebpf"]["decisions"]["totals"]["masquerade"].as_u64() >= Some(1));
}

fn bpftool_shows_the_prefixes_with_named_fields(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    assert_success(&bed.sync_once(&[]));
    let (dump, compact) = dump_pinned(&bed, "non_masq_v4");
    for expected in [
        r#""prefix_len":8,"data":[10,0,0,0]"#,
        r#""prefix_len":16,"data":[169,254,0,0]"#,
    ] {
        assert!(compact.contains(expected), "{expected} in:\n{dump}");
    }
}

fn reattaches_a_program_someone_detached(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let agent = bed.start_agent(&[]);
    let egress_link = |status: &serde_json::Value| {
        status["ebpf"]["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["hook"] == "egress")
            .map(|a| a["link_id"].as_u64().unwrap())
    };
    let old = egress_link(&bed.status_json()).unwrap();
    bed.topo
        .node_run("bpftool", &["link", "detach", "id", &old.to_string()])
        .unwrap();
    wait_for(|| Ok(egress_link(&bed.status_json()).is_some_and(|id| id != old))).unwrap_or_else(
        |e| {
            panic!(
                "not re-attached: {e}
{}",
                agent.log_text()
            )
        },
    );
    assert!(agent.log_text().contains("re-attaching"));
    assert_masqueraded(&bed);
}

/// The clsact filters at the node's uplink hook, as `tc` lists them.
fn clsact_filters(bed: &Bed, hook: &str) -> String {
    bed.topo
        .node_run("tc", &["filter", "show", "dev", topology::UPLINK_IF, hook])
        .unwrap()
}

fn attaches_through_netlink_without_tcx(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let agent = bed.spawn_agent(&bed.plane_args(), &[(attach::FORCE_NETLINK_ENV, "1")]);
    let filters = clsact_filters(&bed, "egress");
    assert!(
        filters.contains("masq_egress"),
        "a clsact filter, not a TCX link: {filters}\n{}",
        agent.log_text()
    );
    assert_masqueraded(&bed);
    assert_success(&bed.ping(0, topology::EXT_ADDR, &[]));
    drop(agent);
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    assert_success(&bed.agent_cmd(&["cleanup", &bpffs]));
    let filters = clsact_filters(&bed, "egress");
    assert!(
        !filters.contains("masq_egress"),
        "cleanup removes the filter: {filters}"
    );
}

/// Where there is no TCX (before 6.6), the programs are clsact filters at a priority and handle
/// of the agent's own. A restarted agent replaces the program in them in one step: a stream of
/// packets through the restart never leaves with a pod's address. A filter someone removed is
/// put back, and `status` lists them.
fn netlink_filters_are_replaced_in_place_and_put_back(plane: Plane) {
    const NETLINK: [(&str, &str); 1] = [(attach::FORCE_NETLINK_ENV, "1")];
    let (pref, handle) = (
        attach::NETLINK_PRIORITY.to_string(),
        format!("{:#x}", attach::NETLINK_HANDLE),
    );
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let mut agent = bed.spawn_agent(&bed.plane_args(), &NETLINK);
    for hook in ["egress", "ingress"] {
        let filters = clsact_filters(&bed, hook);
        assert_eq!(
            filters.lines().filter(|l| l.contains("masq_")).count(),
            1,
            "one filter at {hook}: {filters}"
        );
        assert!(
            filters.contains(&format!("pref {pref} "))
                && filters.contains(&format!("handle {handle} ")),
            "at the agent's priority and handle: {filters}"
        );
    }
    let status = bed.status_json();
    let attachments = status["ebpf"]["attachments"].as_array().unwrap();
    assert_eq!(attachments.len(), 2, "{status}");
    for attachment in attachments {
        assert!(
            attachment["link_id"].is_null(),
            "a filter has no link: {attachment}"
        );
        let id = attachment["program_id"].as_u64().unwrap();
        let hook = attachment["hook"].as_str().unwrap();
        assert!(
            clsact_filters(&bed, hook).contains(&format!(" id {id} ")),
            "status names the program the filter runs: {attachment}"
        );
    }

    // Packets of one flow leave all through the restart, never with the pod's address.
    let leaving = RawObserver::start(&bed.topo.ext, libc::IPPROTO_UDP).unwrap();
    let pod = bed.pod().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sending = stop.clone();
    let sender = std::thread::spawn(move || {
        let socket =
            masq_testbed::netns::within(&pod, || Ok(UdpSocket::bind("0.0.0.0:0")?)).unwrap();
        let mut sent = 0u64;
        while !sending.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = socket.send_to(b"stream", (topology::EXT_ADDR, 9));
            sent += 1;
            std::thread::sleep(Duration::from_micros(100));
        }
        sent
    });
    std::thread::sleep(Duration::from_millis(300));
    agent.stop(libc::SIGKILL).unwrap();
    let agent = bed.spawn_agent(&bed.plane_args(), &NETLINK);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = sender.join().unwrap();
    wait_for(|| Ok(!leaving.packets().is_empty())).unwrap();
    let sources: BTreeSet<IpAddr> = leaving.packets().iter().map(|p| p.src).collect();
    assert_eq!(
        sources,
        BTreeSet::from([node_ip()]),
        "{sent} packets sent, {} seen",
        leaving.packets().len()
    );
    let filters = clsact_filters(&bed, "egress");
    assert_eq!(
        filters.lines().filter(|l| l.contains("masq_")).count(),
        1,
        "replaced, not stacked: {filters}"
    );

    bed.topo
        .node_run(
            "tc",
            &[
                "filter",
                "del",
                "dev",
                topology::UPLINK_IF,
                "egress",
                "pref",
                &pref,
                "handle",
                &handle,
                "bpf",
            ],
        )
        .unwrap();
    wait_for(|| Ok(clsact_filters(&bed, "egress").contains("masq_egress")))
        .unwrap_or_else(|e| panic!("not put back: {e}\n{}", agent.log_text()));
    assert!(agent.log_text().contains("re-attaching"));
    assert_masqueraded(&bed);
}

/// Someone detaches the uplink's egress program, and it cannot be attached again (a directory
/// stands where its link is pinned): liveness says so, and meanwhile the chain masquerades what
/// leaves the uplink. (A device that merely goes away is followed, not a failure.)
fn liveness_fails_when_the_data_plane_is_gone(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    let agent = bed.start_agent(&[&metrics_addr]);
    assert_eq!(http_get(&bed, "/healthz").0, 200);
    let egress = format!("{}-egress", topology::UPLINK_IF);
    let link = bed.status_json()["ebpf"]["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["hook"] == "egress")
        .map(|a| a["link_id"].to_string())
        .unwrap();
    let pin = bed.topo.bpffs.join("links").join(&egress);
    std::fs::remove_file(&pin).unwrap();
    std::fs::create_dir(&pin).unwrap();
    bed.topo
        .node_run("bpftool", &["link", "detach", "id", &link])
        .unwrap();
    wait_for_long(Duration::from_secs(30), || {
        Ok(http_get(&bed, "/healthz").0 == 503)
    })
    .unwrap_or_else(|e| panic!("still healthy: {e}\n{}", agent.log_text()));
    let (_, why) = http_get(&bed, "/healthz");
    assert!(why.contains(&egress), "{why}");
    wait_for_coverage(
        &bed,
        &agent,
        topology::UPLINK_IF,
        IpFamily::Ipv4,
        "iptables",
    );
    assert_masqueraded(&bed);
}
