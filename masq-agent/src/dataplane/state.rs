//! The running agent's mode, for `masq-agent status` in another process. bpffs holds only BPF
//! objects, so the record lives under /run, named after the `--bpffs` directory it belongs to.
//! The DaemonSet mounts that directory from the node, so that the record and a refused
//! program's verifier log outlive the container that wrote them; a reader may therefore sit in
//! another pid namespace than the agent, and the record says which one its pid is in.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::mode::Mode;

/// Where the agent keeps its record and a refused program's verifier log.
pub const STATE_DIR: &str = "/run/masq-agent";

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
    /// Which process `pid` is (absent in the record of an agent from before it).
    #[serde(default)]
    pub process: Option<ProcessIdentity>,
}

/// What tells the agent's process from a later one with the same pid, and a pid of the agent's
/// container from the same number on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    /// The inode of the pid namespace `pid` is numbered in.
    pub pid_namespace: u64,
    /// When the process started, in clock ticks after boot (`/proc/PID/stat`'s starttime).
    pub start_ticks: u64,
}

impl ProcessIdentity {
    /// This process's.
    fn own() -> Option<Self> {
        Some(Self {
            pid_namespace: own_pid_namespace()?,
            start_ticks: start_ticks(std::process::id())?,
        })
    }
}

/// Whether the agent that wrote a record still runs, as far as the reader can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Running,
    Exited,
    /// Its pid is in another pid namespace than the reader's: `status` on the node's shell
    /// about the agent in its container, or the other way round.
    CannotTell,
}

/// The inode of this process's pid namespace: `/proc/self/ns/pid` reads `pid:[INODE]`.
fn own_pid_namespace() -> Option<u64> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    link.to_str()?
        .strip_prefix("pid:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The start time of process `pid` in this pid namespace, if it exists.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    starttime_of_stat(&stat)
}

/// Field 22 of a `/proc/PID/stat` line, counted after the command name, which may hold spaces
/// and parentheses of its own and ends at the line's last `)`.
fn starttime_of_stat(stat: &str) -> Option<u64> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    // After the name come the state (field 3) and so on: starttime is the 20th of those.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process `record` names still runs, seen from this process.
fn liveness(record: &ModeRecord) -> Liveness {
    let Some(identity) = record.process else {
        // An older agent's record: its pid alone.
        return if Path::new(&format!("/proc/{}", record.pid)).exists() {
            Liveness::Running
        } else {
            Liveness::Exited
        };
    };
    if own_pid_namespace() != Some(identity.pid_namespace) {
        return Liveness::CannotTell;
    }
    if start_ticks(record.pid) == Some(identity.start_ticks) {
        Liveness::Running
    } else {
        Liveness::Exited
    }
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
        process: ProcessIdentity::own(),
    };
    std::fs::create_dir_all(STATE_DIR)?;
    let target = path(bpffs);
    let tmp = target.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&record)?)?;
    std::fs::rename(tmp, target)
}

/// The record of the agent running now, if one is (or may be, seen from another pid
/// namespace).
pub fn read(bpffs: &Path) -> Option<ModeRecord> {
    read_last(bpffs)
        .filter(|(_, liveness)| *liveness != Liveness::Exited)
        .map(|(record, _)| record)
}

/// The record the last agent left, and whether it still runs: an agent that exited (`--once`,
/// a crash, a pod deleted) leaves what it installed, and its record says why.
pub fn read_last(bpffs: &Path) -> Option<(ModeRecord, Liveness)> {
    let record: ModeRecord = serde_json::from_slice(&std::fs::read(path(bpffs)).ok()?).ok()?;
    let liveness = liveness(&record);
    Some((record, liveness))
}

pub fn remove(bpffs: &Path) {
    let _ = std::fs::remove_file(path(bpffs));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record_of(process: Option<ProcessIdentity>) -> ModeRecord {
        ModeRecord {
            mode: Mode::Ebpf,
            reason: None,
            pid: std::process::id(),
            flags: None,
            process,
        }
    }

    #[test]
    fn starttime_is_read_after_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 10 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000 10 18446744073709551615";
        assert_eq!(starttime_of_stat(stat), Some(987_654));
        assert_eq!(starttime_of_stat("4242 (short) S 1"), None);
    }

    #[test]
    fn this_process_runs_a_later_one_with_its_pid_did_not_and_another_namespace_cannot_tell() {
        let own = ProcessIdentity::own().expect("this process's identity");
        assert_eq!(liveness(&record_of(Some(own))), Liveness::Running);
        let later = ProcessIdentity {
            start_ticks: own.start_ticks + 1,
            ..own
        };
        assert_eq!(liveness(&record_of(Some(later))), Liveness::Exited);
        let elsewhere = ProcessIdentity {
            pid_namespace: own.pid_namespace + 1,
            ..own
        };
        assert_eq!(liveness(&record_of(Some(elsewhere))), Liveness::CannotTell);
        // An older agent's record has its pid only.
        assert_eq!(liveness(&record_of(None)), Liveness::Running);
    }

    #[test]
    fn an_older_agents_record_still_reads() {
        let older = r#"{"mode":"ebpf","reason":null,"pid":1}"#;
        let record: ModeRecord = serde_json::from_str(older).unwrap();
        assert_eq!(record.process, None);
    }
}
