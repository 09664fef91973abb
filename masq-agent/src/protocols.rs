//! IP protocols by name, as iptables and people write them, and by number.

/// Names and numbers (IANA); the first name of a number is the one printed.
const NAMES: [(&str, u8); 6] = [
    ("tcp", 6),
    ("udp", 17),
    ("icmp", 1),
    ("icmpv6", 58),
    ("ipv6-icmp", 58),
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
