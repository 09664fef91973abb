//! Who is masqueraded: sources left alone (`nonMasqueradeSrcCIDRs`) and the exceptions to them
//! (`masqueradeSrcCIDRs`), beside the destinations. A packet leaves with the node's address only
//! when both its source and its destination say so, on every data plane alike.

use std::net::{IpAddr, SocketAddr};

use masq_agent::policy::IpFamily;
use masq_testbed::{probe, write_config};

use crate::{
    Bed, FamilyOnTheBed, PacedTransfer, Plane, explain_from, host_prefix,
    policy::assert_a_change_moves_no_live_flow, wait_for_udp_source,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            sources_and_destinations_decide_together,
            a_source_change_moves_no_live_flow,
            a_file_of_sources_beside_the_cluster_s_is_merged,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

/// The bed's config with the source lists `non_masq_src` and `masq_src`, and the destinations
/// `non_masq` left alone besides the pods' and services'.
fn with_sources(
    family: IpFamily,
    non_masq: &[&str],
    (non_masq_src, masq_src): (&[String], &[String]),
) -> String {
    let list =
        |cidrs: &[String]| -> String { cidrs.iter().map(|c| format!("  - {c}\n")).collect() };
    format!(
        "{}nonMasqueradeSrcCIDRs:\n{}masqueradeSrcCIDRs:\n{}",
        family.config_with(non_masq, &[]),
        list(non_masq_src),
        list(masq_src)
    )
}

/// The source the outside host at `dst` sees on a fresh UDP flow and a fresh TCP connection
/// from pod `i`: both must agree.
fn seen_from(bed: &Bed, i: usize, dst: SocketAddr, expect: IpAddr, why: &str) {
    let pod = &bed.topo.pods[i];
    bed.server
        .wait_for_udp_from(pod, dst, expect)
        .unwrap_or_else(|e| panic!("{why}, UDP: {e:#}"));
    let tcp = probe::tcp_probe(pod, dst, 0).unwrap_or_else(|e| panic!("{why}, TCP: {e:#}"));
    assert_eq!(tcp.ip(), expect, "{why}, TCP");
}

/// One pod left alone keeps its address while its neighbour is masqueraded; every source left
/// alone but one pod masquerades that pod only, live; and a destination left alone keeps even
/// that pod's address.
fn sources_and_destinations_decide_together(plane: Plane, family: IpFamily) {
    let (pod0, pod1) = (family.pod(0), family.pod(1));
    let dst = family.routable_client();
    let one_pod_alone = with_sources(family, &[], (&[host_prefix(pod1)], &[]));
    let bed = Bed::with_pods(plane, &one_pod_alone, 2);
    let _agent = bed.start_agent(family.agent_args());
    seen_from(&bed, 0, dst, family.node(), "pod 0 is masqueraded");
    seen_from(
        &bed,
        1,
        dst,
        pod1,
        "pod 1, a source left alone, keeps its address",
    );
    let (agreed, said) = explain_from(&bed, family, pod1, dst.ip());
    assert!(agreed, "every data plane agrees with the config: {said}");
    assert_eq!(said["decision"], "keeps-address", "{said}");
    assert_eq!(
        said["source_entry"]["list"], "nonMasqueradeSrcCIDRs",
        "{said}"
    );
    let (_, said) = explain_from(&bed, family, pod0, dst.ip());
    assert_eq!(said["decision"], "masquerade", "{said}");
    if plane == Plane::Ebpf {
        let status = bed.status_json();
        assert_eq!(
            status["ebpf"]["non_masquerade_src"],
            serde_json::json!([host_prefix(pod1)])
        );
        let left = &status["ebpf"]["counters"]["not_masqueraded_non_masq_source"];
        assert!(left.as_u64().unwrap() >= 2, "{status}");
    }

    let any: &str = family.pick("0.0.0.0/0", "::/0");
    let only_pod1 = with_sources(family, &[], (&[any.to_string()], &[host_prefix(pod1)]));
    write_config(&bed.config, &only_pod1).unwrap();
    seen_from(
        &bed,
        1,
        dst,
        family.node(),
        "pod 1, the exception, is masqueraded",
    );
    seen_from(
        &bed,
        0,
        dst,
        pod0,
        "pod 0 is left alone with every other source",
    );

    let (outside_prefix, _) = family.outside_prefixes();
    let destination_too = with_sources(
        family,
        &[outside_prefix],
        (&[any.to_string()], &[host_prefix(pod1)]),
    );
    write_config(&bed.config, &destination_too).unwrap();
    seen_from(
        &bed,
        1,
        dst,
        pod1,
        "a destination left alone keeps pod 1's address",
    );
}

/// No change of the source lists moves a live flow, in either direction: the pod's source
/// dropped from nonMasqueradeSrcCIDRs, or an exception for it added.
fn a_source_change_moves_no_live_flow(plane: Plane, family: IpFamily) {
    let dst = family.routable_client();
    let pod = host_prefix(family.pod(0));
    let left_alone = with_sources(family, &[], (std::slice::from_ref(&pod), &[]));
    let bed = Bed::new(plane, &left_alone);
    let _agent = bed.start_agent(family.agent_args());
    let any: &str = family.pick("0.0.0.0/0", "::/0");
    let changes = [
        with_sources(family, &[], (&[], &[])),
        with_sources(family, &[], (&[any.to_string()], &[pod])),
    ];
    // A TCP transfer with the pod's own address, under way through every change: a moved
    // source would end it (the outside host knows no connection from the node's address).
    wait_for_udp_source(&bed, dst, family.pod(0));
    let transfer = PacedTransfer::start(&bed, (dst.ip(), TRANSFER_PORT).into(), 600);
    for (i, masquerading) in changes.iter().enumerate() {
        let port = 42000 + 2 * i as u16;
        assert_a_change_moves_no_live_flow(&bed, family, dst, (&left_alone, masquerading), port);
    }
    transfer.assert_complete("the transfer under way through the changes");
}

/// The port of the outside host's sink for the transfer under way through the changes.
const TRANSFER_PORT: u16 = 42100;

/// A file of source lists beside the cluster's own, as kubelet projects two ConfigMaps: the
/// lists are joined, and the file's removal takes its sources away, live.
fn a_file_of_sources_beside_the_cluster_s_is_merged(plane: Plane, family: IpFamily) {
    let pod1 = family.pod(1);
    let dst = family.routable_client();
    let bed = Bed::with_pods(plane, &family.config_with(&[], &[]), 2);
    let sources = bed.config.with_file_name("ip-masq-sources");
    let text = format!("nonMasqueradeSrcCIDRs: [{}]\n", host_prefix(pod1));
    write_config(&sources, &text).unwrap();
    let mut args = bed.plane_args();
    let file = format!("--config={}", bed.config.display());
    let dir = format!("--config={}", bed.config.parent().unwrap().display());
    args.iter_mut()
        .filter(|arg| **arg == file)
        .for_each(|arg| *arg = dir.clone());
    args.extend(family.agent_args().iter().map(|a| a.to_string()));
    let _agent = bed.spawn_agent(&args, &[]);
    seen_from(
        &bed,
        1,
        dst,
        pod1,
        "pod 1, left alone by the second file, keeps its address",
    );
    seen_from(&bed, 0, dst, family.node(), "pod 0 is masqueraded");
    std::fs::remove_file(&sources).unwrap();
    seen_from(
        &bed,
        1,
        dst,
        family.node(),
        "with the file gone, pod 1 is masqueraded",
    );
    seen_from(&bed, 0, dst, family.node(), "and pod 0 still is");
}
