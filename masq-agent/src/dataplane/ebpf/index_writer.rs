//! The thread that writes the programs' index of the IPv4 policy trie (`policy_index`), so that
//! no change of the policy waits for the index: its RCU grace period, and at 100 000 prefixes
//! tens of milliseconds of building, stay off the way from the file to the trie and the chain,
//! and a change that follows at once is not held up behind them. The programs ask the trie
//! until the index is stamped with the generation in force, so the trie's answer stands
//! throughout, only found more slowly.
//!
//! The agent hands the thread the generation in force after every sync, with what the trie
//! holds where it changed since the last hand-over. Only the latest hand-over is waiting at any
//! time: one the thread has not taken yet is replaced, keeping what the trie held where the new
//! one says it is unchanged. A stamp carries the generation of the policy the thread wrote, and
//! the programs take the index's answer only while it is the generation in force: a stamp
//! written after the agent moved on is never read as the new policy's.

use std::{
    collections::BTreeMap,
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    thread::JoinHandle,
};

use masq_ebpf::PolicyEntry;

use super::{
    policy_index::{IndexWrite, PolicyIndex},
    prefixes::Prefix,
};

/// What the IPv4 policy trie holds, shared with the thread that writes its index.
pub type SharedTrie = Arc<BTreeMap<Prefix<4>, PolicyEntry>>;

/// The agent's side of the index's thread.
pub struct IndexWriter {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Whether the trie changed since the last hand-over, which must then carry what it holds.
    trie_changed: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled at every hand-over, at the end of every write, and at closing.
    moved: Condvar,
}

#[derive(Default)]
struct State {
    /// The hand-over the thread takes next.
    next: Option<HandOver>,
    /// Whether the thread is at work on a hand-over.
    busy: bool,
    /// Whether the index holds what the trie held at the last hand-over the thread finished.
    holds_the_trie: bool,
    last_write: IndexWrite,
    closing: bool,
}

struct HandOver {
    /// What the trie holds, where it changed since the hand-over before.
    entries: Option<SharedTrie>,
    /// The generation in force once the trie held it.
    generation: u32,
}

impl HandOver {
    /// This hand-over in place of `waiting`, one the thread has not taken: what the trie held
    /// then stands where this one says the trie is unchanged.
    fn replacing(self, waiting: Option<HandOver>) -> HandOver {
        HandOver {
            entries: self.entries.or(waiting.and_then(|w| w.entries)),
            generation: self.generation,
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic in the thread leaves nothing half-done in the state, which only moves whole.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.moved
            .wait(state)
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl IndexWriter {
    /// Starts the thread that writes `index`.
    pub fn spawn(index: PolicyIndex) -> anyhow::Result<IndexWriter> {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            moved: Condvar::new(),
        });
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("policy-index".into())
            .spawn(move || write_as_handed_over(index, &theirs))?;
        Ok(IndexWriter {
            shared,
            thread: Some(thread),
            trie_changed: true,
        })
    }

    /// Says that the trie changed, or may have.
    pub fn trie_changed(&mut self) {
        self.trie_changed = true;
    }

    /// Whether the next hand-over must carry what the trie holds: it changed since the last,
    /// or the thread's last write did not leave the index holding it.
    pub fn wants_entries(&self) -> bool {
        self.trie_changed || !self.shared.lock().holds_the_trie
    }

    /// Hands the thread `generation`, the one in force, and `entries`, what the trie holds
    /// (`None` where `wants_entries` says the index already holds it).
    pub fn hand_over(&mut self, generation: u32, entries: Option<SharedTrie>) {
        let mut state = self.shared.lock();
        let handed = HandOver {
            entries,
            generation,
        };
        state.next = Some(handed.replacing(state.next.take()));
        self.trie_changed = false;
        self.shared.moved.notify_all();
    }

    /// Waits until the thread has written every hand-over, and returns what its last write of
    /// the chunks did.
    pub fn settled(&self) -> IndexWrite {
        let mut state = self.shared.lock();
        while state.busy || state.next.is_some() {
            state = self.shared.wait(state);
        }
        state.last_write
    }
}

impl Drop for IndexWriter {
    /// Lets the thread finish what it was handed, so that an agent that leaves leaves the
    /// index stamped where it could be.
    fn drop(&mut self) {
        self.shared.lock().closing = true;
        self.shared.moved.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread: writes each hand-over as it comes, until the agent's side closes.
fn write_as_handed_over(mut index: PolicyIndex, shared: &Shared) {
    loop {
        let handed = {
            let mut state = shared.lock();
            loop {
                if let Some(handed) = state.next.take() {
                    state.busy = true;
                    break handed;
                }
                if state.closing {
                    return;
                }
                state = shared.wait(state);
            }
        };
        // A write that panics leaves the index unstamped, and the index forgets what it
        // wrote (`PolicyIndex::write`): the programs ask the trie, and the next hand-over
        // writes it whole. The agent goes on either way.
        let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match &handed.entries {
                Some(entries) => index.refresh(entries, handed.generation),
                None if index.holds_the_trie() => index.stamp(handed.generation),
                // The last write failed: the programs ask the trie until a hand-over carries it.
                None => Ok(()),
            }
        }))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("writing the index panicked")));
        if let Err(err) = written {
            tracing::warn!(
                "the programs look IPv4 destinations up in the policy trie, not its index, \
                 until the next change: {err:#}"
            );
        }
        let mut state = shared.lock();
        state.busy = false;
        state.holds_the_trie = index.holds_the_trie();
        state.last_write = index.last_write();
        shared.moved.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(addr: [u8; 4]) -> SharedTrie {
        Arc::new(BTreeMap::from([((24, addr), PolicyEntry::default())]))
    }

    #[test]
    fn a_hand_over_keeps_what_the_trie_held_in_one_it_replaces_where_the_trie_did_not_change() {
        let first = entries([10, 0, 0, 0]);
        let waiting = HandOver {
            entries: Some(Arc::clone(&first)),
            generation: 7,
        };
        let restamp = HandOver {
            entries: None,
            generation: 8,
        };
        let handed = restamp.replacing(Some(waiting));
        assert_eq!(handed.generation, 8);
        assert!(Arc::ptr_eq(handed.entries.as_ref().unwrap(), &first));

        let second = entries([192, 168, 0, 0]);
        let change = HandOver {
            entries: Some(Arc::clone(&second)),
            generation: 9,
        };
        let handed = change.replacing(Some(handed));
        assert_eq!(handed.generation, 9);
        assert!(Arc::ptr_eq(handed.entries.as_ref().unwrap(), &second));

        let alone = HandOver {
            entries: None,
            generation: 10,
        }
        .replacing(None);
        assert!(alone.entries.is_none());
    }
}
