//! Flows of the node's own address that the programs gave another port, because a masqueraded
//! flow held their tuple (architecture.md, sharing the node's address): rare, and a sign that
//! the agent started after such flows did, so the log says each time more appear.

use masq_ebpf::Counter;
use tracing::info;

use super::map_types::{Counters, counter_total};

/// The programs' count of such flows, as last said.
#[derive(Debug)]
pub struct Clashes {
    said: u64,
}

impl Clashes {
    /// Starts from what `counters` hold: an earlier agent said those.
    pub fn since(counters: &Counters) -> Clashes {
        Clashes {
            said: counter_total(counters, Counter::NodePortClash),
        }
    }

    /// Says how many flows were given other ports since last said, if any were.
    pub fn say_new(&mut self, counters: &Counters) {
        let clashes = counter_total(counters, Counter::NodePortClash);
        if clashes > self.said {
            info!(
                flows = clashes - self.said,
                "flows of the node's own address were given other ports: masqueraded flows held their tuples"
            );
        }
        self.said = clashes;
    }
}
