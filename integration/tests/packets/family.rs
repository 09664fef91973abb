//! What a case needs of its address family beyond the frames' layout (`FrameAddress`): the test
//! bed's addresses and policy, the family's NAT table, and its ICMP errors. With it each case is
//! written once and runs in both families, as `<case>::ipv4` and `<case>::ipv6`.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    ops::Range,
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use masq_agent::{
    dataplane::{
        NatUsage,
        ebpf::{
            expiry::{self, Timeouts},
            flow_table::Table,
            map_types::NatFamily,
            testbed::TestBed,
        },
    },
    policy::{Action, IpFamily as PolicyFamily, Rules},
};
use masq_ebpf::{Address, NatEntry, NatKey, SweepReport, nat_kind};
use masq_testbed::packet::*;

/// The NAT ports of the default test bed, each `(first, last)`.
pub const SPANS: [(u16, u16); 2] = [(1024, 32767), (61000, 65535)];

/// A prefix as the tries hold it: its length, and its network address.
pub type Prefix<A> = (u32, A);

/// An ICMP error as the family writes it: type, code, and the four bytes after the checksum.
pub type ErrorKind = (u8, u8, [u8; 4]);

pub trait HarnessFamily: FrameAddress {
    /// How the NAT table holds the family's addresses.
    type Octets: Address;
    /// The family's prefixes, as the agent's policy holds them.
    type Net: Copy + Into<IpNet> + std::str::FromStr<Err = ipnet::AddrParseError>;

    const NODE: Self;
    /// Two pods, in different pod prefixes, and the pods' gateway on the node.
    const POD: Self;
    const POD2: Self;
    const POD_GATEWAY: Self;
    /// Two outside hosts, in different prefixes, and the router in front of the first.
    const REMOTE: Self;
    const REMOTE2: Self;
    const ROUTER: Self;
    /// A service address, inside the non-masquerade prefixes.
    const SERVICE: Self;
    /// A link-local host and a multicast group: addresses no connection is opened to.
    const LINK_LOCAL: Self;
    const ALL_NODES: Self;
    /// The non-masquerade prefixes of the test bed, and the prefixes of `REMOTE` and
    /// `REMOTE2`, which policy changes add.
    const POLICY: &'static [&'static str];
    const REMOTE_NET: Prefix<Self>;
    const REMOTE2_NET: Prefix<Self>;

    /// Too big for the next hop (IPv4's fragmentation needed, IPv6's packet too big), with
    /// the MTU the router reports.
    const TOO_BIG: ErrorKind;
    const PORT_UNREACHABLE: ErrorKind;
    const TIME_EXCEEDED: ErrorKind;
    /// A parameter problem, pointing into the quoted packet's IP header.
    const PARAMETER_PROBLEM: ErrorKind;
    /// How much of a packet an error may quote (RFC 1812 §4.3.2.3: 576 bytes of error for
    /// IPv4; RFC 4443 §2.4: 1280 for IPv6), less the error's own headers.
    const QUOTE_LIMIT: usize;

    fn octets(self) -> Self::Octets;
    fn from_octets(octets: Self::Octets) -> Self;
    /// The real object with fresh maps, configured as the agent would: the NAT ports, the
    /// node's address and `POLICY`, in this family (and, for IPv6, in IPv4 too).
    /// A bed of `nat_entries` entries a family, in the NAT table the environment asks for.
    fn bed(nat_entries: u32, spans: &[(u16, u16)], random_fully: bool) -> TestBed {
        Self::configure(
            TestBed::unconfigured(nat_entries).unwrap(),
            spans,
            random_fully,
        )
    }
    /// As `bed`, the halves in the hash table whatever the environment asks: for what only it
    /// has (the drop sample a full table looks at).
    fn bed_in_hash_table(nat_entries: u32, spans: &[(u16, u16)], random_fully: bool) -> TestBed {
        let unconfigured = TestBed::unconfigured_in(nat_entries, false).unwrap();
        Self::configure(unconfigured, spans, random_fully)
    }
    /// `bed`'s configuration of an unconfigured bed.
    fn configure(unconfigured: TestBed, spans: &[(u16, u16)], random_fully: bool) -> TestBed;
    /// The family, as the agent's policy names it.
    const POLICY_FAMILY: PolicyFamily;
    /// The prefixes draining out of the policy.
    fn draining(bed: &TestBed) -> Vec<Prefix<Self>>;
    /// The flows in the other family's NAT table.
    fn other_family_entries(bed: &TestBed) -> usize;
    /// `frame` with its upper layer moved behind optional IP headers (one word of IPv4
    /// options, an IPv6 destination options header), checksums right again.
    fn with_header_options(frame: &[u8]) -> Vec<u8>;

    // The family's NAT table. (Each family implements these with `nat_table_of!`: a bound on
    // `NatKey<Self::Octets>` written on the trait would not reach the callers.)
    fn nat(bed: &TestBed) -> Table<Self::Octets>;
    fn nat_entry(bed: &TestBed, key: &NatKey<Self::Octets>) -> Option<NatEntry<Self::Octets>>;
    fn remove(bed: &mut TestBed, key: &NatKey<Self::Octets>);
    /// Writes `entry` under `key`, as no program would.
    fn plant(bed: &mut TestBed, key: &NatKey<Self::Octets>, entry: NatEntry<Self::Octets>);
    /// The agent's sweep at `now_ns`.
    /// Sweeps the table as the agent does: with the sweep program where the kernel runs it,
    /// which must remove what the agent's rules in userspace remove from the same table.
    fn expire(bed: &mut TestBed, timeouts: &Timeouts, now_ns: u64) -> NatUsage;
    /// What the sweep program last reported of the family's table: all zeros until it first
    /// walks it, and where the agent sweeps in userspace.
    fn sweep_report(bed: &TestBed) -> SweepReport;
    /// The agent forgetting the flows on a node address it no longer has.
    fn forget_address(bed: &TestBed, addr: Self) -> usize;
    /// The drop sample, slot by slot.
    fn drop_sample(bed: &TestBed) -> Vec<NatKey<Self::Octets>>;
    /// Whether the family's full table looks at the drop sample (its halves are in the hash
    /// table), or at the new flow's buckets (the slot table).
    fn has_drop_sample(bed: &TestBed) -> bool;
    /// Empties every slot of the drop sample, as new flows writing over its slots make it
    /// forget the flows it held.
    fn forget_drop_sample(bed: &TestBed);
    /// The slot of the drop sample a drop freed and no new flow took yet.
    fn drop_vacancy(bed: &TestBed) -> Option<u32>;
    /// Names `slot` as such a slot, as a drop on another CPU would.
    fn set_drop_vacancy(bed: &mut TestBed, slot: Option<u32>);
}

/// Checks that a sweep took from `before` exactly the keys `expected` and left `after`.
pub fn same_removal<A: Address + std::hash::Hash>(
    before: &[(NatKey<A>, NatEntry<A>)],
    after: &[(NatKey<A>, NatEntry<A>)],
    expected: Vec<NatKey<A>>,
) {
    use std::collections::HashSet;
    let keys = |table: &[(NatKey<A>, NatEntry<A>)]| -> HashSet<NatKey<A>> {
        table.iter().map(|(key, _)| *key).collect()
    };
    let removed: HashSet<_> = keys(before).difference(&keys(after)).copied().collect();
    let expected: HashSet<_> = expected.into_iter().collect();
    assert_eq!(
        removed, expected,
        "the sweep program removed what the agent's rules remove"
    );
}

/// `HarnessFamily`'s NAT table methods for the family whose table holds `$octets`.
macro_rules! nat_table_of {
    ($octets:ty) => {
        fn nat(bed: &TestBed) -> Table<$octets> {
            bed.nat_table()
        }
        fn nat_entry(bed: &TestBed, key: &NatKey<$octets>) -> Option<NatEntry<$octets>> {
            bed.nat_entry(key)
        }
        fn remove(bed: &mut TestBed, key: &NatKey<$octets>) {
            <$octets as NatFamily>::table_mut(&mut bed.maps.nat)
                .remove(key)
                .unwrap();
        }
        fn plant(bed: &mut TestBed, key: &NatKey<$octets>, entry: NatEntry<$octets>) {
            <$octets as NatFamily>::table_mut(&mut bed.maps.nat)
                .write(key, &entry)
                .unwrap();
        }
        fn sweep_report(bed: &TestBed) -> SweepReport {
            bed.sweep_report::<$octets>()
        }
        fn expire(bed: &mut TestBed, timeouts: &Timeouts, now_ns: u64) -> NatUsage {
            let before = bed.nat_table::<$octets>();
            let Some((usage, node_side_ports)) =
                bed.expire_in_kernel::<$octets>(timeouts, now_ns).unwrap()
            else {
                let table = <$octets as NatFamily>::table(&bed.maps.nat);
                let sample = <$octets as NatFamily>::drop_sample(&bed.maps.drop_samples);
                return expiry::expire(table, Some(sample), timeouts, now_ns).unwrap();
            };
            // What it removed is checked below, key by key.
            let read = NatUsage {
                expired_flows: usage.expired_flows,
                orphans_removed: usage.orphans_removed,
                ..expiry::usage(&before)
            };
            assert_eq!(
                usage, read,
                "the sweep program counts what a read of the table counts"
            );
            assert!(
                node_side_ports == TestBed::node_side_ports_in(&before),
                "the sweep program finds the node-side ports a read of the table finds"
            );
            let after = bed.nat_table::<$octets>();
            crate::family::same_removal(
                &before,
                &after,
                expiry::removed_by_sweep(&before, timeouts, now_ns),
            );
            usage
        }
        fn forget_address(bed: &TestBed, addr: Self) -> usize {
            let table = <$octets as NatFamily>::table(&bed.maps.nat);
            expiry::forget_address(table, addr.octets()).unwrap()
        }
        fn has_drop_sample(bed: &TestBed) -> bool {
            bed.has_drop_sample::<$octets>()
        }
        fn drop_sample(bed: &TestBed) -> Vec<NatKey<$octets>> {
            let sample = <$octets as NatFamily>::drop_sample(&bed.maps.drop_samples);
            (0..sample.len())
                .map(|slot| sample.get(&slot, 0).unwrap())
                .collect()
        }
        fn forget_drop_sample(bed: &TestBed) {
            let sample = <$octets as NatFamily>::drop_sample(&bed.maps.drop_samples);
            let empty = vec![NatKey::<$octets>::default(); sample.len() as usize];
            let map = aya::maps::IterableMap::map(sample);
            masq_agent::dataplane::ebpf::batch::fill_array(map, &empty).unwrap();
        }
        fn drop_vacancy(bed: &TestBed) -> Option<u32> {
            let vacancies = &bed.maps.drop_samples.vacancies;
            let named = vacancies
                .get(&<$octets as NatFamily>::DROP_VACANCY, 0)
                .unwrap();
            masq_ebpf::drop_vacancy::named(named)
        }
        fn set_drop_vacancy(bed: &mut TestBed, slot: Option<u32>) {
            let vacancies = &mut bed.maps.drop_samples.vacancies;
            let named = slot.map_or(
                masq_ebpf::drop_vacancy::NONE,
                masq_ebpf::drop_vacancy::naming,
            );
            vacancies
                .set(<$octets as NatFamily>::DROP_VACANCY, named, 0)
                .unwrap();
        }
    };
}

impl HarnessFamily for Ipv4Addr {
    type Octets = [u8; 4];
    type Net = Ipv4Net;
    const POLICY_FAMILY: PolicyFamily = PolicyFamily::Ipv4;
    nat_table_of!([u8; 4]);

    const NODE: Self = Ipv4Addr::new(203, 0, 113, 1);
    const POD: Self = Ipv4Addr::new(10, 244, 1, 2);
    const POD2: Self = Ipv4Addr::new(10, 244, 2, 2);
    const POD_GATEWAY: Self = Ipv4Addr::new(10, 244, 1, 1);
    const REMOTE: Self = Ipv4Addr::new(203, 0, 113, 10);
    const REMOTE2: Self = Ipv4Addr::new(198, 51, 100, 10);
    const ROUTER: Self = Ipv4Addr::new(203, 0, 113, 254);
    const SERVICE: Self = Ipv4Addr::new(10, 96, 0, 1);
    const LINK_LOCAL: Self = Ipv4Addr::new(169, 254, 169, 254);
    const ALL_NODES: Self = Ipv4Addr::new(224, 0, 0, 1);
    const POLICY: &'static [&'static str] = &["169.254.0.0/16", "10.0.0.0/8"];
    const REMOTE_NET: Prefix<Self> = (24, Ipv4Addr::new(203, 0, 113, 0));
    const REMOTE2_NET: Prefix<Self> = (24, Ipv4Addr::new(198, 51, 100, 0));

    const TOO_BIG: ErrorKind = (3, 4, [0, 0, 0x05, 0x78]);
    const PORT_UNREACHABLE: ErrorKind = (3, 3, [0; 4]);
    const TIME_EXCEEDED: ErrorKind = (11, 0, [0; 4]);
    const PARAMETER_PROBLEM: ErrorKind = (12, 0, [20, 0, 0, 0]);
    const QUOTE_LIMIT: usize = 576 - 28;

    fn octets(self) -> [u8; 4] {
        Ipv4Addr::octets(&self)
    }

    fn from_octets(octets: [u8; 4]) -> Self {
        Ipv4Addr::from(octets)
    }

    fn configure(unconfigured: TestBed, spans: &[(u16, u16)], random_fully: bool) -> TestBed {
        TestBed::configured(
            unconfigured,
            spans,
            random_fully,
            Self::NODE,
            &nets::<Self>(Self::POLICY),
        )
        .unwrap()
    }

    fn draining(bed: &TestBed) -> Vec<Prefix<Self>> {
        let keys = bed
            .maps
            .policy
            .v4
            .draining
            .as_ref()
            .expect("a draining trie")
            .keys();
        keys.map(|k| k.map(|k| (k.prefix_len(), k.data().into())).unwrap())
            .collect()
    }

    fn other_family_entries(bed: &TestBed) -> usize {
        bed.nat_v6().len()
    }

    fn with_header_options(frame: &[u8]) -> Vec<u8> {
        let mut f = frame[..L4].to_vec();
        f[IP] = 0x46;
        let total = word(&f, IP + 2) + 4;
        f[IP + 2..IP + 4].copy_from_slice(&total.to_be_bytes());
        // Three no-operations and an end of list.
        f.extend([1, 1, 1, 0]);
        f[IP + 10..IP + 12].copy_from_slice(&[0, 0]);
        let c = checksum(&f[IP..L4 + 4]);
        f[IP + 10..IP + 12].copy_from_slice(&c.to_be_bytes());
        f.extend(&frame[L4..]);
        f
    }
}

impl HarnessFamily for Ipv6Addr {
    type Octets = [u8; 16];
    type Net = Ipv6Net;
    const POLICY_FAMILY: PolicyFamily = PolicyFamily::Ipv6;
    nat_table_of!([u8; 16]);

    const NODE: Self = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
    const POD: Self = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
    const POD2: Self = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 2);
    const POD_GATEWAY: Self = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 1);
    const REMOTE: Self = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);
    const REMOTE2: Self = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10);
    const ROUTER: Self = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0xfe);
    const SERVICE: Self = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 1);
    const LINK_LOCAL: Self = Ipv6Addr::new(0xfe80, 0, 0, 0, 0x200, 0xff, 0xfe00, 2);
    const ALL_NODES: Self = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    const POLICY: &'static [&'static str] = &["fd00::/8", "fe80::/10"];
    const REMOTE_NET: Prefix<Self> = (64, Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0));
    const REMOTE2_NET: Prefix<Self> = (64, Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0));

    const TOO_BIG: ErrorKind = (ICMPV6_PACKET_TOO_BIG, 0, [0, 0, 0x05, 0x00]);
    const PORT_UNREACHABLE: ErrorKind = (ICMPV6_DEST_UNREACH, 4, [0; 4]);
    const TIME_EXCEEDED: ErrorKind = (ICMPV6_TIME_EXCEEDED, 0, [0; 4]);
    const PARAMETER_PROBLEM: ErrorKind = (ICMPV6_PARAMETER_PROBLEM, 0, [0, 0, 0, 6]);
    const QUOTE_LIMIT: usize = 1280 - 48;

    fn octets(self) -> [u8; 16] {
        Ipv6Addr::octets(&self)
    }

    fn from_octets(octets: [u8; 16]) -> Self {
        Ipv6Addr::from(octets)
    }

    fn configure(unconfigured: TestBed, spans: &[(u16, u16)], random_fully: bool) -> TestBed {
        let node_v4 = <Ipv4Addr as HarnessFamily>::NODE;
        let mut bed = TestBed::configured(
            unconfigured,
            spans,
            random_fully,
            node_v4,
            &nets::<Ipv4Addr>(<Ipv4Addr as HarnessFamily>::POLICY),
        )
        .unwrap();
        bed.enable_ipv6(Self::NODE, &nets::<Self>(Self::POLICY))
            .unwrap();
        bed
    }

    fn draining(bed: &TestBed) -> Vec<Prefix<Self>> {
        let keys = bed
            .maps
            .policy
            .v6
            .draining
            .as_ref()
            .expect("a draining trie")
            .keys();
        keys.map(|k| k.map(|k| (k.prefix_len(), k.data().into())).unwrap())
            .collect()
    }

    fn other_family_entries(bed: &TestBed) -> usize {
        bed.nat().len()
    }

    fn with_header_options(frame: &[u8]) -> Vec<u8> {
        insert_ext6(frame, &[ExtHeader::destination_options(1)])
    }
}

/// Applies the family's non-masquerade prefixes and exceptions (`masqueradeCIDRs`) the way the
/// data plane does.
pub fn set_policy<F: HarnessFamily>(bed: &mut TestBed, non_masq: &[F::Net], exceptions: &[F::Net]) {
    let with = |action| move |n: &F::Net| ((*n).into(), action);
    let rules: Rules = (non_masq.iter().map(with(Action::NonMasquerade)))
        .chain(exceptions.iter().map(with(Action::Masquerade)))
        .collect();
    bed.maps.policy.set_rules(F::POLICY_FAMILY, &rules).unwrap();
}

/// The family's prefixes in `list`.
pub fn nets<F: HarnessFamily>(list: &[&str]) -> Vec<F::Net> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

/// The test bed's policy with the prefix `(len, network)` added.
pub fn policy_with<F: HarnessFamily>((len, network): Prefix<F>) -> Vec<F::Net> {
    let mut policy = nets::<F>(F::POLICY);
    policy.push(format!("{network}/{len}").parse().unwrap());
    policy
}

/// The default test bed: `SPANS`, fully random ports, room for 1024 entries.
pub fn harness<F: HarnessFamily>() -> TestBed {
    F::bed(1024, &SPANS, true)
}

/// The pods' ports of the flows in the family's NAT table, sorted.
pub fn pod_ports<F: HarnessFamily>(h: &TestBed) -> Vec<u16> {
    let mut ports: Vec<u16> = F::nat(h)
        .iter()
        .filter(|(k, _)| k.direction == masq_ebpf::direction::EGRESS)
        .map(|(k, _)| u16::from_be(k.sport))
        .collect();
    ports.sort();
    ports
}

pub fn in_spans(port: u16) -> bool {
    SPANS.iter().any(|&(a, b)| (a..=b).contains(&port))
}

pub fn key<F: HarnessFamily>(
    (saddr, sport): (F, u16),
    (daddr, dport): (F, u16),
    proto: u8,
    direction: u8,
) -> NatKey<F::Octets> {
    NatKey {
        saddr: saddr.octets(),
        daddr: daddr.octets(),
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        direction,
        _pad: [0; 2],
    }
}

/// The entry under `key`: an SNAT entry to (`addr`, `port`), with its last packet's time.
pub fn assert_snat_entry<F: HarnessFamily>(
    h: &TestBed,
    key: &NatKey<F::Octets>,
    addr: F,
    port: u16,
) {
    let entry = F::nat_entry(h, key).unwrap_or_else(|| panic!("no NAT entry for {key:?}"));
    assert_eq!(F::from_octets(entry.addr), addr, "{key:?}");
    assert_eq!(u16::from_be(entry.port), port, "{key:?}");
    assert_eq!(entry.kind, nat_kind::SNAT, "{key:?}");
    assert!(entry.last_seen_ns > 0, "{key:?}");
}

/// The address at `at` and, in IPv4, the header checksum that covers it: what rewriting an
/// address may change in the IP header.
pub fn address_fields<F: HarnessFamily>(at: usize) -> Vec<Range<usize>> {
    let mut fields = vec![range(at, F::ADDR_LEN)];
    fields.extend(F::IP_CHECKSUM.map(|c| range(c, 2)));
    fields
}

/// The source address, source port and TCP or UDP checksum of a frame whose upper layer starts
/// at `l4`: what an egress translation may change.
pub fn egress_fields<F: HarnessFamily>(l4: usize, proto: u8) -> Vec<Range<usize>> {
    let mut fields = address_fields::<F>(F::SRC);
    fields.extend([range(l4, 2), range(l4 + l4_checksum_offset(proto), 2)]);
    fields
}

/// The destination address, destination port and checksum: what an ingress translation may
/// change.
pub fn ingress_fields<F: HarnessFamily>(l4: usize, proto: u8) -> Vec<Range<usize>> {
    let mut fields = address_fields::<F>(F::DST);
    fields.extend([range(l4 + 2, 2), range(l4 + l4_checksum_offset(proto), 2)]);
    fields
}

/// The checksum fields `assert_frame` compares as numbers: the upper layer's at `l4_checksum`,
/// and the IP header's where the family has one.
pub fn checksums<F: HarnessFamily>(l4_checksum: usize) -> Vec<usize> {
    F::IP_CHECKSUM.into_iter().chain([l4_checksum]).collect()
}

/// An ICMP error from `from` to `to`, quoting the first `quote_len` bytes of the IP packet in
/// the frame `quoted`.
pub fn icmp_error<F: HarnessFamily>(
    (from, to): (F, F),
    (kind, code, rest): ErrorKind,
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    icmp_frame(from, to, kind, code, rest, &quoted[IP..IP + quote_len])
}

/// Where the checksums of an ICMP error sit: the outer IP header's (IPv4), the ICMP message's,
/// the quoted IP header's (IPv4), and the quoted upper layer's when the quote holds it.
pub fn error_checksums<F: HarnessFamily>(error: &[u8]) -> Vec<usize> {
    let outer = F::packet_at(error, IP).expect("the error parses");
    let inner = outer.l4 + 8;
    let quote = F::packet_at(error, inner).expect("the quote parses");
    let mut at = F::IP_CHECKSUM.into_iter().collect::<Vec<_>>();
    at.push(outer.l4 + 2);
    at.extend(F::IP_CHECKSUM.map(|c| c - IP + inner));
    at.push(quote.l4 + l4_checksum_offset(quote.proto));
    at.retain(|&c| c + 2 <= error.len());
    at
}

/// Cases written once over both families: each runs as `<case>::ipv4` and `<case>::ipv6`, the
/// halves where the agent keeps them here (in the slot table where the kernel has BPF atomics
/// on map values, 5.12), and as `<case>::ipv4_hash_table` and `<case>::ipv6_hash_table`, the
/// halves in the hash table, as an older kernel keeps them.
macro_rules! in_both_families {
    ($($case:ident),* $(,)?) => {
        $(mod $case {
            #[test]
            fn ipv4() {
                super::$case::<std::net::Ipv4Addr>()
            }
            #[test]
            fn ipv4_hash_table() {
                masq_agent::dataplane::ebpf::testbed::TestBed::in_table(
                    false,
                    super::$case::<std::net::Ipv4Addr>,
                )
            }
            #[test]
            fn ipv6() {
                super::$case::<std::net::Ipv6Addr>()
            }
            #[test]
            fn ipv6_hash_table() {
                masq_agent::dataplane::ebpf::testbed::TestBed::in_table(
                    false,
                    super::$case::<std::net::Ipv6Addr>,
                )
            }
        })*
    };
}
pub(crate) use in_both_families;
