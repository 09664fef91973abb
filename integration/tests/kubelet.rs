//! The agent as kubelet runs it from deploy/: the image's entrypoint with the DaemonSet's exact
//! args, the ConfigMap projected at /etc/config the way kubelet projects and updates it, and the
//! pins at the default /sys/fs/bpf/ip-masq-agent, the container's capabilities and nothing more.
//! The container is a private mount namespace inside the test bed's node namespace, so the
//! host's /etc, bpffs and /run are never touched.

use std::{
    net::Ipv4Addr,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use masq_testbed::deploy::{
    agent_args, agent_capabilities, agent_container, dashboard_queries, deploy_dir, example_config,
    find, init_command, series, with_only,
};
use masq_testbed::{
    keeps_address_v4,
    kubelet::ConfigMapVolume,
    probe,
    topology::{self, Process, Topology},
    wait_for, wait_for_long,
};

/// The container's view of the node, made by `sh -c CONTAINER_MOUNTS sh STAGE VOLUME PINS
/// COMMAND...` inside `unshare --mount --propagation private`: nothing it mounts reaches the
/// host, and all of it goes away with the last process in the namespace.
const CONTAINER_MOUNTS: &str = r#"set -eu
stage=$1 volume=$2 pins=$3
shift 3
mount -t tmpfs masq-test "$stage"
mkdir "$stage/etc-upper" "$stage/etc-work" "$stage/pins"
# Still reachable here once the fresh bpffs below covers the host's.
mount --bind "$pins" "$stage/pins"
# A throwaway layer over /etc, so that /etc/config can exist in this namespace alone.
mount -t overlay masq-test -o "lowerdir=/etc,upperdir=$stage/etc-upper,workdir=$stage/etc-work" /etc
mkdir -p /etc/config
mount --bind "$volume" /etc/config
# A bpffs of its own hides the host's pins; only the test's directory shows through.
mount -t bpf bpf /sys/fs/bpf
mkdir /sys/fs/bpf/ip-masq-agent
mount --bind "$stage/pins" /sys/fs/bpf/ip-masq-agent
# The container's own /run, where the agent records its mode.
mount -t tmpfs masq-test /run
exec "$@"
"#;

/// A test-bed node with the image's PATH: `masq-agent` and the entrypoint's iptables links.
struct Node {
    topo: Topology,
    bin: PathBuf,
}

impl Node {
    fn new() -> Node {
        let topo = Topology::new(0).expect("topology");
        let bin = topo.path("bin");
        std::fs::create_dir(&bin).unwrap();
        symlink(masq_testbed::agent_binary(), bin.join("masq-agent")).unwrap();
        Node { topo, bin }
    }

    fn envs(&self) -> [(&'static str, String); 2] {
        let path = format!(
            "{}:{}",
            self.bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        [
            ("PATH", path),
            ("IPTABLES_LINK_DIR", self.bin.display().to_string()),
        ]
    }

    /// Starts the container: the entrypoint with `args`, behind kubelet's mounts of `volume`.
    fn start(&self, volume: &ConfigMapVolume, args: &[String]) -> Process {
        let stage = self.topo.path("stage");
        std::fs::create_dir(&stage).unwrap();
        std::fs::create_dir_all(&self.topo.bpffs).unwrap();
        let entrypoint = deploy_dir().join("entrypoint.sh");
        let mut argv: Vec<&str> = vec!["--mount", "--propagation", "private"];
        argv.extend(["sh", "-c", CONTAINER_MOUNTS, "sh"]);
        let paths: [&Path; 3] = [&stage, volume.dir(), &self.topo.bpffs];
        argv.extend(paths.map(as_str));
        // The runtime's mounts are made; the container runs with its capabilities only.
        let unprivileged = with_only(&agent_capabilities());
        argv.extend(unprivileged.iter().map(String::as_str));
        argv.push(as_str(&entrypoint));
        argv.extend(args.iter().map(String::as_str));
        let envs = self.envs();
        let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let agent = self
            .topo
            .spawn_in_node(Path::new("unshare"), &argv, &envs, "agent.log")
            .expect("start the container");
        wait_for(|| Ok(agent.log_text().contains("policy applied")))
            .unwrap_or_else(|e| panic!("agent never synced: {e}\n{}", agent.log_text()));
        agent
    }

    /// `masq-agent status --json` in the running container's namespaces, as `kubectl exec`
    /// runs it.
    fn status(&self, container: &Process) -> serde_json::Value {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--target={}", container.child.id()))
            .args(["--mount", "--net", "--", "masq-agent", "status", "--json"])
            .envs(self.envs())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Runs the entrypoint in the node namespace and returns the backend that `iptables` and
    /// each of its siblings on PATH then run: "legacy" or "nf_tables".
    fn entrypoint_backend(&self) -> String {
        let out = self
            .topo
            .node_command(as_str(&deploy_dir().join("entrypoint.sh")))
            .arg("--version")
            .envs(self.envs())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with("masq-agent "),
            "the entrypoint runs the agent with its args: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let backends: Vec<String> = ["iptables", "ip6tables"]
            .iter()
            .flat_map(|family| ["", "-save", "-restore"].map(|suffix| format!("{family}{suffix}")))
            .map(|command| {
                let version = masq_testbed::netns::run(as_str(&self.bin.join(&command)), &["-V"])
                    .unwrap_or_else(|e| panic!("{command}: {e:#}"));
                let backend = version.split(['(', ')']).nth(1);
                backend.unwrap_or_else(|| panic!("{version}")).to_string()
            })
            .collect();
        assert!(
            backends.iter().all(|b| *b == backends[0]),
            "one backend for every command: {backends:?}"
        );
        backends[0].clone()
    }
}

fn as_str(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// Whether the agent's pinned `non_masq_v4` exempts `addr` now.
fn exempt(node: &Node, addr: Ipv4Addr) -> anyhow::Result<bool> {
    keeps_address_v4(&node.topo.bpffs.join("non_masq_v4"), addr)
}

/// A node running the DaemonSet's pod with the example ConfigMap.
fn node_with_the_daemonset_pod() -> (Node, ConfigMapVolume, Process) {
    let node = Node::new();
    let volume = ConfigMapVolume::create(
        &node.topo.path("volume"),
        "ip-masq-agent",
        &example_config(),
    )
    .unwrap();
    let agent = node.start(&volume, &agent_args());
    (node, volume, agent)
}

#[test]
fn kubelet_s_probes_and_prometheus_reach_the_daemonset_s_agent() {
    let (node, _volume, agent) = node_with_the_daemonset_pod();
    let container = agent_container();
    let port = find(&container["ports"], "metrics")["containerPort"].as_u64();
    let server = (topology::NODE_UPLINK, port.unwrap() as u16).into();
    for kind in ["readinessProbe", "livenessProbe"] {
        // Where kubelet sends the probe: the host and port it names, on the node.
        let get = &container[kind]["httpGet"];
        let path = get["path"].as_str().unwrap();
        let host: std::net::IpAddr = get["host"].as_str().unwrap().parse().unwrap();
        let probed = (host, get["port"].as_u64().unwrap() as u16).into();
        wait_for(|| Ok(probe::http_get(&node.topo.node, probed, path)?.0 == 200))
            .unwrap_or_else(|e| panic!("{kind} GET {path}: {e}\n{}", agent.log_text()));
        // From the network, only the metrics answer.
        let from_outside = (topology::NODE_UPLINK, probed.port()).into();
        assert!(probe::http_get(&node.topo.node, from_outside, path).is_err());
        let (status, _) = probe::http_get(&node.topo.node, server, path).unwrap();
        assert_eq!(status, 404, "{path} on the metrics port");
    }
    // Each scrape must hold every metric the dashboard shows; the first few after the start
    // may lack the NAT table's, which come with the first sweep.
    let queries = dashboard_queries();
    let unexposed = || -> anyhow::Result<Vec<&str>> {
        let (_, metrics) = probe::http_get(&node.topo.node, server, "/metrics")?;
        let exposed = |name: &str| {
            metrics.lines().any(|line| {
                line.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']))
            })
        };
        Ok(queries
            .iter()
            .flat_map(|query| series(query).map(|(name, _)| name))
            .filter(|name| !exposed(name))
            .collect())
    };
    wait_for(|| Ok(unexposed()?.is_empty())).unwrap_or_else(|e| {
        panic!("on the dashboard, not exposed: {:?} ({e})", unexposed());
    });
}

#[test]
fn the_daemonset_s_agent_picks_up_a_kubelet_configmap_swap_within_a_second() {
    let (node, mut volume, agent) = node_with_the_daemonset_pod();
    assert!(
        agent
            .log_text()
            .contains("entrypoint: iptables backend nft (0 legacy and 0 nft rules"),
        "a node without rules gets nft:\n{}",
        agent.log_text()
    );
    // The pins went to the default --bpffs, which is the test's own directory here.
    let added = Ipv4Addr::new(198, 51, 100, 1);
    assert!(exempt(&node, Ipv4Addr::new(10, 1, 2, 3)).unwrap());
    assert!(!exempt(&node, added).unwrap());
    assert_eq!(node.status(&agent)["mode"], "ebpf");

    let with_added = "nonMasqueradeCIDRs: [10.0.0.0/8, 198.51.100.0/24]\nresyncInterval: 60s\n";
    for (text, want) in [(with_added, true), (&example_config(), false)] {
        let swapped = Instant::now();
        volume.update(text).unwrap();
        wait_for_long(Duration::from_secs(1), || Ok(exempt(&node, added)? == want)).unwrap_or_else(
            |e| {
                panic!(
                    "198.51.100.0/24 exempt={want} not in force {:?} after the swap: {e}\n{}",
                    swapped.elapsed(),
                    agent.log_text()
                )
            },
        );
    }
    assert_eq!(
        node.status(&agent)["ebpf"]["non_masquerade_v4"],
        serde_json::json!(["10.0.0.0/8", "169.254.0.0/16"]),
    );
}

#[test]
fn the_entrypoint_picks_the_iptables_backend_the_node_uses() {
    let node = Node::new();
    let run = |command: &str| {
        let mut words = command.split_whitespace();
        let program = words.next().unwrap();
        node.topo
            .node_run(program, &words.collect::<Vec<_>>())
            .unwrap();
    };
    run("iptables-legacy -t nat -A POSTROUTING -d 192.0.2.1 -j RETURN");
    assert_eq!(node.entrypoint_backend(), "legacy", "only legacy has rules");
    run("iptables-nft -t nat -A POSTROUTING -d 192.0.2.2 -j RETURN");
    run("iptables-nft -t nat -A POSTROUTING -d 192.0.2.3 -j RETURN");
    assert_eq!(node.entrypoint_backend(), "nf_tables", "nft has more rules");
    run("iptables-legacy -t mangle -N KUBE-IPTABLES-HINT");
    assert_eq!(
        node.entrypoint_backend(),
        "legacy",
        "kubelet's hint outweighs the rule count"
    );
}

/// The init container mounts a BPF filesystem where the node has none, and leaves one that is
/// there alone. Run in a private mount namespace whose /sys/fs/bpf is unmounted: a node where
/// nothing has mounted it.
#[test]
fn the_init_container_mounts_a_bpffs_only_where_the_node_has_none() {
    const NODE_WITHOUT_BPFFS: &str = r#"set -eu
while grep -q ' /sys/fs/bpf ' /proc/self/mounts; do umount -l /sys/fs/bpf; done
before=$(stat -f -c %T /sys/fs/bpf)
"$@"
"$@"
after=$(grep -c ' /sys/fs/bpf ' /proc/self/mounts)
echo "$(stat -f -c %T /sys/fs/bpf) $before $after"
"#;
    let command = init_command("mount-bpffs");
    let mut argv = vec!["--mount", "--propagation", "private"];
    argv.extend(["sh", "-c", NODE_WITHOUT_BPFFS, "sh"]);
    argv.extend(command.iter().map(String::as_str));
    let out = std::process::Command::new("unshare")
        .args(&argv)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        said.trim(),
        "bpf_fs sysfs 1",
        "mounted once, then left alone"
    );
}
