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

/// The flows `datapath_bench`'s spread case opens in a NAT table of `capacity` entries before
/// cases of `runs` runs each: half the table (a flow takes two entries) less half of what a
/// new-flow case adds (a flow a run), so that a new-flow case's table is half full on average.
pub fn spread_flows(runs: u32, capacity: u32) -> u32 {
    (capacity / 4).saturating_sub(runs / 2)
}

/// `n` with its thousands apart, as the docs write numbers: 116 072.
pub fn in_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(digit);
    }
    out
}

/// `bpftool --json ARGS`, parsed: `null` for a lookup of a key the map lacks.
fn bpftool_json(args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let out = std::process::Command::new("bpftool")
        .arg("--json")
        .args(args)
        .output()?;
    // A lookup fails both for a key the map lacks, printing `null`, and for a missing map.
    if !out.status.success() && out.stdout.trim_ascii() != b"null" {
        let said = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        anyhow::bail!("bpftool {}: {}", args.join(" "), said.trim());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The id of the map named `name` that program `program_id` uses, if it uses one: how a map
/// the agent does not pin is found.
pub fn program_map_id(program_id: u32, name: &str) -> anyhow::Result<Option<u32>> {
    let name = masq_ebpf::map_names::as_the_kernel_keeps(name);
    let program = bpftool_json(&["prog", "show", "id", &program_id.to_string()])?;
    for id in program["map_ids"].as_array().into_iter().flatten() {
        let id = id.as_u64().context("a map id")?.to_string();
        if bpftool_json(&["map", "show", "id", &id])?["name"] == name {
            return Ok(Some(id.parse()?));
        }
    }
    Ok(None)
}

/// Whether every one of `ports` of `proto` has its bit set in the port map `map_id`, laid out
/// as `node_ports` (`masq_ebpf::node_ports::slot`).
pub fn port_bits_set(map_id: u32, proto: u8, ports: &[u16]) -> anyhow::Result<bool> {
    let mut words = std::collections::BTreeMap::<u32, u64>::new();
    for &port in ports {
        let (word, bit) =
            masq_ebpf::node_ports::slot(proto, port).context("a protocol with ports")?;
        *words.entry(word).or_default() |= bit;
    }
    let map_id = map_id.to_string();
    for (word, bits) in words {
        let key: Vec<String> = word.to_ne_bytes().map(|b| b.to_string()).into();
        let mut args = vec!["map", "lookup", "id", &map_id, "key"];
        args.extend(key.iter().map(String::as_str));
        // In the machine's byte order.
        let bytes = value_bytes(&bpftool_json(&args)?)?;
        let value = u64::from_ne_bytes(bytes.try_into().ok().context("an eight-byte value")?);
        if value & bits != bits {
            return Ok(false);
        }
    }
    Ok(true)
}

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
        "{} is not built: run `cargo test --workspace --no-run`, or `cargo xtask test`",
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
    let mut args = vec!["map", "lookup", "pinned", pin, "key"];
    args.extend(key.iter().map(String::as_str));
    let entry = bpftool_json(&args)?;
    if entry.is_null() {
        return Ok(false);
    }
    let action = std::mem::offset_of!(masq_ebpf::PolicyEntry, action);
    let value = value_bytes(&entry)?;
    let action = value
        .get(action)
        .with_context(|| format!("no action in {entry}"))?;
    Ok(*action == masq_ebpf::prefix_action::NON_MASQUERADE)
}

/// The bytes of the value bpftool's `--json` shows for a map entry, which it lists as hex
/// strings.
fn value_bytes(entry: &serde_json::Value) -> anyhow::Result<Vec<u8>> {
    entry["value"]
        .as_array()
        .with_context(|| format!("no value in {entry}"))?
        .iter()
        .map(|byte| {
            byte.as_str()
                .and_then(|hex| u8::from_str_radix(hex.trim_start_matches("0x"), 16).ok())
        })
        .collect::<Option<_>>()
        .with_context(|| format!("a value of bytes in {entry}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_with_their_thousands_apart() {
        let written: Vec<String> = [0, 999, 1_000, 30_000, 116_072, 524_288, 1_234_567]
            .into_iter()
            .map(in_thousands)
            .collect();
        assert_eq!(
            written,
            [
                "0",
                "999",
                "1 000",
                "30 000",
                "116 072",
                "524 288",
                "1 234 567"
            ]
        );
    }

    #[test]
    fn the_spread_flows_and_a_new_flow_case_s_fill_half_the_table_on_average() {
        let (runs, capacity) = (30_000, 524_288);
        let spread = spread_flows(runs, capacity);
        assert_eq!(spread, 116_072);
        // Two entries a flow: the case starts below half and ends above it, as far each way.
        let (start, end) = (2 * spread, 2 * (spread + runs));
        assert_eq!(capacity / 2 - start, end - capacity / 2);
        assert_eq!(spread_flows(capacity, capacity), 0);
    }
}
