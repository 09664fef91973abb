//! Prefixes as the tries hold them: their key as plain data, the policy trie's type, and the
//! conversions between the policy's rules, the trie's entries and the config's notation.

use std::{collections::BTreeMap, net::IpAddr};

use aya::maps::{LpmTrie, MapData};
use ipnet::IpNet;
use masq_ebpf::{PolicyEntry, PrefixAction, prefix_action};

use crate::policy::{Action, Rules};

/// An LPM trie key as plain data: prefix length in bits, then the address bytes.
pub type Prefix<const N: usize> = (u32, [u8; N]);

/// A family's policy trie.
pub type PolicyTrie<const N: usize> = LpmTrie<MapData, [u8; N], PolicyEntry>;

/// The trie's value for an action.
pub fn action_value(action: Action) -> PrefixAction {
    match action {
        Action::NonMasquerade => prefix_action::NON_MASQUERADE,
        Action::Masquerade => prefix_action::MASQUERADE,
    }
}

/// The action a trie's value stands for (any value but non-masquerade masquerades, as the
/// programs read it).
pub fn action_of(value: PrefixAction) -> Action {
    if value == prefix_action::NON_MASQUERADE {
        Action::NonMasquerade
    } else {
        Action::Masquerade
    }
}

/// A family's rules as trie entries; the rules of the other family are left out.
pub fn trie_entries<const N: usize>(rules: &Rules) -> BTreeMap<Prefix<N>, PrefixAction> {
    rules
        .iter()
        .filter_map(|(net, action)| {
            let octets: [u8; N] = match net.network() {
                IpAddr::V4(addr) => addr.octets().as_slice().try_into().ok()?,
                IpAddr::V6(addr) => addr.octets().as_slice().try_into().ok()?,
            };
            Some(((u32::from(net.prefix_len()), octets), action_value(*action)))
        })
        .collect()
}

/// The prefixes the policy trie holds, with their entries.
pub fn entries<const N: usize>(trie: &PolicyTrie<N>) -> BTreeMap<Prefix<N>, PolicyEntry> {
    trie.iter()
        .filter_map(Result::ok)
        .map(|(k, entry)| ((k.prefix_len(), k.data()), entry))
        .collect()
}

/// A prefix as the policy holds it.
pub fn net<const N: usize>((len, data): Prefix<N>) -> IpNet
where
    IpAddr: From<[u8; N]>,
{
    IpNet::new(IpAddr::from(data), len as u8)
        .expect("the kernel's LPM trie holds no prefix longer than its addresses")
}

/// Seconds of CLOCK_MONOTONIC, as the draining trie dates its prefixes.
pub fn seconds(ns: u64) -> u32 {
    (ns / 1_000_000_000) as u32
}
