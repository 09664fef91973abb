//! What the programs know of the devices they translate on: each device's addresses, by
//! ifindex. `interfaces` (a hash table, pinned) holds all of them; `interfaces_by_ifindex` (an
//! array, the programs' own) holds those of the small ifindexes again, where a program finds one
//! in a few instructions instead of a call that hashes and compares
//! (`masq_ebpf::map_names::INTERFACES_BY_IFINDEX`).
//!
//! An array element is rewritten in place, so a program could read it half written. The
//! programs read an element only while its `in_use` is set, and the hash table otherwise; the
//! agent takes an element out of use, waits for every program run that may have seen it in use
//! (`wait_for_program_runs`), rewrites it, waits again, and only then puts it back in use. So
//! an element in use holds what the hash table holds, and no run ever reads one while it
//! changes.

use std::{collections::BTreeMap, time::Duration};

use masq_ebpf::{INTERFACES_BY_IFINDEX_ENTRIES, IndexedInterface, Interface};

use super::map_types::Interfaces;
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
    // Out of use first: the programs read the hash table for these while it changes.
    let mut taken_out = false;
    for index in wanted.keys().chain(&stale) {
        if let Some(element) = element(maps, *index)?
            && element.in_use != 0
            && wanted.get(index) != Some(&element.iface)
        {
            set_element(maps, *index, false, element.iface)?;
            taken_out = true;
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
    let mut to_use = Vec::new();
    for (index, entry) in &wanted {
        if let Some(element) = element(maps, *index)?
            && (element.in_use == 0 || element.iface != *entry)
        {
            to_use.push((*index, *entry));
        }
    }
    if to_use.is_empty() {
        return Ok(());
    }
    if taken_out {
        wait_for_program_runs();
    }
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

/// How long to wait for the program runs in flight where the kernel cannot say when they are
/// over: a run takes microseconds, so this is the wait's margin, not its measure.
const PROGRAM_RUNS_OVER_WITHIN: Duration = Duration::from_millis(100);

/// Returns once every program run that started before the call is over. tc programs run inside
/// RCU read-side sections, and `membarrier(2)`'s `MEMBARRIER_CMD_GLOBAL` waits for an RCU grace
/// period (`synchronize_rcu`), which also leaves every CPU's earlier stores seen by all. Where the
/// kernel refuses it (`nohz_full` CPUs), a sleep far longer than any run.
fn wait_for_program_runs() {
    // SAFETY: membarrier takes no pointer; its result is only tested.
    let done = unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            libc::MEMBARRIER_CMD_GLOBAL,
            0u32,
            0i32,
        )
    };
    if done != 0 {
        std::thread::sleep(PROGRAM_RUNS_OVER_WITHIN);
    }
}
