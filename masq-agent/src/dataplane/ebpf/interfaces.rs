//! What the programs know of the devices they translate on: each device's addresses, by
//! ifindex. `interfaces` (a hash table) holds all of them; `interfaces_by_ifindex` (an array)
//! holds those of the small ifindexes again, where a program finds one
//! in a few instructions instead of a call that hashes and compares
//! (`masq_ebpf::map_names::INTERFACES_BY_IFINDEX`).
//!
//! An array element is rewritten in place, so a program could read it half written. The
//! programs read an element only while its `in_use` is set, and the hash table otherwise; the
//! agent takes an element out of use, waits for every program run that may have seen it in use
//! (`wait_for_program_runs`), rewrites it, waits again, and only then puts it back in use. So
//! an element in use holds what the hash table holds, and no run ever reads one while it
//! changes. Both are pinned: the programs a restarted agent replaces read what it writes.

use std::{collections::BTreeMap, os::fd::AsRawFd as _, time::Duration};

use aya_obj::generated::bpf_map_type;
use masq_ebpf::{INTERFACES_BY_IFINDEX_ENTRIES, IndexedInterface, Interface};

use super::{
    map_types::Interfaces,
    syscall::{ElemAttr, MapCreateAttr, bpf, bpf_fd, cmd},
};
use crate::{
    dataplane::chosen_address::ChosenAddresses,
    netdev::Device,
    policy::{IpFamilies, IpFamily},
};

/// Makes the maps hold exactly `devices`, so that no stale device keeps translating. Their IPv6
/// addresses go in only for IPv6 among `families`: without one, the programs leave IPv6 alone.
/// `chosen`: the addresses pods' masqueraded flows take instead of the devices'.
pub fn write_interfaces(
    maps: &mut Interfaces,
    devices: &[Device],
    families: IpFamilies,
    chosen: ChosenAddresses,
) -> anyhow::Result<()> {
    let wanted: BTreeMap<u32, Interface> = devices
        .iter()
        .map(|device| (device.index, entry_of(device, families, chosen)))
        .collect();
    let stale: Vec<u32> = maps
        .table
        .keys()
        .filter_map(Result::ok)
        .filter(|index| !wanted.contains_key(index))
        .collect();
    // The elements of the devices and of the stale ones, read once.
    let mut elements = Vec::new();
    for index in wanted.keys().chain(&stale) {
        if let Some(element) = element(maps, *index)? {
            elements.push((*index, element));
        }
    }
    // Out of use first: the programs read the hash table for these while it changes.
    for (index, element) in &elements {
        if element.in_use != 0 && wanted.get(index) != Some(&element.iface) {
            set_element(maps, *index, false, element.iface)?;
        }
    }
    for (index, entry) in &wanted {
        if maps.table.get(index, 0).ok().as_ref() != Some(entry) {
            maps.table.insert(index, entry, 0)?;
        }
    }
    for index in stale {
        maps.table.remove(&index)?;
    }
    // The devices' elements not in use as they are to be, as read before the first step.
    let to_use: Vec<(u32, Interface)> = elements
        .iter()
        .filter_map(|(index, element)| {
            let entry = wanted.get(index)?;
            (element.in_use == 0 || element.iface != *entry).then_some((*index, *entry))
        })
        .collect();
    if to_use.is_empty() {
        return Ok(());
    }
    // Whenever an element was taken out of use (here, or by an earlier call that stopped
    // short, or one that removed its device), a run that saw it in use may still read it.
    wait_for_program_runs();
    for (index, entry) in &to_use {
        set_element(maps, *index, false, *entry)?;
    }
    wait_for_program_runs();
    for (index, entry) in to_use {
        set_element(maps, index, true, entry)?;
    }
    Ok(())
}

/// What the programs give `device`'s flows.
fn entry_of(device: &Device, families: IpFamilies, chosen: ChosenAddresses) -> Interface {
    let ipv6 = families.contains(IpFamily::Ipv6);
    Interface {
        ipv4: device.ipv4.octets(),
        ipv6: device
            .ipv6
            .filter(|_| ipv6)
            .map_or([0; 16], |addr| addr.octets()),
        masquerade_ipv4: chosen.v4.map_or([0; 4], |addr| addr.octets()),
        masquerade_ipv6: chosen
            .v6
            .filter(|_| ipv6 && device.ipv6.is_some())
            .map_or([0; 16], |addr| addr.octets()),
    }
}

/// The array's element for `index`; none where the ifindex is past the array.
fn element(maps: &Interfaces, index: u32) -> anyhow::Result<Option<IndexedInterface>> {
    if index >= INTERFACES_BY_IFINDEX_ENTRIES {
        return Ok(None);
    }
    Ok(Some(maps.by_ifindex.get(&index, 0)?))
}

fn set_element(
    maps: &mut Interfaces,
    index: u32,
    in_use: bool,
    iface: Interface,
) -> anyhow::Result<()> {
    let element = IndexedInterface {
        in_use: u32::from(in_use),
        iface,
    };
    maps.by_ifindex.set(index, element, 0)?;
    Ok(())
}

/// Whether this machine's CPUs see each other's stores in the order they were made, and make
/// their own loads in order: x86's do (total store order); arm64's, for one, do not. Where they
/// do, a run that reads a word the agent wrote last reads all it wrote before, without a wait.
pub const MEMORY_IN_ORDER: bool = cfg!(any(target_arch = "x86_64", target_arch = "x86"));

/// How long to wait for the program runs in flight where the kernel cannot be made to say when
/// they are over: a run takes microseconds, so this is the wait's margin, not its measure.
const PROGRAM_RUNS_OVER_WITHIN: Duration = Duration::from_millis(100);

/// Returns once every program run that started before the call is over. tc programs run inside
/// RCU read-side sections, and an update of a map of maps returns only after an RCU grace period
/// (`synchronize_rcu` in the kernel's `maybe_wait_bpf_programs`, so that userspace knows no
/// program still reads the inner map it replaced; Linux 4.12 on), whatever the CPUs and the
/// preemption model. `membarrier(2)` would not do: it skips the grace period on one CPU, where a
/// preemptible run (PREEMPT_RT's softirq, BPF_PROG_TEST_RUN) may be in flight. Where the map
/// cannot be made or updated, a sleep far longer than any run.
pub fn wait_for_program_runs() -> WaitedBy {
    match update_a_map_of_maps() {
        Ok(()) => WaitedBy::GracePeriod,
        Err(err) => {
            tracing::debug!("waiting for the program runs in flight by the clock: {err}");
            std::thread::sleep(PROGRAM_RUNS_OVER_WITHIN);
            WaitedBy::Clock
        }
    }
}

/// How `wait_for_program_runs` waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitedBy {
    /// An RCU grace period, which the kernel waited for.
    GracePeriod,
    /// `PROGRAM_RUNS_OVER_WITHIN`.
    Clock,
}

/// Makes a map of maps of one slot, and puts a map in it: an update the kernel answers only
/// after an RCU grace period. Both maps go when their descriptors close.
fn update_a_map_of_maps() -> std::io::Result<()> {
    let one_word = |map_type: bpf_map_type, inner_map_fd| MapCreateAttr {
        map_type: map_type as u32,
        key_size: 4,
        value_size: 4,
        max_entries: 1,
        map_flags: 0,
        inner_map_fd,
    };
    // SAFETY (all three calls): each attribute is the member its command reads, and the key
    // and value point at four bytes each that outlive the call.
    let inner = unsafe {
        bpf_fd(
            cmd::BPF_MAP_CREATE,
            &mut one_word(bpf_map_type::BPF_MAP_TYPE_ARRAY, 0),
        )
    }?;
    let inner_fd = inner.as_raw_fd() as u32;
    let outer = unsafe {
        bpf_fd(
            cmd::BPF_MAP_CREATE,
            &mut one_word(bpf_map_type::BPF_MAP_TYPE_ARRAY_OF_MAPS, inner_fd),
        )
    }?;
    let slot = 0u32;
    let mut update = ElemAttr {
        map_fd: outer.as_raw_fd() as u32,
        key: &raw const slot as u64,
        value: &raw const inner_fd as u64,
        ..ElemAttr::default()
    };
    unsafe { bpf(cmd::BPF_MAP_UPDATE_ELEM, &mut update) }
}
