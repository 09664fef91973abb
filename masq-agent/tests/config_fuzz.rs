//! The config file and `--to-ports` parsers under hostile input: random bytes, token soup,
//! deep nesting, aliases, invalid UTF-8 and a huge file. Never a panic; always a valid config or
//! a clean rejection that names the file; and bounded memory.

use std::{os::unix::process::ExitStatusExt as _, path::Path, process::Command};

use masq_agent::{
    config::{self, ConfigOptions, MAX_CONFIG_BYTES},
    ports::PortRanges,
};
use proptest::prelude::*;

const ORIGIN: &str = "/etc/config/ip-masq-agent";
const OPTS: ConfigOptions = ConfigOptions {
    nomasq_all_reserved_ranges: false,
    families: masq_agent::families::IpFamilies::DUAL_STACK,
};

/// Parses `text`: a valid config or an error that names the file and says something.
fn parse_cleanly(text: &[u8]) -> Result<(), TestCaseError> {
    if let Err(e) = config::parse(text, ORIGIN, &OPTS) {
        prop_assert_eq!(e.origin.as_str(), ORIGIN);
        prop_assert!(!e.message.trim().is_empty(), "an empty message");
    }
    Ok(())
}

/// Pieces of YAML and JSON, config keys and values among them, to make text that gets past
/// the first checks far more often than random bytes do.
const TOKENS: &[&str] = &[
    "nonMasqueradeCIDRs",
    "masqueradeCIDRs",
    "nonMasqueradeSrcCIDRs",
    "masqueradeSrcCIDRs",
    "masqueradeAddress",
    "masqueradeAddressIPv6",
    "NonMasqueradeSrcCIDRs",
    "masqLinkLocal",
    "masqLinkLocalIPv6",
    "resyncInterval",
    "cidrLimit",
    ": ",
    ":",
    "\n",
    "  ",
    "- ",
    "-",
    "[",
    "]",
    "{",
    "}",
    ",",
    "\"",
    "'",
    "&a ",
    "*a",
    "<<: ",
    "!!str ",
    "!!binary ",
    "? ",
    "|",
    ">",
    "#",
    "---\n",
    "...\n",
    "10.0.0.0/8",
    "fc00::/7",
    "0.0.0.0/0",
    "::/0",
    "198.51.100.7",
    "2001:db8::7",
    "::ffff:198.51.100.7",
    "255.255.255.255",
    "300.0.0.0/8",
    "10.0.0.0/33",
    "true",
    "false",
    "yes",
    "no",
    "~",
    "null",
    "60s",
    "1h2m",
    "-1s",
    "9223372036854775807",
    "1e309",
    "0x10",
    "\\u0060",
    "\t",
    "\u{feff}",
    "\u{0}",
    "é",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_are_rejected_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        parse_cleanly(&bytes)?;
    }

    #[test]
    fn yaml_token_soup_is_parsed_or_rejected_cleanly(
        tokens in proptest::collection::vec(proptest::sample::select(TOKENS), 0..48)
    ) {
        parse_cleanly(tokens.concat().as_bytes())?;
    }

    #[test]
    fn to_ports_never_panics_on_any_text(s in "\\PC{0,48}") {
        if let Err(e) = PortRanges::parse_flag(&s) {
            prop_assert!(e.starts_with("invalid --to-ports"), "{}", e);
        }
    }

    #[test]
    fn to_ports_number_soup_is_parsed_or_rejected_cleanly(
        tokens in proptest::collection::vec(
            proptest::sample::select(&["0", "1", "1024", "65535", "65536", "99999999999999999999",
                                      "-", ",", " ", "+", "a", "-1"][..]),
            0..16,
        )
    ) {
        let text = tokens.concat();
        match PortRanges::parse_flag(&text) {
            Ok(ranges) => prop_assert!(ranges.ranges().iter().all(|r| r.first >= 1 && r.first <= r.last)),
            Err(e) => prop_assert!(e.starts_with("invalid --to-ports"), "{}", e),
        }
    }
}

#[test]
fn deep_nesting_is_rejected_without_exhausting_the_stack() {
    let depth = 100_000;
    let flow = format!(
        "nonMasqueradeCIDRs: {}{}",
        "[".repeat(depth),
        "]".repeat(depth)
    );
    // Block nesting costs its indentation: 3 000 levels are 4.5 MB.
    let block: String = (0..3_000)
        .map(|level| format!("{}a:\n", " ".repeat(level)))
        .collect();
    let json = format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
    for text in [flow, block, json] {
        let e = config::parse(text.as_bytes(), ORIGIN, &OPTS).expect_err("too deep");
        assert_eq!(e.origin, ORIGIN);
    }
}

#[test]
fn alias_bombs_are_rejected() {
    // Each level refers to the one before nine times: 9^12 strings if expanded.
    let mut laughs = String::from("a0: &a0 [\"10.0.0.0/8\"]\n");
    for level in 1..12 {
        let refs = vec![format!("*a{}", level - 1); 9].join(", ");
        laughs.push_str(&format!("a{level}: &a{level} [{refs}]\n"));
    }
    laughs.push_str("nonMasqueradeCIDRs: *a11\n");
    let e = config::parse(laughs.as_bytes(), ORIGIN, &OPTS).expect_err("an alias bomb");
    assert_eq!(e.origin, ORIGIN);
}

#[test]
fn invalid_utf8_is_rejected_with_a_message() {
    for text in [
        &b"nonMasqueradeCIDRs: [\"10.0.0.0/8\xff\"]\n"[..],
        b"\xc3\x28resyncInterval: 60s\n",
        b"{\"nonMasqueradeCIDRs\": [\"\xed\xa0\x80\"]}",
    ] {
        let e = config::parse(text, ORIGIN, &OPTS).expect_err("invalid UTF-8");
        assert!(!e.message.is_empty());
    }
}

/// A 100 MB file: `check-config` says it is too large and exits 1, having read no more than
/// the limit. Measured in a child process, whose peak memory is its own.
#[test]
fn a_huge_file_is_refused_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ip-masq-agent");
    let file = std::fs::File::create(&path).unwrap();
    // Sparse: 100 MB the kernel hands out as zeros, without the test writing them.
    file.set_len(100 << 20).unwrap();
    let (status, stderr, peak_kib) = run_measured(&path);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("larger than {} MiB", MAX_CONFIG_BYTES >> 20)),
        "{stderr}"
    );
    let limit_kib = (MAX_CONFIG_BYTES >> 10) + 32 * 1024;
    assert!(
        peak_kib < limit_kib as i64,
        "peak {peak_kib} KiB for a file refused at {} MiB",
        MAX_CONFIG_BYTES >> 20
    );
}

/// Runs `masq-agent check-config` on `config`; its exit status, stderr and peak RSS in KiB.
fn run_measured(config: &Path) -> (std::process::ExitStatus, String, i64) {
    let stderr_path = config.with_extension("stderr");
    // Reaped by wait4 below, which also reports the child's peak memory.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_masq-agent"))
        .arg("check-config")
        .arg(format!("--config={}", config.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let mut raw_status = 0;
    // SAFETY: rusage is plain data that wait4 fills in for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut raw_status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32, "wait4");
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    (
        std::process::ExitStatus::from_raw(raw_status),
        stderr,
        usage.ru_maxrss,
    )
}
