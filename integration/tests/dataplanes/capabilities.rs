//! The agent with exactly the capabilities deploy/daemonset.yaml gives its unprivileged
//! container: everything works with them, including a restart over its own pins and the
//! fallback to the chain; without one of them, the agent names it.

use std::{process::Output, time::Duration};

use masq_testbed::{
    deploy,
    topology::{self, Process},
    wait_for,
};

use crate::{Bed, DEFAULT_CONFIG, PacedTransfer, Plane, args_with, assert_masqueraded};

mod ebpf {
    cases!(Ebpf:
        runs_with_only_the_manifest_s_capabilities,
        a_missing_capability_is_named,
    );
}

/// The capabilities deploy/daemonset.yaml gives the agent's container, which must not be
/// privileged.
fn manifest_capabilities() -> Vec<String> {
    let context = &deploy::agent_container()["securityContext"];
    assert_eq!(context["privileged"], false, "{context:?}");
    deploy::agent_capabilities()
}

/// `setpriv`, its arguments and the agent binary: the agent with only `capabilities`.
fn with_only(capabilities: &[String]) -> Vec<String> {
    let mut command = deploy::with_only(capabilities);
    command.push(masq_testbed::agent_binary().display().to_string());
    command
}

/// The effective capability mask of process `pid`.
fn effective_capabilities(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap();
    u64::from_str_radix(hex.trim(), 16).unwrap()
}

impl Bed {
    /// The agent with only `capabilities`, run with `args`, once it has synced.
    fn start_agent_with_only(&self, capabilities: &[String], args: &[String]) -> Process {
        let mut command = with_only(capabilities);
        command.extend_from_slice(args);
        let args: Vec<&str> = command[1..].iter().map(String::as_str).collect();
        let agent = self
            .topo
            .spawn_in_node(
                std::path::Path::new("setpriv"),
                &args,
                &[("PATH", self.path.as_str())],
                "agent-capabilities.log",
            )
            .expect("start agent");
        wait_for(|| Ok(agent.log_text().contains("policy applied")))
            .unwrap_or_else(|e| panic!("agent never synced: {e}\n{}", agent.log_text()));
        agent
    }

    /// The agent binary with only `capabilities`, run to completion with `args`.
    fn agent_cmd_with_only(&self, capabilities: &[String], args: &[String]) -> Output {
        let mut command = with_only(capabilities);
        command.extend_from_slice(args);
        self.topo
            .node_command("setpriv")
            .args(&command[1..])
            .env("PATH", &self.path)
            .output()
            .unwrap()
    }
}

/// The bed's arguments, with the manifest's default of falling back to the chain.
fn as_the_manifest_runs_it(bed: &Bed, replace: &[(&str, &str)]) -> Vec<String> {
    let mut replace = replace.to_vec();
    replace.push(("--fallback-to-iptables", "true"));
    args_with(bed, &replace)
}

/// The agent runs with exactly the capabilities the manifest gives its container: it
/// masquerades, pins, takes its pins over after a restart, and falls back to the chain when
/// eBPF cannot run.
fn runs_with_only_the_manifest_s_capabilities(plane: Plane) {
    let capabilities = manifest_capabilities();
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    let args = as_the_manifest_runs_it(&bed, &[]);
    let mut agent = bed.start_agent_with_only(&capabilities, &args);
    let wanted = capabilities.iter().fold(0u64, |mask, name| {
        let number = match name.as_str() {
            "NET_ADMIN" => 12,
            "NET_RAW" => 13,
            "PERFMON" => 38,
            "BPF" => 39,
            other => panic!("a capability the test does not know: {other}"),
        };
        mask | 1 << number
    });
    assert_eq!(effective_capabilities(agent.child.id()), wanted);
    assert_masqueraded(&bed);
    // What an operator runs with `kubectl exec`, in the same container.
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    let status = bed.agent_cmd_with_only(&capabilities, &["status".into(), "--json".into(), bpffs]);
    assert!(status.status.success(), "{status:?}");
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["mode"], "ebpf", "{status:#}");
    let running = |a: &serde_json::Value| a["running"] == true;
    let attachments = status["ebpf"]["attachments"].as_array().unwrap();
    assert_eq!(
        attachments.iter().filter(|a| running(a)).count(),
        2,
        "{status:#}"
    );
    let mut explain = vec!["explain".to_string(), topology::EXT_ADDR.to_string()];
    explain.extend(args.iter().cloned());
    let explained = bed.agent_cmd_with_only(&capabilities, &explain);
    assert!(explained.status.success(), "{explained:?}");

    // A restart takes the pins over, and a connection open across it goes on.
    let transfer = PacedTransfer::start(&bed, (topology::EXT_ADDR, 9001).into(), 20);
    std::thread::sleep(Duration::from_millis(300));
    agent.stop(libc::SIGTERM).unwrap();
    let agent = bed.start_agent_with_only(&capabilities, &args);
    assert!(
        agent.log_text().contains("mode=ebpf"),
        "{}",
        agent.log_text()
    );
    transfer.assert_complete("the transfer survived the restart");
    assert_masqueraded(&bed);
    drop(agent);

    // Where eBPF cannot run, the chain masquerades everything.
    let id = bed.topo.dir.file_name().unwrap().to_string_lossy();
    let nowhere = format!("/proc/self/{id}/ip-masq-agent");
    let args = as_the_manifest_runs_it(&bed, &[("--bpffs", &nowhere)]);
    let fallback = bed.start_agent_with_only(&capabilities, &args);
    let log = fallback.log_text();
    assert!(
        log.contains("falling back to the full iptables chain"),
        "{log}"
    );
    assert_masqueraded(&bed);
}

/// With one of the manifest's capabilities missing, the agent says which: without one the
/// programs need, it falls back to the chain and says why; without one the chain needs, it
/// cannot run, and exits saying so.
fn a_missing_capability_is_named(plane: Plane) {
    let capabilities = manifest_capabilities();
    let bed = Bed::new(plane, DEFAULT_CONFIG);
    for missing in &capabilities {
        let fewer: Vec<String> = capabilities
            .iter()
            .filter(|c| *c != missing)
            .cloned()
            .collect();
        let mut args = as_the_manifest_runs_it(&bed, &[]);
        args.push("--once".into());
        let out = bed.agent_cmd_with_only(&fewer, &args);
        let said = String::from_utf8_lossy(&out.stderr);
        let name = format!("CAP_{missing}");
        let line = said
            .lines()
            .find(|l| l.contains(&name))
            .unwrap_or_else(|| panic!("without {name}: nothing names it:\n{said}"));
        match missing.as_str() {
            "BPF" | "PERFMON" => {
                assert!(out.status.success(), "{said}");
                assert!(
                    line.contains("falling back to the full iptables chain"),
                    "{line}"
                );
                assert_masqueraded(&bed);
            }
            _ => {
                assert_eq!(out.status.code(), Some(1), "{said}");
                assert!(line.contains("iptables"), "{line}");
            }
        }
    }
}
