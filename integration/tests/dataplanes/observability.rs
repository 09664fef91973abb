//! What the agent tells an operator, checked against what the outside host sees: `--once` and
//! `status`, the metrics and health endpoints, `flows`, `explain`, and the counts of the
//! decisions each policy entry takes.

use std::net::{IpAddr, SocketAddr};

use masq_agent::{dataplane::ebpf::expiry::SWEEP_INTERVAL, policy::IpFamily};
use masq_testbed::{
    probe::{self, metric},
    wait_for, wait_for_long, write_config,
};

use crate::{
    Bed, CHAIN, DEFAULT_CONFIG, FamilyOnTheBed, METRICS_ADDR, Plane, assert_masqueraded,
    assert_success, decisions_of, http_get, nat_room, reads_full, unanswered_queries,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane: explain_says_what_the_outside_host_sees);
        cases!($plane:
            once_applies_and_exits_and_status_reports,
            serves_metrics_health_and_readiness,
            explain_names_the_entry_when_the_file_turns_ipv6_on,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
    family_cases!(Ebpf:
        flows_says_which_port_a_pod_got_and_why_it_is_held,
        a_closing_connection_is_timed_as_conntrack_times_it,
        the_entries_that_decide_traffic_are_counted,
        a_full_nat_table_reads_full_beside_the_other_familys_empty_one,
    );
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

mod iptables_legacy {
    cases!(IptablesLegacy: once_applies_and_exits_and_status_reports);
}

impl Bed {
    /// `masq-agent explain DST --json` with the agent's own flags: its exit status, and what it
    /// printed.
    fn explain(&self, dst: IpAddr, family: IpFamily) -> (bool, serde_json::Value) {
        let dst = dst.to_string();
        let mut args = vec!["explain".to_string(), dst, "--json".to_string()];
        args.extend(self.family_args(family));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.agent_cmd(&args);
        let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&out.stderr));
        });
        (out.status.success(), json)
    }

    /// `masq-agent flows` with `args`: its text, or with `--json` its flows.
    fn flows(&self, args: &[&str]) -> String {
        let bpffs = format!("--bpffs={}", self.topo.bpffs.display());
        let mut all = vec!["flows", &bpffs];
        all.extend_from_slice(args);
        let out = self.agent_cmd(&all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn flows_json(&self, args: &[&str]) -> Vec<serde_json::Value> {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        serde_json::from_str(&self.flows(&all)).unwrap()
    }
}

fn once_applies_and_exits_and_status_reports(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    assert_success(&bed.sync_once(&[]));
    assert_masqueraded(&bed);

    let status = bed.status_json();
    let v4 = status["chains"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["family"] == "ipv4")
        .unwrap();
    assert_eq!(v4["jump_installed"], true);
    // The full chain lists them in rule order; the eBPF data plane's set lists them sorted.
    let expected = match plane {
        Plane::Ebpf => ["10.0.0.0/8", "169.254.0.0/16"],
        _ => ["169.254.0.0/16", "10.0.0.0/8"],
    };
    assert_eq!(v4["non_masquerade"], serde_json::json!(expected));
    if plane == Plane::Ebpf {
        assert_eq!(status["mode"], "ebpf");
        let ebpf = &status["ebpf"];
        let hooks: Vec<&str> = ebpf["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["hook"].as_str().unwrap())
            .collect();
        assert_eq!(hooks, ["egress", "ingress"]);
        assert_eq!(
            ebpf["non_masquerade_v4"],
            serde_json::json!(["10.0.0.0/8", "169.254.0.0/16"])
        );
        assert_eq!(ebpf["nat"]["ipv4"]["pod_flows"], 1, "the probe's flow");
        assert!(ebpf["counters"]["masqueraded"].as_u64().unwrap() >= 2);
        assert!(ebpf["counters"]["reverse_translated"].as_u64().unwrap() >= 2);
        assert_eq!(
            v4["ebpf_protocols_returned"],
            serde_json::json!(["tcp", "udp", "icmp"])
        );
    } else {
        assert_eq!(status["mode"], "iptables");
        assert_eq!(v4["masquerade_rules"], 1);
    }

    // An invalid config with --once exits 1 and changes nothing.
    let before = bed.chain().unwrap();
    write_config(
        &bed.config,
        "cidrLimit: 1\nnonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n",
    )
    .unwrap();
    let out = bed.sync_once(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the daemon can only accept up to 1 CIDRs")
    );
    assert_eq!(bed.chain().unwrap(), before);
    assert_masqueraded(&bed);
}

fn serves_metrics_health_and_readiness(plane: Plane) {
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    let agent = bed.start_agent(&[&metrics_addr]);
    assert_eq!(http_get(&bed, "/readyz"), (200, "ok\n".into()));
    assert_eq!(http_get(&bed, "/healthz"), (200, "ok\n".into()));
    assert_eq!(http_get(&bed, "/nothing-here").0, 404);
    assert_masqueraded(&bed);

    let (status, metrics) = http_get(&bed, "/metrics");
    assert_eq!(status, 200);
    assert!(metrics.ends_with("# EOF\n"), "OpenMetrics text:\n{metrics}");
    let series = |s: &str| metric(&metrics, s);
    assert!(series("masq_agent_config_reloads_total{result=\"success\"}") >= Some(1.0));
    // DEFAULT_CONFIG's 10/8, and link-local.
    assert_eq!(
        series("masq_agent_non_masquerade_prefixes{family=\"ipv4\"}"),
        Some(2.0)
    );
    let mode = match plane {
        Plane::Ebpf => "ebpf",
        _ => "iptables",
    };
    assert_eq!(
        series(&format!("masq_agent_dataplane_mode{{mode=\"{mode}\"}}")),
        Some(1.0)
    );
    assert_eq!(series("masq_agent_fallback_events_total"), Some(0.0));
    assert!(series("masq_agent_apply_duration_seconds_count") >= Some(1.0));
    assert!(series("process_open_fds") >= Some(3.0));
    assert!(series("process_resident_memory_bytes") > Some(1e6));
    assert_eq!(
        series("masq_agent_ebpf_counter_read_errors_total"),
        Some(0.0)
    );
    if plane == Plane::Ebpf {
        assert!(series("masq_agent_packets_masqueraded_total") >= Some(1.0));
        assert!(series("masq_agent_packets_reverse_translated_total{kind=\"reply\"}") >= Some(1.0));
        assert_eq!(
            series("masq_agent_packets_dropped_total{reason=\"nat_table_full\"}"),
            Some(0.0)
        );
        // Each family's table has its own series; IPv6 is off here, and has none.
        assert_eq!(
            series("masq_agent_nat_capacity_entries{family=\"ipv4\"}"),
            Some(nat_room(&bed, IpFamily::Ipv4, 262_144) as f64)
        );
        assert_eq!(
            series("masq_agent_nat_capacity_entries{family=\"ipv6\"}"),
            None
        );
        let swept = |metrics: &str, family: &str| {
            metric(
                metrics,
                &format!("masq_agent_nat_entries{{family=\"{family}\"}}"),
            )
        };
        wait_for(|| Ok(swept(&http_get(&bed, "/metrics").1, "ipv4").is_some()))
            .expect("the first sweep gives IPv4's table a series");
        assert_eq!(swept(&http_get(&bed, "/metrics").1, "ipv6"), None);
        // Counters that cannot be read raise the error metric and a warning, rather than
        // leaving the alerts on them without data.
        let pin = bed.topo.bpffs.join("counters");
        let pin = pin.to_str().unwrap();
        let shown = masq_testbed::netns::run("bpftool", &["-j", "map", "show", "pinned", pin]);
        let shown: serde_json::Value = serde_json::from_str(&shown.unwrap()).unwrap();
        let id = shown["id"].to_string();
        std::fs::remove_file(pin).unwrap();
        let (_, metrics) = http_get(&bed, "/metrics");
        masq_testbed::netns::run("bpftool", &["map", "pin", "id", &id, pin]).unwrap();
        let errors = metric(&metrics, "masq_agent_ebpf_counter_read_errors_total");
        assert!(errors >= Some(1.0), "{metrics}");
        assert!(metric(&metrics, "masq_agent_packets_masqueraded_total").is_none());
        let warned = agent.log_text();
        assert!(
            warned.contains("WARN") && warned.contains("reading the eBPF counters"),
            "{warned}"
        );
    } else {
        assert_eq!(
            series("masq_agent_packets_masqueraded_total"),
            None,
            "the chain's packets are counted by iptables, not here"
        );
    }
    drop(agent);
}

/// `masq-agent flows` says which port a pod's flow got and why it is still held, as `conntrack
/// -L` would: the pod's tuple, the node's, whose flow it is, its state and when it expires;
/// filtered by pod, destination, kind and protocol.
fn flows_says_which_port_a_pod_got_and_why_it_is_held(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let udp = probe::udp_probe(bed.pod(), family.outside(), 5353).unwrap();
    let tcp = probe::tcp_probe(bed.pod(), family.outside(), 0).unwrap();
    let pod = family.pod(0).to_string();

    let flows = bed.flows_json(&["--pod", &pod, "--proto", "udp"]);
    let [flow] = flows.as_slice() else {
        panic!("the UDP flow alone: {flows:#?}");
    };
    assert_eq!(flow["proto"], "udp", "{flow:#}");
    assert_eq!(flow["kind"], "pod", "{flow:#}");
    assert_eq!(flow["source"]["addr"], pod, "{flow:#}");
    assert_eq!(flow["source"]["port"], 5353, "{flow:#}");
    assert_eq!(
        flow["destination"]["addr"],
        family.outside().ip().to_string()
    );
    assert_eq!(flow["destination"]["port"], family.outside().port());
    assert_eq!(flow["translated_to"]["addr"], udp.ip().to_string());
    assert_eq!(
        flow["translated_to"]["port"],
        udp.port(),
        "the port the host saw"
    );
    assert_eq!(flow["state"], "replied", "answered once, as a query");
    let left = flow["expires_in_seconds"].as_u64().unwrap();
    // A query's 30 s, and the second by which its last packet's time may lag.
    let lag = masq_agent::dataplane::ebpf::expiry::LAST_SEEN_LAG.as_secs();
    assert!((1..=30 + lag).contains(&left), "{flow:#}");

    let flows = bed.flows_json(&["--proto", "tcp", "--kind", "pod"]);
    assert!(
        flows
            .iter()
            .any(|f| f["translated_to"]["port"] == tcp.port() && f["source"]["addr"] == pod),
        "{flows:#?}"
    );
    let elsewhere = family.pick("192.0.2.0/24", "2001:db8:99::/64");
    assert!(bed.flows_json(&["--destination", elsewhere]).is_empty());
    assert!(bed.flows_json(&["--kind", "kept"]).is_empty());

    let text = bed.flows(&["--pod", &pod, "--proto", "udp"]);
    let translated = match udp {
        SocketAddr::V4(_) => format!("as {udp} replied"),
        SocketAddr::V6(_) => format!("as [{}]:{} replied", udp.ip(), udp.port()),
    };
    assert!(text.contains(&translated), "{text}");
    assert!(text.ends_with("\n1 flow\n"), "{text}");
}

/// A pod's connection closing, one end then the other, is in the state the node's conntrack
/// has it in at each step (conntrack still sees the pods' own tuples here), and expires when
/// conntrack's entry does: CLOSE_WAIT's 60 s once the pod's FIN is acknowledged, TIME_WAIT's
/// 120 s once both are.
fn a_closing_connection_is_timed_as_conntrack_times_it(plane: Plane, family: IpFamily) {
    use std::{
        io::{Read as _, Write as _},
        net::{Shutdown, TcpListener, TcpStream},
    };
    let (bed, _agent) = Bed::with_agent(plane, family);
    let server_addr = SocketAddr::from((family.outside().ip(), 9708));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(server_addr)?))
            .unwrap();
    let mut client =
        masq_testbed::netns::within(bed.pod(), move || Ok(TcpStream::connect(server_addr)?))
            .unwrap();
    let (mut server, _) = listener.accept().unwrap();
    client.write_all(b"q").unwrap();
    server.read_exact(&mut [0]).unwrap();
    let pod_port = client.local_addr().unwrap().port();

    // The pod's flow as `flows` and conntrack show it: the state's name, and seconds left.
    let states = || {
        let pod = family.pod(0).to_string();
        let flows = bed.flows_json(&["--pod", &pod, "--proto", "tcp"]);
        let flow = flows
            .iter()
            .find(|f| f["source"]["port"] == pod_port)
            .unwrap_or_else(|| panic!("the pod's connection: {flows:#?}"));
        let port = pod_port.to_string();
        let listed = bed
            .topo
            .node_run("conntrack", &["-L", "-p", "tcp", "--orig-port-src", &port])
            .unwrap();
        // `tcp 6 SECONDS STATE src=...`
        let fields: Vec<&str> = listed.split_whitespace().collect();
        assert!(fields.len() > 3, "conntrack lists the flow: {listed:?}");
        let mine = (
            flow["state"].as_str().unwrap().to_string(),
            flow["expires_in_seconds"].as_u64().unwrap(),
        );
        let conntracks = (fields[3].to_lowercase(), fields[2].parse::<u64>().unwrap());
        (mine, conntracks)
    };
    let lag = masq_agent::dataplane::ebpf::expiry::LAST_SEEN_LAG.as_secs();
    let same_as_conntrack = |step: &str, want: &str| {
        let mut last = None;
        wait_for(|| {
            let ((state, left), (ct_state, ct_left)) = states();
            last = Some(format!(
                "{state} {left} s, conntrack {ct_state} {ct_left} s"
            ));
            // As long as conntrack's entry, and no more than the second a last packet's time
            // may lag it and the second each rounds to.
            Ok(state == want
                && ct_state == want
                && left + 1 >= ct_left
                && left <= ct_left + lag + 1)
        })
        .unwrap_or_else(|e| panic!("{step}: want {want}: {}: {e}", last.unwrap_or_default()));
    };

    client.shutdown(Shutdown::Write).unwrap();
    assert_eq!(server.read(&mut [0]).unwrap(), 0, "the pod's FIN arrived");
    same_as_conntrack("the pod closed", "close_wait");
    server.shutdown(Shutdown::Write).unwrap();
    assert_eq!(
        client.read(&mut [0]).unwrap(),
        0,
        "the server's FIN arrived"
    );
    same_as_conntrack("both closed", "time_wait");
}

/// `explain` says what the outside host sees, with the entry that decides it, and the data
/// plane installed agrees; with the data plane tampered with (the agent stopped, so that it
/// does not repair it first), it disagrees and exits 1.
fn explain_says_what_the_outside_host_sees(plane: Plane, family: IpFamily) {
    let (range, outside_host) = family.outside_prefixes();
    let config = family.config_with(&[range], &[outside_host]);
    let bed = Bed::new(plane, &config);
    let mut agent = bed.start_agent(family.agent_args());
    family.assert_masqueraded(&bed);
    let (agrees, said) = bed.explain(family.outside().ip(), family);
    assert!(agrees, "{said:#}");
    assert_eq!(said["decision"], "masquerade", "{said:#}");
    assert_eq!(
        said["masqueraded_to"],
        family.node().to_string(),
        "{said:#}"
    );
    assert_explained_by_the_exception(&said, &bed, &config, outside_host);
    let installed = said["installed"].as_array().unwrap();
    assert_eq!(installed.len(), 1, "{said:#}");

    // Run as `kubectl exec` runs it, without the daemon's flags: the running agent's are used.
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    let dst = family.outside().ip().to_string();
    let bare = bed.agent_cmd(&["explain", &dst, "--json", &bpffs]);
    let said: serde_json::Value = serde_json::from_slice(&bare.stdout).unwrap();
    assert!(bare.status.success(), "{said:#}");
    assert_eq!(said["entry"]["list"], "masqueradeCIDRs", "{said:#}");

    let client = family.routable_client();
    let seen = probe::tcp_probe(bed.pod(), client, 0).unwrap();
    assert_eq!(seen.ip(), family.pod(0));
    let (agrees, said) = bed.explain(client.ip(), family);
    assert!(agrees, "{said:#}");
    assert_eq!(said["decision"], "keeps-address", "{said:#}");
    assert_eq!(said["entry"]["prefix"], range, "{said:#}");

    agent.stop(libc::SIGTERM).unwrap();
    match plane {
        // The exception out of the trie: the programs would keep the pod's address.
        Plane::Ebpf => {
            let host = family.outside().ip();
            let (bits, octets) = match host {
                IpAddr::V4(a) => (32u32, a.octets().to_vec()),
                IpAddr::V6(a) => (128u32, a.octets().to_vec()),
            };
            let map = family.pick("non_masq_v4", "non_masq_v6");
            let pin = bed.topo.bpffs.join(map).display().to_string();
            let key: Vec<String> = bits
                .to_ne_bytes()
                .into_iter()
                .chain(octets)
                .map(|b| b.to_string())
                .collect();
            let mut args = vec!["map", "delete", "pinned", &pin, "key"];
            args.extend(key.iter().map(String::as_str));
            bed.topo.node_run("bpftool", &args).unwrap();
        }
        // The chain flushed down to one rule that returns everything.
        _ => {
            let table = |args: &[&str]| match family {
                IpFamily::Ipv4 => bed.iptables(args),
                IpFamily::Ipv6 => bed.ip6tables(args),
            };
            table(&["-t", "nat", "-F", CHAIN]).unwrap();
            table(&["-t", "nat", "-A", CHAIN, "-j", "RETURN"]).unwrap();
        }
    }
    let (agrees, said) = bed.explain(family.outside().ip(), family);
    assert!(!agrees, "a tampered data plane must disagree: {said:#}");
    assert_eq!(
        said["installed"][0]["decision"], "keeps-address",
        "{said:#}"
    );
}

/// What `explain` `said` names as the deciding entry is the exception `outside_host`, with the
/// line of `config` (the bed's file) that lists it.
fn assert_explained_by_the_exception(
    said: &serde_json::Value,
    bed: &Bed,
    config: &str,
    outside_host: &str,
) {
    assert_eq!(said["entry"]["prefix"], outside_host, "{said:#}");
    assert_eq!(said["entry"]["list"], "masqueradeCIDRs", "{said:#}");
    let line = config
        .lines()
        .position(|l| l.contains(outside_host))
        .unwrap()
        + 1;
    assert_eq!(said["entry"]["line"], line, "{said:#}");
    assert_eq!(said["entry"]["file"], bed.config.display().to_string());
}

/// Where IPv6 is turned on by the file (`enableIPv6: true`) rather than by the flag, `explain`
/// names the IPv6 entry that decides, with its file and line, as it does under the flag.
fn explain_names_the_entry_when_the_file_turns_ipv6_on(plane: Plane) {
    let v6 = IpFamily::Ipv6;
    let (range, outside_host) = v6.outside_prefixes();
    let config = v6.config_with(&[range], &[outside_host]) + "enableIPv6: true\n";
    let bed = Bed::new(plane, &config);
    let _agent = bed.start_agent(&[]);
    let dst = v6.outside().ip().to_string();
    let mut args = vec!["explain".to_string(), dst, "--json".to_string()];
    args.extend(bed.plane_args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bed.agent_cmd(&args);
    let said: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(said["decision"], "masquerade", "{said:#}");
    assert_explained_by_the_exception(&said, &bed, &config, outside_host);
}

/// Each entry counts what it decides, as `status`, `explain` and the metrics read it: a new
/// flow to an exception once, every packet of a flow that keeps its address, and an entry no
/// traffic reaches never; the counts survive an agent restart.
fn the_entries_that_decide_traffic_are_counted(plane: Plane, family: IpFamily) {
    let (range, outside_host) = family.outside_prefixes();
    let unused = family.pick("198.18.0.0/15", "2001:db8:ffff::/48");
    let config = family.config_with(&[range, unused], &[outside_host]);
    let bed = Bed::new(plane, &config);
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    let mut args = vec![metrics_addr.as_str()];
    args.extend(family.agent_args());
    let mut agent = bed.start_agent(&args);
    let before = bed.status_json();
    let exception_before = decisions_of(&before, outside_host).expect("the exception's count");
    let range_before = decisions_of(&before, range).expect("the range's count");

    const NEW_FLOWS: u64 = 3;
    for _ in 0..NEW_FLOWS {
        family.assert_masqueraded(&bed);
    }
    let seen = probe::tcp_probe(bed.pod(), family.routable_client(), 0).unwrap();
    assert_eq!(seen.ip(), family.pod(0));

    let status = bed.status_json();
    assert_eq!(
        decisions_of(&status, outside_host),
        Some(exception_before + NEW_FLOWS),
        "one decision per new masqueraded flow: {status:#}"
    );
    let range_now = decisions_of(&status, range).unwrap();
    assert!(
        range_now >= range_before + 3,
        "a connection that keeps its address is decided at each of its packets: {status:#}"
    );
    assert_eq!(decisions_of(&status, unused), Some(0));
    let text = bed.agent_cmd(&["status", &format!("--bpffs={}", bed.topo.bpffs.display())]);
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    let never = text
        .lines()
        .find(|l| l.contains("never matched:"))
        .unwrap_or("");
    assert!(never.contains(unused), "{text}");
    let busiest = text.lines().find(|l| l.contains("busiest:")).unwrap_or("");
    assert!(
        busiest.contains(range) || busiest.contains(outside_host),
        "{text}"
    );

    let (agrees, said) = bed.explain(family.outside().ip(), family);
    assert!(agrees, "{said:#}");
    assert_eq!(
        said["installed"][0]["decisions"].as_u64(),
        decisions_of(&status, outside_host),
        "{said:#}"
    );

    let (_, metrics) = http_get(&bed, "/metrics");
    let total = |action: &str| {
        let series = format!("masq_agent_policy_decisions_total{{action=\"{action}\"}}");
        metric(&metrics, &series).unwrap_or_else(|| panic!("{series} in:\n{metrics}")) as u64
    };
    let totals = &status["ebpf"]["decisions"]["totals"];
    assert!(total("masquerade") >= totals["masquerade"].as_u64().unwrap());
    assert!(total("masquerade") >= exception_before + NEW_FLOWS);
    assert!(total("non-masquerade") >= totals["non_masquerade"].as_u64().unwrap());
    assert!(
        !metrics.contains(&format!("prefix=\"{range}\"")),
        "no series per prefix"
    );

    agent.stop(libc::SIGTERM).unwrap();
    let _agent = bed.start_agent(&args);
    let after = bed.status_json();
    assert_eq!(
        decisions_of(&after, outside_host),
        decisions_of(&status, outside_host),
        "a restart keeps the counts: {after:#}"
    );
    assert!(decisions_of(&after, range) >= Some(range_now));
}

/// Pods fill one family's NAT table on a dual-stack node while the other's stays empty:
/// `status` and the metrics read the full one as full, as that family's pods find it, and the
/// other as empty; never half full over both.
fn a_full_nat_table_reads_full_beside_the_other_familys_empty_one(plane: Plane, family: IpFamily) {
    // IPv6's config holds both families' pods.
    let bed = Bed::new(plane, IpFamily::Ipv6.config());
    let metrics_addr = format!("--metrics-addr={METRICS_ADDR}");
    // 64 flows: 128 entries in each family's table, and more room in a slot table.
    const FLOWS: u32 = 64;
    let capacity = format!("--nat-capacity={FLOWS}");
    let _agent = bed.start_agent(&["--enable-ipv6", &capacity, &metrics_addr]);
    family.assert_masqueraded(&bed);
    let _silent = unanswered_queries(&bed, family, 9709, 100);
    let other = family.pick(IpFamily::Ipv6, IpFamily::Ipv4);
    let status = bed.status_json();
    let full = &status["ebpf"]["nat"][family.label()];
    assert!(reads_full(full), "{status:#}");
    let held = full["entries"].as_u64().unwrap();
    // Each table: its entries, its room and how full it reads.
    let room = |table| nat_room(&bed, table, FLOWS);
    let tables = [
        (
            family,
            held,
            room(family),
            (held * 100).div_ceil(room(family)),
        ),
        (other, 0, room(other), 0),
    ];

    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    let text = String::from_utf8(bed.agent_cmd(&["status", &bpffs]).stdout).unwrap();
    for (table, entries, room, percent) in tables {
        let nat = &status["ebpf"]["nat"][table.label()];
        let read = ["entries", "capacity", "percent_full"].map(|field| nat[field].as_u64());
        let expected = [entries, room, percent].map(Some);
        assert_eq!(read, expected, "{status:#}");
        let line = format!(
            "  NAT table {}: {entries} of {room} entries ({percent}% full)",
            table.label()
        );
        assert!(
            text.lines().any(|l| l.starts_with(&line)),
            "{line:?} in:\n{text}"
        );
    }

    // The entries are counted at each sweep; the capacities at each scrape.
    let series = |metrics: &str, name: &str, table: IpFamily| {
        let label = table.label();
        metric(metrics, &format!("{name}{{family=\"{label}\"}}"))
    };
    let mut metrics = String::new();
    wait_for_long(2 * SWEEP_INTERVAL, || {
        metrics = http_get(&bed, "/metrics").1;
        Ok(series(&metrics, "masq_agent_nat_entries", family) == Some(held as f64))
    })
    .unwrap_or_else(|e| panic!("{e}: a sweep counts the full table:\n{metrics}"));
    for (table, entries, room, _) in tables {
        let read = ["masq_agent_nat_entries", "masq_agent_nat_capacity_entries"]
            .map(|name| series(&metrics, name, table));
        assert_eq!(read, [Some(entries as f64), Some(room as f64)], "{metrics}");
    }
}
