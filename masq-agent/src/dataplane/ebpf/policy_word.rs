//! The word the programs tag their cached verdicts with (`policy_generation`): the policy's
//! generation, which every change to the tries moves on so that no verdict cached before it
//! survives, and the strays-cleared flag (see `strays`). The layout is masq-ebpf's
//! `policy_word`; this is the agent's one handle on the map.

use aya::maps::{Array, MapData};
use masq_ebpf::policy_word;

pub struct PolicyWord(pub Array<MapData, u32>);

impl PolicyWord {
    /// The generation, without the flag.
    pub fn generation(&self) -> anyhow::Result<u32> {
        Ok(read(&self.0)? & policy_word::GENERATION_MASK)
    }

    /// Moves the generation on, which also clears the strays-cleared flag: a cached verdict
    /// may come from a trie that changed since, and a flow's entry may lead where the policy
    /// now leaves alone.
    pub fn next_generation(&mut self) -> anyhow::Result<()> {
        let current = read(&self.0)?;
        self.0.set(0, masq_ebpf::verdict_slot::next(current), 0)?;
        Ok(())
    }

    /// Whether the programs skip the NAT table for packets to and from addresses the policy
    /// leaves alone.
    pub fn strays_cleared(&self) -> anyhow::Result<bool> {
        Ok(policy_word::strays_cleared(read(&self.0)?))
    }

    /// Lets the programs skip the NAT table for packets to and from addresses the policy
    /// leaves alone.
    pub fn raise_strays_cleared(&mut self) -> anyhow::Result<()> {
        let word = read(&self.0)?;
        self.0.set(0, word | policy_word::STRAYS_CLEARED, 0)?;
        Ok(())
    }
}

fn read(word: &Array<MapData, u32>) -> anyhow::Result<u32> {
    Ok(word.get(&0, 0)?)
}
