//! ICMP errors about masqueraded flows, both ways, in both families: arriving for a pod, they
//! are restored as the pod's packet was sent; leaving about a reply the node restored, they are
//! translated as conntrack translates a RELATED error. Errors about anything else pass as they
//! are.

use masq_agent::dataplane::ebpf::testbed::{Answered, TC_ACT_OK};
use masq_ebpf::Counter;
use masq_testbed::packet::*;

use crate::family::*;

in_both_families!(
    icmp_errors_about_masqueraded_flows_are_translated_inside_and_out,
    egress_icmp_errors_about_masqueraded_flows_are_translated_as_conntrack_does,
    egress_icmp_errors_about_no_masqueraded_flow_pass_untouched,
);

/// One error arriving for a pod.
struct ErrorCase {
    what: &'static str,
    kind: ErrorKind,
    /// The packet as the pod sent it, and as it left the node.
    sent: Vec<u8>,
    left: Vec<u8>,
    quote_len: usize,
    /// Whether the quote holds the whole upper layer, so that its checksum verifies.
    whole: bool,
}

fn icmp_errors_about_masqueraded_flows_are_translated_inside_and_out<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let mut flow = |sent: Vec<u8>| {
        let (verdict, left) = h.egress(&sent);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(F::at(&left, F::SRC), F::NODE);
        (sent, left)
    };
    let tcp_flow = flow(tcp(F::POD, 40001, F::REMOTE, 443, SYN));
    let udp_flow = flow(udp(F::POD, 40002, F::REMOTE2, 53));
    let ping_flow = flow(ping(F::POD, F::REMOTE, F::ECHO_REQUEST, 7));
    // A big segment, of which an error quotes only what fits.
    let big_payload = vec![0x5a; 1400];
    let big_segment = |sport| Tcp {
        sport,
        dport: 443,
        payload: &big_payload,
        ..Tcp::default()
    };
    let big_flow = flow(big_segment(40003).frame(F::POD, F::REMOTE));
    let big_port = word(&big_flow.1, F::L4);
    let big_left = big_segment(big_port).frame(F::NODE, F::REMOTE);
    assert_frame(&big_flow.1, &big_left, &checksums::<F>(F::L4 + 16));
    // A segment behind optional headers: the quote's are walked too.
    let opts_flow = flow(F::with_header_options(&tcp(
        F::POD,
        40004,
        F::REMOTE,
        443,
        SYN,
    )));

    let whole = |(_, left): &(Vec<u8>, Vec<u8>)| left.len() - IP;
    let eight_bytes = F::IP_HLEN + 8;
    let case = |what, kind, flow: &(Vec<u8>, Vec<u8>), quote_len: usize| ErrorCase {
        what,
        kind,
        sent: flow.0.clone(),
        left: flow.1.clone(),
        quote_len,
        whole: quote_len == flow.1.len() - IP,
    };
    let cases = [
        case(
            "too big, quoting the whole TCP SYN",
            F::TOO_BIG,
            &tcp_flow,
            whole(&tcp_flow),
        ),
        case(
            "port unreachable, quoting the whole UDP datagram",
            F::PORT_UNREACHABLE,
            &udp_flow,
            whole(&udp_flow),
        ),
        case(
            "time exceeded, quoting the whole echo request",
            F::TIME_EXCEEDED,
            &ping_flow,
            whole(&ping_flow),
        ),
        case(
            "port unreachable, quoting 8 bytes of TCP (RFC 792's least): no checksum",
            F::PORT_UNREACHABLE,
            &tcp_flow,
            eight_bytes,
        ),
        case(
            "time exceeded, quoting the UDP header alone, checksum included",
            F::TIME_EXCEEDED,
            &udp_flow,
            eight_bytes,
        ),
        case(
            "time exceeded, quoting 8 bytes of the echo request",
            F::TIME_EXCEEDED,
            &ping_flow,
            eight_bytes,
        ),
        case(
            "too big, quoting as much of a big segment as an error may",
            F::TOO_BIG,
            &big_flow,
            F::QUOTE_LIMIT,
        ),
        case(
            "parameter problem, quoting a TCP SYN behind optional headers",
            F::PARAMETER_PROBLEM,
            &opts_flow,
            whole(&opts_flow),
        ),
    ];
    for (n, case) in cases.iter().enumerate() {
        let what = case.what;
        let error = icmp_error((F::ROUTER, F::NODE), case.kind, &case.left, case.quote_len);
        assert!(checksums_ok::<F>(&error), "{what}: the error as built");
        let (verdict, back) = h.ingress(&error);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(
            h.counter(Counter::IcmpErrorTranslated),
            n as u64 + 1,
            "{what}"
        );

        // What the pod should see: the same error, to the pod, about the packet as it sent it.
        let expected = icmp_error((F::ROUTER, F::POD), case.kind, &case.sent, case.quote_len);
        let outer = F::packet_at(&back, IP).unwrap();
        let inner = outer.l4 + 8;
        let quote = F::packet_at(&back, inner).expect("the quote parses");
        let quoted_id = if quote.proto == F::ICMP {
            quote.l4 + 4
        } else {
            quote.l4
        };
        let mut allowed = address_fields::<F>(F::DST);
        allowed.extend(address_fields::<F>(F::SRC).iter().map(|r| {
            let at = r.start - IP + inner;
            at..at + r.len()
        }));
        allowed.extend([outer.l4 + 2..outer.l4 + 4, range(quoted_id, 2)]);
        allowed.push(range(quote.l4 + l4_checksum_offset(quote.proto), 2));
        assert_changed_within(&error, &back, &allowed);
        assert_frame(&back, &expected, &error_checksums::<F>(&back));
        assert_eq!(F::at(&back, F::DST), F::POD, "{what}: outer destination");
        assert_eq!(quote.src, F::POD, "{what}: quoted source");
        assert!(checksums_ok::<F>(&back), "{what}: outer checksums");
        assert!(
            F::header_checksum_ok(&back, inner),
            "{what}: quoted IP header"
        );
        assert_eq!(
            back[outer.l4 + 4..outer.l4 + 8],
            case.kind.2,
            "{what}: MTU or pointer"
        );
        if case.whole {
            assert!(segment_checksum_ok(&back, &quote), "{what}: quoted L4");
        }
    }

    // An error about a flow the node never translated passes untouched.
    let stray = tcp(F::NODE, 33333, F::REMOTE, 443, SYN);
    let error = icmp_error(
        (F::ROUTER, F::NODE),
        F::PORT_UNREACHABLE,
        &stray,
        eight_bytes,
    );
    assert_eq!(h.ingress(&error), (TC_ACT_OK, error));
    // So does one about a translated flow's packet that is not addressed to the quoted source.
    let misaddressed = icmp_error(
        (F::ROUTER, F::REMOTE2),
        F::TOO_BIG,
        &tcp_flow.1,
        whole(&tcp_flow),
    );
    assert_eq!(h.ingress(&misaddressed), (TC_ACT_OK, misaddressed));
    assert_eq!(h.counter(Counter::IcmpErrorTranslated), cases.len() as u64);
}

/// ICMP errors leaving the node about replies it restored to a pod, as conntrack translates a
/// RELATED error: the quoted packet becomes the reply as it arrived (to the node's address and
/// NAT port), and the outer source the node's address. Each is compared with the frame the
/// outside host must receive, built from scratch.
fn egress_icmp_errors_about_masqueraded_flows_are_translated_as_conntrack_does<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let tcp_flow = h.answered(&tcp(F::POD, 40001, F::REMOTE, 443, SYN), |left| {
        tcp(F::REMOTE, 443, F::NODE, word(left, F::L4), SYN | ACK)
    });
    let udp_flow = h.answered(&udp(F::POD, 40002, F::REMOTE2, 53), |left| {
        udp(F::REMOTE2, 53, F::NODE, word(left, F::L4))
    });
    let request = ping(F::POD, F::REMOTE, F::ECHO_REQUEST, 0x4242);
    let echo_flow = h.answered(&request, |left| {
        ping(F::REMOTE, F::NODE, F::ECHO_REPLY, word(left, F::L4 + 4))
    });
    let whole = |f: &Answered| f.restored.len() - IP;
    let cases = [
        (
            "the node's too big about a TCP reply, quoted whole",
            F::NODE,
            F::TOO_BIG,
            &tcp_flow,
            whole(&tcp_flow),
        ),
        (
            "the node's time exceeded from the pods' gateway, 8 bytes of TCP quoted",
            F::POD_GATEWAY,
            F::TIME_EXCEEDED,
            &tcp_flow,
            F::IP_HLEN + 8,
        ),
        (
            "the pod's port unreachable about a UDP reply, quoted whole",
            F::POD,
            F::PORT_UNREACHABLE,
            &udp_flow,
            whole(&udp_flow),
        ),
        (
            "the pod's parameter problem about an echo reply, quoted whole",
            F::POD,
            F::PARAMETER_PROBLEM,
            &echo_flow,
            whole(&echo_flow),
        ),
    ];
    for (n, (what, from, kind, flow, quote_len)) in cases.into_iter().enumerate() {
        let remote = F::at(&flow.arrived, F::SRC);
        let error = icmp_error((from, remote), kind, &flow.restored, quote_len);
        assert!(checksums_ok::<F>(&error), "{what}: the error as built");
        let (verdict, out) = h.egress(&error);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        let expected = icmp_error((F::NODE, remote), kind, &flow.arrived, quote_len);
        assert_frame(&out, &expected, &error_checksums::<F>(&out));
        assert!(checksums_ok::<F>(&out), "{what}: checksums from scratch");
        let inner = F::packet_at(&out, IP).unwrap().l4 + 8;
        let quote = F::packet_at(&out, inner).expect("the quote parses");
        assert_eq!(quote.dst, F::NODE, "{what}: quoted destination");
        assert!(F::header_checksum_ok(&out, inner), "{what}: quoted header");
        if quote_len == whole(flow) {
            assert!(segment_checksum_ok(&out, &quote), "{what}: quoted L4");
        }
        assert_eq!(
            h.counter(Counter::IcmpErrorMasqueraded),
            n as u64 + 1,
            "{what}"
        );
    }
    assert_eq!(h.counter(Counter::NotMasqIcmpOther), 0);
}

/// Errors that are about no masqueraded flow, or not addressed to where the quoted packet came
/// from, leave as they are, as conntrack leaves them.
fn egress_icmp_errors_about_no_masqueraded_flow_pass_untouched<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let flow = h.answered(&udp(F::POD, 40010, F::REMOTE, 53), |left| {
        udp(F::REMOTE, 53, F::NODE, word(left, F::L4))
    });
    // A connection opened from outside keeps the pod's address, and so do errors about it.
    h.ingress(&tcp(F::REMOTE, 5555, F::POD, 8080, SYN));
    let inbound = tcp(F::REMOTE, 5555, F::POD, 8080, ACK);
    let whole = flow.restored.len() - IP;
    let eight_bytes = F::IP_HLEN + 8;
    let to_remote = (F::POD, F::REMOTE);
    let unreachable = F::PORT_UNREACHABLE;
    for (what, error) in [
        (
            "about a flow never seen",
            icmp_error(
                to_remote,
                unreachable,
                &udp(F::REMOTE, 53, F::POD, 40011),
                eight_bytes,
            ),
        ),
        (
            "about a connection from outside",
            icmp_error(to_remote, unreachable, &inbound, eight_bytes),
        ),
        (
            "to another host than the quoted source",
            icmp_error((F::POD, F::REMOTE2), unreachable, &flow.restored, whole),
        ),
        (
            "quoting less than 8 bytes of UDP",
            icmp_error(to_remote, unreachable, &flow.restored, eight_bytes - 1),
        ),
        (
            "quoting an echo request, which no masqueraded echo flow received",
            icmp_error(
                to_remote,
                F::PARAMETER_PROBLEM,
                &ping(F::REMOTE, F::POD, F::ECHO_REQUEST, 40010),
                eight_bytes,
            ),
        ),
    ] {
        assert!(checksums_ok::<F>(&error), "{what}: as built");
        let (verdict, out) = h.egress(&error);
        assert_eq!((verdict, &out), (TC_ACT_OK, &error), "{what}");
    }
    assert_eq!(h.counter(Counter::IcmpErrorMasqueraded), 0);
    assert_eq!(h.counter(Counter::NotMasqIcmpOther), 5);
}
