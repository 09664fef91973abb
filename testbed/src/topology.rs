//! The test topology: a pod, a forwarding node and outside hosts, each a network namespace with a
//! unique name that the run creates and deletes itself. Every link
//! is dual-stack:
//!
//! ```text
//!  pod<i> 10.244.<i>.2 ──veth── node ──veth── ext 203.0.113.10 ──veth (MTU 1280)── far 192.0.2.20
//!                       10.244.<i>.1  eth0 203.0.113.1   + 198.51.100.10   (outside, no route back)
//!                                                        + 10.200.0.10     (cluster-local)
//!                                                        + 169.254.169.254 (link-local)
//!                                                        + 203.0.113.20    (a routable client)
//!
//!  pod<i> fd00:10:244:<i+1>::2 ──veth── node ──veth── ext 2001:db8:1::10 ──veth (MTU 1280)── far 2001:db8:3::20
//!               fd00:10:244:<i+1>::1  eth0 2001:db8:1::1   + 2001:db8:2::10 (outside, no route back)
//!                                                          + fd00:200::10   (cluster-local)
//!                                                          + 2001:db8:1::20 (a routable client)
//!
//!  and, once a test connects it, a second uplink with only a connected route:
//!                                  up1 198.51.100.129/25 ──veth── ext2 198.51.100.130
//!                                  up1 2001:db8:4::1/64            ext2 2001:db8:4::10
//! ```
//!
//! The outside servers have no route to the pod CIDRs (10.244.0.0/16, fd00:10:244::/48), so a
//! reply only arrives when the node masquerades (toward `ext2`, with the second uplink's
//! address). The cluster-local, link-local and routable-client addresses of `ext` answer from a
//! routing table that does route back to the pods (there is no IPv6 link-local case: fe80::/10
//! does not cross routers). `far` sits behind a narrower
//! link, so path-MTU discovery toward it depends on ICMP and ICMPv6 errors from `ext`. IPv6
//! addresses skip duplicate address detection, so they are usable at once. Dropping a `Topology`
//! deletes every namespace it made, which also removes their links and iptables state, and its
//! bpffs directory.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
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
/// The pods' ephemeral ports (`net.ipv4.ip_local_port_range`, both families): above every fixed
/// port a test sends from, so that a probe from "any port" never opens, by chance, the conntrack
/// entry or NAT flow of a port a test later uses as a new flow.
pub const POD_EPHEMERAL_PORTS: &str = "50000 60999";

/// The pods' IPv4 prefix: pod `i` lives in `10.244.<i+1>.0/24`.
pub const POD_PREFIX: &str = "10.244.0.0/16";
/// The pods' IPv6 prefix: pod `i` lives in `fd00:10:244:<i+1>::/64`.
pub const POD_PREFIX_V6: &str = "fd00:10:244::/48";
/// The IPv6 CIDR that holds `CLUSTER_LOCAL_ADDR_V6`, for non-masquerade configs.
pub const CLUSTER_LOCAL_CIDR_V6: &str = "fd00:200::/64";
pub const NODE_UPLINK_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
pub const EXT_ADDR_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);
/// Outside, with no route back to the pods.
pub const EXT_SECOND_ADDR_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10);
/// Inside `CLUSTER_LOCAL_CIDR_V6`, with a route back to the pods.
pub const CLUSTER_LOCAL_ADDR_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 0x10);
/// An outside address with a route back to the pods, to open connections toward them. It sits
/// on the uplink's subnet, so unlike the other extra addresses it is on `ext`'s `eth0`, not on
/// `lo`: neighbour discovery only answers for addresses of the interface asked.
pub const ROUTABLE_CLIENT_ADDR_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x20);
pub const EXT_FAR_SIDE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 1);
pub const FAR_ADDR_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 0x20);

/// Interface name of the node's second uplink, which tests connect and delete.
pub const SECOND_UPLINK_IF: &str = "up1";
pub const NODE_SECOND_UPLINK: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 129);
/// The host behind the second uplink, with no route back to the pods.
pub const EXT2_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 130);
const SECOND_UPLINK_PREFIX_LEN: u8 = 25;
pub const NODE_SECOND_UPLINK_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 4, 0, 0, 0, 0, 1);
pub const EXT2_ADDR_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 4, 0, 0, 0, 0, 0x10);

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

/// Every IPv6 address of the outside host.
pub const EXT_ADDRS_V6: [Ipv6Addr; 4] = [
    EXT_ADDR_V6,
    EXT_SECOND_ADDR_V6,
    CLUSTER_LOCAL_ADDR_V6,
    ROUTABLE_CLIENT_ADDR_V6,
];
/// The outside IPv6 addresses that have a route back to the pods.
const ROUTES_BACK_V6: [Ipv6Addr; 2] = [CLUSTER_LOCAL_ADDR_V6, ROUTABLE_CLIENT_ADDR_V6];

pub fn pod_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, (i + 1) as u8, 2)
}

fn pod_gateway(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, (i + 1) as u8, 1)
}

/// Pod `i`'s IPv6 address, `fd00:10:244:<i+1>::2`.
pub fn pod_addr_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x244, (i + 1) as u16, 0, 0, 0, 2)
}

fn pod_gateway_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x244, (i + 1) as u16, 0, 0, 0, 1)
}

pub struct Topology {
    pub pods: Vec<String>,
    pub node: String,
    pub ext: String,
    pub far: String,
    /// The host behind the second uplink; its namespace exists from the start, the link only
    /// once `connect_second_uplink` makes it.
    pub ext2: String,
    /// Scratch directory for this topology's config files and logs; removed on drop.
    pub dir: PathBuf,
    /// A directory of this topology's own on bpffs, for the agent's `--bpffs`; removed on drop.
    pub bpffs: PathBuf,
    /// What every name of its starts with: `<NS_PREFIX><pid>-<n>`.
    id: String,
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
            ext2: format!("{id}-ext2"),
            dir,
            bpffs: Path::new(BPFFS_ROOT).join(&id),
            id,
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

        ip(
            node,
            &format!("-6 addr add {NODE_UPLINK_V6}/64 dev {UPLINK_IF} nodad"),
        )?;
        ip(ext, &format!("-6 addr add {EXT_ADDR_V6}/64 dev eth0 nodad"))?;
        // Deprecated, so that `ext` never picks it as the source of its own packets (ICMPv6
        // errors, say), which the longest-prefix rule would otherwise prefer; it still answers
        // and may be bound.
        ip(
            ext,
            &format!("-6 addr add {ROUTABLE_CLIENT_ADDR_V6}/128 dev eth0 nodad preferred_lft 0"),
        )?;
        ip(node, &format!("-6 route add default via {EXT_ADDR_V6}"))?;
        ip(
            ext,
            &format!(
                "-6 route add {POD_PREFIX_V6} via {NODE_UPLINK_V6} table {CLUSTER_LOCAL_TABLE}"
            ),
        )?;
        Ok(())
    }

    /// The node's second uplink `up1` toward `ext2`, with addresses and connected routes only:
    /// no default route on the node, and no route back to the pods in `ext2`.
    pub fn connect_second_uplink(&self) -> anyhow::Result<()> {
        let (node, ext2) = (&self.node, &self.ext2);
        let len = SECOND_UPLINK_PREFIX_LEN;
        veth(node, SECOND_UPLINK_IF, ext2, "eth0")?;
        ip(
            node,
            &format!("addr add {NODE_SECOND_UPLINK}/{len} dev {SECOND_UPLINK_IF}"),
        )?;
        ip(ext2, &format!("addr add {EXT2_ADDR}/{len} dev eth0"))?;
        ip(
            node,
            &format!("-6 addr add {NODE_SECOND_UPLINK_V6}/64 dev {SECOND_UPLINK_IF} nodad"),
        )?;
        ip(
            ext2,
            &format!("-6 addr add {EXT2_ADDR_V6}/64 dev eth0 nodad"),
        )?;
        Ok(())
    }

    /// Deletes the second uplink; its end in `ext2` goes with it.
    pub fn disconnect_second_uplink(&self) -> anyhow::Result<()> {
        ip(&self.node, &format!("link del {SECOND_UPLINK_IF}")).map(drop)
    }

    /// Every namespace of the topology.
    pub fn namespaces(&self) -> impl Iterator<Item = &String> {
        self.pods
            .iter()
            .chain([&self.node, &self.ext, &self.far, &self.ext2])
    }

    fn build(&self) -> anyhow::Result<()> {
        for ns in self.namespaces() {
            run("ip", &["netns", "add", ns])?;
            // Before any link exists, so that every link (also a recreated uplink) inherits
            // `default`: IPv6 on, addresses usable at once (no duplicate address detection), no
            // autoconfiguration.
            let mut settings = vec![
                "net.ipv4.conf.all.rp_filter=0".to_string(),
                "net.ipv4.conf.default.rp_filter=0".to_string(),
                "net.ipv6.conf.lo.disable_ipv6=0".to_string(),
            ];
            for conf in ["all", "default"] {
                for setting in ["disable_ipv6=0", "accept_dad=0", "accept_ra=0"] {
                    settings.push(format!("net.ipv6.conf.{conf}.{setting}"));
                }
            }
            if self.pods.contains(ns) {
                settings.push(format!(
                    "net.ipv4.ip_local_port_range={POD_EPHEMERAL_PORTS}"
                ));
            }
            sysctls(ns, &settings)?;
            ip(ns, "link set lo up")?;
        }
        for router in [&self.node, &self.ext] {
            sysctls(
                router,
                &[
                    "net.ipv4.ip_forward=1",
                    "net.ipv6.conf.all.forwarding=1",
                    "net.ipv6.conf.default.forwarding=1",
                ],
            )?;
        }
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
        for extra in [EXT_SECOND_ADDR_V6, CLUSTER_LOCAL_ADDR_V6] {
            ip(ext, &format!("-6 addr add {extra}/128 dev lo nodad"))?;
        }
        for addr in ROUTES_BACK_V6 {
            ip(
                ext,
                &format!("-6 rule add from {addr} lookup {CLUSTER_LOCAL_TABLE}"),
            )?;
        }
        self.connect_uplink()?;

        veth(ext, "far0", far, "eth0")?;
        ip(ext, &format!("link set far0 mtu {FAR_LINK_MTU}"))?;
        ip(far, &format!("link set eth0 mtu {FAR_LINK_MTU}"))?;
        ip(ext, &format!("addr add {EXT_FAR_SIDE}/24 dev far0"))?;
        ip(far, &format!("addr add {FAR_ADDR}/24 dev eth0"))?;
        ip(far, &format!("route add default via {EXT_FAR_SIDE}"))?;
        ip(
            ext,
            &format!("-6 addr add {EXT_FAR_SIDE_V6}/64 dev far0 nodad"),
        )?;
        ip(far, &format!("-6 addr add {FAR_ADDR_V6}/64 dev eth0 nodad"))?;
        ip(far, &format!("-6 route add default via {EXT_FAR_SIDE_V6}"))?;

        for (i, pod) in self.pods.iter().enumerate() {
            let node_if = format!("pod{i}");
            veth(node, &node_if, pod, "eth0")?;
            ip(
                node,
                &format!("addr add {}/24 dev {node_if}", pod_gateway(i)),
            )?;
            ip(pod, &format!("addr add {}/24 dev eth0", pod_addr(i)))?;
            ip(pod, &format!("route add default via {}", pod_gateway(i)))?;
            ip(
                node,
                &format!("-6 addr add {}/64 dev {node_if} nodad", pod_gateway_v6(i)),
            )?;
            ip(
                pod,
                &format!("-6 addr add {}/64 dev eth0 nodad", pod_addr_v6(i)),
            )?;
            ip(
                pod,
                &format!("-6 route add default via {}", pod_gateway_v6(i)),
            )?;
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
                        Path::new("/usr/sbin").join(iptables_command(family, backend, suffix)),
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

    /// Routes to pod `i` over a path of `mtu` bytes, smaller than the uplink's, as an overlay's
    /// tunnel would: the node then answers a bigger packet for the pod with fragmentation
    /// needed (packet too big), locked so that nothing raises it.
    pub fn narrow_pod_route(&self, i: usize, mtu: u32) -> anyhow::Result<()> {
        let dev = format!("pod{i}");
        ip(
            &self.node,
            &format!("route replace {}/32 dev {dev} mtu lock {mtu}", pod_addr(i)),
        )?;
        ip(
            &self.node,
            &format!(
                "-6 route replace {}/128 dev {dev} mtu lock {mtu}",
                pod_addr_v6(i)
            ),
        )?;
        Ok(())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in self.namespaces() {
            let _ = run("ip", &["netns", "del", ns]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.bpffs);
        remove_agent_records(|name| is_named_for(&self.id, name));
    }
}

/// Where a running agent records its mode for `masq-agent status`.
const AGENT_RECORDS: &str = "/run/masq-agent";

/// Whether `name` (from `NS_PREFIX` on) is made of topology `id`'s: the id, then anything but
/// another digit (`mqa1-1` is not `mqa1-12`'s).
fn is_named_for(id: &str, name: &str) -> bool {
    name.strip_prefix(id)
        .is_some_and(|rest| !rest.starts_with(|c: char| c.is_ascii_digit()))
}

/// Removes the agents' files (`masq-agent status`'s record, a refused program's verifier log)
/// that `picked` chooses by their names from `NS_PREFIX` on. Each is named after its agent's
/// `--bpffs`, a test-bed directory (or one under it), whose name the file's keeps. Files no
/// topology's name are never removed (a node's own agent's), nor those of a topology whose test
/// still runs, but by its own drop, whether their agents run or not: a test reads what its
/// exited agent left.
fn remove_agent_records(picked: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(AGENT_RECORDS) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.find(NS_PREFIX).is_some_and(|at| picked(&name[at..])) {
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

/// Sets `key=value` settings in namespace `ns`, with one `sysctl` run.
fn sysctls(ns: &str, settings: &[impl AsRef<str>]) -> anyhow::Result<()> {
    let mut args = vec!["-qw"];
    args.extend(settings.iter().map(AsRef::as_ref));
    run_in(ns, "sysctl", &args).map(drop)
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
    remove_agent_records(stale);
}

/// The command of `family`'s tables (`iptables` or `ip6tables`) in `backend` (`nft` or
/// `legacy`), with `suffix` (`""`, `-restore`, `-save`), as Debian installs them.
pub fn iptables_command(family: &str, backend: &str, suffix: &str) -> String {
    format!("{family}-{backend}{suffix}")
}

/// Where bpffs is conventionally mounted; the test bed mounts it there if nothing has.
pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

pub(crate) fn ensure_bpffs() -> anyhow::Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts")?;
    if !mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(BPFFS_ROOT) && l.contains(" bpf "))
    {
        run("mount", &["-t", "bpf", "bpf", BPFFS_ROOT])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A topology removes its own agents' files on drop, those of its directories' names
    /// (`--bpffs` under it), and no other topology's, whose test may be reading them.
    #[test]
    fn a_topologys_agent_files_are_those_named_for_it_alone() {
        let id = format!("{NS_PREFIX}7-1");
        for own in [
            format!("{id}.json"),
            format!("{id}_fresh.json"),
            format!("{id}.masq_egress.verifier.log"),
        ] {
            assert!(is_named_for(&id, &own), "{own}");
        }
        for other in [
            format!("{NS_PREFIX}7-12.json"),
            format!("{NS_PREFIX}7-2.json"),
            format!("{NS_PREFIX}70-1.json"),
        ] {
            assert!(!is_named_for(&id, &other), "{other}");
        }
    }
}
