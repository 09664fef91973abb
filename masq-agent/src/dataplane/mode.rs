//! Which data plane enforces the policy, in its one spelling.

use serde::Deserialize;

/// Which mechanism enforces the policy. Its one spelling, `label`, is what the status text,
/// the JSON, the state file and the metrics all say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Ebpf,
    Iptables,
    /// The full iptables chain, because the eBPF data plane could not run.
    IptablesFallback,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Ebpf, Mode::Iptables, Mode::IptablesFallback];

    pub fn label(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::IptablesFallback => "iptables-fallback",
        }
    }
}

spelled_by_label!(Mode);

impl<'de> Deserialize<'de> for Mode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Mode, D::Error> {
        let label = String::deserialize(deserializer)?;
        Mode::ALL
            .into_iter()
            .find(|mode| mode.label() == label)
            .ok_or_else(|| serde::de::Error::custom(format!("no data plane is called {label}")))
    }
}
