//! A chosen masquerade address (`masqueradeAddress`, `masqueradeAddressIPv6`): masqueraded
//! traffic takes it while the node holds it, on the uplink or on any other device, and the
//! outgoing device's address while it does not; flows keep the address they started with.

use std::{net::IpAddr, process::Command};

use masq_agent::policy::IpFamily;
use masq_testbed::topology;

use crate::{Bed, Conversation, FamilyOnTheBed, Plane};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            new_flows_take_the_chosen_address_while_the_uplink_holds_it,
            new_flows_take_the_chosen_address_held_on_another_device,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

/// An address of the uplink's prefix that no one holds at first.
fn chosen(family: IpFamily) -> IpAddr {
    family
        .pick("203.0.113.50", "2001:db8:1::50")
        .parse()
        .unwrap()
}

/// A device of the node's that holds nothing but what a case gives it.
const OTHER_DEVICE: &str = "masq-addr";

/// Runs `ip ARGS` in namespace `ns`.
fn ip_in(ns: &str, args: &[&str]) {
    let out = Command::new("ip")
        .args(["-n", ns])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Gives `device` the chosen address (`op`: `add` or `del`).
fn chosen_on(bed: &Bed, family: IpFamily, op: &str, device: &str) {
    let addr = chosen(family);
    let prefix = format!("{addr}/{}", family.pick(32, 128));
    let mut args = vec!["addr", op, prefix.as_str(), "dev", device];
    if family == IpFamily::Ipv6 && op == "add" {
        args.push("nodad");
    }
    ip_in(&bed.topo.node, &args);
}

/// Before the node holds the chosen address, new flows take the device's; once `device` holds
/// it, they take it, and once it goes, the device's again; a connection open throughout keeps
/// the address it started with.
/// `prepare` readies the node before the agent starts.
fn the_chosen_address_follows_the_node(
    plane: Plane,
    family: IpFamily,
    device: &str,
    prepare: impl Fn(&Bed),
) {
    let key = family.pick("masqueradeAddress", "masqueradeAddressIPv6");
    let config = format!("{}{key}: {}\n", family.config(), chosen(family));
    let bed = Bed::new(plane, &config);
    prepare(&bed);
    let agent = bed.start_agent(family.agent_args());
    let dst = family.outside();
    let wait = |expect: IpAddr, why: &str| {
        bed.server
            .wait_for_udp_from(bed.pod(), dst, expect)
            .unwrap_or_else(|e| panic!("{why}: {e:#}\n{}", agent.log_text()));
    };
    wait(family.node(), "not held yet: the device's address");
    let open_before = Conversation::open(&bed, family, 9781);
    assert_eq!(open_before.node_side.ip(), family.node());
    chosen_on(&bed, family, "add", device);
    wait(chosen(family), "held: the chosen address");
    // Status says what is in force, once the agent has followed the change.
    masq_testbed::wait_for(|| {
        let status = bed.status_json();
        let said = match plane {
            Plane::Ebpf => status["ebpf"]["chosen_addresses"].to_string(),
            _ => status["chains"].to_string(),
        };
        Ok(said.contains(&chosen(family).to_string()))
    })
    .unwrap_or_else(|e| panic!("status never named the chosen address: {e}"));
    let open_while_held = Conversation::open(&bed, family, 9782);
    assert_eq!(open_while_held.node_side.ip(), chosen(family));
    open_while_held
        .exchange("replies reach the chosen address")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    open_before
        .exchange("a connection keeps the address it started with")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    chosen_on(&bed, family, "del", device);
    wait(family.node(), "gone: the device's address again");
    open_before
        .exchange("and keeps it when the chosen one goes")
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    assert!(
        agent
            .log_text()
            .contains("the node does not hold the chosen masquerade address"),
        "the fallback is said"
    );
}

fn new_flows_take_the_chosen_address_while_the_uplink_holds_it(plane: Plane, family: IpFamily) {
    the_chosen_address_follows_the_node(plane, family, topology::UPLINK_IF, |_| {});
}

/// The address on a device of its own, as a VIP on a device of its own: replies still come in by
/// the uplink, where the programs translate them back.
fn new_flows_take_the_chosen_address_held_on_another_device(plane: Plane, family: IpFamily) {
    let other_device = |bed: &Bed| {
        // The outside host's router sends the address to the node, as a VIP's would: the
        // node answers neighbour discovery only for its uplink's own addresses.
        let via = family.node().to_string();
        let to = format!("{}/{}", chosen(family), family.pick(32, 128));
        ip_in(&bed.topo.ext, &["route", "add", &to, "via", &via]);
        // A veth whose peer carries nothing: this kernel may have no dummy devices.
        let peer = format!("{OTHER_DEVICE}-p");
        ip_in(
            &bed.topo.node,
            &[
                "link",
                "add",
                OTHER_DEVICE,
                "type",
                "veth",
                "peer",
                "name",
                &peer,
            ],
        );
        ip_in(&bed.topo.node, &["link", "set", OTHER_DEVICE, "up"]);
    };
    the_chosen_address_follows_the_node(plane, family, OTHER_DEVICE, other_device);
}
