//! NAT state: the two halves of every translated flow in `nat_v4` or `nat_v6`, how they are
//! created, found and kept fresh. The reply-direction half is created first, with `BPF_NOEXIST`, so two CPUs can
//! never hand the same port to two flows.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_coarse_ns, programs::TcContext};
use masq_ebpf::{Address, Counter, NatEntry, NatKey, Settings, nat_kind, tcp_seen};

use crate::{family::Family, maps, ports, verifier};

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
pub fn key<A>(saddr: A, daddr: A, proto: u8, sport: u16, dport: u16, dir: u8) -> NatKey<A> {
    NatKey {
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
pub fn lookup<F: Family>(key: &NatKey<F::Addr>) -> Option<*mut NatEntry<F::Addr>> {
    F::nat().get_ptr_mut(key)
}

/// Records that the flow is alive, and how far a TCP connection has got.
#[inline(always)]
pub fn refresh<A: Address>(entry: *mut NatEntry<A>, progress: u8) {
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
pub fn create_snat<F: Family>(
    ctx: &TcContext,
    egress_key: &NatKey<F::Addr>,
    node_addr: F::Addr,
    settings: &Settings,
    progress: u8,
) -> Result<NatEntry<F::Addr>, AllocError> {
    let mut egress = NatEntry {
        last_seen_ns: now_ns(),
        addr: node_addr,
        port: 0,
        kind: nat_kind::SNAT,
        tcp_seen: progress,
        _pad: Default::default(),
    };
    match reserve_port::<F>(ctx, egress_key, &mut egress, settings) {
        RESERVED => {
            let ingress_key = egress_key.reverse(&egress);
            publish_egress::<F>(egress_key, &ingress_key, egress)
        }
        PORTS_EXHAUSTED => {
            maps::count(Counter::AllocationFailed);
            Err(AllocError::PortsExhausted)
        }
        _ => Err(AllocError::TableFull),
    }
}

const RESERVED: u32 = 0;
const PORTS_EXHAUSTED: u32 = 1;
const TABLE_FULL: u32 = 2;

step! {
/// Finds `egress` a free port and reserves it by inserting the flow's reply half. A function
/// of its own, taking references and returning a plain code: a BPF function gets five
/// registers and no stack arguments, and its frame is not added to its callers' all at once.
fn reserve_port<F: Family>(
    ctx: &TcContext,
    egress_key: &NatKey<F::Addr>,
    egress: &mut NatEntry<F::Addr>,
    settings: &Settings,
) -> u32 {
    // The reply half differs from one attempt to the next only in its port.
    let mut ingress_key = egress_key.reverse(egress);
    let ingress = NatEntry {
        addr: egress_key.saddr,
        port: egress_key.sport,
        ..*egress
    };
    // Each span a port may come from is a path of its own for the verifier, and every attempt
    // would multiply them.
    let start = verifier::forget(ctx, ports::first_offset(settings, egress_key.sport));
    for attempt in 0..ports::MAX_ATTEMPTS {
        let port = ports::candidate(settings, start, attempt);
        ingress_key.dport = verifier::forget(ctx, u32::from(port)) as u16;
        // By reference: copies for the helper would take the frame past the verifier's limit.
        let (key, value) = (&ingress_key, &ingress);
        match F::nat().insert(key, value, BPF_NOEXIST as u64) {
            Ok(()) => {
                egress.port = ingress_key.dport;
                return RESERVED;
            }
            Err(EEXIST) => continue,
            Err(_) => return TABLE_FULL,
        }
    }
    PORTS_EXHAUSTED
}
}

/// Inserts the egress half once its port is reserved. If another CPU translated the same flow
/// meanwhile, its translation wins and our reservation is released.
#[inline(always)]
fn publish_egress<F: Family>(
    egress_key: &NatKey<F::Addr>,
    ingress_key: &NatKey<F::Addr>,
    egress: NatEntry<F::Addr>,
) -> Result<NatEntry<F::Addr>, AllocError> {
    match F::nat().insert(egress_key, egress, BPF_NOEXIST as u64) {
        Ok(()) => Ok(egress),
        Err(err) => {
            let _ = F::nat().remove(ingress_key);
            match (err, lookup::<F>(egress_key)) {
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
pub fn track_passthrough<F: Family>(egress_key: &NatKey<F::Addr>, progress: u8) -> bool {
    let now = now_ns();
    let egress = NatEntry {
        last_seen_ns: now,
        addr: egress_key.saddr,
        port: egress_key.sport,
        kind: nat_kind::PASSTHROUGH,
        tcp_seen: progress,
        _pad: Default::default(),
    };
    let ingress_key = egress_key.reverse(&egress);
    let ingress = NatEntry {
        addr: ingress_key.daddr,
        port: ingress_key.dport,
        ..egress
    };
    let nat = F::nat();
    // Egress half first: if the pod already has a masqueraded flow with this tuple, keep it.
    if nat.insert(egress_key, egress, BPF_NOEXIST as u64).is_err() {
        return false;
    }
    if nat
        .insert(ingress_key, ingress, BPF_NOEXIST as u64)
        .is_err()
    {
        let _ = nat.remove(egress_key);
        return false;
    }
    true
}

/// The pod-side tuple of a flow whose first packet came in as `ingress_key`.
#[inline(always)]
pub fn egress_key_of<A: Address>(ingress_key: &NatKey<A>) -> NatKey<A> {
    let identity = NatEntry {
        addr: ingress_key.daddr,
        port: ingress_key.dport,
        ..NatEntry::default()
    };
    ingress_key.reverse(&identity)
}
