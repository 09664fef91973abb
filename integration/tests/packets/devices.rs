//! Where the programs find the device a packet crosses: in `interfaces_by_ifindex` while its
//! element is in use, in the `interfaces` hash table otherwise; and the agent keeping the two
//! in step.

use std::net::Ipv4Addr;

use masq_agent::{
    dataplane::{
        chosen_address::ChosenAddresses,
        ebpf::{
            interfaces::{WaitedBy, wait_for_program_runs, write_interfaces},
            testbed::{TEST_RUN_IFINDEX, TestBed},
        },
    },
    netdev::Device,
    policy::IpFamilies,
};
use masq_ebpf::{INTERFACES_BY_IFINDEX_ENTRIES, IndexedInterface, Interface};
use masq_testbed::packet::*;

use crate::family::*;

in_both_families!(the_array_answers_while_its_element_is_in_use_and_the_hash_table_after);

/// `iface` with `addr` as its address in `addr`'s family.
fn with_address<F: HarnessFamily>(mut iface: Interface, addr: F) -> Interface {
    let octets = addr.octets();
    match octets.as_ref() {
        [a, b, c, d] => iface.ipv4 = [*a, *b, *c, *d],
        bytes => iface.ipv6.copy_from_slice(bytes),
    }
    iface
}

fn the_array_answers_while_its_element_is_in_use_and_the_hash_table_after<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let entry = h.maps.interfaces.table.get(&TEST_RUN_IFINDEX, 0).unwrap();
    assert_eq!(
        h.maps
            .interfaces
            .by_ifindex
            .get(&TEST_RUN_IFINDEX, 0)
            .unwrap(),
        IndexedInterface {
            in_use: 1,
            iface: entry
        },
        "the agent puts the device in the array as in the hash table"
    );

    // An element whose address differs from the hash table's, as the agent never writes one:
    // while it is in use, a pod's new flow takes the array's address, and a packet from that
    // address is the node's own, which keeps its address and port; once it is not, the hash
    // table's address does both.
    let elsewhere = with_address(entry, F::REMOTE2);
    for (in_use, node, port) in [(1, F::REMOTE2, 40000), (0, F::NODE, 40010)] {
        let element = IndexedInterface {
            in_use,
            iface: elsewhere,
        };
        h.maps
            .interfaces
            .by_ifindex
            .set(TEST_RUN_IFINDEX, element, 0)
            .unwrap();
        let out = h.egress(&tcp(F::POD, port, F::REMOTE, 80, SYN)).1;
        assert_eq!(F::at(&out, F::SRC), node, "in use: {in_use}");
        let own = tcp(node, port + 1, F::REMOTE, 80, SYN);
        assert_eq!(h.egress(&own).1, own, "in use: {in_use}");
    }
}

#[test]
fn the_agent_keeps_the_array_as_the_hash_table() {
    let mut h = harness::<Ipv4Addr>();
    let small = 7;
    let large = INTERFACES_BY_IFINDEX_ENTRIES + 7;
    let device = |index: u32, last: u8| Device {
        name: format!("uplink{index}"),
        index,
        ipv4: Ipv4Addr::new(203, 0, 113, last),
        ipv6: None,
    };
    let write = |h: &mut TestBed, devices: &[Device]| {
        write_interfaces(
            &mut h.maps.interfaces,
            devices,
            IpFamilies::IPV4,
            ChosenAddresses::default(),
        )
        .unwrap();
    };
    // Each element in use, by ifindex, and what it holds.
    let in_use = |h: &TestBed| -> Vec<(u32, [u8; 4])> {
        (0..INTERFACES_BY_IFINDEX_ENTRIES)
            .filter_map(|index| {
                let element = h.maps.interfaces.by_ifindex.get(&index, 0).unwrap();
                (element.in_use != 0).then_some((index, element.iface.ipv4))
            })
            .collect()
    };
    let table = |h: &TestBed| -> Vec<(u32, [u8; 4])> {
        let mut all: Vec<(u32, [u8; 4])> = h
            .maps
            .interfaces
            .table
            .iter()
            .map(|kv| kv.map(|(index, iface)| (index, iface.ipv4)).unwrap())
            .collect();
        all.sort();
        all
    };

    write(&mut h, &[device(small, 1), device(large, 2)]);
    assert_eq!(
        table(&h),
        [(small, [203, 0, 113, 1]), (large, [203, 0, 113, 2])]
    );
    assert_eq!(
        in_use(&h),
        [(small, [203, 0, 113, 1])],
        "a large ifindex: the hash table alone"
    );

    write(&mut h, &[device(small, 3), device(large, 2)]);
    assert_eq!(
        table(&h),
        [(small, [203, 0, 113, 3]), (large, [203, 0, 113, 2])]
    );
    assert_eq!(in_use(&h), [(small, [203, 0, 113, 3])]);

    write(&mut h, &[device(large, 2)]);
    assert_eq!(table(&h), [(large, [203, 0, 113, 2])]);
    assert_eq!(in_use(&h), [], "a device gone is out of use in the array");
    let gone = h.maps.interfaces.by_ifindex.get(&small, 0).unwrap();
    assert_eq!(gone.in_use, 0);

    write(&mut h, &[]);
    assert_eq!(table(&h), []);
}

/// The agent's wait for the program runs in flight, before it rewrites an element, is the
/// kernel's RCU grace period, not the clock.
#[test]
fn the_wait_for_the_program_runs_is_a_grace_period() {
    assert_eq!(wait_for_program_runs(), WaitedBy::GracePeriod);
}
