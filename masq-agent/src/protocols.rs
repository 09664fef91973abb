//! IP protocols by name, as iptables and people write them, and by number.

use masq_ebpf::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP};

/// Names and numbers (IANA); the first name of a number is the one printed.
const NAMES: [(&str, u8); 6] = [
    ("tcp", IPPROTO_TCP),
    ("udp", IPPROTO_UDP),
    ("icmp", IPPROTO_ICMP),
    ("icmpv6", IPPROTO_ICMPV6),
    ("ipv6-icmp", IPPROTO_ICMPV6),
    ("sctp", 132),
];

/// A protocol's number, from its name or its number written out.
pub fn number(name: &str) -> Option<u8> {
    NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, number)| *number)
        .or_else(|| name.parse().ok())
}

/// An IP protocol, by its number; shown, and serialized, as people name it (`name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Protocol(pub u8);

impl Protocol {
    /// From its name or its number written out, as iptables lists it.
    pub fn parse(name: &str) -> Option<Protocol> {
        number(name).map(Protocol)
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&name(self.0))
    }
}

impl serde::Serialize for Protocol {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// A protocol as people name it: its name, or `protocol N`.
pub fn name(number: u8) -> String {
    NAMES.iter().find(|(_, n)| *n == number).map_or_else(
        || format!("protocol {number}"),
        |(name, _)| name.to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers() {
        assert_eq!(number("tcp"), Some(6));
        assert_eq!(number("ipv6-icmp"), Some(58));
        assert_eq!(number("47"), Some(47));
        assert_eq!(number("gre?"), None);
        assert_eq!(name(58), "icmpv6");
        assert_eq!(name(47), "protocol 47");
    }
}
