//! Large non-masquerade policies for the benchmarks: deterministic, so every run measures the
//! same tables.

use std::net::Ipv4Addr;

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

/// A config file with `count` random prefixes and a `cidrLimit` that admits them, with room for
/// a few more.
pub fn config(count: usize) -> String {
    let limit = count.max(64) + 16;
    let mut text = format!("cidrLimit: {limit}\nresyncInterval: 60s\nnonMasqueradeCIDRs:\n");
    for prefix in random(count) {
        text.push_str("  - ");
        text.push_str(&prefix);
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
