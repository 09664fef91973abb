//! The test topology of design.md §4, made of network namespaces with unique names:
//!
//! ```text
//!  pod<i> 10.244.<i>.2 ──veth── node ──veth── ext 203.0.113.10 ──veth (MTU 1280)── far 192.0.2.20
//!                       10.244.<i>.1  eth0 203.0.113.1   + 198.51.100.10   (outside, no route back)
//!                                                        + 10.200.0.10     (cluster-local)
//!                                                        + 169.254.169.254 (link-local)
//!                                                        + 203.0.113.20    (a routable client)
//! ```
//!
//! The outside server has no route to the pod CIDR, so a reply only arrives when the node
//! masquerades. Its cluster-local, link-local and routable-client addresses answer from a routing
//! table that does route back to the pods. `far` sits behind a narrower link, so path-MTU
//! discovery toward it depends on ICMP errors from `ext`. Dropping a `Topology` deletes every
//! namespace it made, which also removes their links and iptables state, and its bpffs directory.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::Context as _;

use crate::netns::{self, command_in, run, run_in};

/// Name prefix of every namespace the test bed creates; `<prefix><pid>-<n>-<role>`.
pub const NS_PREFIX: &str = "mqa";
pub const NODE_UPLINK: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
pub const EXT_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const EXT_SECOND_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
pub const CLUSTER_LOCAL_ADDR: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 10);
pub const LINK_LOCAL_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// An outside address with a route back to the pods, to open connections toward them.
pub const ROUTABLE_CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
pub const EXT_FAR_SIDE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const FAR_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 20);
/// The MTU of the link between `ext` and `far`.
pub const FAR_LINK_MTU: u32 = 1280;
/// Interface name of the node's uplink, inside the node namespace.
pub const UPLINK_IF: &str = "eth0";
const CLUSTER_LOCAL_TABLE: &str = "100";

static NEXT_ID: AtomicU32 = AtomicU32::new(0);

/// Every address of the outside host.
pub const EXT_ADDRS: [Ipv4Addr; 5] = [
    EXT_ADDR,
    EXT_SECOND_ADDR,
    CLUSTER_LOCAL_ADDR,
    LINK_LOCAL_ADDR,
    ROUTABLE_CLIENT_ADDR,
];
/// The outside addresses that have a route back to the pods.
const ROUTES_BACK: [Ipv4Addr; 3] = [CLUSTER_LOCAL_ADDR, LINK_LOCAL_ADDR, ROUTABLE_CLIENT_ADDR];

pub fn pod_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, (i + 1) as u8, 2)
}

fn pod_gateway(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, (i + 1) as u8, 1)
}

pub struct Topology {
    pub pods: Vec<String>,
    pub node: String,
    pub ext: String,
    pub far: String,
    /// Scratch directory for this topology's config files and logs; removed on drop.
    pub dir: PathBuf,
    /// A directory of this topology's own on bpffs, for the agent's `--bpffs`; removed on drop.
    pub bpffs: PathBuf,
}

impl Topology {
    /// Builds the topology with `pods` pod namespaces.
    pub fn new(pods: usize) -> anyhow::Result<Topology> {
        ensure_bpffs()?;
        sweep_stale();
        let id = format!(
            "{NS_PREFIX}{}-{}",
            std::process::id(),
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(&id);
        std::fs::create_dir_all(&dir)?;
        let topo = Topology {
            pods: (0..pods).map(|i| format!("{id}-pod{i}")).collect(),
            node: format!("{id}-node"),
            ext: format!("{id}-ext"),
            far: format!("{id}-far"),
            dir,
            bpffs: Path::new(BPFFS_ROOT).join(&id),
        };
        // From here on, Drop cleans up whatever was created, even if a later step fails.
        topo.build().context("building the test topology")?;
        Ok(topo)
    }

    /// The link between the node and the outside host, with its addresses and routes: built
    /// with the topology, and built again by tests that delete it.
    pub fn connect_uplink(&self) -> anyhow::Result<()> {
        let (node, ext) = (&self.node, &self.ext);
        veth(node, UPLINK_IF, ext, "eth0")?;
        ip(node, &format!("addr add {NODE_UPLINK}/24 dev {UPLINK_IF}"))?;
        ip(node, &format!("route add default via {EXT_ADDR}"))?;
        ip(ext, &format!("addr add {EXT_ADDR}/24 dev eth0"))?;
        ip(
            ext,
            &format!("route add 10.244.0.0/16 via {NODE_UPLINK} table {CLUSTER_LOCAL_TABLE}"),
        )?;
        Ok(())
    }

    fn namespaces(&self) -> impl Iterator<Item = &String> {
        self.pods.iter().chain([&self.node, &self.ext, &self.far])
    }

    fn build(&self) -> anyhow::Result<()> {
        for ns in self.namespaces() {
            run("ip", &["netns", "add", ns])?;
            ip(ns, "link set lo up")?;
            sysctl(ns, "net.ipv4.conf.all.rp_filter", "0")?;
            sysctl(ns, "net.ipv4.conf.default.rp_filter", "0")?;
        }
        sysctl(&self.node, "net.ipv4.ip_forward", "1")?;
        sysctl(&self.ext, "net.ipv4.ip_forward", "1")?;
        let (node, ext, far) = (&self.node, &self.ext, &self.far);

        for extra in &EXT_ADDRS[1..] {
            ip(ext, &format!("addr add {extra}/32 dev lo"))?;
        }
        // Only these addresses may answer pods directly.
        for addr in ROUTES_BACK {
            ip(
                ext,
                &format!("rule add from {addr} lookup {CLUSTER_LOCAL_TABLE}"),
            )?;
        }
        self.connect_uplink()?;

        veth(ext, "far0", far, "eth0")?;
        ip(ext, &format!("link set far0 mtu {FAR_LINK_MTU}"))?;
        ip(far, &format!("link set eth0 mtu {FAR_LINK_MTU}"))?;
        ip(ext, &format!("addr add {EXT_FAR_SIDE}/24 dev far0"))?;
        ip(far, &format!("addr add {FAR_ADDR}/24 dev eth0"))?;
        ip(far, &format!("route add default via {EXT_FAR_SIDE}"))?;

        for (i, pod) in self.pods.iter().enumerate() {
            let node_if = format!("pod{i}");
            veth(node, &node_if, pod, "eth0")?;
            ip(
                node,
                &format!("addr add {}/24 dev {node_if}", pod_gateway(i)),
            )?;
            ip(pod, &format!("addr add {}/24 dev eth0", pod_addr(i)))?;
            ip(pod, &format!("route add default via {}", pod_gateway(i)))?;
        }
        Ok(())
    }

    /// Path for a file in this topology's scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Starts `binary args...` inside the node namespace, logging to `<dir>/<log_name>`.
    pub fn spawn_in_node(
        &self,
        binary: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
        log_name: &str,
    ) -> anyhow::Result<Process> {
        let log = self.path(log_name);
        let file = std::fs::File::create(&log)?;
        let child = command_in(&self.node, binary.to_str().context("binary path")?)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(Process { child, log })
    }

    /// A PATH on which `iptables` and friends run the given backend (`nft` or `legacy`), the
    /// way the agent's image picks the one the node uses. The directory is made on first use.
    pub fn path_with_iptables(&self, backend: &str) -> anyhow::Result<String> {
        let dir = self.path(&format!("bin-{backend}"));
        if !dir.exists() {
            std::fs::create_dir_all(&dir)?;
            for family in ["iptables", "ip6tables"] {
                for suffix in ["", "-restore", "-save"] {
                    std::os::unix::fs::symlink(
                        format!("/usr/sbin/{family}-{backend}{suffix}"),
                        dir.join(format!("{family}{suffix}")),
                    )?;
                }
            }
        }
        Ok(format!(
            "{}:{}",
            dir.display(),
            std::env::var("PATH").unwrap_or_default()
        ))
    }

    /// Runs a command inside the node namespace and returns its output, failing on non-zero.
    pub fn node_run(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        run_in(&self.node, program, args)
    }

    /// A command to run inside the node namespace.
    pub fn node_command(&self, program: &str) -> Command {
        command_in(&self.node, program)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in self.namespaces() {
            let _ = run("ip", &["netns", "del", ns]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.bpffs);
        sweep_agent_records();
    }
}

/// Where a running agent records its mode for `masq-agent status`.
const AGENT_RECORDS: &str = "/run/masq-agent";

/// Removes the mode records of agents that are no longer running.
fn sweep_agent_records() {
    let Ok(entries) = std::fs::read_dir(AGENT_RECORDS) else {
        return;
    };
    for entry in entries.flatten() {
        let pid = std::fs::read(entry.path())
            .ok()
            .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok())
            .and_then(|record| record["pid"].as_u64());
        if pid.is_none_or(|pid| !netns::is_process_alive(pid as u32)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A process started in a namespace; killed when dropped.
pub struct Process {
    pub child: Child,
    pub log: PathBuf,
}

impl Process {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` and waits for the process to exit.
    pub fn stop(&mut self, signal: i32) -> anyhow::Result<std::process::ExitStatus> {
        // SAFETY: kill on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, signal) };
        Ok(self.child.wait()?)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs `ip -n <ns> <command>`; the command's words are split on whitespace.
fn ip(ns: &str, command: &str) -> anyhow::Result<String> {
    let mut args = vec!["-n", ns];
    args.extend(command.split_whitespace());
    run("ip", &args)
}

fn sysctl(ns: &str, key: &str, value: &str) -> anyhow::Result<()> {
    run_in(ns, "sysctl", &["-qw", &format!("{key}={value}")]).map(drop)
}

/// A veth pair with one end in each namespace, both up. Created directly inside the namespaces,
/// so the names never appear in (or collide in) the machine's own namespace.
fn veth(ns_a: &str, if_a: &str, ns_b: &str, if_b: &str) -> anyhow::Result<()> {
    run(
        "ip",
        &[
            "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b,
        ],
    )?;
    ip(ns_a, &format!("link set {if_a} up"))?;
    ip(ns_b, &format!("link set {if_b} up"))?;
    Ok(())
}

/// Deletes namespaces, bpffs directories and agent records left behind by test-bed runs whose process no
/// longer exists (a run that was killed before it could clean up).
pub fn sweep_stale() {
    let stale = |name: &str| {
        name.strip_prefix(NS_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| !netns::is_process_alive(pid))
    };
    if let Ok(list) = run("ip", &["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if stale(name) {
                let _ = run("ip", &["netns", "del", name]);
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(BPFFS_ROOT) {
        for entry in entries.flatten() {
            if stale(&entry.file_name().to_string_lossy()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    sweep_agent_records();
}

/// Where bpffs is conventionally mounted; the test bed mounts it there if nothing has.
pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

fn ensure_bpffs() -> anyhow::Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts")?;
    if !mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(BPFFS_ROOT) && l.contains(" bpf "))
    {
        run("mount", &["-t", "bpf", "bpf", BPFFS_ROOT])?;
    }
    Ok(())
}
