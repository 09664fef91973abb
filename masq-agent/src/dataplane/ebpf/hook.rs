//! The two tc hooks the programs run at, and the program each runs.

use aya::programs::TcAttachType;
use masq_ebpf::program_names;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hook {
    Egress,
    Ingress,
}

/// In `status --json` and wherever it is written out: its one spelling, `name()`.
impl Serialize for Hook {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl Hook {
    pub const BOTH: [Hook; 2] = [Hook::Egress, Hook::Ingress];

    pub fn name(self) -> &'static str {
        match self {
            Hook::Egress => "egress",
            Hook::Ingress => "ingress",
        }
    }

    /// The program that runs at this hook.
    pub fn program(self) -> &'static str {
        match self {
            Hook::Egress => program_names::EGRESS,
            Hook::Ingress => program_names::INGRESS,
        }
    }

    pub(super) fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Egress => TcAttachType::Egress,
            Hook::Ingress => TcAttachType::Ingress,
        }
    }
}
