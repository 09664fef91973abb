//! masq-agent: config -> policy -> data plane.
//!
//! - [`config`] reads the ConfigMap file with upstream's rules and messages;
//! - [`policy`] turns it into the non-masquerade prefix sets per family;
//! - [`dataplane`] makes the kernel enforce that policy, with eBPF or with iptables;
//! - [`agent`] keeps the data plane in sync with the file;
//! - [`telemetry`] tells operators how that goes: metrics, liveness and readiness;
//! - [`privileges`] checks the capabilities the data planes need, and names any missing.

/// `Display` and `Serialize` for each type, from its `label()`: the one spelling its values
/// have, in the status text, the JSON and the metrics' labels alike.
macro_rules! spelled_by_label {
    ($($type:ty),* $(,)?) => {$(
        impl std::fmt::Display for $type {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.label())
            }
        }

        impl serde::Serialize for $type {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.label())
            }
        }
    )*};
}

pub mod agent;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod explain;
pub mod families;
pub mod netdev;
pub mod netlink;
pub mod policy;
pub mod ports;
pub mod privileges;
pub mod protocols;
pub mod telemetry;
