//! NAT state: the two halves of every translated flow in `nat_v4`, how they are created, found
//! and kept fresh. The reply-direction half is created first, with `BPF_NOEXIST`, so two CPUs can
//! never hand the same port to two flows.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_coarse_ns};
use masq_ebpf::{Counter, NatEntryV4, NatKeyV4, Settings, nat_kind, tcp_seen};

use crate::{maps, ports};

const EEXIST: i32 = -17;
/// Entries are refreshed at most this often, to keep per-packet writes to shared cache lines
/// rare; expiry works in seconds to hours, so this costs no precision that matters.
const REFRESH_NS: u64 = 1_000_000_000;

/// The time entries are stamped with: CLOCK_MONOTONIC at tick precision, which is all that
/// expiry in seconds needs, and cheaper per packet than the precise clock.
#[inline(always)]
fn now_ns() -> u64 {
    // SAFETY: the helper has no preconditions.
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// Why a new flow could not be given a translation.
pub enum AllocError {
    PortsExhausted,
    TableFull,
}

/// A NAT table key. For ICMP echo, the identifier stands in the pod-side port and the other
/// port is 0.
#[inline(always)]
pub fn key(saddr: [u8; 4], daddr: [u8; 4], proto: u8, sport: u16, dport: u16, dir: u8) -> NatKeyV4 {
    NatKeyV4 {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        direction: dir,
        _pad: [0; 2],
    }
}

/// What the TCP flags byte tells about the connection's progress.
#[inline(always)]
pub fn tcp_progress(flags: u8) -> u8 {
    const FIN: u8 = 0x01;
    const SYN: u8 = 0x02;
    const RST: u8 = 0x04;
    let mut seen = if flags & SYN != 0 {
        tcp_seen::SYN
    } else {
        tcp_seen::ACK
    };
    if flags & FIN != 0 {
        seen |= tcp_seen::FIN;
    }
    if flags & RST != 0 {
        seen |= tcp_seen::RST;
    }
    seen
}

#[inline(always)]
pub fn lookup(key: &NatKeyV4) -> Option<*mut NatEntryV4> {
    maps::NAT_V4.get_ptr_mut(key)
}

/// Records that the flow is alive, and how far a TCP connection has got.
#[inline(always)]
pub fn refresh(entry: *mut NatEntryV4, progress: u8) {
    // SAFETY: `entry` points into a map value; concurrent updates race benignly (both write a
    // recent time, flags only gain bits).
    unsafe {
        let now = now_ns();
        if now.wrapping_sub((*entry).last_seen_ns) > REFRESH_NS {
            (*entry).last_seen_ns = now;
        }
        if (*entry).tcp_seen & progress != progress {
            (*entry).tcp_seen |= progress;
        }
    }
}

/// Gives a new egress flow a port on `node_addr`, creating both halves. Returns the egress half.
#[inline(always)]
pub fn create_snat(
    egress_key: &NatKeyV4,
    node_addr: [u8; 4],
    settings: &Settings,
    progress: u8,
) -> Result<NatEntryV4, AllocError> {
    let now = now_ns();
    let mut start = 0;
    for attempt in 0..ports::MAX_ATTEMPTS {
        let port = ports::candidate(settings, egress_key.sport, attempt, &mut start);
        let egress = NatEntryV4 {
            last_seen_ns: now,
            addr: node_addr,
            port,
            kind: nat_kind::SNAT,
            tcp_seen: progress,
        };
        let ingress_key = egress_key.reverse(&egress);
        let ingress = NatEntryV4 {
            addr: egress_key.saddr,
            port: egress_key.sport,
            ..egress
        };
        match maps::NAT_V4.insert(ingress_key, ingress, BPF_NOEXIST as u64) {
            Ok(()) => return publish_egress(egress_key, &ingress_key, egress),
            Err(EEXIST) => continue,
            Err(_) => return Err(AllocError::TableFull),
        }
    }
    maps::count(Counter::AllocationFailed);
    Err(AllocError::PortsExhausted)
}

/// Inserts the egress half once its port is reserved. If another CPU translated the same flow
/// meanwhile, its translation wins and our reservation is released.
#[inline(always)]
fn publish_egress(
    egress_key: &NatKeyV4,
    ingress_key: &NatKeyV4,
    egress: NatEntryV4,
) -> Result<NatEntryV4, AllocError> {
    match maps::NAT_V4.insert(egress_key, egress, BPF_NOEXIST as u64) {
        Ok(()) => Ok(egress),
        Err(err) => {
            let _ = maps::NAT_V4.remove(ingress_key);
            match (err, lookup(egress_key)) {
                // SAFETY: map value pointer from a successful lookup.
                (EEXIST, Some(winner)) => Ok(unsafe { *winner }),
                _ => Err(AllocError::TableFull),
            }
        }
    }
}

/// Remembers a flow that must never be translated (`egress_key` is its pod-side tuple): a
/// connection opened from outside toward a pod, or one that started unmasqueraded before its
/// destination left the non-masquerade CIDRs. Both halves are identity entries.
#[inline(always)]
pub fn track_passthrough(egress_key: &NatKeyV4, progress: u8) -> bool {
    let now = now_ns();
    let egress = NatEntryV4 {
        last_seen_ns: now,
        addr: egress_key.saddr,
        port: egress_key.sport,
        kind: nat_kind::PASSTHROUGH,
        tcp_seen: progress,
    };
    let ingress_key = egress_key.reverse(&egress);
    let ingress = NatEntryV4 {
        addr: ingress_key.daddr,
        port: ingress_key.dport,
        ..egress
    };
    // Egress half first: if the pod already has a masqueraded flow with this tuple, keep it.
    if maps::NAT_V4
        .insert(egress_key, egress, BPF_NOEXIST as u64)
        .is_err()
    {
        return false;
    }
    if maps::NAT_V4
        .insert(ingress_key, ingress, BPF_NOEXIST as u64)
        .is_err()
    {
        let _ = maps::NAT_V4.remove(egress_key);
        return false;
    }
    true
}

/// The pod-side tuple of a flow whose first packet came in as `ingress_key`.
#[inline(always)]
pub fn egress_key_of(ingress_key: &NatKeyV4) -> NatKeyV4 {
    let identity = NatEntryV4 {
        addr: ingress_key.daddr,
        port: ingress_key.dport,
        ..NatEntryV4::default()
    };
    ingress_key.reverse(&identity)
}
