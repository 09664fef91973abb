//! The interface both data planes implement, and what its methods say.

use super::{chosen_address, mode::Mode, nat_usage::NatSweep, status::Status};
use crate::policy::Policy;

/// What an `apply` changed in the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// The kernel already matched the policy.
    Unchanged,
    /// A new policy was installed.
    Applied,
    /// The policy was unchanged, but someone had altered the kernel state; it was put back.
    Repaired,
}

pub trait DataPlane {
    fn mode(&self) -> Mode;

    /// The chosen masquerade addresses in force (`masqueradeAddress`): those the node holds.
    fn masquerade_addresses(&self) -> chosen_address::ChosenAddresses {
        chosen_address::ChosenAddresses::default()
    }

    /// Why this data plane runs instead of the one asked for, if it does.
    fn mode_reason(&self) -> Option<String> {
        None
    }

    /// Makes the kernel match `policy`. On error, whatever was in force before stays in force.
    /// A change is applied as the difference from what this data plane knows it installed.
    fn apply(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome>;

    /// The next `apply` reads back everything it installed from the kernel, rather than trust
    /// its own record of it, and installs whatever differs: the agent asks at every resync, so
    /// that whatever someone else changed is repaired.
    fn verify_next_apply(&mut self) {}

    /// Periodic upkeep between applies: puts back programs someone detached, and expires
    /// idle NAT entries. Returns what the NAT tables hold, for data planes that have them.
    fn maintain(&mut self) -> anyhow::Result<Option<NatSweep>> {
        Ok(None)
    }

    /// The agent exits, and leaves what this data plane installed in force for the agent that
    /// comes next.
    fn leave(&mut self) {}

    /// Reads back what is installed.
    fn status(&self) -> anyhow::Result<Status>;

    /// Removes everything this data plane installed.
    fn cleanup(&mut self) -> anyhow::Result<()>;
}
