//! The reference data plane: upstream's `nat` chain, byte for byte, applied with
//! `iptables-restore --noflush` so that only this chain changes, atomically.

use std::{
    collections::HashMap,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};
use serde::Serialize;

use super::{ApplyOutcome, DataPlane, Mode, Status, ipset, run_with_input};
use crate::policy::{Action, IpFamily, MasqueradeOptions, Policy, Rules};

const NON_MASQ_COMMENT: &str =
    r#"-m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE""#;
const MASQ_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)""#;
const MASQ_EXCEPTION_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: traffic to a masqueradeCIDRs entry is subject to MASQUERADE""#;
const SWITCHED_OFF_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: IPv6 switched off by the config; what is open stays translated""#;
const EBPF_RETURN_COMMENT: &str =
    r#"-m comment --comment "ip-masq-agent: translated by the eBPF data plane""#;
/// Seconds to wait for the xtables lock, as upstream does.
const XTABLES_WAIT_SECS: &str = "5";
/// MASQUERADE's `--to-ports` applies to these protocols, one rule per range each.
const PORT_MAPPED_PROTOCOLS: [&str; 3] = ["tcp", "udp", "sctp"];

/// Which chain body to install.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainVariant {
    /// Upstream's chain: masquerades everything not exempted.
    Full,
    /// The same chain, but what the eBPF programs translate returns first when it leaves by a
    /// device that carries them, so the chain handles the other protocols (SCTP, GRE, ...) and
    /// whatever leaves by other devices.
    OutsideEbpf {
        /// Never empty: see `beside_programs`.
        devices: Vec<String>,
    },
}

impl ChainVariant {
    /// The chain beside programs on `devices`: upstream's when there are none, as then nothing
    /// is left to the programs.
    pub fn beside_programs(devices: Vec<String>) -> ChainVariant {
        if devices.is_empty() {
            ChainVariant::Full
        } else {
            ChainVariant::OutsideEbpf { devices }
        }
    }
}

/// The protocols the eBPF programs translate, as the family's iptables names them.
fn ebpf_protocols(family: IpFamily) -> [&'static str; 3] {
    let icmp = match family {
        IpFamily::Ipv4 => "icmp",
        IpFamily::Ipv6 => "ipv6-icmp",
    };
    ["tcp", "udp", icmp]
}

/// What the installed iptables can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// `--random-fully` needs iptables >= 1.6.2.
    pub random_fully: bool,
}

impl Capabilities {
    /// Probes `iptables --version`. Without iptables we assume a modern one, so that
    /// `render-iptables` still shows what a current node would get.
    pub fn detect(family: IpFamily) -> Capabilities {
        let version = Command::new(binary(family))
            .arg("--version")
            .output()
            .ok()
            .and_then(|out| parse_version(&String::from_utf8_lossy(&out.stdout)));
        Capabilities {
            random_fully: version.is_none_or(|v| v >= (1, 6, 2)),
        }
    }
}

/// Parses `iptables v1.8.9 (nf_tables)` into `(1, 8, 9)`.
fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

fn binary(family: IpFamily) -> &'static str {
    match family {
        IpFamily::Ipv4 => "iptables",
        IpFamily::Ipv6 => "ip6tables",
    }
}

fn restore_binary(family: IpFamily) -> &'static str {
    match family {
        IpFamily::Ipv4 => "iptables-restore",
        IpFamily::Ipv6 => "ip6tables-restore",
    }
}

/// A family's entries in rule order, so that the first rule a destination matches is the one
/// that decides it; `None` when the policy leaves the family alone. Without exceptions that is
/// upstream's order; with them, longest prefix first.
fn rules_in_chain_order(family: IpFamily, policy: &Policy) -> Option<Rules> {
    let mut rules = policy.rules(family)?;
    if rules
        .iter()
        .any(|(_, action)| *action == Action::Masquerade)
    {
        rules.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
    }
    Some(rules)
}

/// The members of the set that stands for a family's entries beside the programs: `hash:net`
/// matches the longest prefix it holds, and an exception is a `nomatch` entry, so the set gives
/// the same answer as the trie. The set holds no /0, which two /1 halves stand for; an entry
/// for one of those /1s is the longer prefix, and takes its half's place.
pub fn set_members(rules: &Rules) -> Vec<ipset::Member> {
    // Of the entries for one prefix, the one sorted last holds: a rule over a /0's half, of two
    // rules the later one, and of two /0s' halves the earlier one's. Sorting (rather than
    // hashing) 100 000 entries takes half the time, and the set wants them sorted anyway.
    let mut ranked: Vec<(ipnet::IpNet, (bool, isize), Action)> = Vec::with_capacity(rules.len());
    for (i, &(net, action)) in rules.iter().enumerate() {
        let i = i as isize;
        match net.prefix_len() {
            0 => ranked.extend(
                (net.subnets(1).expect("a /0 splits in two"))
                    .map(|half| (half, (false, -i), action)),
            ),
            _ => ranked.push((net, (true, i), action)),
        }
    }
    ranked.sort_unstable_by_key(|&(net, rank, _)| (net, rank));
    let mut members: Vec<ipset::Member> = Vec::with_capacity(ranked.len());
    for (net, _, action) in ranked {
        let member = ipset::Member {
            net,
            nomatch: action == Action::Masquerade,
        };
        match members.last_mut() {
            Some(last) if last.net == net => *last = member,
            _ => members.push(member),
        }
    }
    members
}

/// The iptables-restore input for one family, or `None` when the policy leaves that family
/// alone (IPv6 not enabled).
pub fn render(
    family: IpFamily,
    policy: &Policy,
    opts: &MasqueradeOptions,
    caps: Capabilities,
    variant: &ChainVariant,
) -> Option<String> {
    let rules = rules_in_chain_order(family, policy)?;
    let chain = &opts.chain;
    let mut lines = vec!["*nat".to_string(), format!(":{chain} - [0:0]")];
    if let ChainVariant::OutsideEbpf { devices } = variant {
        for device in devices {
            for proto in ebpf_protocols(family) {
                lines.push(format!(
                    "-A {chain} {EBPF_RETURN_COMMENT} -o {device} -p {proto} -j RETURN"
                ));
            }
        }
    }
    let masquerade = if opts.random_fully && caps.random_fully {
        "-j MASQUERADE --random-fully"
    } else {
        "-j MASQUERADE"
    };
    // The rules that masquerade what reaches them: to `dst` only, or (last) everything.
    let masquerade_rules = |dst: Option<&str>| {
        let (comment, dst) = match dst {
            Some(cidr) => (MASQ_EXCEPTION_COMMENT, format!(" -d {cidr}")),
            None => (MASQ_COMMENT, String::new()),
        };
        let mut rules = Vec::new();
        if let Some(ports) = &opts.to_ports {
            for proto in PORT_MAPPED_PROTOCOLS {
                for (range, probability) in ports.sequential_probabilities() {
                    let statistic = probability
                        .map(|p| format!(" -m statistic --mode random --probability {p}"))
                        .unwrap_or_default();
                    rules.push(format!(
                        "-A {chain} {comment}{dst} {masquerade} -p {proto}{statistic} --to-ports {range}"
                    ));
                }
            }
        }
        rules.push(format!("-A {chain} {comment}{dst} {masquerade}"));
        rules
    };
    match variant {
        ChainVariant::Full => {
            for (cidr, action) in rules {
                match action {
                    Action::NonMasquerade => {
                        lines.push(format!("-A {chain} {NON_MASQ_COMMENT} -d {cidr} -j RETURN"));
                    }
                    Action::Masquerade => lines.extend(masquerade_rules(Some(&cidr.to_string()))),
                }
            }
        }
        ChainVariant::OutsideEbpf { .. } => {
            let set = ipset::name(chain, family);
            lines.push(format!(
                "-A {chain} {NON_MASQ_COMMENT} -m set --match-set {set} dst -j RETURN"
            ));
        }
    }
    lines.extend(masquerade_rules(None));
    lines.push("COMMIT".to_string());
    let mut text = lines.join("\n");
    text.push('\n');
    Some(text)
}

/// The rule that sends non-local traffic from POSTROUTING into our chain, as argv words.
fn jump_rule(chain: &str) -> Vec<String> {
    let comment = format!(
        "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom {chain} chain"
    );
    [
        "-m",
        "comment",
        "--comment",
        &comment,
        "-m",
        "addrtype",
        "!",
        "--dst-type",
        "LOCAL",
        "-j",
        chain,
    ]
    .map(String::from)
    .to_vec()
}

/// Runs iptables for one family, always waiting for the xtables lock.
struct Iptables {
    family: IpFamily,
}

impl Iptables {
    fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let bin = binary(self.family);
        let out = Command::new(bin)
            .args(["-w", XTABLES_WAIT_SECS])
            .args(args)
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            bail!(
                "{bin} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `true` when the command succeeds, `false` when iptables says no; used for `-C`. A
    /// resource problem (iptables' exit code 4: not root, no nat table) is an error, not a no.
    fn check(&self, args: &[&str]) -> anyhow::Result<bool> {
        const RESOURCE_PROBLEM: i32 = 4;
        let bin = binary(self.family);
        let out = Command::new(bin)
            .args(["-w", XTABLES_WAIT_SECS])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {bin}"))?;
        if out.status.code() == Some(RESOURCE_PROBLEM) {
            bail!(
                "{bin} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out.status.success())
    }

    fn restore(&self, input: &str) -> anyhow::Result<()> {
        run_with_input(
            restore_binary(self.family),
            &["--noflush", "-w", XTABLES_WAIT_SECS],
            input,
        )
    }

    fn jump_args<'a>(op: &'a str, jump: &'a [String]) -> Vec<&'a str> {
        let mut args = vec!["-t", "nat", op, "POSTROUTING"];
        args.extend(jump.iter().map(String::as_str));
        args
    }

    fn jump_present(&self, chain: &str) -> anyhow::Result<bool> {
        self.check(&Self::jump_args("-C", &jump_rule(chain)))
    }

    fn ensure_jump(&self, chain: &str) -> anyhow::Result<()> {
        if !self.jump_present(chain)? {
            self.run(&Self::jump_args("-A", &jump_rule(chain)))?;
        }
        Ok(())
    }

    /// The chain as iptables lists it, or `None` if it does not exist.
    fn list_chain(&self, chain: &str) -> anyhow::Result<Option<String>> {
        if !self.check(&["-t", "nat", "-S", chain])? {
            return Ok(None);
        }
        self.run(&["-t", "nat", "-S", chain]).map(Some)
    }

    /// Removes the chain and every jump to it; says whether the chain was there.
    fn remove(&self, chain: &str) -> anyhow::Result<bool> {
        let jump = jump_rule(chain);
        // `-D` removes one copy per call; a bounded loop also removes duplicates others added.
        let mut jumps = 0;
        for _ in 0..64 {
            if !self.check(&Self::jump_args("-D", &jump))? {
                break;
            }
            jumps += 1;
        }
        let present = self.list_chain(chain)?.is_some();
        if present {
            self.run(&["-t", "nat", "-F", chain])?;
            self.run(&["-t", "nat", "-X", chain])?;
        }
        // The eBPF data plane's chain matches its CIDRs through a set; it goes with the chain.
        ipset::destroy(&ipset::name(chain, self.family))?;
        Ok(present || jumps > 0)
    }

    fn chain_status(&self, chain: &str) -> anyhow::Result<ChainStatus> {
        let listing = self.list_chain(chain)?;
        let mut status = ChainStatus::read(self.family, chain, listing.as_deref(), ipset::members)?;
        status.jump_installed = self.jump_present(chain)?;
        Ok(status)
    }
}

fn push_new(list: &mut Vec<String>, item: String) {
    if !list.contains(&item) {
        list.push(item);
    }
}

/// iptables' `-o` wildcard: a name ending in `+` matches every name it begins.
const ANY_DEVICE: &str = "+";

/// Whether `-o pattern` matches `device`.
fn device_matches(pattern: &str, device: &str) -> bool {
    match pattern.strip_suffix(ANY_DEVICE) {
        Some(prefix) => device.starts_with(prefix),
        None => device == pattern,
    }
}

/// The word after `flag` among a rule's `words`, as `iptables -S` lists it.
fn flag_value<'a>(words: &[&'a str], flag: &str) -> Option<&'a str> {
    let at = words.iter().position(|w| *w == flag)?;
    words.get(at + 1).copied()
}

/// One family's chain, as read back from the kernel.
#[derive(Debug, Clone, Serialize)]
pub struct ChainStatus {
    pub family: IpFamily,
    pub chain: String,
    pub installed: bool,
    pub jump_installed: bool,
    /// Protocols that return early because the eBPF programs translate them.
    pub ebpf_protocols_returned: Vec<String>,
    /// The devices (as `-o` names them) by which those protocols return early.
    pub ebpf_devices_returned: Vec<String>,
    pub non_masquerade: Vec<String>,
    /// The masqueradeCIDRs entries, where there are any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub masquerade_exceptions: Vec<String>,
    pub masquerade_rules: usize,
}

impl ChainStatus {
    /// The chain as `iptables -S` lists it (`None`: not installed), with the members of the set
    /// it matches on from `set_members`.
    fn read(
        family: IpFamily,
        chain: &str,
        listing: Option<&str>,
        set_members: impl Fn(&str) -> anyhow::Result<Vec<String>>,
    ) -> anyhow::Result<ChainStatus> {
        let mut status = ChainStatus {
            family,
            chain: chain.to_string(),
            installed: listing.is_some(),
            jump_installed: false,
            ebpf_protocols_returned: Vec::new(),
            ebpf_devices_returned: Vec::new(),
            non_masquerade: Vec::new(),
            masquerade_exceptions: Vec::new(),
            masquerade_rules: 0,
        };
        for line in listing.unwrap_or_default().lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |flag: &str| flag_value(&words, flag).map(String::from);
            if line.contains("-j MASQUERADE") {
                status.masquerade_rules += 1;
                if let Some(dst) = after("-d") {
                    push_new(&mut status.masquerade_exceptions, dst);
                }
            } else if let Some(set) = after("--match-set") {
                for member in set_members(&set)? {
                    match member.strip_suffix(&format!(" {}", ipset::NOMATCH)) {
                        Some(exception) => status.masquerade_exceptions.push(exception.into()),
                        None => status.non_masquerade.push(member),
                    }
                }
            } else if let Some(dst) = after("-d") {
                status.non_masquerade.push(dst);
            } else if let Some(proto) = after("-p") {
                // A rule without `-o` (an agent before per-device rules) returns every device.
                let device = after("-o").unwrap_or_else(|| ANY_DEVICE.to_string());
                push_new(&mut status.ebpf_protocols_returned, proto);
                push_new(&mut status.ebpf_devices_returned, device);
            }
        }
        Ok(status)
    }

    /// Whether the chain returns the TCP, UDP and ICMP leaving by `device` to the eBPF
    /// programs, masquerading none of it.
    pub fn returns_to_programs(&self, device: &str) -> bool {
        self.ebpf_devices_returned
            .iter()
            .any(|pattern| device_matches(pattern, device))
    }

    /// Whether packets leaving the node go through this chain at all.
    pub fn in_force(&self) -> bool {
        self.installed && self.jump_installed
    }
}

impl std::fmt::Display for ChainStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let family = match self.family {
            IpFamily::Ipv4 => "iptables",
            IpFamily::Ipv6 => "ip6tables",
        };
        if !self.installed {
            return writeln!(f, "{family} nat chain {}: not installed", self.chain);
        }
        writeln!(
            f,
            "{family} nat chain {}: {} non-masquerade rules, {} MASQUERADE rules, POSTROUTING jump {}",
            self.chain,
            self.non_masquerade.len(),
            self.masquerade_rules,
            if self.jump_installed {
                "present"
            } else {
                "MISSING"
            }
        )?;
        if !self.ebpf_protocols_returned.is_empty() {
            writeln!(
                f,
                "  left to eBPF: {} leaving by {}",
                self.ebpf_protocols_returned.join(", "),
                self.ebpf_devices_returned.join(", ")
            )?;
        }
        for cidr in &self.masquerade_exceptions {
            writeln!(f, "  masqueraded although inside what is not: {cidr}")?;
        }
        for cidr in &self.non_masquerade {
            writeln!(f, "  not masqueraded: {cidr}")?;
        }
        Ok(())
    }
}

/// What was last installed for one family, to make re-applying an unchanged policy cheap.
struct Installed {
    rendered: String,
    /// The members of the chain's set, for the chain beside the eBPF programs.
    set: Option<Vec<ipset::Member>>,
    /// `iptables -S` of the chain right after installing it; any difference later means someone
    /// else changed it.
    listing: String,
}

pub struct IptablesDataPlane {
    opts: MasqueradeOptions,
    /// The chain each family gets.
    variants: HashMap<IpFamily, ChainVariant>,
    mode: Mode,
    reason: Option<String>,
    /// Probed once: the iptables binaries do not change under a running agent.
    caps: HashMap<IpFamily, Capabilities>,
    installed: HashMap<IpFamily, Installed>,
    /// The next apply reads the chain and the set back rather than trust `installed`: at every
    /// resync, and after an apply that failed midway.
    verify: bool,
}

impl IptablesDataPlane {
    pub fn new(opts: MasqueradeOptions, variant: ChainVariant, mode: Mode) -> Self {
        IptablesDataPlane {
            opts,
            variants: [IpFamily::Ipv4, IpFamily::Ipv6]
                .into_iter()
                .map(|f| (f, variant.clone()))
                .collect(),
            mode,
            reason: None,
            caps: [IpFamily::Ipv4, IpFamily::Ipv6]
                .into_iter()
                .map(|f| (f, Capabilities::detect(f)))
                .collect(),
            installed: HashMap::new(),
            verify: true,
        }
    }

    /// Gives `family` the `variant` chain from the next apply on.
    pub fn set_variant(&mut self, family: IpFamily, variant: ChainVariant) {
        self.variants.insert(family, variant);
    }

    /// The full chain, standing in for the eBPF data plane, which could not run because of
    /// `reason`.
    pub fn fallback(opts: MasqueradeOptions, reason: String) -> Self {
        IptablesDataPlane {
            reason: Some(reason),
            ..Self::new(opts, ChainVariant::Full, Mode::IptablesFallback)
        }
    }

    pub fn chain(&self) -> &str {
        &self.opts.chain
    }

    /// For IPv6 switched off by the file (`enableIPv6: false`), a chain that masquerades
    /// nothing. Its one rule matches on conntrack's state: on a node where nothing else
    /// uses IPv6 connection tracking, the last MASQUERADE rule gone would take conntrack's
    /// IPv6 hooks with it, and the connections already translated would stop being
    /// translated back. `None` when the family is merely left alone, as upstream leaves it.
    fn switched_off(&self, family: IpFamily, policy: &Policy) -> Option<String> {
        // Asked on every apply while IPv6 is off, which is most nodes: only a switch the file
        // makes is worth a look at the kernel's chain.
        if family != IpFamily::Ipv6 || !policy.ipv6_switched_off {
            return None;
        }
        let chain = &self.opts.chain;
        let ours = self.installed.contains_key(&family)
            || (Iptables { family })
                .list_chain(chain)
                .ok()??
                .contains("-A ");
        ours.then(|| {
            format!(
                "*nat\n:{chain} - [0:0]\n-A {chain} {SWITCHED_OFF_COMMENT} -m conntrack --ctstate SNAT -j RETURN\nCOMMIT\n"
            )
        })
    }

    /// Both families' chains and sets made to match `policy`.
    fn apply_families(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome> {
        let mut outcome = ApplyOutcome::Unchanged;
        for (family, caps) in [IpFamily::Ipv4, IpFamily::Ipv6].map(|f| (f, self.caps[&f])) {
            let variant = &self.variants[&family];
            let rendered = render(family, policy, &self.opts, caps, variant)
                .or_else(|| self.switched_off(family, policy));
            let Some(rendered) = rendered else {
                continue;
            };
            let set = matches!(variant, ChainVariant::OutsideEbpf { .. })
                .then(|| policy.rules(family).as_ref().map(set_members))
                .flatten();
            match self.apply_family(family, rendered, set)? {
                ApplyOutcome::Unchanged => {}
                changed => outcome = changed,
            }
        }
        Ok(outcome)
    }

    fn apply_family(
        &mut self,
        family: IpFamily,
        rendered: String,
        set: Option<Vec<ipset::Member>>,
    ) -> anyhow::Result<ApplyOutcome> {
        let ipt = Iptables { family };
        let chain = &self.opts.chain;
        let set_name = ipset::name(chain, family);
        let previous = self.installed.get(&family);
        // Listing a chain of 100 000 rules takes seconds: only one that should not change is,
        // and only when verifying; each look costs a process or two.
        let chain_intact = match previous {
            Some(prev) if prev.rendered == rendered => {
                !self.verify
                    || (ipt.list_chain(chain)?.as_deref() == Some(prev.listing.as_str())
                        && ipt.jump_present(chain)?)
            }
            _ => false,
        };
        // The members the live set holds, as far as the agent can tell without listing them:
        // those it installed, if it has as many.
        let live_set = match previous.and_then(|prev| prev.set.as_ref()) {
            Some(members) if !self.verify || ipset::len(&set_name)? == Some(members.len()) => {
                Some(members)
            }
            _ => None,
        };
        let set_intact = set.is_none() || (live_set.is_some() && live_set == set.as_ref());
        if chain_intact && set_intact {
            return Ok(ApplyOutcome::Unchanged);
        }
        let outcome = match previous {
            Some(prev) if prev.rendered == rendered && prev.set == set => ApplyOutcome::Repaired,
            _ => ApplyOutcome::Applied,
        };
        // The set before the chain that matches on it; the chain before the jump to it, so there
        // is no moment with a jump to an empty chain.
        if let Some(members) = &set
            && !set_intact
        {
            match live_set {
                Some(live) => ipset::update(&set_name, live, members)?,
                None => ipset::sync(&set_name, family, members)?,
            }
        }
        let listing = match previous {
            Some(prev) if chain_intact => prev.listing.clone(),
            _ => {
                ipt.restore(&rendered)?;
                ipt.ensure_jump(chain)?;
                ipt.list_chain(chain)?
                    .context("chain vanished right after it was installed")?
            }
        };
        self.installed.insert(
            family,
            Installed {
                rendered,
                set,
                listing,
            },
        );
        Ok(outcome)
    }
}

impl DataPlane for IptablesDataPlane {
    fn mode(&self) -> Mode {
        self.mode
    }

    fn mode_reason(&self) -> Option<String> {
        self.reason.clone()
    }

    fn apply(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome> {
        let applied = self.apply_families(policy);
        // What a failed apply left behind is not known.
        self.verify = applied.is_err();
        applied
    }

    fn verify_next_apply(&mut self) {
        self.verify = true;
    }

    fn status(&self) -> anyhow::Result<Status> {
        let mut status = super::read_back(&self.opts.chain, None)?;
        if status.mode.is_some() {
            status.mode = Some(self.mode);
            status.mode_reason = self.reason.clone();
        }
        Ok(status)
    }

    fn cleanup(&mut self) -> anyhow::Result<()> {
        self.installed.clear();
        cleanup(&self.opts.chain).map(drop)
    }
}

/// What the installed chain does with a packet, found rule by rule as the kernel would.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChainVerdict {
    /// A rule returns it unmasqueraded (or the chain ends).
    KeepsAddress,
    Masquerades,
    /// It returns at once, for the eBPF programs on its device to translate.
    LeftToPrograms,
    /// No POSTROUTING rule jumps to the chain: nothing in it applies.
    NotJumpedTo,
}

/// What chain `chain` of `family` does with a packet of `protocol` (IANA number) to `dst`
/// leaving by `device`; `None` if the chain is not installed.
pub fn chain_verdict(
    family: IpFamily,
    chain: &str,
    dst: std::net::IpAddr,
    protocol: u8,
    device: &str,
) -> anyhow::Result<Option<ChainVerdict>> {
    let iptables = Iptables { family };
    let Some(listing) = iptables.list_chain(chain)? else {
        return Ok(None);
    };
    if !iptables.jump_present(chain)? {
        return Ok(Some(ChainVerdict::NotJumpedTo));
    }
    let packet = Packet {
        dst,
        protocol,
        device,
    };
    evaluate(&listing, &packet, |set| ipset::contains(set, dst)).map(Some)
}

/// A packet as the chain's matches see it.
struct Packet<'a> {
    dst: std::net::IpAddr,
    protocol: u8,
    device: &'a str,
}

/// Whether a rule uses only what the agent's own chains use, which `evaluate` follows: no
/// negation, no source match, and no match module but comment, set and statistic (which picks
/// among masquerade rules, all of which masquerade).
fn understood(words: &[&str]) -> bool {
    let mut modules = words
        .windows(2)
        .filter(|pair| pair[0] == "-m")
        .map(|pair| pair[1]);
    !words
        .iter()
        .any(|w| matches!(*w, "!" | "-s" | "--source" | "-i" | "-g" | "--goto"))
        && modules.all(|m| matches!(m, "comment" | "set" | "statistic"))
}

/// The verdict of the first rule of `listing` (as `iptables -S` prints the chain) that
/// `packet` matches; `in_set` answers `--match-set`.
fn evaluate(
    listing: &str,
    packet: &Packet,
    in_set: impl Fn(&str) -> anyhow::Result<bool>,
) -> anyhow::Result<ChainVerdict> {
    for line in listing.lines().filter(|l| l.starts_with("-A ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if !understood(&words) {
            bail!("the chain holds a rule this reading cannot follow: {line}");
        }
        let after = |flag: &str| flag_value(&words, flag);
        let on_device = after("-o").is_none_or(|o| device_matches(o, packet.device));
        let protocol_matches =
            after("-p").is_none_or(|p| crate::protocols::number(p) == Some(packet.protocol));
        let dst_matches = after("-d").is_none_or(|d| {
            d.parse::<ipnet::IpNet>()
                .or_else(|_| d.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .is_ok_and(|net| net.contains(&packet.dst))
        });
        if !(on_device && protocol_matches && dst_matches) {
            continue;
        }
        if let Some(set) = after("--match-set")
            && !in_set(set)?
        {
            continue;
        }
        return Ok(match after("-j") {
            Some("MASQUERADE") => ChainVerdict::Masquerades,
            _ if after("-o").is_some() => ChainVerdict::LeftToPrograms,
            _ => ChainVerdict::KeepsAddress,
        });
    }
    Ok(ChainVerdict::KeepsAddress)
}

/// Families whose iptables is installed on this node.
fn available_families() -> Vec<IpFamily> {
    [IpFamily::Ipv4, IpFamily::Ipv6]
        .into_iter()
        .filter(|f| Command::new(binary(*f)).arg("--version").output().is_ok())
        .collect()
}

/// Reads the chains back from the kernel, for any process (the daemon or `status`).
pub fn read_chains(chain: &str) -> anyhow::Result<Vec<ChainStatus>> {
    available_families()
        .into_iter()
        .map(|family| Iptables { family }.chain_status(chain))
        .collect()
}

/// Removes the chain and its POSTROUTING jump for every family.
/// Removes the chain of every family and its jumps; returns the families it was found in.
pub fn cleanup(chain: &str) -> anyhow::Result<Vec<IpFamily>> {
    let mut found = Vec::new();
    for family in available_families() {
        if (Iptables { family }).remove(chain)? {
            found.push(family);
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests;
