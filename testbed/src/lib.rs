//! The namespace test bed shared by `cargo xtask demo`, the integration tests and the
//! benchmarks: a pod, a forwarding node and an outside server, each in a network namespace the
//! run creates and deletes itself.

pub mod deploy;
pub mod kube_tools;
pub mod kubelet;
pub mod load;
pub mod netns;
pub mod packet;
pub mod prefixes;
pub mod probe;
pub mod topology;
pub mod verifier;
pub mod workers;

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Context as _;

/// The root of the masq-agent workspace.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the test bed lives in the workspace")
        .to_path_buf()
}

/// The agent's binary, built beside the test that asks for it (`cargo test --workspace` builds
/// every binary of the workspace; `cargo xtask test` runs that).
pub fn agent_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/<test>: the binary is in target/<profile>.
    let binary = exe
        .parent()
        .and_then(Path::parent)
        .expect("a test runs from target/<profile>/deps")
        .join("masq-agent");
    assert!(
        binary.exists(),
        "{} is not built: run `cargo build -p masq-agent`, or `cargo xtask test`",
        binary.display()
    );
    binary
}

/// Polls `check` every 50 ms until it returns `Ok(true)`, for at most 10 seconds.
pub fn wait_for(check: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    wait_for_long(Duration::from_secs(10), check)
}

/// The environment variable by which a slower machine stretches every wait of the tests: `cargo
/// xtask test` sets it in the VMs, whose emulated CPU runs the agent many times slower than the
/// host does. A wait is a limit, never a measure, so stretching it changes no verdict.
pub const SLOWDOWN_ENV: &str = "MASQ_TEST_SLOWDOWN";

/// How many times longer than on the host each wait may last here: `SLOWDOWN_ENV`, or 1.
pub fn slowdown() -> u32 {
    std::env::var(SLOWDOWN_ENV)
        .ok()
        .and_then(|factor| factor.parse().ok())
        .filter(|factor| *factor >= 1)
        .unwrap_or(1)
}

/// Polls `check` until it returns `Ok(true)`, for at most `limit` (times `slowdown()`); every
/// 2 ms at first, so that short waits are measured finely, then every 50 ms.
pub fn wait_for_long(
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let limit = limit * slowdown();
    let started = Instant::now();
    while started.elapsed() < limit {
        if check().unwrap_or(false) {
            return Ok(());
        }
        let pause = if started.elapsed() < Duration::from_secs(1) {
            2
        } else {
            50
        };
        std::thread::sleep(Duration::from_millis(pause));
    }
    anyhow::bail!("timed out after {limit:?}")
}

/// Replaces a file atomically (write, then rename), as a ConfigMap update does.
pub fn write_config(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Whether a packet to `addr` keeps the pod's address under the pinned `non_masq_v4` map at
/// `pin`: an LPM-trie lookup of the full address finds the longest prefix that holds it, if
/// any, and its value says what happens.
pub fn keeps_address_v4(pin: &Path, addr: Ipv4Addr) -> anyhow::Result<bool> {
    let pin = pin.to_str().context("pin path")?;
    // The key is `{prefix_len: u32, data: [u8; 4]}` in the machine's byte order.
    let key: Vec<String> = 32u32
        .to_ne_bytes()
        .into_iter()
        .chain(addr.octets())
        .map(|b| b.to_string())
        .collect();
    let mut args = vec!["--json", "map", "lookup", "pinned", pin, "key"];
    args.extend(key.iter().map(String::as_str));
    let out = std::process::Command::new("bpftool").args(&args).output()?;
    // bpftool fails both for "no entry" (for which `--json` prints `null`) and for a missing
    // map; only the first is an answer.
    if !out.status.success() {
        if out.stdout.trim_ascii() == b"null" {
            return Ok(false);
        }
        let said = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        anyhow::bail!("bpftool {}: {}", args.join(" "), said.trim());
    }
    let entry: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    // The value's bytes, as hex strings: the entry's action is one of them.
    let action = std::mem::offset_of!(masq_ebpf::PolicyEntry, action);
    let value = entry["value"][action]
        .as_str()
        .and_then(|hex| u8::from_str_radix(hex.trim_start_matches("0x"), 16).ok())
        .with_context(|| format!("no value in {entry}"))?;
    Ok(value == masq_ebpf::prefix_action::NON_MASQUERADE)
}

/// The `--flag value` pairs a benchmark binary was given, in order.
pub fn flag_pairs() -> anyhow::Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        pairs.push((flag, value));
    }
    Ok(pairs)
}
