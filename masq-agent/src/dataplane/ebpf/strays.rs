//! Flows that outlived their policy: a flow keeps its NAT entry whatever the policy says now,
//! so after a change some entries may lead toward destinations the policy now leaves alone.
//! While any may, the programs look every packet up in the NAT table. Once a check of the
//! tables finds none, the agent sets `policy_word::STRAYS_CLEARED`, and packets to and from
//! such addresses skip the table (a flow's reply half comes from its egress half's
//! destination); the next change to the policy tries clears it again. The agent
//! checks as soon as the grace after a change has passed, then at every sweep until no stray is
//! left: a check reads both NAT tables whole.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use aya::{
    Pod,
    maps::{MapError, lpm_trie::Key},
};
use masq_ebpf::{Address, Decision, NatEntry, NatKey, direction};

use super::{
    flow_table::NatTable, map_types::NatTables, policy_word::PolicyWord, prefixes::PolicyTrie,
};

/// When a flow's entry may last have come to lead toward a destination the policy leaves alone,
/// and whether the NAT tables were checked since.
pub struct StrayWatch {
    pub possible_since: Instant,
    pub checked: bool,
}

/// A watch that knows nothing yet: a check is due.
impl Default for StrayWatch {
    fn default() -> StrayWatch {
        StrayWatch {
            possible_since: Instant::now(),
            checked: false,
        }
    }
}

impl StrayWatch {
    /// Clears `policy_word::STRAYS_CLEARED`, so that the programs look every packet up again,
    /// and moves the generation on with it: a verdict cached before may come from a trie that
    /// changed since without a move (an agent killed between the two), and would go on
    /// judging new flows by it.
    pub fn lower(&mut self, word: &mut PolicyWord) -> anyhow::Result<()> {
        word.next_generation()?;
        self.possible_since = Instant::now();
        self.checked = false;
        Ok(())
    }
}

/// How long after a change to the tries a check may set the flag: a program that judged a
/// destination by the old policy may still insert its flow's entry just after the change, but
/// programs run for microseconds.
pub const GRACE: Duration = Duration::from_secs(1);

impl StrayWatch {
    /// Whether the programs skip the NAT table for addresses the policy leaves alone. If
    /// not, and the tries changed more than `grace` ago, checks both tables against both
    /// policy tries, and sets the flag if no entry leads toward such a destination.
    pub fn check(
        &mut self,
        word: &mut PolicyWord,
        nat: &NatTables,
        (v4, v6): (&PolicyTrie<4>, &PolicyTrie<16>),
        grace: Duration,
    ) -> anyhow::Result<bool> {
        if word.strays_cleared()? {
            return Ok(true);
        }
        if self.possible_since.elapsed() < grace {
            return Ok(false);
        }
        let started = Instant::now();
        self.checked = true;
        if any_stray(&nat.v4, v4)? || any_stray(&nat.v6, v6)? {
            return Ok(false);
        }
        // A change made while the tables were read would have cleared the flag since: there
        // was none, since the agent alone writes the tries, and it was here.
        word.raise_strays_cleared()?;
        tracing::debug!(
            took = ?started.elapsed(),
            "no flow outlived its policy: packets the policy leaves alone skip the NAT table"
        );
        Ok(true)
    }
}

/// Whether a flow of `nat` leaves toward a destination `trie` now leaves alone.
fn any_stray<const N: usize>(nat: &NatTable<[u8; N]>, trie: &PolicyTrie<N>) -> anyhow::Result<bool>
where
    [u8; N]: Address,
    NatKey<[u8; N]>: Pod,
    NatEntry<[u8; N]>: Pod,
{
    let entries = nat.read_all()?;
    // Flows share destinations: each is asked about once, a system call each.
    let destinations: HashSet<[u8; N], foldhash::fast::RandomState> = entries
        .iter()
        .filter(|(k, _)| k.direction == direction::EGRESS)
        .map(|(k, _)| k.daddr)
        .collect();
    for destination in destinations {
        let entry = match trie.get(&Key::new(<[u8; N]>::BITS, destination), 0) {
            Ok(entry) => Some(entry),
            Err(MapError::KeyNotFound) => None,
            Err(err) => return Err(err.into()),
        };
        if Decision::of(entry.as_ref()).keeps_address {
            return Ok(true);
        }
    }
    Ok(false)
}
