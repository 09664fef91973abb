//! The eBPF data plane: masq-ebpf's tc programs on each selected device, the non-masquerade
//! tries they look destinations up in, the NAT table, and beside them the reference chain
//! reduced to what the programs leave alone: other protocols, and whatever leaves by a device
//! without them.

pub mod attach;
pub mod batch;
mod carry;
mod conntrack;
pub mod devices;
pub mod expiry;
pub mod leftovers;
pub mod pins;
#[cfg(feature = "testbed")]
pub mod testbed;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, LpmTrie, Map, MapData, PerCpuArray, lpm_trie::Key},
    programs::{
        SchedClassifier,
        links::{FdLink, PinnedLink},
    },
};
use ipnet::{Ipv4Net, Ipv6Net};
use masq_ebpf::{
    COUNTER_SLOTS, Counter, Interface, MAX_PORT_SPANS, NAT_DEFAULT_ENTRIES, NON_MASQ_PRESENT,
    PortSpan, Settings, map_names, program_names,
};
use serde::Serialize;
use tracing::{info, warn};

use self::{
    attach::{Attachment, Hook},
    carry::Carried,
    devices::{Notes, Returned, Selection},
    expiry::Timeouts,
    pins::Pins,
};
use super::{
    ApplyOutcome, DataPlane, Mode, NatUsage, Status,
    iptables::{ChainVariant, IptablesDataPlane},
};
use crate::{
    netdev::{self, Device},
    policy::{IpFamily, MasqueradeOptions, Policy},
    ports::PortRange,
};

/// The compiled tc programs, embedded so that the agent is one binary.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/masq"));

/// The eBPF data plane could not run (load, attach) or stopped running (detached and not
/// re-attachable). The agent falls back to iptables on this error, if allowed to.
#[derive(Debug, thiserror::Error)]
#[error("eBPF data plane unavailable: {0:#}")]
pub struct Unavailable(pub anyhow::Error);

/// What the eBPF data plane needs from the flags and the node.
#[derive(Debug, Clone)]
pub struct EbpfOptions {
    pub bpffs: PathBuf,
    pub devices: Selection,
    pub nat_capacity: u32,
    pub port_spans: Vec<PortRange>,
    pub random_fully: bool,
    pub masquerade: MasqueradeOptions,
    /// `--enable-ipv6`: the programs masquerade IPv6 too.
    pub enable_ipv6: bool,
}

impl EbpfOptions {
    pub const DEFAULT_NAT_CAPACITY: u32 = NAT_DEFAULT_ENTRIES;

    /// The size of `nat_v6`: a table that is never used takes one entry, not megabytes.
    pub fn nat_v6_capacity(&self) -> u32 {
        if self.enable_ipv6 {
            self.nat_capacity
        } else {
            1
        }
    }
}

pub struct EbpfDataPlane {
    ebpf: Ebpf,
    pins: Pins,
    enable_ipv6: bool,
    selection: Selection,
    /// The devices carrying the programs, as last looked up.
    devices: Vec<Device>,
    /// Devices no longer selected (no longer named, or without their default route), whose
    /// programs stay, but out of the chain's early returns, while the flows they translate
    /// through them drain: released once none is left, or once the device is gone.
    draining: Vec<Device>,
    /// Devices an earlier agent left programs on: taken over, or released, at the first apply.
    inherited: Vec<String>,
    notes: Notes,
    attachments: Vec<(String, Hook, Attachment)>,
    chain: IptablesDataPlane,
    /// What the chain returns to the programs, as last installed.
    returned: Returned,
    timeouts: Timeouts,
    applied: Option<Policy>,
    last_sweep: Option<std::time::Instant>,
    /// The old NAT tables whose flows are carried into the new ones, held until the first
    /// apply has taken the links over from the old programs.
    carried: Carried,
    /// The programs' count of node flows given another port, as last said.
    clashes_said: u64,
}

/// How often the NAT table is swept for idle flows; upkeep runs more often than that, to catch
/// a changed address or a detached program quickly.
pub(crate) const SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Loads the embedded object, reusing the maps an earlier agent pinned when their layout
/// matches. Nothing is attached until the first `apply`, so that the programs never run with
/// empty non-masquerade tries.
pub fn new(opts: &EbpfOptions) -> Result<EbpfDataPlane, Unavailable> {
    load(opts).map_err(Unavailable)
}

fn load(opts: &EbpfOptions) -> anyhow::Result<EbpfDataPlane> {
    let pins = Pins::new(&opts.bpffs);
    pins.prepare()?;
    let carried = Carried::open(&pins, |name| match name {
        map_names::NAT_V6 => opts.nat_v6_capacity(),
        _ => opts.nat_capacity,
    });
    pins.discard_incompatible(opts.nat_capacity, opts.nat_v6_capacity());
    let mut loader = EbpfLoader::new();
    loader.map_max_entries(map_names::NAT_V4, opts.nat_capacity);
    loader.map_max_entries(map_names::NAT_V6, opts.nat_v6_capacity());
    let paths: Vec<(&str, PathBuf)> = map_names::PINNED
        .iter()
        .map(|name| (*name, pins.map(name)))
        .collect();
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf = loader.load(OBJECT).context("loading the eBPF object")?;
    for name in [program_names::EGRESS, program_names::INGRESS] {
        classifier(&mut ebpf, name)?
            .load()
            .with_context(|| format!("loading program {name}"))?;
    }
    write_settings(&mut ebpf, &opts.port_spans, opts.random_fully)?;
    carried.copy_into(&mut ebpf);
    Ok(EbpfDataPlane {
        ebpf,
        inherited: pins.linked_devices(),
        pins,
        enable_ipv6: opts.enable_ipv6,
        selection: opts.devices.clone(),
        devices: Vec::new(),
        draining: Vec::new(),
        notes: Notes::default(),
        attachments: Vec::new(),
        // Until programs run somewhere, the chain leaves nothing to them.
        chain: IptablesDataPlane::new(opts.masquerade.clone(), ChainVariant::Full, Mode::Ebpf),
        returned: Returned::default(),
        timeouts: Timeouts::default(),
        applied: None,
        last_sweep: None,
        carried,
        clashes_said: node_port_clashes(&opts.bpffs)?,
    })
}

fn classifier<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut SchedClassifier> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a classifier"))
}

fn map_mut<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut Map> {
    ebpf.map_mut(name)
        .with_context(|| format!("map {name} missing from the object"))
}

fn write_settings(ebpf: &mut Ebpf, spans: &[PortRange], random_fully: bool) -> anyhow::Result<()> {
    if spans.is_empty() {
        bail!("no ports left for NAT: the ephemeral range covers 1024-65535; set --to-ports");
    }
    if spans.len() > MAX_PORT_SPANS {
        bail!(
            "--to-ports lists {} ranges; the eBPF data plane takes at most {MAX_PORT_SPANS}",
            spans.len()
        );
    }
    let mut settings = Settings {
        span_count: spans.len() as u32,
        random_fully: u32::from(random_fully),
        ..Settings::default()
    };
    for (slot, span) in settings.spans.iter_mut().zip(spans) {
        *slot = PortSpan {
            first: u32::from(span.first),
            count: span.port_count(),
        };
    }
    settings.total_ports = settings.spans.iter().map(|s| s.count).sum();
    let mut array: Array<&mut MapData, Settings> =
        Array::try_from(map_mut(ebpf, map_names::SETTINGS)?)?;
    array.set(0, settings, 0)?;
    Ok(())
}

/// Makes the `interfaces` map hold exactly `devices`, so that no stale device keeps translating.
/// Their IPv6 addresses go in only with `ipv6`: without one, the programs leave IPv6 alone.
fn write_interfaces(ebpf: &mut Ebpf, devices: &[Device], ipv6: bool) -> anyhow::Result<()> {
    let mut map: BpfHashMap<&mut MapData, u32, Interface> =
        BpfHashMap::try_from(map_mut(ebpf, map_names::INTERFACES)?)?;
    for device in devices {
        let entry = Interface {
            ipv4: device.ipv4.octets(),
            ipv6: device
                .ipv6
                .filter(|_| ipv6)
                .map_or([0; 16], |addr| addr.octets()),
        };
        if map.get(&device.index, 0).ok() != Some(entry) {
            map.insert(device.index, entry, 0)?;
        }
    }
    let stale: Vec<u32> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|index| !devices.iter().any(|d| d.index == *index))
        .collect();
    for index in stale {
        map.remove(&index)?;
    }
    Ok(())
}

/// The programs' count of node flows given another port for a clash, as pinned under `bpffs`.
fn node_port_clashes(bpffs: &Path) -> anyhow::Result<u64> {
    Ok(read_kernel_counters(bpffs)?
        .and_then(|kernel| {
            kernel
                .packets
                .into_iter()
                .find(|(counter, _)| *counter == Counter::NodePortClash)
        })
        .map_or(0, |(_, n)| n))
}

/// How many flows the programs translate to each node address, in one family's table.
fn translated_by_address<A>(ebpf: &Ebpf, name: &str) -> anyhow::Result<BTreeMap<A, usize>>
where
    A: masq_ebpf::Address + Ord,
    masq_ebpf::NatKey<A>: aya::Pod,
    masq_ebpf::NatEntry<A>: aya::Pod,
{
    let map = ebpf
        .map(name)
        .with_context(|| format!("map {name} missing from the object"))?;
    let (_, entries) = expiry::read_table::<A>(map)?;
    Ok(expiry::translated_by_address(&entries))
}

/// An LPM trie key as plain data: prefix length in bits, then the address bytes.
type Prefix<const N: usize> = (u32, [u8; N]);

/// Makes a trie hold exactly `desired`, adding before removing so that a prefix that stays is
/// never missing, not even for a moment. A failed insert rolls back what this call added, so
/// the previous policy stays whole. Returns whether anything changed, and what was removed.
fn sync_trie<const N: usize>(
    ebpf: &mut Ebpf,
    name: &str,
    desired: &BTreeSet<Prefix<N>>,
) -> anyhow::Result<(bool, Vec<Prefix<N>>)> {
    let mut trie: LpmTrie<&mut MapData, [u8; N], u8> = LpmTrie::try_from(map_mut(ebpf, name)?)?;
    let current: BTreeSet<Prefix<N>> = trie
        .keys()
        .filter_map(Result::ok)
        .map(|k| (k.prefix_len(), k.data()))
        .collect();
    let mut added = Vec::new();
    for (len, data) in desired.difference(&current) {
        let key = Key::new(*len, *data);
        if let Err(err) = trie.insert(&key, NON_MASQ_PRESENT, 0) {
            for key in &added {
                let _ = trie.remove(key);
            }
            return Err(err).with_context(|| format!("adding a prefix to {name}"));
        }
        added.push(key);
    }
    let removed: Vec<Prefix<N>> = current.difference(desired).copied().collect();
    for (len, data) in &removed {
        trie.remove(&Key::new(*len, *data))
            .with_context(|| format!("removing a prefix from {name}"))?;
    }
    Ok((!added.is_empty() || !removed.is_empty(), removed))
}

/// A family's non-masquerade trie and the trie its removed prefixes drain in.
struct Tries {
    non_masq: &'static str,
    draining: &'static str,
}

const TRIES_V4: Tries = Tries {
    non_masq: map_names::NON_MASQ_V4,
    draining: map_names::DRAINING_V4,
};
const TRIES_V6: Tries = Tries {
    non_masq: map_names::NON_MASQ_V6,
    draining: map_names::DRAINING_V6,
};

/// Makes a family's non-masquerade trie hold `desired`, starts the removed prefixes draining,
/// and moves the policy generation on, so that the programs' cached verdicts go stale. Returns
/// whether the trie changed.
fn sync_non_masq<const N: usize>(
    ebpf: &mut Ebpf,
    tries: &Tries,
    desired: &BTreeSet<Prefix<N>>,
) -> anyhow::Result<bool> {
    let synced = sync_trie(ebpf, tries.non_masq, desired);
    // Even a sync that failed half-way may have changed the trie: no cached verdict survives it.
    if !matches!(synced, Ok((false, _))) {
        next_policy_generation(ebpf)?;
    }
    let (changed, removed) = synced?;
    sync_draining(
        ebpf,
        tries.draining,
        &removed,
        desired,
        expiry::monotonic_now_ns(),
    )?;
    Ok(changed)
}

fn next_policy_generation(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let mut generation: Array<&mut MapData, u32> =
        Array::try_from(map_mut(ebpf, map_names::POLICY_GENERATION)?)?;
    let current = generation.get(&0, 0)?;
    generation.set(0, masq_ebpf::verdict_slot::next(current), 0)?;
    Ok(())
}

/// Keeps prefixes that left the non-masquerade CIDRs in the draining trie for as long as a TCP
/// connection may stay idle, so that connections that started unmasqueraded keep their
/// addresses; a prefix that comes back stops draining.
fn sync_draining<const N: usize>(
    ebpf: &mut Ebpf,
    name: &str,
    removed: &[Prefix<N>],
    policy: &BTreeSet<Prefix<N>>,
    now_ns: u64,
) -> anyhow::Result<()> {
    let mut draining: LpmTrie<&mut MapData, [u8; N], u32> =
        LpmTrie::try_from(map_mut(ebpf, name)?)?;
    for (len, data) in removed {
        draining.insert(&Key::new(*len, *data), seconds(now_ns), 0)?;
    }
    let back: Vec<Key<[u8; N]>> = draining
        .keys()
        .filter_map(Result::ok)
        .filter(|k| policy.contains(&(k.prefix_len(), k.data())))
        .collect();
    for key in back {
        draining.remove(&key)?;
    }
    Ok(())
}

fn seconds(ns: u64) -> u32 {
    (ns / 1_000_000_000) as u32
}

/// Ends the draining of prefixes removed longer ago than `drain`.
fn expire_draining<const N: usize>(
    ebpf: &mut Ebpf,
    name: &str,
    drain: std::time::Duration,
    now_ns: u64,
) -> anyhow::Result<()> {
    let mut draining: LpmTrie<&mut MapData, [u8; N], u32> =
        LpmTrie::try_from(map_mut(ebpf, name)?)?;
    let done: Vec<Key<[u8; N]>> = draining
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, since)| u64::from(seconds(now_ns).saturating_sub(*since)) > drain.as_secs())
        .map(|(key, _)| key)
        .collect();
    for key in done {
        draining.remove(&key)?;
    }
    Ok(())
}

fn v4_keys(nets: &[Ipv4Net]) -> BTreeSet<Prefix<4>> {
    nets.iter()
        .map(|n| (u32::from(n.prefix_len()), n.network().octets()))
        .collect()
}

fn v6_keys(nets: &[Ipv6Net]) -> BTreeSet<Prefix<16>> {
    nets.iter()
        .map(|n| (u32::from(n.prefix_len()), n.network().octets()))
        .collect()
}

/// What following the devices changed.
struct Followed {
    /// A device started or stopped carrying the programs, or changed its address or index.
    devices_changed: bool,
    /// A program found detached was attached again.
    reattached: bool,
}

impl EbpfDataPlane {
    /// Makes the programs run on the devices the selection picks now, and the chain return to
    /// them exactly what those devices can translate. A device's traffic leaves the chain's
    /// early returns before its programs go, and joins them only once its programs run with
    /// its address, so that no new flow leaves untranslated.
    fn follow_devices(&mut self, policy: &Policy) -> anyhow::Result<Followed> {
        let carrying = self.carrying();
        let states = devices::states(&self.selection.followed()?)?;
        self.notes
            .report(&self.selection, &states, self.enable_ipv6);
        let fresh = devices::usable(&states);
        let kept = self
            .returned
            .common(&Returned::by(&fresh, self.enable_ipv6));
        self.return_to_programs(kept, policy)?;
        let leaving: Vec<String> = carrying
            .into_iter()
            .filter(|name| !fresh.iter().any(|d| d.name == *name))
            .collect();
        for device in &leaving {
            self.leave(device)?;
        }
        // A draining device selected again carries the programs again.
        self.draining
            .retain(|d| !fresh.iter().any(|f| f.name == d.name));
        self.drop_vanished_draining()?;
        self.inherited.clear();
        let changed = self.take_devices(fresh)?;
        let reattached = self.ensure_attached();
        // A device whose programs could not be attached stays with the chain.
        let running: Vec<Device> = self
            .devices
            .iter()
            .filter(|d| self.runs_both_programs(&d.name))
            .cloned()
            .collect();
        self.return_to_programs(Returned::by(&running, self.enable_ipv6), policy)?;
        let reattached = reattached.map_err(Unavailable)?;
        Ok(Followed {
            devices_changed: changed || !leaving.is_empty(),
            reattached,
        })
    }

    fn runs_both_programs(&self, device: &str) -> bool {
        Hook::BOTH.into_iter().all(|hook| {
            self.attachments
                .iter()
                .any(|(d, h, _)| d == device && *h == hook)
        })
    }

    /// The devices that carry the programs, or did under an earlier agent.
    fn carrying(&self) -> Vec<String> {
        let mut names: Vec<String> = self.devices.iter().map(|d| d.name.clone()).collect();
        devices::merge(&mut names, &self.inherited);
        names
    }

    /// Installs the chain that returns `returned` to the programs, if it is not in force.
    fn return_to_programs(&mut self, returned: Returned, policy: &Policy) -> anyhow::Result<()> {
        if returned == self.returned {
            return Ok(());
        }
        for family in [IpFamily::Ipv4, IpFamily::Ipv6] {
            self.chain.set_variant(family, returned.variant(family));
        }
        self.chain.apply(policy)?;
        self.returned = returned;
        Ok(())
    }

    /// A device that no longer carries the programs: one that still exists with the same
    /// addresses keeps them while its flows drain; any other (gone, or without its address)
    /// is released at once, as its flows can no longer be answered anyway.
    fn leave(&mut self, name: &str) -> anyhow::Result<()> {
        let before = self.devices.iter().find(|d| d.name == name);
        let kept = match (netdev::device_state(name)?, before) {
            (netdev::DeviceState::Usable(now), Some(before)) => (now == *before).then_some(now),
            // An earlier agent's: its flows are on the addresses it has now.
            (netdev::DeviceState::Usable(now), None) => Some(now),
            _ => None,
        };
        match kept {
            Some(device) => {
                info!(
                    device = name,
                    "device no longer selected: its programs stay while the flows they translate through it drain"
                );
                self.draining.push(device);
            }
            _ => self.release(name),
        }
        Ok(())
    }

    /// Holds the tuples of the node's own flows that conntrack knew of before the programs ran
    /// (netfilter's masqueraded ones, the node's sockets'), to masqueraded destinations: one
    /// that sends nothing for a while would meanwhile look free to the allocator. Where the
    /// kernel does not list conntrack's table, such a flow is held at its next packet, and a
    /// clash until then is said (`node_port_clashes`).
    fn hold_conntracks_node_flows(&mut self, policy: &Policy) {
        let Some(table) = conntrack::read_table() else {
            info!(
                "conntrack's table is not listed here: the node's own flows are held as they send"
            );
            return;
        };
        let held = netdev::local_addresses().and_then(|addresses| {
            let flows: Vec<conntrack::NodeFlow> =
                conntrack::node_flows(&table, |addr| addresses.contains(&addr))
                    .into_iter()
                    .filter(|flow| !policy.exempts(flow.remote))
                    .collect();
            conntrack::hold(&mut self.ebpf, &flows)
        });
        match held {
            Ok(0) => {}
            Ok(flows) => info!(flows, "the node's own flows conntrack knew of are held"),
            Err(err) => warn!("holding the node's own flows conntrack knew of: {err:#}"),
        }
    }

    /// Says when the programs gave flows of the node's own address other ports: their tuples
    /// were masqueraded flows' (see architecture.md, sharing the node's address).
    fn say_clashes(&mut self) -> anyhow::Result<()> {
        let clashes = node_port_clashes(&self.pins.dir)?;
        if clashes > self.clashes_said {
            info!(
                flows = clashes - self.clashes_said,
                "flows of the node's own address were given other ports: masqueraded flows held their tuples"
            );
        }
        self.clashes_said = clashes;
        Ok(())
    }

    /// Releases the draining devices that vanished or changed: their flows cannot be answered.
    fn drop_vanished_draining(&mut self) -> anyhow::Result<()> {
        for device in self.draining.clone() {
            if netdev::device_state(&device.name)? != netdev::DeviceState::Usable(device.clone()) {
                self.end_draining(&device.name)?;
            }
        }
        Ok(())
    }

    /// Releases the draining devices through which no translated flow is left.
    fn release_drained(&mut self) -> anyhow::Result<()> {
        if self.draining.is_empty() {
            return Ok(());
        }
        let v4 = translated_by_address::<[u8; 4]>(&self.ebpf, map_names::NAT_V4)?;
        let v6 = translated_by_address::<[u8; 16]>(&self.ebpf, map_names::NAT_V6)?;
        for device in self.draining.clone() {
            let left = v4.get(&device.ipv4.octets()).copied().unwrap_or(0)
                + device
                    .ipv6
                    .and_then(|a| v6.get(&a.octets()).copied())
                    .unwrap_or(0);
            if left == 0 {
                info!(
                    device = device.name,
                    "the device's last translated flow ended"
                );
                self.end_draining(&device.name)?;
            }
        }
        Ok(())
    }

    /// Takes a draining device's programs off, its entry out of `interfaces` and its flows out
    /// of the tables.
    fn end_draining(&mut self, name: &str) -> anyhow::Result<()> {
        let Some(at) = self.draining.iter().position(|d| d.name == name) else {
            return Ok(());
        };
        let device = self.draining.remove(at);
        self.release(name);
        self.write_interfaces()?;
        self.forget_flows(&device, None)
    }

    /// Makes the `interfaces` map hold the devices carrying the programs and those draining.
    fn write_interfaces(&mut self) -> anyhow::Result<()> {
        let all: Vec<Device> = self.devices.iter().chain(&self.draining).cloned().collect();
        write_interfaces(&mut self.ebpf, &all, self.enable_ipv6)
    }

    /// Takes the programs off `device`: its flows are no longer translated.
    fn release(&mut self, device: &str) {
        self.attachments.retain(|(name, _, _)| name != device);
        for hook in Hook::BOTH {
            let pin = self.pins.link(device, hook.name());
            attach::detach(device, hook, &pin, program_name(hook));
        }
        info!(device, "programs removed from the device");
    }

    /// Gives the programs `fresh`'s addresses. As MASQUERADE forgets its connections when their
    /// address goes, the flows on an address a device no longer has are forgotten: replies to it
    /// can no longer reach the node. Returns whether anything changed.
    fn take_devices(&mut self, fresh: Vec<Device>) -> anyhow::Result<bool> {
        if fresh == self.devices {
            return Ok(false);
        }
        let previous = std::mem::replace(&mut self.devices, fresh.clone());
        self.write_interfaces()?;
        for old in previous {
            let new = fresh.iter().find(|d| d.name == old.name);
            if let Some(new) = new.filter(|new| **new != old) {
                info!(device = new.name, old = ?(old.ipv4, old.ipv6), new = ?(new.ipv4, new.ipv6), index = new.index, "device changed");
            }
            // A draining device keeps its addresses, and its flows.
            let draining = self.draining.iter().find(|d| d.name == old.name).cloned();
            self.forget_flows(&old, new.or(draining.as_ref()))?;
        }
        Ok(true)
    }

    /// Forgets the flows on the addresses `old` had and `new` (the same device now, if it still
    /// carries the programs) does not.
    fn forget_flows(&mut self, old: &Device, new: Option<&Device>) -> anyhow::Result<()> {
        if new.is_none_or(|new| new.ipv4 != old.ipv4) {
            let nat = map_mut(&mut self.ebpf, map_names::NAT_V4)?;
            let purged = expiry::forget_address(nat, old.ipv4.octets())?;
            info!(device = old.name, address = %old.ipv4, flows = purged, "flows on the old address forgotten");
        }
        if let Some(gone) = old
            .ipv6
            .filter(|addr| new.is_none_or(|new| new.ipv6 != Some(*addr)))
        {
            let nat = map_mut(&mut self.ebpf, map_names::NAT_V6)?;
            let purged = expiry::forget_address(nat, gone.octets())?;
            info!(device = old.name, address = %gone, flows = purged, "flows on the old address forgotten");
        }
        Ok(())
    }

    /// Attaches wherever a program is missing: on a device that starts carrying them, and after
    /// someone detached one or its device was recreated. Returns whether anything had to be
    /// attached again.
    fn ensure_attached(&mut self) -> anyhow::Result<bool> {
        let mut repaired = false;
        // Draining devices too: their programs translate the flows that drain.
        let devices: Vec<Device> = self.devices.iter().chain(&self.draining).cloned().collect();
        for device in devices {
            let new = !self.attachments.iter().any(|(d, _, _)| *d == device.name);
            for hook in Hook::BOTH {
                let pin = self.pins.link(&device.name, hook.name());
                let prog = classifier(&mut self.ebpf, program_name(hook))?;
                let position = self
                    .attachments
                    .iter()
                    .position(|(d, h, _)| *d == device.name && *h == hook);
                if position.is_some() && attach::is_attached(prog, &device.name, hook)? {
                    continue;
                }
                if let Some(i) = position {
                    warn!(
                        device = device.name,
                        hook = hook.name(),
                        "program was detached; re-attaching"
                    );
                    self.attachments.remove(i);
                    let _ = std::fs::remove_file(&pin);
                    repaired = true;
                }
                let attachment = attach::attach(prog, &device.name, hook, &pin)?;
                self.attachments
                    .push((device.name.clone(), hook, attachment));
            }
            if new {
                let ipv6 = device.ipv6.filter(|_| self.enable_ipv6);
                info!(device = device.name, address = %device.ipv4, ?ipv6, "programs attached to the device");
            }
        }
        Ok(repaired)
    }

    fn sync_policy(&mut self, policy: &Policy) -> anyhow::Result<bool> {
        let v4 = v4_keys(&policy.non_masq_v4);
        let mut changed = sync_non_masq(&mut self.ebpf, &TRIES_V4, &v4)?;
        if let Some(v6) = &policy.non_masq_v6 {
            changed |= sync_non_masq(&mut self.ebpf, &TRIES_V6, &v6_keys(v6))?;
        }
        Ok(changed)
    }
}

/// The program that runs at `hook`.
fn program_name(hook: Hook) -> &'static str {
    match hook {
        Hook::Egress => program_names::EGRESS,
        Hook::Ingress => program_names::INGRESS,
    }
}

impl DataPlane for EbpfDataPlane {
    fn mode(&self) -> Mode {
        Mode::Ebpf
    }

    fn apply(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome> {
        let first = self.applied.is_none();
        let changed = self.sync_policy(policy)?;
        if first {
            self.hold_conntracks_node_flows(policy);
        }
        let followed = self.follow_devices(policy)?;
        // The old programs have handed over their links: what they created meanwhile too.
        std::mem::take(&mut self.carried).copy_into(&mut self.ebpf);
        // The reduced chain goes in only once the programs run, so that no new flow is left
        // untranslated in between.
        let chain = self.chain.apply(policy)?;
        self.applied = Some(policy.clone());
        Ok(if first || changed || followed.devices_changed {
            ApplyOutcome::Applied
        } else if followed.reattached || chain != ApplyOutcome::Unchanged {
            ApplyOutcome::Repaired
        } else {
            ApplyOutcome::Unchanged
        })
    }

    fn maintain(&mut self) -> anyhow::Result<Option<NatUsage>> {
        // Nothing is attached before the first apply has filled the non-masquerade tries.
        if let Some(policy) = self.applied.take() {
            let followed = self.follow_devices(&policy);
            self.applied = Some(policy);
            followed?;
        }
        if self
            .last_sweep
            .is_some_and(|last| last.elapsed() < SWEEP_INTERVAL)
        {
            return Ok(None);
        }
        self.last_sweep = Some(std::time::Instant::now());
        let now = expiry::monotonic_now_ns();
        let drain = self.timeouts.tcp_established;
        expire_draining::<4>(&mut self.ebpf, map_names::DRAINING_V4, drain, now)?;
        expire_draining::<16>(&mut self.ebpf, map_names::DRAINING_V6, drain, now)?;
        let v4 = expiry::expire::<[u8; 4]>(
            map_mut(&mut self.ebpf, map_names::NAT_V4)?,
            &self.timeouts,
            now,
        )?;
        let v6 = expiry::expire::<[u8; 16]>(
            map_mut(&mut self.ebpf, map_names::NAT_V6)?,
            &self.timeouts,
            now,
        )?;
        let run = v4 + v6;
        if run.expired_flows + run.orphans_removed > 0 {
            tracing::debug!(?run, "expired NAT entries");
        }
        self.release_drained()?;
        self.say_clashes()?;
        Ok(Some(run))
    }

    fn status(&self) -> anyhow::Result<Status> {
        let mut status = super::read_back(self.chain.chain(), Some(&self.pins.dir))?;
        status.mode = Some(Mode::Ebpf);
        Ok(status)
    }

    fn cleanup(&mut self) -> anyhow::Result<()> {
        self.attachments.clear();
        cleanup(&self.pins.dir)?;
        self.chain.cleanup()
    }
}

/// One attachment, as read back from its pinned link.
#[derive(Debug, Clone, Serialize)]
pub struct AttachmentStatus {
    pub device: String,
    pub hook: String,
    pub link_id: u32,
    pub program_id: u32,
    /// Whether the program runs at the device's hook: not once the device is gone.
    pub running: bool,
}

/// The eBPF data plane as read back from bpffs.
#[derive(Debug, Clone, Serialize)]
pub struct EbpfStatus {
    pub bpffs: PathBuf,
    pub attachments: Vec<AttachmentStatus>,
    pub interfaces: BTreeMap<u32, Ipv4Addr>,
    /// The interfaces that masquerade IPv6, and their addresses.
    pub interfaces_v6: BTreeMap<u32, Ipv6Addr>,
    pub non_masquerade_v4: Vec<String>,
    pub non_masquerade_v6: Vec<String>,
    /// Flows in the NAT table (each takes two entries), and the table's size in entries.
    pub nat_flows: usize,
    pub nat_inbound_flows: usize,
    /// Flows of the node's own address the table holds the tuple of.
    pub nat_node_flows: usize,
    /// Flows the programs translate: those that need them to go on.
    pub nat_translated_flows: usize,
    /// The same, by the node address they are translated to.
    pub translated_by_address: BTreeMap<IpAddr, usize>,
    pub nat_entries: usize,
    pub nat_capacity: u32,
    pub counters: BTreeMap<&'static str, u64>,
}

impl EbpfStatus {
    /// Whether the programs translate `family` leaving by `device`: they run at both its
    /// hooks, with its address in the `interfaces` map.
    pub fn translates(&self, device: &str, index: u32, family: IpFamily) -> bool {
        let runs = |hook: Hook| {
            self.attachments
                .iter()
                .any(|a| a.device == device && a.hook == hook.name() && a.running)
        };
        // Clsact filters (kernels without TCX) leave no pins to read back: the map tells.
        let attached = !attach::uses_tcx() || Hook::BOTH.into_iter().all(runs);
        let addressed = match family {
            IpFamily::Ipv4 => self.interfaces.contains_key(&index),
            IpFamily::Ipv6 => self.interfaces_v6.contains_key(&index),
        };
        attached && addressed
    }

    /// The flows the programs on `device` (ifindex `index`) translate, if they run there: while
    /// the chain no longer returns the device's traffic to them, these drain.
    pub fn flows_through(&self, device: &str, index: u32) -> Option<usize> {
        let runs = self
            .attachments
            .iter()
            .any(|a| a.device == device && a.running);
        let addresses = [
            self.interfaces.get(&index).map(|a| IpAddr::from(*a)),
            self.interfaces_v6.get(&index).map(|a| IpAddr::from(*a)),
        ];
        runs.then(|| {
            addresses
                .into_iter()
                .flatten()
                .filter_map(|a| self.translated_by_address.get(&a))
                .sum()
        })
    }
}

fn pinned(pins: &Pins, name: &str) -> anyhow::Result<Map> {
    let data =
        MapData::from_pin(pins.map(name)).with_context(|| format!("opening pinned map {name}"))?;
    Map::from_map_data(data).with_context(|| format!("pinned map {name}"))
}

/// Reads the data plane's state from `bpffs`; `None` if nothing is pinned there.
pub fn read_status(bpffs: &Path) -> anyhow::Result<Option<EbpfStatus>> {
    let pins = Pins::new(bpffs);
    if !pins.map(map_names::NAT_V4).exists() {
        return Ok(None);
    }
    let v4: LpmTrie<MapData, [u8; 4], u8> = pinned(&pins, map_names::NON_MASQ_V4)?.try_into()?;
    let v6: LpmTrie<MapData, [u8; 16], u8> = pinned(&pins, map_names::NON_MASQ_V6)?.try_into()?;
    let table_v4 = expiry::read_table::<[u8; 4]>(&pinned(&pins, map_names::NAT_V4)?)?.1;
    // An agent from before IPv6 pinned no `nat_v6`.
    let table_v6 = match pins.map(map_names::NAT_V6).exists() {
        true => expiry::read_table::<[u8; 16]>(&pinned(&pins, map_names::NAT_V6)?)?.1,
        false => Vec::new(),
    };
    let nat = expiry::usage(&table_v4) + expiry::usage(&table_v6);
    let translated_by_address = expiry::translated_by_address(&table_v4)
        .into_iter()
        .map(|(addr, flows)| (IpAddr::from(addr), flows))
        .chain(
            expiry::translated_by_address(&table_v6)
                .into_iter()
                .map(|(addr, flows)| (IpAddr::from(addr), flows)),
        )
        .collect();
    let interfaces: BpfHashMap<MapData, u32, Interface> =
        pinned(&pins, map_names::INTERFACES)?.try_into()?;
    let kernel = read_kernel_counters(bpffs)?.context("the counters map is not pinned")?;

    let mut non_masquerade_v4: Vec<Prefix<4>> = v4
        .keys()
        .filter_map(Result::ok)
        .map(|k| (k.prefix_len(), k.data()))
        .collect();
    non_masquerade_v4.sort();
    let mut non_masquerade_v6: Vec<Prefix<16>> = v6
        .keys()
        .filter_map(Result::ok)
        .map(|k| (k.prefix_len(), k.data()))
        .collect();
    non_masquerade_v6.sort();
    let counters = kernel
        .packets
        .iter()
        .map(|(counter, total)| (counter.name(), *total))
        .collect();
    Ok(Some(EbpfStatus {
        bpffs: bpffs.to_path_buf(),
        attachments: read_attachments(&pins),
        interfaces: interfaces
            .iter()
            .filter_map(Result::ok)
            .map(|(index, iface)| (index, Ipv4Addr::from(iface.ipv4)))
            .collect(),
        interfaces_v6: interfaces
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, iface)| iface.ipv6 != [0; 16])
            .map(|(index, iface)| (index, Ipv6Addr::from(iface.ipv6)))
            .collect(),
        non_masquerade_v4: non_masquerade_v4
            .iter()
            .map(|(len, data)| format!("{}/{len}", Ipv4Addr::from(*data)))
            .collect(),
        non_masquerade_v6: non_masquerade_v6
            .iter()
            .map(|(len, data)| format!("{}/{len}", Ipv6Addr::from(*data)))
            .collect(),
        nat_flows: nat.masqueraded_flows,
        nat_inbound_flows: nat.inbound_flows,
        nat_node_flows: nat.node_flows,
        nat_translated_flows: nat.translated_flows,
        translated_by_address,
        nat_entries: nat.entries,
        nat_capacity: kernel.nat_capacity,
        counters,
    }))
}

/// The programs' packet counters (summed over CPUs) and the NAT tables' capacity.
pub struct KernelCounters {
    pub packets: Vec<(Counter, u64)>,
    pub nat_capacity: u32,
}

/// Reads the counters from the maps pinned in `bpffs`; `None` if nothing is pinned there.
/// Cheap enough for every metrics scrape: it reads no table, only the counters.
pub fn read_kernel_counters(bpffs: &Path) -> anyhow::Result<Option<KernelCounters>> {
    let pins = Pins::new(bpffs);
    if !pins.map(map_names::COUNTERS).exists() {
        return Ok(None);
    }
    let capacity = |name: &str| -> anyhow::Result<u32> {
        if !pins.map(name).exists() {
            return Ok(0);
        }
        Ok(match pinned(&pins, name)? {
            Map::HashMap(data) => data.info()?.max_entries(),
            _ => 0,
        })
    };
    // `nat_v6` takes a single entry while IPv6 is off: no capacity to speak of.
    let v6 = capacity(map_names::NAT_V6)?;
    let nat_capacity = capacity(map_names::NAT_V4)? + if v6 > 1 { v6 } else { 0 };
    let counters: PerCpuArray<MapData, u64> = pinned(&pins, map_names::COUNTERS)?.try_into()?;
    let packets = Counter::ALL
        .iter()
        .filter(|c| (**c as u32) < COUNTER_SLOTS)
        .map(|c| {
            let total = counters
                .get(&(*c as u32), 0)
                .map(|per_cpu| per_cpu.iter().sum())
                .unwrap_or(0);
            (*c, total)
        })
        .collect();
    Ok(Some(KernelCounters {
        packets,
        nat_capacity,
    }))
}

impl std::fmt::Display for EbpfStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "eBPF objects pinned under {}", self.bpffs.display())?;
        for a in &self.attachments {
            writeln!(
                f,
                "  attached: {} {} (link {}, program {})",
                a.device, a.hook, a.link_id, a.program_id
            )?;
        }
        let v4 = self.interfaces.iter().map(|(i, a)| (i, IpAddr::from(*a)));
        let v6 = self
            .interfaces_v6
            .iter()
            .map(|(i, a)| (i, IpAddr::from(*a)));
        for (index, addr) in v4.chain(v6) {
            writeln!(f, "  masquerades to {addr} on ifindex {index}")?;
        }
        for prefix in self.non_masquerade_v4.iter().chain(&self.non_masquerade_v6) {
            writeln!(f, "  not masqueraded: {prefix}")?;
        }
        writeln!(
            f,
            "  NAT table: {} masqueraded flows, {} inbound flows, {} node flows, {} of {} entries",
            self.nat_flows,
            self.nat_inbound_flows,
            self.nat_node_flows,
            self.nat_entries,
            self.nat_capacity
        )?;
        for (name, value) in &self.counters {
            writeln!(f, "  {name}: {value}")?;
        }
        Ok(())
    }
}

fn read_attachments(pins: &Pins) -> Vec<AttachmentStatus> {
    let mut out: Vec<AttachmentStatus> = pins
        .links()
        .into_iter()
        .filter_map(|(device, hook, path)| {
            let link: FdLink = PinnedLink::from_pin(path).ok()?.into();
            let info = link.info().ok()?;
            Some(AttachmentStatus {
                running: attach::runs(info.program_id(), &device, hook).unwrap_or(false),
                device,
                hook: hook.name().to_string(),
                link_id: info.id(),
                program_id: info.program_id(),
            })
        })
        .collect();
    out.sort_by(|a, b| (&a.device, &a.hook).cmp(&(&b.device, &b.hook)));
    out
}

/// Detaches the programs and removes every pin under `bpffs`.
pub fn cleanup(bpffs: &Path) -> anyhow::Result<()> {
    let pins = Pins::new(bpffs);
    // The namespace's own devices: /sys/class/net shows those of whoever mounted /sys.
    let devices: Vec<String> = netdev::names_and_indexes()?
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    attach::detach_all(&pins.links_dir(), &devices, &Hook::BOTH.map(program_name))?;
    for name in map_names::PINNED {
        match std::fs::remove_file(pins.map(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing pin {name}"));
            }
            _ => {}
        }
    }
    for dir in [pins.links_dir(), pins.dir.clone()] {
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", dir.display()));
            }
            _ => {}
        }
    }
    Ok(())
}
