//! `--to-ports`: the source ports masqueraded flows may use.

use std::fmt;

/// One inclusive port range, `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub fn port_count(&self) -> u32 {
        u32::from(self.last) - u32::from(self.first) + 1
    }
}

impl fmt::Display for PortRange {
    /// iptables syntax: `1024-29999`, or `1024` for a single port.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// A non-empty list of disjoint port ranges, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRanges(Vec<PortRange>);

impl PortRanges {
    /// Parses `1024-29999,32768-65535`-style lists: comma-separated ranges or single ports, each
    /// within 1-65535, low end first, no spaces, no overlaps.
    pub fn parse_flag(s: &str) -> Result<PortRanges, String> {
        let invalid = |why: String| format!("invalid --to-ports {s:?}: {why}");
        if s.is_empty() {
            return Err(invalid("empty list".into()));
        }
        if s.chars().any(char::is_whitespace) {
            return Err(invalid("spaces are not allowed".into()));
        }
        let mut ranges: Vec<PortRange> = Vec::new();
        for item in s.split(',') {
            let range = parse_range(item).map_err(invalid)?;
            if let Some(other) = ranges.iter().find(|r| overlaps(r, &range)) {
                return Err(invalid(format!("{range} overlaps {other}")));
            }
            ranges.push(range);
        }
        Ok(PortRanges(ranges))
    }

    pub fn ranges(&self) -> &[PortRange] {
        &self.0
    }

    pub fn total_ports(&self) -> u32 {
        self.0.iter().map(PortRange::port_count).sum()
    }

    /// For each range, the probability that a rule placed in list order should pick it, given
    /// that no earlier rule did, so the overall choice is uniform over every listed port. The
    /// last range is the fall-through and gets `None`.
    pub fn sequential_probabilities(&self) -> Vec<(PortRange, Option<f64>)> {
        let mut remaining = self.total_ports();
        let last = self.0.len() - 1;
        self.0
            .iter()
            .enumerate()
            .map(|(i, range)| {
                let p = (i != last).then(|| f64::from(range.port_count()) / f64::from(remaining));
                remaining -= range.port_count();
                (*range, p)
            })
            .collect()
    }
}

impl fmt::Display for PortRanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// The ports NAT hands out: `--to-ports` if given, otherwise 1024-65535 minus the node's
/// ephemeral range, so that NAT ports never collide with the node's own connections.
pub fn nat_port_spans(to_ports: Option<&PortRanges>, ephemeral: (u16, u16)) -> Vec<PortRange> {
    if let Some(ranges) = to_ports {
        return ranges.ranges().to_vec();
    }
    let (lo, hi) = ephemeral;
    let mut spans = Vec::new();
    if lo > 1024 {
        spans.push(PortRange {
            first: 1024,
            last: lo - 1,
        });
    }
    if hi < 65535 {
        spans.push(PortRange {
            first: hi.max(1023) + 1,
            last: 65535,
        });
    }
    spans
}

/// Parses `--node-port-range`: one range (`30000-32767`, as kube-proxy's
/// `--service-node-port-range` writes it), or `none`.
/// Whether one of `spans` (NAT's) holds `port`.
pub fn in_spans(spans: &[PortRange], port: u16) -> bool {
    spans.iter().any(|s| (s.first..=s.last).contains(&port))
}

pub fn parse_node_port_range(s: &str) -> Result<NodePortRange, String> {
    if s == "none" {
        return Ok(NodePortRange(None));
    }
    parse_range(s)
        .map(|range| NodePortRange(Some(range)))
        .map_err(|why| {
            format!("invalid --node-port-range {s:?}: {why} (a range such as 30000-32767, or none)")
        })
}

/// `--node-port-range`: kube-proxy's NodePort range, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePortRange(pub Option<PortRange>);

impl fmt::Display for NodePortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(range) => write!(f, "{range}"),
            None => f.write_str("none"),
        }
    }
}

fn parse_range(item: &str) -> Result<PortRange, String> {
    let (first, last) = match item.split_once('-') {
        Some((a, b)) => (parse_port(a)?, parse_port(b)?),
        None => {
            let p = parse_port(item)?;
            (p, p)
        }
    };
    if first > last {
        return Err(format!("range {item} is reversed (use {last}-{first})"));
    }
    Ok(PortRange { first, last })
}

fn parse_port(s: &str) -> Result<u16, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?} is not a port number"));
    }
    match s.parse::<u32>() {
        Ok(p @ 1..=65535) => Ok(p as u16),
        _ => Err(format!("port {s} is outside 1-65535")),
    }
}

fn overlaps(a: &PortRange, b: &PortRange) -> bool {
    a.first <= b.last && b.first <= a.last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(s: &str) -> Vec<(u16, u16)> {
        PortRanges::parse_flag(s)
            .unwrap()
            .ranges()
            .iter()
            .map(|r| (r.first, r.last))
            .collect()
    }

    #[test]
    fn accepts_lists_and_single_ports() {
        assert_eq!(ranges("1024-29999"), [(1024, 29999)]);
        assert_eq!(
            ranges("1024-29999,32768-65535"),
            [(1024, 29999), (32768, 65535)]
        );
        assert_eq!(ranges("1024,65535"), [(1024, 1024), (65535, 65535)]);
        assert_eq!(ranges("1-65535"), [(1, 65535)]);
    }

    #[test]
    fn rejects_bad_lists_with_clear_messages() {
        for (input, expect) in [
            ("2000-1000", "reversed"),
            ("1024 - 2000", "spaces"),
            ("1024, 2000", "spaces"),
            ("0-100", "outside 1-65535"),
            ("1024-65536", "outside 1-65535"),
            ("99999999999", "outside 1-65535"),
            ("", "empty"),
            ("1024,", "not a port"),
            ("a-b", "not a port"),
            ("-5", "not a port"),
            ("+5", "not a port"),
            ("1000-2000,1500-2500", "overlaps"),
        ] {
            let err = PortRanges::parse_flag(input).unwrap_err();
            assert!(err.contains(expect), "{input:?}: {err}");
            assert!(err.contains("--to-ports"), "{input:?}: {err}");
        }
    }

    #[test]
    fn probabilities_are_uniform_over_all_ports() {
        let p = PortRanges::parse_flag("1024-29999,32768-49151,61000-65535").unwrap();
        let probs = p.sequential_probabilities();
        // Each port must be picked with probability 1/total: walk the rule chain.
        let total = f64::from(p.total_ports());
        let mut reach = 1.0;
        for (range, prob) in &probs {
            let pick = prob.unwrap_or(1.0);
            let per_port = reach * pick / f64::from(range.port_count());
            assert!(
                (per_port - 1.0 / total).abs() < 1e-15,
                "{range}: {per_port}"
            );
            reach *= 1.0 - pick;
        }
        assert_eq!(probs.last().unwrap().1, None);
    }

    #[test]
    fn nat_ports_avoid_the_ephemeral_range() {
        let spans = |eph| -> Vec<String> {
            nat_port_spans(None, eph)
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        assert_eq!(spans((32768, 60999)), ["1024-32767", "61000-65535"]);
        assert_eq!(spans((1024, 65535)), Vec::<String>::new());
        assert_eq!(spans((500, 40000)), ["40001-65535"]);
        assert_eq!(spans((40000, 65535)), ["1024-39999"]);
        let given = PortRanges::parse_flag("2000-3000").unwrap();
        assert_eq!(nat_port_spans(Some(&given), (32768, 60999)), given.ranges());
    }

    #[test]
    fn display_round_trips() {
        for s in ["1024-29999,32768-65535", "1024,65535", "80"] {
            assert_eq!(PortRanges::parse_flag(s).unwrap().to_string(), s);
        }
    }
}
