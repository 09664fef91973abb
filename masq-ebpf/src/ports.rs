//! NAT port allocation: which port (or ICMP echo identifier) a new masqueraded flow gets.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use masq_ebpf::{MAX_PORT_SPANS, Settings, node_ports};

use crate::maps::{self, PortBits};

/// How many candidate ports a new flow tries before its packet is dropped. Bounded, so that a
/// nearly exhausted range costs a fixed amount of work per packet.
pub const MAX_ATTEMPTS: u32 = 32;

/// Where in the spans a walk through them starts, without `--random-fully`: at the pod's own
/// port when the range holds it, so that the first attempt keeps it, or anywhere.
#[inline(always)]
pub fn first_offset(settings: &Settings, pod_port: u16) -> u32 {
    offset_of(settings, u16::from_be(pod_port))
        .unwrap_or_else(|| random_below(settings.total_ports))
}

/// The port to try on `attempt` (0-based), in network byte order. With `--random-fully` every
/// attempt is random; otherwise the attempts walk on from `start` (see `first_offset`).
#[inline(always)]
pub fn candidate(settings: &Settings, start: u32, attempt: u32) -> u16 {
    let total = fresh(&settings.total_ports);
    let offset = if fresh(&settings.random_fully) != 0 {
        random_below(total)
    } else {
        (start % MAX_OFFSET + attempt)
            .checked_rem(total)
            .unwrap_or(0)
    };
    port_at(settings, offset).to_be()
}

/// Whether the node holds `port` (network byte order) of `proto` for its own sockets or its
/// NodePorts: NAT never hands it out, and the node's flows on it need no reservation.
#[inline(always)]
pub fn held_by_node(proto: u8, port: u16) -> bool {
    port_bit(&maps::NODE_PORTS, proto, port)
}

/// Whether no NAT entry holds `port` (network byte order) of `proto` on the node's side, as the
/// agent found (`map_names::ENTRYLESS_PORTS`): one the node holds, or one outside NAT's spans.
#[inline(always)]
pub fn without_entry(proto: u8, port: u16) -> bool {
    port_bit(&maps::ENTRYLESS_PORTS, proto, port)
}

/// `port`'s (network byte order) bit of `proto` in a map laid out as `node_ports`.
#[inline(always)]
fn port_bit(map: &PortBits, proto: u8, port: u16) -> bool {
    let Some((word, bit)) = node_ports::slot(proto, u16::from_be(port)) else {
        return false;
    };
    map.get(word).is_some_and(|held| held & bit != 0)
}

/// Whether NAT could ever hand `port` (network byte order) out: it is in the spans.
#[inline(always)]
pub fn in_spans(settings: &Settings, port: u16) -> bool {
    offset_of(settings, u16::from_be(port)).is_some()
}

/// Above any offset into the spans: they hold at most 65 536 ports.
const MAX_OFFSET: u32 = 1 << 16;

#[inline(always)]
fn random_below(n: u32) -> u32 {
    // SAFETY: no preconditions.
    let random = unsafe { bpf_get_prandom_u32() };
    random.checked_rem(n).unwrap_or(0)
}

/// `value`, read from the map afresh. Settings the compiler kept in registers across attempts
/// would carry what the verifier learned of them on one attempt's path into every later one,
/// and it would walk each combination apart.
#[inline(always)]
fn fresh<T: Copy>(value: &T) -> T {
    // SAFETY: a reference is valid to read.
    unsafe { core::ptr::read_volatile(value) }
}

/// The `offset`-th port counting through the spans in order.
#[inline(always)]
fn port_at(settings: &Settings, mut offset: u32) -> u16 {
    for i in 0..MAX_PORT_SPANS {
        if i as u32 >= fresh(&settings.span_count) {
            break;
        }
        let Some(span) = settings.spans.get(i).map(fresh) else {
            break;
        };
        if offset < span.count {
            return (span.first + offset) as u16;
        }
        offset -= span.count;
    }
    // Unreachable while total_ports is the sum of the counts; any port is still a valid answer.
    settings.spans.first().map_or(0, |s| s.first as u16)
}

/// Where `port` sits in the spans, if it is in them.
#[inline(always)]
fn offset_of(settings: &Settings, port: u16) -> Option<u32> {
    let port = port as u32;
    let mut base = 0;
    for i in 0..MAX_PORT_SPANS {
        if i as u32 >= settings.span_count {
            break;
        }
        let Some(span) = settings.spans.get(i) else {
            break;
        };
        if port >= span.first && port < span.first + span.count {
            return Some(base + port - span.first);
        }
        base += span.count;
    }
    None
}
