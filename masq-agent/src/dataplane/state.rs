//! The running agent's mode, for `masq-agent status` in another process. bpffs holds only BPF
//! objects, so the record lives under /run, named after the `--bpffs` directory it belongs to.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Mode;

const STATE_DIR: &str = "/run/masq-agent";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModeRecord {
    pub mode: Mode,
    /// Why the agent fell back to iptables, when it did.
    pub reason: Option<String>,
    pub pid: u32,
    /// The flags that shape its policy, for `explain` in another process (absent in the
    /// record of an agent from before `explain`).
    #[serde(default)]
    pub flags: Option<PolicyFlags>,
}

/// The flags that decide what the running agent's policy is and where it is installed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyFlags {
    pub config: PathBuf,
    pub masq_chain: String,
    pub nomasq_all_reserved_ranges: bool,
    pub enable_ipv6: bool,
}

fn path(bpffs: &Path) -> PathBuf {
    Path::new(STATE_DIR).join(format!("{}.json", file_stem(bpffs)))
}

/// Where the full verifier log goes when the kernel refuses `program` for the agent of `bpffs`.
pub fn verifier_log(bpffs: &Path, program: &str) -> PathBuf {
    Path::new(STATE_DIR).join(format!("{}.{program}.verifier.log", file_stem(bpffs)))
}

/// Writes `text` to `path` in the state directory.
pub fn write(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(STATE_DIR)?;
    std::fs::write(path, text)
}

/// The agent's files are named after its `--bpffs` directory, so that agents on one node with
/// different directories keep apart.
fn file_stem(bpffs: &Path) -> String {
    bpffs
        .to_string_lossy()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Records the mode of the agent running now (replacing the file atomically).
pub fn record(
    bpffs: &Path,
    mode: Mode,
    reason: Option<String>,
    flags: PolicyFlags,
) -> std::io::Result<()> {
    let record = ModeRecord {
        mode,
        reason,
        pid: std::process::id(),
        flags: Some(flags),
    };
    std::fs::create_dir_all(STATE_DIR)?;
    let target = path(bpffs);
    let tmp = target.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&record)?)?;
    std::fs::rename(tmp, target)
}

/// The record of the agent running now, if one is.
pub fn read(bpffs: &Path) -> Option<ModeRecord> {
    read_last(bpffs)
        .filter(|(_, running)| *running)
        .map(|(record, _)| record)
}

/// The record the last agent left, and whether it still runs: an agent that exited (`--once`,
/// a crash, a pod deleted) leaves what it installed, and its record says why.
pub fn read_last(bpffs: &Path) -> Option<(ModeRecord, bool)> {
    let record: ModeRecord = serde_json::from_slice(&std::fs::read(path(bpffs)).ok()?).ok()?;
    let running = Path::new(&format!("/proc/{}", record.pid)).exists();
    Some((record, running))
}

pub fn remove(bpffs: &Path) {
    let _ = std::fs::remove_file(path(bpffs));
}
