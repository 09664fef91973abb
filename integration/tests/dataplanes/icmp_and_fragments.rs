//! Packets too big for a link, and the ICMP errors about flows: datagrams in fragments, path-MTU
//! discovery both ways through the translation, and a pod's own ICMP error reaching the outside
//! host as about the datagram that host sent.

use std::{
    io::ErrorKind,
    net::{IpAddr, SocketAddr, UdpSocket},
    time::Duration,
};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    probe::{self, BulkSink, BulkSource, IPPROTO_ICMP},
    topology, wait_for,
};

use crate::{Bed, FamilyOnTheBed, Plane, assert_success};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            fragmented_datagrams_arrive_whole_both_ways,
            path_mtu_discovery_works_through_the_translation,
            path_mtu_discovery_toward_a_pod_behind_a_narrower_route,
            a_pods_icmp_error_reaches_the_outside_host,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

/// Datagrams larger than the links' MTU travel as fragments: a 4 000-byte UDP datagram goes out
/// to the outside host in fragments and its echo comes back in fragments, whole; a 4 000-byte
/// ping does the same.
fn fragmented_datagrams_arrive_whole_both_ways(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let server = SocketAddr::from((family.outside().ip(), 9500));
    let echo =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(UdpSocket::bind(server)?)).unwrap();
    let echoer = std::thread::spawn(move || {
        let mut buf = vec![0u8; 8192];
        echo.set_read_timeout(Some(Duration::from_secs(5))).ok();
        if let Ok((n, from)) = echo.recv_from(&mut buf) {
            let _ = echo.send_to(&buf[..n], from);
        }
    });
    let payload: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
    let sent = payload.clone();
    let any = family.any();
    let echoed = masq_testbed::netns::within(bed.pod(), move || {
        let socket = UdpSocket::bind((any, 0))?;
        socket.set_read_timeout(Some(Duration::from_secs(3)))?;
        socket.send_to(&sent, server)?;
        let mut buf = vec![0u8; 8192];
        let (n, _) = socket.recv_from(&mut buf)?;
        buf.truncate(n);
        Ok(buf)
    })
    .unwrap();
    echoer.join().unwrap();
    assert!(echoed == payload, "{} bytes came back", echoed.len());
    assert_success(&bed.ping(0, server.ip(), &["-s", "4000"]));
    bed.assert_ebpf_counter("dropped_fragment", 0, "no fragment was dropped");
}

/// A pod learns the narrower path's MTU toward the far host from the ICMP error (frag-needed,
/// or packet-too-big) that the hop before it sends to the node, and a bulk transfer completes.
fn path_mtu_discovery_works_through_the_translation(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    pod_learns_the_path_mtu(&bed, family);
}

/// The pod on `bed` learns the narrower path's MTU toward the far host, and a bulk transfer
/// over that path completes.
pub(crate) fn pod_learns_the_path_mtu(bed: &Bed, family: IpFamily) {
    let far: IpAddr = family.pick(topology::FAR_ADDR.into(), topology::FAR_ADDR_V6.into());
    let dst = far.to_string();
    let out = bed.ping_output(
        0,
        &[
            family.pick("-4", "-6"),
            "-M",
            "do",
            "-s",
            "1400",
            "-c",
            "2",
            "-i",
            "0.3",
            "-W",
            "2",
            &dst,
        ],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let mtu = topology::FAR_LINK_MTU;
    assert!(
        text.contains(&format!("mtu = {mtu}")) || text.contains(&format!("mtu={mtu}")),
        "the pod must learn the path MTU from the translated ICMP error:\n{text}"
    );
    let sink = BulkSink::start(&bed.topo.far, 9000).unwrap();
    let sent =
        probe::tcp_bulk(bed.pod(), (far, 9000).into(), 64 * 1024, 32, Duration::ZERO).unwrap();
    assert_eq!(
        sent,
        32 * 64 * 1024,
        "a bulk transfer over the narrower path completes"
    );
    drop(sink);
}

/// Pods behind a smaller MTU than the uplink (an overlay's): the node answers a reply too big
/// for the pod's route with fragmentation needed (packet too big), which must reach the
/// outside sender as about the segment it sent, or path-MTU discovery black-holes the download.
fn path_mtu_discovery_toward_a_pod_behind_a_narrower_route(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    bed.topo.narrow_pod_route(0, 1400).unwrap();
    const DOWNLOAD: usize = 20 << 20;
    let _source = BulkSource::start(&bed.topo.ext, 9800, DOWNLOAD).unwrap();
    let server = SocketAddr::from((family.outside().ip(), 9800));
    let got = probe::tcp_download(bed.pod(), server, Duration::from_secs(5)).unwrap();
    assert_eq!(
        got, DOWNLOAD as u64,
        "a 20 MB download into a pod behind a 1400-byte route"
    );
}

/// A pod closes its UDP socket; the outside host's late reply is restored to the pod, which
/// answers it with port unreachable. The host must get that error as conntrack translates it:
/// from the node's address, about the datagram the host sent to the node's port, so that the
/// host's own socket takes it (ECONNREFUSED). Untranslated, it carries the pod's address and
/// quotes a packet the host never sent.
fn a_pods_icmp_error_reaches_the_outside_host(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    a_pods_icmp_error_leaves_as(&bed, family, family.node());
}

/// The pod's port unreachable about a late reply reaches the outside host from `masqueraded_as`,
/// the address the pod's datagram left with, about the datagram the host sent there.
pub(crate) fn a_pods_icmp_error_leaves_as(bed: &Bed, family: IpFamily, masqueraded_as: IpAddr) {
    // Errors the bed's earlier probes drew count too.
    let translated_before = bed.status_json()["ebpf"]["counters"]["icmp_error_masqueraded"]
        .as_u64()
        .unwrap_or(0);
    let server = SocketAddr::from((family.outside().ip(), 9600));
    let host =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(UdpSocket::bind(server)?)).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let any = family.any();
    masq_testbed::netns::within(bed.pod(), move || {
        UdpSocket::bind((any, 0))?.send_to(b"hello", server)?;
        Ok(())
    })
    .unwrap();
    let mut buf = [0u8; 64];
    let (_, node_side) = host.recv_from(&mut buf).unwrap();
    assert_eq!(node_side.ip(), masqueraded_as, "masqueraded");
    let errors = family.observe(&bed.topo.ext, IPPROTO_ICMP);
    host.connect(node_side).unwrap();
    host.send(b"late reply").unwrap();
    assert_eq!(
        host.recv(&mut buf).map_err(|e| e.kind()).err(),
        Some(ErrorKind::ConnectionRefused),
        "the host's socket must take the pod's port unreachable as about its own datagram"
    );
    // ICMP's destination unreachable type.
    let unreachable = family.pick(3, 1);
    wait_for(|| {
        Ok(errors
            .packets()
            .iter()
            .any(|p| p.l4.first() == Some(&unreachable)))
    })
    .unwrap();
    let sources: Vec<IpAddr> = errors.packets().iter().map(|p| p.src).collect();
    assert!(
        sources.iter().all(|&src| src == masqueraded_as),
        "the error left with the node's address: {sources:?}"
    );
    bed.assert_ebpf_counter(
        "icmp_error_masqueraded",
        translated_before + 1,
        "the programs translated the error",
    );
}
