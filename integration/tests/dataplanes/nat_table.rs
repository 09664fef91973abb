//! The NAT table: what keeps a flow in it (a blind RST does not end one, a lone ACK does not
//! establish one), what fills it, and what a full one gives up so that pods keep connecting:
//! the node's services and NodePorts under floods, a pod's unanswered queries, a connection from
//! outside to a pod, a table filled before a restart, a smaller table after one.

use std::{
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::Duration,
};

use masq_agent::policy::IpFamily;
use masq_testbed::{
    packet::{ACK, RST, Tcp},
    probe::{self, IPPROTO_TCP, Observer, Proto},
    wait_for,
};

use crate::{
    Bed, Conversation, DEFAULT_CONFIG, FamilyOnTheBed, KUBE_PROXY_MASQUERADE, Plane, host_prefix,
    kube_proxy, nat_halves, node_ip, outside, pod_ip, queries_from_fresh_ports, reads_full,
    unanswered_queries,
};

/// What pods see must not depend on the data plane.
macro_rules! common_cases {
    ($plane:ident) => {
        family_cases!($plane:
            a_blind_rst_does_not_end_an_established_connection,
            connections_to_the_nodes_services_leave_the_pods_their_nat_table,
            nodeport_connections_to_another_node_leave_the_pods_their_nat_table,
            a_pods_unanswered_queries_leave_room_for_new_flows,
            a_pods_closed_connections_leave_room_for_new_flows,
            a_connection_from_outside_to_a_pod_makes_room_too,
            a_table_filled_before_a_restart_still_makes_room,
            a_smaller_table_carries_the_pods_flows_first,
        );
    };
}

mod ebpf {
    common_cases!(Ebpf);
    family_cases!(Ebpf: a_lone_ack_opens_no_established_flow);
    cases!(Ebpf: a_full_nat_table_keeps_its_flows_and_drops_new_ones);

    #[test]
    fn the_node_holds_its_listening_and_unconnected_ports_read_either_way() {
        super::the_node_holds_its_listening_and_unconnected_ports_read_either_way();
    }
}

mod iptables_nft {
    common_cases!(IptablesNft);
}

/// The agent's arguments, with room for 64 flows in the NAT table: tests of a full table fill
/// it in a moment.
fn small_table_args(family: IpFamily) -> Vec<&'static str> {
    let mut args = family.agent_args().to_vec();
    args.push("--nat-capacity=64");
    args
}

/// An outside host sends one RST with the connection's addresses and ports and a sequence
/// number far outside the window. The pod's kernel ignores it, and so must the NAT: well past
/// the reset timeout and a sweep of the NAT table, the connection still carries data both ways.
fn a_blind_rst_does_not_end_an_established_connection(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    let segments = family.observe(&bed.topo.ext, IPPROTO_TCP);
    let conversation = Conversation::open(&bed, family, 9700);
    let node_side = conversation.node_side;
    assert_eq!(node_side.ip(), family.node(), "masqueraded");
    // An acknowledgment the node sent: the host's sequence numbers lie near it, and a quarter
    // of the sequence space away from it is far outside any window. The observer records on
    // a thread of its own: wait for it.
    let port_of = |l4: &[u8], at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
    let node_ack = || {
        segments
            .packets()
            .iter()
            .rev()
            .find(|p| p.src == node_side.ip() && port_of(&p.l4, 0) == node_side.port())
            .map(|p| u32::from_be_bytes([p.l4[8], p.l4[9], p.l4[10], p.l4[11]]))
    };
    wait_for(|| Ok(node_ack().is_some())).expect("the host saw the node's segments");
    let acked = node_ack().unwrap();
    let rst = Tcp {
        sport: conversation.server.port(),
        dport: node_side.port(),
        flags: RST,
        seq: acked.wrapping_add(1 << 30),
        ack: 0,
        payload: &[],
    }
    .segment_between(conversation.server.ip(), node_side.ip());
    probe::raw_send_from(
        &bed.topo.ext,
        i32::from(IPPROTO_TCP),
        conversation.server.ip(),
        node_side.ip(),
        &rst,
    )
    .unwrap();
    // Past the reset timeout (10 s) and the next sweep of the NAT table (every 10 s).
    std::thread::sleep(Duration::from_secs(25));
    conversation
        .exchange("still there")
        .expect("the connection outlived a blind RST");
    bed.assert_ebpf_counter(
        "tcp_rst_not_acceptable",
        1,
        "the programs judged the RST blind",
    );
}

/// Established means both directions seen: a pod's lone ACK toward a host that never answers
/// leaves the flow's reply half unseen, so it goes with the transitory timeout (60 s), not the
/// established one (2 h).
fn a_lone_ack_opens_no_established_flow(plane: Plane, family: IpFamily) {
    let (bed, _agent) = Bed::with_agent(plane, family);
    // Beyond the outside host, on its narrow link, where no host answers: the node sends it
    // on through the uplink (an address on the uplink's own subnet would wait for a neighbour
    // that never answers, and never leave).
    let nowhere: IpAddr = family.pick("192.0.2.99", "2001:db8:3::99").parse().unwrap();
    let ack = Tcp {
        sport: 41000,
        dport: 443,
        flags: ACK,
        ..Tcp::default()
    }
    .segment_between(family.pod(0), nowhere);
    probe::raw_send_from(
        bed.pod(),
        i32::from(IPPROTO_TCP),
        family.pod(0),
        nowhere,
        &ack,
    )
    .unwrap();
    let halves = || -> Vec<(u64, u64)> {
        nat_halves(&bed, family)
            .iter()
            .map(|(key, entry)| {
                (
                    key["direction"].as_u64().unwrap(),
                    entry["tcp_seen"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    wait_for(|| Ok(halves().len() == 2)).unwrap();
    let mut seen = halves();
    seen.sort();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_ne!(seen[0].1, 0, "the pod's half saw its ACK: {seen:?}");
    assert_eq!(seen[1].1, 0, "no reply crossed the other half: {seen:?}");
}

/// With the NAT table full of assured flows (streams, answered twice), the flows in it keep
/// working; new ones are dropped and counted, never sent with the pod's address. The table
/// holds at least the flows `--nat-capacity` asks: the hash table that many, the slot table
/// more (its two buckets' 16 slots, where every key goes at this size).
fn a_full_nat_table_keeps_its_flows_and_drops_new_ones(plane: Plane) {
    use masq_ebpf::slot_table::{BUCKET_SLOTS, buckets_for};
    const CAPACITY: u64 = 2;
    // Two halves a flow, in every slot of the table the agent makes for it.
    const SLOT_TABLE_ROOM: u64 = (buckets_for(2 * CAPACITY as u32) * BUCKET_SLOTS / 2) as u64;
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let _agent = bed.start_agent(&[&format!("--nat-capacity={CAPACITY}")]);
    let stream = |pod_port| {
        let first = probe::udp_probe(bed.pod(), outside(), pod_port).ok()?;
        let again = probe::udp_probe(bed.pod(), outside(), pod_port).unwrap();
        assert_eq!(first, again);
        Some(first)
    };
    let made: Vec<_> = (5001..)
        .take(SLOT_TABLE_ROOM as usize + 1)
        .map_while(stream)
        .collect();
    let streams = made.len() as u64;
    assert!(
        (CAPACITY..=SLOT_TABLE_ROOM).contains(&streams),
        "{streams} flows found room"
    );
    assert!(made.iter().all(|from| from.ip() == node_ip()), "{made:?}");
    let first = made[0];
    let status = bed.status_json();
    assert!(status["ebpf"]["counters"]["dropped_nat_table_full"].as_u64() >= Some(1));
    assert_eq!(status["ebpf"]["nat"]["ipv4"]["pod_flows"], streams);
    assert_eq!(
        probe::udp_probe(bed.pod(), outside(), 5001).unwrap(),
        first,
        "the first flow keeps its translation"
    );
    assert!(
        bed.server
            .sources(Proto::Udp)
            .iter()
            .all(|s| *s != pod_ip(0)),
        "nothing left with the pod's address"
    );
}

/// Sources no one has, off the outside host's links, so that the node's answers go out by its
/// uplink (where the programs see them) and reach no one.
fn spoofed(family: IpFamily, i: u32) -> IpAddr {
    family.pick(
        std::net::Ipv4Addr::new(192, 0, 2, 100 + (i % 100) as u8).into(),
        std::net::Ipv6Addr::new(0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 1 + (i % 1000) as u16).into(),
    )
}

/// SYNs to the node's `port`, `count` of them: the flood's `round`th, each from a spoofed
/// source and port no earlier round used (until some 64 000 SYNs wrap around).
fn spoofed_syns(family: IpFamily, port: u16, round: usize, count: u32) -> Vec<Vec<u8>> {
    use masq_testbed::packet::{SYN, tcp};
    let first = round as u32 * count;
    (first..first + count)
        .map(|i| {
            let sport = 1024 + (i % 64_000) as u16;
            match (spoofed(family, i), family.node()) {
                (IpAddr::V4(src), IpAddr::V4(node)) => tcp(src, sport, node, port, SYN),
                (IpAddr::V6(src), IpAddr::V6(node)) => tcp(src, sport, node, port, SYN),
                _ => unreachable!("one family"),
            }
        })
        .collect()
}

/// Between a flood's rounds. A flood of new flows that turns a table over faster than a
/// handshake's round trip makes every flow it may drop younger than a pod's connection in its
/// handshake, which is then the one to go: any early drop (conntrack's too) takes it. The
/// tests' table holds 64 flows and runs beside the rest of the suite, where a handshake can
/// take some milliseconds: a round of new flows every 20 ms turns it over a few times a second
/// at most. (The default table, 262 144 flows, takes a flood of 100 000 new flows a second
/// for over two seconds to turn over.)
const FLOOD_PAUSE: Duration = Duration::from_millis(20);

/// A pod's connections out, each masqueraded, made while a flood goes on: enough to outlast
/// the half second in which a churn on two CPUs left the drop sample pointing at nothing
/// (`early_drop::remember`).
const PROBES_DURING_A_FLOOD: usize = 100;

/// Runs `flood` round after round on a thread of its own (`flood` is told which round), and,
/// once its first round is in, has a pod connect out `PROBES_DURING_A_FLOOD` times while
/// the later rounds go on: each connection must be masqueraded. Pods must keep connecting
/// throughout a flood, not only once it is over. The flood stops after the last connection;
/// a panic on its thread fails the test.
fn pods_connect_throughout(bed: &Bed, family: IpFamily, mut flood: impl FnMut(usize) + Send) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    /// Stops the flood however the probes end, so that the scope can join its thread.
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Relaxed);
        }
    }
    let (rounds, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    std::thread::scope(|scope| {
        let flooding = scope.spawn(|| {
            while !stop.load(Relaxed) {
                flood(rounds.load(Relaxed));
                rounds.fetch_add(1, Relaxed);
                std::thread::sleep(FLOOD_PAUSE);
            }
        });
        let _stop = StopOnDrop(&stop);
        wait_for(|| Ok(rounds.load(Relaxed) > 0 || flooding.is_finished())).unwrap();
        for _ in 0..PROBES_DURING_A_FLOOD {
            family.assert_masqueraded(bed);
        }
    });
}

/// Connections from outside to the node's own services, real or spoofed, to a port it listens
/// on or to a closed one, and the node's own clients' churn (a DNS forwarder's fresh port per
/// query) take nothing from the NAT table that the pods' flows need: with room for 64 flows, a
/// pod's new connections keep succeeding after hundreds of them.
fn connections_to_the_nodes_services_leave_the_pods_their_nat_table(
    plane: Plane,
    family: IpFamily,
) {
    const SERVICE: u16 = 20080;
    const CLOSED: u16 = 20081;
    let bed = Bed::new(plane, family.config());
    // A node service, listening before the agent starts.
    let listener =
        masq_testbed::netns::within(&bed.topo.node, || Ok(TcpListener::bind(("::", SERVICE))?))
            .unwrap();
    let _agent = bed.start_agent(&small_table_args(family));
    family.assert_masqueraded(&bed);

    // Real connections from outside, the service holding the last 200 open.
    let node = SocketAddr::from((family.node(), SERVICE));
    let ext = bed.topo.ext.clone();
    let mut held = std::collections::VecDeque::new();
    pods_connect_throughout(&bed, family, |round| {
        for _ in 0..if round == 0 { 200 } else { 20 } {
            let ext = ext.clone();
            let client =
                masq_testbed::netns::within(&ext, move || Ok(TcpStream::connect(node)?)).unwrap();
            held.push_back((client, accept_soon(&listener)));
        }
        while held.len() > 200 {
            held.pop_front();
        }
    });
    // Spoofed SYNs to the service (the node answers each with a SYN-ACK) and to a closed port
    // (with a reset).
    pods_connect_throughout(&bed, family, |round| {
        let mut flood = spoofed_syns(family, SERVICE, round, 300);
        flood.extend(spoofed_syns(family, CLOSED, round, 300));
        probe::send_frames(&ext, flood).unwrap();
    });
    // The node's clients, each from a fresh port of its ephemeral range.
    let (outside, any) = (family.outside(), family.any());
    let node_ns = bed.topo.node.clone();
    pods_connect_throughout(&bed, family, |_| {
        masq_testbed::netns::within(&node_ns, move || {
            for _ in 0..300 {
                UdpSocket::bind((any, 0))?.send_to(b"query", outside)?;
            }
            Ok(())
        })
        .unwrap();
    });
    if plane == Plane::Ebpf {
        let status = bed.status_json();
        let node_flows = status["ebpf"]["nat"][family.label()]["node_flows"]
            .as_u64()
            .unwrap();
        assert!(node_flows < 10, "{node_flows} node flows held: {status:#}");
        assert_eq!(status["ebpf"]["counters"]["dropped_nat_table_full"], 0);
    }
}

/// kube-proxy's NodePort in the tests.
const NODE_PORT: u16 = 30080;

/// `count` established connections from outside to a NodePort whose endpoint is on another node
/// (the outside host, for want of one), each as the client's end and the endpoint's: kube-proxy
/// DNATs them and masquerades them to the node's address with ports from the whole range
/// (`--random-fully`), so that most take ports NAT hands out too and hold them in the NAT table.
fn nodeport_connections_to_another_node(
    bed: &Bed,
    family: IpFamily,
    count: usize,
) -> Vec<(TcpStream, TcpStream)> {
    let endpoint = SocketAddr::from((family.outside().ip(), 9706));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(endpoint)?))
            .unwrap();
    let node = family.node();
    let host = host_prefix(node);
    let mark = format!(
        "-A PREROUTING -d {host} -p tcp --dport {NODE_PORT} -j MARK --set-xmark 0x4000/0x4000"
    );
    let dnat = format!(
        "-A PREROUTING -d {host} -p tcp --dport {NODE_PORT} -j DNAT --to-destination {endpoint}"
    );
    kube_proxy(bed, family, &[&mark, &dnat, KUBE_PROXY_MASQUERADE]);
    let service = SocketAddr::from((node, NODE_PORT));
    let clients: Vec<TcpStream> = (0..count)
        .map(|_| {
            masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpStream::connect(service)?))
                .unwrap()
        })
        .collect();
    let served = listener.incoming().take(count).map(|s| s.unwrap());
    let mut connections: Vec<(TcpStream, TcpStream)> = clients.into_iter().zip(served).collect();
    // Past the handshake both ways: established flows, each with a reservation.
    for (client, server) in &mut connections {
        exchange_a_byte(client, server);
    }
    connections
}

/// NodePort connections to an endpoint on another node take ports NAT hands out, and hold them
/// in the NAT table. Established or spoofed, however many, they never cost a pod its new
/// connections: a full table gives up the node's reservations first, and the connections keep
/// working.
fn nodeport_connections_to_another_node_leave_the_pods_their_nat_table(
    plane: Plane,
    family: IpFamily,
) {
    let bed = Bed::new(plane, family.config());
    let _agent = bed.start_agent(&small_table_args(family));
    family.assert_masqueraded(&bed);
    let mut connections = nodeport_connections_to_another_node(&bed, family, 100);
    let ext = bed.topo.ext.clone();
    pods_connect_throughout(&bed, family, |round| {
        probe::send_frames(&ext, spoofed_syns(family, NODE_PORT, round, 300)).unwrap();
    });
    // The node's connections keep working.
    for (client, server) in &mut connections {
        exchange_a_byte(client, server);
    }
    assert_made_room(&bed, "nat_node_flow_dropped");
}

/// The next connection `listener` accepts, within the tests' usual wait: a handshake the NAT
/// broke (the client's end established, the server's never) fails the test rather than hang it
/// in a blocking accept.
fn accept_soon(listener: &TcpListener) -> TcpStream {
    listener.set_nonblocking(true).unwrap();
    let mut accepted = None;
    wait_for(|| match listener.accept() {
        Ok((stream, _)) => Ok(accepted.replace(stream).is_none()),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(e.into()),
    })
    .unwrap_or_else(|e| panic!("the server end of a connection the client made: {e:#}"));
    let stream = accepted.unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
}

/// A byte from `client` to `server` and one back, within three seconds each.
fn exchange_a_byte(client: &mut TcpStream, server: &mut TcpStream) {
    use std::io::{Read, Write};
    let one_way = |from: &mut TcpStream, to: &mut TcpStream| {
        let mut byte = [0u8; 1];
        to.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        from.write_all(b"x").unwrap();
        to.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"x");
    };
    one_way(client, server);
    one_way(server, client);
}

/// On the eBPF plane: the NAT table was full, and made room for every new flow of a pod by
/// dropping flows that `dropped` counts.
fn assert_made_room(bed: &Bed, dropped: &str) {
    if bed.plane == Plane::Ebpf {
        let counters = &bed.status_json()["ebpf"]["counters"];
        assert!(counters[dropped].as_u64().unwrap() > 0, "{counters:#}");
        assert_eq!(counters["dropped_nat_table_full"], 0, "{counters:#}");
    }
}

/// An agent restarted over a NAT table that pods filled with flows never answered: its programs
/// find those flows to drop (the agent hands them the table's flows when it loads them), and
/// pods keep connecting.
fn a_table_filled_before_a_restart_still_makes_room(plane: Plane, family: IpFamily) {
    let bed = Bed::new(plane, family.config());
    let args = small_table_args(family);
    let mut agent = bed.start_agent(&args);
    family.assert_masqueraded(&bed);
    let _server = unanswered_queries(&bed, family, 9707, 100);
    agent.stop(libc::SIGKILL).unwrap();
    let _restarted = bed.start_agent(&args);
    for _ in 0..5 {
        family.assert_masqueraded(&bed);
    }
    if plane == Plane::Ebpf {
        let status = bed.status_json();
        assert!(
            reads_full(&status["ebpf"]["nat"][family.label()]),
            "the test filled the table: {status:#}"
        );
    }
}

/// A NAT table that the node's flows fill, replaced by a smaller one (another
/// `--nat-capacity`): the pods' flows are carried first, so that every pod connection survives,
/// and pods keep connecting.
fn a_smaller_table_carries_the_pods_flows_first(plane: Plane, family: IpFamily) {
    let bed = Bed::new(plane, family.config());
    let mut agent = bed.start_agent(&small_table_args(family));
    let held = SocketAddr::from((family.outside().ip(), 9708));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(held)?)).unwrap();
    let mut pods_connections: Vec<(TcpStream, TcpStream)> = (0..4)
        .map(|_| {
            let pod_end =
                masq_testbed::netns::within(bed.pod(), move || Ok(TcpStream::connect(held)?))
                    .unwrap();
            (pod_end, listener.accept().unwrap().0)
        })
        .collect();
    for (pod_end, host_end) in &mut pods_connections {
        exchange_a_byte(pod_end, host_end);
    }
    let _node_connections = nodeport_connections_to_another_node(&bed, family, 100);
    agent.stop(libc::SIGTERM).unwrap();
    let mut args = family.agent_args().to_vec();
    args.push("--nat-capacity=16");
    let _smaller = bed.start_agent(&args);
    for (pod_end, host_end) in &mut pods_connections {
        exchange_a_byte(pod_end, host_end);
    }
    family.assert_masqueraded(&bed);
    if plane == Plane::Ebpf {
        let counters = &bed.status_json()["ebpf"]["counters"];
        assert!(
            counters["nat_flows_not_carried"].as_u64().unwrap() > 0,
            "the node's flows did not all fit: {counters:#}"
        );
    }
}

/// A pod's resolver retrying against a server that never answers, each query from a fresh
/// port, fills a small NAT table with flows no one will use again. As conntrack's early drop
/// does, those make room for the pods' next flows: with room for 64 flows, after 300 unanswered
/// queries a pod still connects, and a connection established before them still carries data.
fn a_pods_unanswered_queries_leave_room_for_new_flows(plane: Plane, family: IpFamily) {
    const SILENT: u16 = 9702;
    const HELD: u16 = 9703;
    let bed = Bed::new(plane, family.config());
    let _agent = bed.start_agent(&small_table_args(family));
    family.assert_masqueraded(&bed);

    let outside = family.outside().ip();
    let held = SocketAddr::from((outside, HELD));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(held)?)).unwrap();
    let mut pod_end =
        masq_testbed::netns::within(bed.pod(), move || Ok(TcpStream::connect(held)?)).unwrap();
    let (mut host_end, _) = listener.accept().unwrap();
    host_end
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    pod_end
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    exchange_a_byte(&mut pod_end, &mut host_end);

    let silent = SocketAddr::from((outside, SILENT));
    let _server =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(UdpSocket::bind(silent)?)).unwrap();
    let pod = bed.pod().to_string();
    pods_connect_throughout(&bed, family, |round| {
        queries_from_fresh_ports(&pod, family, silent, if round == 0 { 300 } else { 20 });
    });
    exchange_a_byte(&mut pod_end, &mut host_end);
    assert_made_room(&bed, "nat_early_dropped");
}

/// A connection from outside toward a pod needs an entry of its own, or the pod's SYN-ACK
/// would leave masqueraded and the handshake fail: in a table that a pod's unanswered queries
/// filled, it makes room as the pod's own new flows do, as conntrack's early drop makes room for
/// any new connection.
fn a_connection_from_outside_to_a_pod_makes_room_too(plane: Plane, family: IpFamily) {
    const SERVER: u16 = 9711;
    let bed = Bed::new(plane, family.config());
    let _agent = bed.start_agent(&small_table_args(family));
    let pod = family.pod(0);
    let in_pod = Observer::start(bed.pod(), &[pod], SERVER).unwrap();
    let _silent = unanswered_queries(&bed, family, 9710, 300);
    let client = SocketAddr::new(family.routable_client().ip(), 0);
    let seen = probe::tcp_probe_from(&bed.topo.ext, client, (pod, SERVER).into())
        .expect("the connection from outside completes its handshake");
    assert_eq!(seen.ip(), client.ip());
    assert_eq!(in_pod.sources(Proto::Tcp), [client.ip()]);
    assert_made_room(&bed, "nat_early_dropped");
}

/// A pod that opens and closes connections one after another (a client without keep-alive)
/// fills a small NAT table with closed connections, which conntrack keeps as long as TIME_WAIT
/// lasts (two minutes) and drops from a table past 95 % full. So do the programs: with room for
/// 64 flows, 150 connections closed one after another leave the pod connecting, and a
/// connection established before them still carries data.
fn a_pods_closed_connections_leave_room_for_new_flows(plane: Plane, family: IpFamily) {
    const SERVER: u16 = 9709;
    let bed = Bed::new(plane, family.config());
    let _agent = bed.start_agent(&small_table_args(family));
    let server = SocketAddr::from((family.outside().ip(), SERVER));
    let listener =
        masq_testbed::netns::within(&bed.topo.ext, move || Ok(TcpListener::bind(server)?)).unwrap();
    let pod = bed.pod().to_string();
    let connect = || {
        let pod = pod.clone();
        let pod_end = masq_testbed::netns::within(&pod, move || {
            Ok(TcpStream::connect_timeout(&server, Duration::from_secs(3))?)
        })
        .expect("the pod connects");
        (pod_end, accept_soon(&listener))
    };
    let (mut held_pod_end, mut held_host_end) = connect();
    exchange_a_byte(&mut held_pod_end, &mut held_host_end);
    pods_connect_throughout(&bed, family, |round| {
        for _ in 0..if round == 0 { 150 } else { 10 } {
            let (mut pod_end, mut host_end) = connect();
            exchange_a_byte(&mut pod_end, &mut host_end);
            // Both ends close: a FIN each way, as a client and server without keep-alive do.
        }
    });
    exchange_a_byte(&mut held_pod_end, &mut held_host_end);
    assert_made_room(&bed, "nat_early_dropped");
}

/// The ports NAT never hands out are those of the node's listening TCP sockets and unconnected
/// UDP ones, of both families, and not a connection's own port: as the kernel's socket
/// diagnostics list them, and as `/proc/net` does, which the agent reads where those are
/// missing.
fn the_node_holds_its_listening_and_unconnected_ports_read_either_way() {
    use masq_agent::dataplane::ebpf::node_ports::NodePorts;
    let topo = masq_testbed::topology::Topology::new(0).unwrap();
    let (read, expected) = masq_testbed::netns::within(&topo.node, || {
        let v4 = TcpListener::bind("0.0.0.0:0")?;
        let v6 = TcpListener::bind("[::]:0")?;
        let unconnected = UdpSocket::bind("[::]:0")?;
        let connected = UdpSocket::bind("127.0.0.1:0")?;
        connected.connect(("127.0.0.1", unconnected.local_addr()?.port()))?;
        let client = TcpStream::connect(("127.0.0.1", v4.local_addr()?.port()))?;
        let _served = v4.accept()?;
        let expected = NodePorts {
            tcp: [&v4, &v6].map(|l| l.local_addr().unwrap().port()).into(),
            udp: [unconnected.local_addr()?.port()].into(),
        };
        assert!(!expected.tcp.contains(&client.local_addr()?.port()));
        assert!(!expected.udp.contains(&connected.local_addr()?.port()));
        let read = [
            NodePorts::from_socket_diagnostics(None)?,
            NodePorts::from_proc(None),
        ];
        Ok((read, expected))
    })
    .unwrap();
    let [diagnostics, proc] = read;
    assert_eq!(diagnostics, expected, "from the socket diagnostics");
    assert_eq!(proc, expected, "from /proc/net");
}
