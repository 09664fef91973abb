//! The main job: masq-agent on a self-made namespace topology, with real traffic, a live config
//! change and the agent's own status. Every claim the demo prints is checked.

use std::{
    net::{IpAddr, SocketAddr},
    time::Instant,
};

use anyhow::{Context as _, bail, ensure};
use masq_testbed::{
    probe::{self, Observer},
    topology::{self, Topology},
    wait_for, workspace_root, write_config,
};

use crate::step;

const PORT: u16 = 8080;

pub fn run() -> anyhow::Result<()> {
    step("cargo", &["build", "--release", "--package", "masq-agent"])?;
    let agent_bin = workspace_root().join("target/release/masq-agent");

    say(
        "1",
        "building the topology: pod -> node (forwarding) -> outside server",
    );
    let topo = Topology::new(1)?;
    let pod = &topo.pods[0];
    println!(
        "    pod {}  node uplink {}  outside server {} and {}  cluster-local {}",
        topology::pod_addr(0),
        topology::NODE_UPLINK,
        topology::EXT_ADDR,
        topology::EXT_SECOND_ADDR,
        topology::CLUSTER_LOCAL_ADDR
    );
    let server = Observer::start(&topo.ext, &topology::EXT_ADDRS, PORT)?;

    let config_dir = topo.path("config");
    std::fs::create_dir_all(&config_dir)?;
    let config = config_dir.join("ip-masq-agent");
    write_config(
        &config,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 60s\n",
    )?;

    say(
        "2",
        "starting masq-agent in the node namespace (eBPF data plane on the uplink)",
    );
    let config_arg = format!("--config={}", config.display());
    let bpffs_arg = format!("--bpffs={}", topo.bpffs.display());
    let mut agent = topo.spawn_in_node(
        &agent_bin,
        &[
            "--dataplane=ebpf",
            "--fallback-to-iptables=false",
            &config_arg,
            &bpffs_arg,
        ],
        &[],
        "agent.log",
    )?;
    wait_for(|| Ok(topo.bpffs.join("links").read_dir()?.count() == 2))
        .with_context(|| format!("the agent did not attach:\n{}", agent.log_text()))?;
    println!(
        "    tc programs attached to the uplink's egress and ingress, pinned under {}",
        topo.bpffs.display()
    );

    say("3", "pod traffic, as the outside server sees it");
    let outside = SocketAddr::from((topology::EXT_ADDR, PORT));
    let cluster_local = SocketAddr::from((topology::CLUSTER_LOCAL_ADDR, PORT));
    let seen = probe::tcp_probe(pod, outside, 0)?;
    show(
        "TCP to the outside",
        seen,
        topology::NODE_UPLINK.into(),
        "masqueraded to the node's address",
    )?;
    let seen = probe::udp_probe(pod, outside, 0)?;
    show(
        "UDP to the outside",
        seen,
        topology::NODE_UPLINK.into(),
        "masqueraded to the node's address",
    )?;
    ensure!(
        masq_testbed::netns::command_in(pod, "ping")
            .args(["-c", "1", "-W", "2", &topology::EXT_ADDR.to_string()])
            .output()?
            .status
            .success(),
        "ping to the outside got no reply"
    );
    println!(
        "    ping to the outside: reply received (the server can only answer the node's address)"
    );
    let seen = probe::tcp_probe(pod, cluster_local, 0)?;
    show(
        "TCP to cluster-local",
        seen,
        topology::pod_addr(0).into(),
        "in 10.0.0.0/8: keeps the pod's address",
    )?;
    let pin = topo.bpffs.join(masq_ebpf::map_names::NON_MASQ_V4);
    println!("    $ bpftool map dump pinned {}", pin.display());
    let dump = masq_testbed::netns::run(
        "bpftool",
        &["map", "dump", "pinned", pin.to_str().context("path")?],
    )?;
    for line in dump.lines() {
        println!("      {line}");
    }

    say(
        "4",
        "changing the ConfigMap live: 198.51.100.0/24 becomes non-masquerade",
    );
    let second = SocketAddr::from((topology::EXT_SECOND_ADDR, PORT));
    let seen = probe::udp_probe(pod, second, 0)?;
    show(
        "UDP to 198.51.100.10 before",
        seen,
        topology::NODE_UPLINK.into(),
        "masqueraded",
    )?;
    write_config(
        &config,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nresyncInterval: 60s\n",
    )?;
    let changed = Instant::now();
    server
        .wait_for_udp_from(pod, second, topology::pod_addr(0).into())
        .context("the config change did not take effect")?;
    println!(
        "    UDP to 198.51.100.10 after: server saw {} (pod's own address) within {} ms of the file change",
        topology::pod_addr(0),
        changed.elapsed().as_millis()
    );

    say(
        "5",
        "an exception inside it: masqueradeCIDRs [198.51.100.10/32], and explain says why",
    );
    write_config(
        &config,
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.51.100.0/24\nmasqueradeCIDRs:\n  - 198.51.100.10/32\nresyncInterval: 60s\n",
    )?;
    server
        .wait_for_udp_from(pod, second, topology::NODE_UPLINK.into())
        .context("the exception did not take effect")?;
    println!(
        "    UDP to 198.51.100.10: server saw {} again: the longest prefix decides",
        topology::NODE_UPLINK
    );
    let target = topology::EXT_SECOND_ADDR.to_string();
    println!("    $ masq-agent explain {target}");
    let explained = topo
        .node_command(agent_bin.to_str().context("path")?)
        .args(["explain", &target, &config_arg, &bpffs_arg])
        .output()?;
    let said = String::from_utf8_lossy(&explained.stdout);
    for line in said.lines() {
        println!("      {line}");
    }
    ensure!(
        explained.status.success(),
        "the data plane disagrees with the config: {}",
        String::from_utf8_lossy(&explained.stderr)
    );
    ensure!(
        said.contains(&format!("masqueraded to {}", topology::NODE_UPLINK))
            && said.contains("198.51.100.10/32 in masqueradeCIDRs"),
        "explain must say what the server saw, and why"
    );

    say("6", "masq-agent status");
    let status = topo.node_run(agent_bin.to_str().context("path")?, &["status", &bpffs_arg])?;
    for line in status.lines() {
        println!("    {line}");
    }

    say(
        "7",
        "stopping the agent: SIGTERM leaves the data plane in place, traffic keeps flowing",
    );
    agent.stop(libc::SIGTERM)?;
    let seen = probe::tcp_probe(pod, outside, 0)?;
    show(
        "TCP to the outside, agent stopped",
        seen,
        topology::NODE_UPLINK.into(),
        "still masqueraded",
    )?;

    say("8", "cleanup removes everything");
    topo.node_run(
        agent_bin.to_str().context("path")?,
        &["cleanup", &bpffs_arg],
    )?;
    ensure!(!topo.bpffs.exists(), "cleanup must remove the pins");
    ensure!(
        topo.node_run("iptables", &["-t", "nat", "-S", "IP-MASQ-AGENT"])
            .is_err(),
        "cleanup must remove the chain"
    );
    ensure!(
        probe::tcp_probe(pod, outside, 0).is_err(),
        "without masquerading the server cannot answer"
    );
    println!(
        "    programs detached, pins and chain removed: the server can no longer answer the pod; deleting the namespaces"
    );
    drop(server);
    drop(topo);
    println!("\ndemo passed: every claim above was checked against real traffic");
    Ok(())
}

fn say(n: &str, what: &str) {
    println!("\n[{n}] {what}");
}

fn show(what: &str, seen: SocketAddr, expect: IpAddr, meaning: &str) -> anyhow::Result<()> {
    if seen.ip() != expect {
        bail!("{what}: server saw {seen}, expected {expect}");
    }
    println!("    {what}: server saw {seen}  ({meaning})");
    Ok(())
}
