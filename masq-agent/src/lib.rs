//! masq-agent: config -> policy -> data plane.
//!
//! - [`config`] reads the ConfigMap file with upstream's rules and messages;
//! - [`policy`] turns it into the non-masquerade prefix sets per family;
//! - [`dataplane`] makes the kernel enforce that policy, with eBPF or with iptables;
//! - [`agent`] keeps the data plane in sync with the file;
//! - [`telemetry`] tells operators how that goes: metrics, liveness and readiness;
//! - [`privileges`] checks the capabilities the data planes need, and names any missing.

pub mod agent;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod explain;
pub mod families;
pub mod netdev;
pub mod policy;
pub mod ports;
pub mod privileges;
pub mod protocols;
pub mod telemetry;
