//! Large non-masquerade policies for the benchmarks: deterministic, so every run measures the
//! same tables.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::topology;

/// A small deterministic generator: the same prefixes on every run, the same cases in a test.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `count` prefixes as `a.b.c.d/len` strings: 10.0.0.0/8 and 169.254.0.0/16 first (so cluster
/// destinations hit), then random prefixes of lengths 12 to 32 that cover none of the test bed's
/// outside or node addresses, so that traffic to them walks the whole policy and is masqueraded.
pub fn random(count: usize) -> Vec<String> {
    let keep_clear = [
        topology::EXT_ADDR,
        topology::EXT_SECOND_ADDR,
        topology::NODE_UPLINK,
        topology::FAR_ADDR,
    ];
    let mut out = vec!["10.0.0.0/8".to_string(), "169.254.0.0/16".to_string()];
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    while out.len() < count {
        let len = 12 + (rng.next_u64() % 21) as u32;
        let mask = u32::MAX << (32 - len);
        let network = (rng.next_u64() as u32) & mask;
        if keep_clear.iter().any(|a| u32::from(*a) & mask == network) {
            continue;
        }
        out.push(format!("{}/{len}", Ipv4Addr::from(network)));
    }
    out.truncate(count.max(1));
    out
}

/// `count` IPv6 prefixes as `addr/len` strings: fd00::/8 and fe80::/10 first (so cluster
/// destinations hit), then random prefixes of lengths 24 to 64 outside both and outside
/// 2001:db8::/32, which holds the test bed's outside and node addresses, so that traffic there
/// walks the whole policy and is masqueraded.
pub fn random_v6(count: usize) -> Vec<String> {
    let keep_clear: [(u128, u32); 3] = [
        (0xfd << 120, 8),
        (0xfe80 << 112, 10),
        (0x2001_0db8 << 96, 32),
    ];
    let mut out = vec!["fd00::/8".to_string(), "fe80::/10".to_string()];
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    while out.len() < count {
        let len = 24 + (rng.next_u64() % 41) as u32;
        let mask = u128::MAX << (128 - len);
        let network = ((u128::from(rng.next_u64()) << 64) | u128::from(rng.next_u64())) & mask;
        // Two prefixes overlap where they agree on the bits of the shorter.
        let overlaps = |&(clear, bits): &(u128, u32)| {
            let common = 128 - len.min(bits);
            network >> common == clear >> common
        };
        if keep_clear.iter().any(overlaps) {
            continue;
        }
        out.push(format!("{}/{len}", Ipv6Addr::from(network)));
    }
    out.truncate(count.max(1));
    out
}

/// A config file with `count` random prefixes and a `cidrLimit` that admits them, with room for
/// a few more.
pub fn config(count: usize) -> String {
    config_of(&random(count))
}

/// The same with `count` random IPv6 prefixes besides (`random_v6`): a policy of that size in
/// each family, for an agent that translates IPv6 too.
pub fn config_both_families(count: usize) -> String {
    config_of(&[random(count), random_v6(count)].concat())
}

/// A config file with `prefixes` and a `cidrLimit` that admits them, with room for a few more.
fn config_of(prefixes: &[String]) -> String {
    let limit = prefixes.len().max(64) + 16;
    let mut text = format!("cidrLimit: {limit}\nresyncInterval: 60s\nnonMasqueradeCIDRs:\n");
    for prefix in prefixes {
        text.push_str("  - ");
        text.push_str(prefix);
        text.push('\n');
    }
    text
}

/// The same with a quarter of the prefixes (each one once) as exceptions (`masqueradeCIDRs`)
/// instead: a large policy of both actions.
pub fn config_with_exceptions(count: usize) -> String {
    let limit = count.max(64) + 16;
    let mut seen = std::collections::HashSet::new();
    let unique: Vec<String> = random(count)
        .into_iter()
        .filter(|p| seen.insert(p.clone()))
        .collect();
    // The first two stay non-masquerade: cluster destinations hit them.
    let (mut non_masq, mut masq) = (String::new(), String::new());
    for (i, prefix) in unique.iter().enumerate() {
        let list = if i >= 2 && i % 4 == 0 {
            &mut masq
        } else {
            &mut non_masq
        };
        list.push_str(&format!("  - {prefix}\n"));
    }
    format!(
        "cidrLimit: {limit}\nresyncInterval: 60s\nnonMasqueradeCIDRs:\n{non_masq}masqueradeCIDRs:\n{masq}"
    )
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use super::config_both_families;
    use crate::topology;

    #[test]
    fn a_config_of_both_families_holds_the_count_in_each_and_admits_them_all() {
        let text = config_both_families(100);
        let config: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        let cidrs: Vec<&str> = config["nonMasqueradeCIDRs"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        let ipv6 = cidrs.iter().filter(|c| c.contains(':')).count();
        assert_eq!((cidrs.len() - ipv6, ipv6), (100, 100));
        assert!(config["cidrLimit"].as_u64().unwrap() >= 200);
    }

    #[test]
    fn random_v6_prefixes_leave_the_outside_hosts_to_be_masqueraded() {
        let prefixes = super::random_v6(2_000);
        assert_eq!(prefixes.len(), 2_000);
        assert_eq!(prefixes[..2], ["fd00::/8", "fe80::/10"]);
        let outside = [
            topology::EXT_ADDR_V6,
            topology::NODE_UPLINK_V6,
            topology::FAR_ADDR_V6,
        ];
        for prefix in &prefixes[2..] {
            let (addr, len) = prefix.split_once('/').expect("addr/len");
            let (addr, len): (Ipv6Addr, u32) = (addr.parse().unwrap(), len.parse().unwrap());
            assert!((24..=64).contains(&len), "{prefix}");
            let mask = u128::MAX << (128 - len);
            assert_eq!(u128::from(addr) & !mask, 0, "{prefix}: a network address");
            for host in outside
                .iter()
                .chain(&[Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 10)])
            {
                assert_ne!(
                    u128::from(*host) & mask,
                    u128::from(addr),
                    "{prefix} holds {host}"
                );
            }
        }
    }
}
