//! The verifier's budget for each program: the instructions it processed, and the stack of the
//! deepest chain of BPF-to-BPF calls, which it caps at 512 bytes. Both are read from the
//! verbose log that `bpftool -d prog loadall` prints (libbpf's own lines name the functions),
//! so that a change creeping toward a limit shows in the figures before a kernel rejects it.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{Context as _, bail};
use aya::programs::{ProgramError, SchedClassifier};
use masq_ebpf::program_names;

use crate::topology::{self, BPFFS_ROOT, NS_PREFIX};

/// The stack the verifier allows along one chain of calls.
pub const STACK_LIMIT: u32 = 512;
/// The instructions it processes before it gives up on a program.
pub const PROCESSED_LIMIT: u64 = 1_000_000;

/// What the figures (docs/install.md) add to the name of a program of the object built with
/// the slot table, to tell it from the same program without.
pub const SLOT_TABLE_PROGRAM: &str = " (slot table)";

/// How a kernel rounds each function's frame when it adds up a chain of calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackRule {
    /// Before 6.9: every frame up to a multiple of 32 bytes, and at least 32 (the
    /// interpreter's granularity), so that each call costs 32 bytes even for a frame of none.
    Rounded32,
    /// From 6.9, with the JIT on (as on every x86-64 distribution kernel): multiples of 16.
    Rounded16,
}

impl StackRule {
    /// The rule of the kernel whose `uname -r` is `release`.
    pub fn for_release(release: &str) -> StackRule {
        let mut numbers = release
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse::<u32>().ok());
        let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
        if version >= (6, 9) {
            StackRule::Rounded16
        } else {
            StackRule::Rounded32
        }
    }

    /// What a frame of `depth` bytes counts for.
    pub fn frame(self, depth: u32) -> u32 {
        match self {
            StackRule::Rounded32 => depth.max(1).div_ceil(32) * 32,
            StackRule::Rounded16 => depth.div_ceil(16) * 16,
        }
    }
}

/// One BPF function of a program, as the kernel numbers them (`func#N`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Function {
    /// Its first instruction.
    pub start: u32,
    pub name: String,
    /// The stack it uses, as the verifier measured it.
    pub depth: u32,
}

/// What the verifier said of one program.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Budget {
    pub program: String,
    /// Instructions processed (the verifier's `processed N insns`).
    pub processed: Option<u64>,
    /// Its functions, in the kernel's order.
    pub functions: Vec<Function>,
    /// Which function calls which, by index into `functions`.
    pub calls: BTreeSet<(usize, usize)>,
    /// The verifier's last words when it rejected the program.
    pub error: Option<String>,
    /// Why the program was not loaded at all, where the agent does without it.
    #[serde(default)]
    pub not_loaded: Option<String>,
}

/// The deepest chain of calls of a program, under one kernel's rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// The combined stack, as the kernel adds it up.
    pub bytes: u32,
    /// The functions along it, outermost first, by index.
    pub functions: Vec<usize>,
}

impl Budget {
    /// The chain of calls whose frames add up to the most, under `rule`. `None` when the log
    /// lacked the frames (a program rejected before its stack was measured).
    pub fn deepest(&self, rule: StackRule) -> Option<Chain> {
        if self.functions.is_empty() {
            return None;
        }
        let mut deepest: Vec<Option<Chain>> = vec![None; self.functions.len()];
        Some(self.deepest_from(0, rule, &mut deepest))
    }

    fn deepest_from(&self, at: usize, rule: StackRule, memo: &mut [Option<Chain>]) -> Chain {
        if let Some(chain) = &memo[at] {
            return chain.clone();
        }
        let own = rule.frame(self.functions[at].depth);
        let callees: Vec<usize> = self
            .calls
            .range((at, 0)..=(at, usize::MAX))
            .map(|&(_, callee)| callee)
            // The verifier forbids recursion; a log that shows one is not followed round.
            .filter(|&callee| callee > at || !self.reaches(callee, at))
            .collect();
        let mut best = Chain {
            bytes: own,
            functions: vec![at],
        };
        for callee in callees {
            let below = self.deepest_from(callee, rule, memo);
            if own + below.bytes > best.bytes {
                best.bytes = own + below.bytes;
                best.functions = std::iter::once(at).chain(below.functions).collect();
            }
        }
        memo[at] = Some(best.clone());
        best
    }

    fn reaches(&self, from: usize, to: usize) -> bool {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from];
        while let Some(at) = stack.pop() {
            if at == to {
                return true;
            }
            if seen.insert(at) {
                stack.extend(
                    self.calls
                        .range((at, 0)..=(at, usize::MAX))
                        .map(|&(_, c)| c),
                );
            }
        }
        false
    }

    /// Every function with its frame as `rule` counts it, its callees indented below it, from
    /// the program's entry: where the stack goes.
    pub fn tree(&self, rule: StackRule) -> String {
        let mut out = String::new();
        self.tree_from(0, 0, rule, &mut out);
        out
    }

    fn tree_from(&self, at: usize, indent: usize, rule: StackRule, out: &mut String) {
        let Some(f) = self.functions.get(at) else {
            return;
        };
        let below = self.deepest_below(at, rule);
        out.push_str(&format!(
            "{:indent$}{} {} (deepest chain from here {below})\n",
            "",
            f.name,
            rule.frame(f.depth),
        ));
        for &(_, callee) in self.calls.range((at, 0)..=(at, usize::MAX)) {
            self.tree_from(callee, indent + 2, rule, out);
        }
    }

    fn deepest_below(&self, at: usize, rule: StackRule) -> u32 {
        let mut memo = vec![None; self.functions.len()];
        self.deepest_from(at, rule, &mut memo).bytes
    }

    /// `chain` as a line: each function with the bytes it counts for.
    pub fn describe(&self, chain: &Chain, rule: StackRule) -> String {
        chain
            .functions
            .iter()
            .map(|&i| {
                let f = &self.functions[i];
                format!("{} {}", f.name, rule.frame(f.depth))
            })
            .collect::<Vec<_>>()
            .join(" → ")
    }
}

/// Loads every program of `object` into the running kernel with the verifier's verbose log on,
/// and reads their budgets from it: the instructions processed, and every function's frame and
/// calls. The verbose log takes the verifier some ten times longer to write than to verify;
/// `load_quick` is what an emulated CPU can afford.
pub fn measure(object: &Path) -> anyhow::Result<Vec<Budget>> {
    let (budgets, pins) = load_all(object)?;
    let _ = std::fs::remove_dir_all(&pins);
    if budgets.is_empty() {
        bail!("bpftool loaded {} without a verifier log", object.display());
    }
    Ok(budgets)
}

/// Loads each program of `object` into the running kernel on its own, as the agent does,
/// without the verbose log, and says what the kernel recorded of each: the instructions it
/// processed (`verified_instructions`, 5.16), or the verifier's last words when it refused one.
/// A program the kernel lacks the helpers for is not loaded, as the agent leaves it, and says
/// so. No frames: those are the same on every kernel, and `measure` reads them where it is
/// cheap.
pub fn load_quick(object: &Path) -> anyhow::Result<Vec<Budget>> {
    let bytes = std::fs::read(object).with_context(|| format!("reading {}", object.display()))?;
    let mut ebpf = aya::Ebpf::load(&bytes)
        .with_context(|| format!("loading the maps of {}", object.display()))?;
    let mut names: Vec<String> = ebpf.programs().map(|(name, _)| name.to_string()).collect();
    names.sort();
    if names.is_empty() {
        bail!("{} holds no program", object.display());
    }
    names
        .into_iter()
        .map(|program| {
            let classifier: &mut SchedClassifier = ebpf
                .program_mut(&program)
                .expect("listed")
                .try_into()
                .with_context(|| format!("{program} is not a classifier"))?;
            let mut budget = Budget {
                program: program.clone(),
                ..Budget::default()
            };
            if let Some(helper) = program_names::missing_helper(&program) {
                budget.not_loaded = Some(format!("not loaded: the kernel lacks {helper:?}"));
                return Ok(budget);
            }
            match classifier.load() {
                Ok(()) => {
                    budget.processed = classifier
                        .info()?
                        .verified_instruction_count()
                        .map(u64::from)
                }
                Err(ProgramError::LoadError { verifier_log, .. }) => {
                    budget.error = Some(last_words(&verifier_log.to_string()))
                }
                Err(err) => budget.error = Some(err.to_string()),
            }
            Ok(budget)
        })
        .collect()
}

/// The verifier's last line, which says why it refused.
fn last_words(log: &str) -> String {
    log.lines()
        .rev()
        .map(str::trim)
        .find(|line| may_say_why(line))
        .unwrap_or("the verifier wrote no log")
        .to_string()
}

/// Whether a line of the verifier's log may be its last words: not blank, and not the timing
/// it writes after them.
fn may_say_why(line: &str) -> bool {
    !line.trim().is_empty() && !line.starts_with("verification time")
}

/// Runs `bpftool -d prog loadall` on `object`, pinning into a directory of this run's own on
/// bpffs, which the caller removes. Returns what the verbose log said, program by program, and
/// the directory.
fn load_all(object: &Path) -> anyhow::Result<(Vec<Budget>, PathBuf)> {
    topology::ensure_bpffs()?;
    topology::sweep_stale();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let pins = Path::new(BPFFS_ROOT).join(format!(
        "{NS_PREFIX}{}-budget{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&pins);
    let mut bpftool = Command::new("bpftool")
        .args(["-d", "prog", "loadall"])
        .arg(object)
        .arg(&pins)
        .args(["type", "classifier"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running bpftool")?;
    let log = bpftool.stderr.take().expect("piped");
    let budgets = parse(BufReader::new(log));
    bpftool.wait().context("waiting for bpftool")?;
    Ok((budgets?, pins))
}

/// Reads the budgets of every program in the output of `bpftool -d prog loadall`, in the order
/// the programs were loaded. The log is read line by line: a verbose log runs to 100 MB.
pub fn parse(log: impl BufRead) -> anyhow::Result<Vec<Budget>> {
    let mut parser = Parser::default();
    for line in log.lines() {
        parser.line(&line?);
    }
    Ok(parser.finish())
}

/// The state of `parse`.
#[derive(Default)]
struct Parser {
    budgets: Vec<Budget>,
    /// Per program libbpf assembled: its functions' names by first instruction.
    names: BTreeMap<String, BTreeMap<u32, String>>,
    /// The program libbpf is assembling now.
    assembling: Option<String>,
    /// The program whose verifier log is being read, and what it said so far.
    reading: Option<Reading>,
    /// Each program's last verifier line, its error if libbpf then says the load failed.
    last_words: BTreeMap<String, String>,
}

#[derive(Default)]
struct Reading {
    budget: Budget,
    starts: Vec<u32>,
    /// Calls by instruction: (call site, target).
    calls: BTreeSet<(u32, u32)>,
    depths: Vec<u32>,
    last_words: Option<String>,
}

const LIBBPF: &str = "libbpf: prog '";
const LOG_BEGINS: &str = "': -- BEGIN PROG LOAD LOG --";
const LOG_ENDS: &str = "-- END PROG LOAD LOG --";
const LOAD_FAILED: &str = "failed to load";

impl Parser {
    fn line(&mut self, line: &str) {
        if let Some(reading) = &mut self.reading {
            if line.starts_with(LOG_ENDS) {
                let reading = self.reading.take().expect("reading");
                self.finish_reading(reading);
            } else {
                reading.line(line);
            }
            return;
        }
        let Some(rest) = line.strip_prefix(LIBBPF) else {
            return;
        };
        let Some((prog, said)) = rest.split_once("': ") else {
            return;
        };
        if said.starts_with(LOAD_FAILED) {
            let last_words = self.last_words.get(prog).cloned();
            if let Some(budget) = self.budgets.iter_mut().rev().find(|b| b.program == prog) {
                budget.error = last_words.or_else(|| Some(said.to_string()));
            }
        } else if line.ends_with(LOG_BEGINS) {
            self.reading = Some(Reading {
                budget: Budget {
                    program: prog.to_string(),
                    ..Budget::default()
                },
                ..Reading::default()
            });
        } else if said.starts_with("added ") && said.contains(" insns from sub-prog ") {
            // Only a program being assembled has sub-programs added to it.
            self.assembling = Some(prog.to_string());
            self.names
                .entry(prog.to_string())
                .or_default()
                .insert(0, prog.to_string());
        } else if let Some(assembling) = &self.assembling
            && let Some((callee, start)) = relocated_call(said)
        {
            self.names
                .entry(assembling.clone())
                .or_default()
                .insert(start, short_name(callee));
        }
    }

    fn finish_reading(&mut self, reading: Reading) {
        let program = reading.budget.program.clone();
        if let Some(words) = &reading.last_words {
            self.last_words.insert(program.clone(), words.clone());
        }
        let names = self.names.get(&program);
        self.budgets.push(reading.finish(names));
    }

    fn finish(mut self) -> Vec<Budget> {
        if let Some(reading) = self.reading.take() {
            self.finish_reading(reading);
        }
        self.budgets
    }
}

impl Reading {
    fn line(&mut self, line: &str) {
        if let Some(func) = line.strip_prefix("func#") {
            if let Some(start) = func.split_once(" @").and_then(|(_, s)| s.parse().ok()) {
                self.starts.push(start);
            }
        } else if let Some(depths) = line.strip_prefix("stack depth ") {
            self.depths = depths
                .split('+')
                .filter_map(|d| d.trim().parse().ok())
                .collect();
        } else if let Some(processed) = line.strip_prefix("processed ") {
            self.budget.processed = processed
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok());
        } else if let Some(call) = pseudo_call(line) {
            self.calls.insert(call);
        } else if may_say_why(line) {
            self.last_words = Some(line.to_string());
        }
    }

    fn finish(mut self, names: Option<&BTreeMap<u32, String>>) -> Budget {
        let owner = |insn: u32, starts: &[u32]| starts.partition_point(|&s| s <= insn) - 1;
        if self.starts.is_empty() {
            self.starts.push(0);
        }
        if self.depths.len() == self.starts.len() {
            self.budget.functions = self
                .starts
                .iter()
                .zip(&self.depths)
                .map(|(&start, &depth)| Function {
                    start,
                    // A program without sub-programs is its entry alone, which libbpf names
                    // only where it adds some.
                    name: names
                        .and_then(|n| n.get(&start).cloned())
                        .or_else(|| (start == 0).then(|| self.budget.program.clone()))
                        .unwrap_or_else(|| format!("func@{start}")),
                    depth,
                })
                .collect();
            for &(site, target) in &self.calls {
                if let Ok(callee) = self.starts.binary_search(&target) {
                    self.budget
                        .calls
                        .insert((owner(site, &self.starts), callee));
                }
            }
        }
        self.budget
    }
}

/// A BPF-to-BPF call in the verbose log: `6771: (85) call pc-76`, as (call site, target).
fn pseudo_call(line: &str) -> Option<(u32, u32)> {
    let (site, rest) = line.split_once(": (85) call pc")?;
    let site: u32 = site.trim().parse().ok()?;
    let offset: i64 = rest
        .split(|c: char| c.is_whitespace() || c == '#')
        .next()?
        .parse()
        .ok()?;
    let target = i64::from(site) + 1 + offset;
    Some((site, u32::try_from(target).ok()?))
}

/// libbpf's `insn #k relocated, imm N points to subprog 'NAME' (now at OFF offset)`.
fn relocated_call(said: &str) -> Option<(&str, u32)> {
    let (_, rest) = said.split_once("points to subprog '")?;
    let (name, rest) = rest.split_once("' (now at ")?;
    let start = rest.split_whitespace().next()?.parse().ok()?;
    Some((name, start))
}

/// A function's name as a reader of the code knows it: `snat_nat<V6>` for
/// `masq::programs::snat_nat::snat_nat::<masq::family::V6>`.
pub fn short_name(symbol: &str) -> String {
    let demangled = format!("{:#}", rustc_demangle::demangle(symbol));
    let (path, generics) = match demangled.split_once("::<") {
        Some((path, generics)) => (path, Some(generics.trim_end_matches('>'))),
        None => (demangled.as_str(), None),
    };
    let last = path.rsplit("::").next().unwrap_or(path);
    match generics {
        Some(generics) => {
            let args: Vec<&str> = generics
                .split(", ")
                .map(|arg| arg.rsplit("::").next().unwrap_or(arg))
                .collect();
            format!("{last}<{}>", args.join(", "))
        }
        None => last.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An excerpt of a real log, cut down: two programs, the first rejected for its stack.
    const LOG: &str = "\
libbpf: prog 'masq_egress': added 13 insns from sub-prog '_RINvNtCs8QTMUCP3hrt_4masq5parse4loadtEB4_'
libbpf: prog 'masq_egress': insn #18 relocated, imm 54 points to subprog '_RINvNtCs8QTMUCP3hrt_4masq5parse4loadtEB4_' (now at 73 offset)
libbpf: prog 'masq_egress': added 500 insns from sub-prog '_RINvNtCs8QTMUCP3hrt_4masq8programs6egressNtNtB4_6family2V6EB4_'
libbpf: prog '_RINvNtCs8QTMUCP3hrt_4masq8programs6egressNtNtB4_6family2V6EB4_': insn #4 relocated, imm -30 points to subprog '_RINvNtCs8QTMUCP3hrt_4masq5parse4loadtEB4_' (now at 73 offset)
libbpf: prog 'masq_egress': insn #48 relocated, imm 37 points to subprog '_RINvNtCs8QTMUCP3hrt_4masq8programs6egressNtNtB4_6family2V6EB4_' (now at 86 offset)
libbpf: prog 'masq_ingress': added 13 insns from sub-prog '_RINvNtCs8QTMUCP3hrt_4masq5parse4loadtEB4_'
libbpf: prog 'masq_ingress': insn #16 relocated, imm 26 points to subprog '_RINvNtCs8QTMUCP3hrt_4masq5parse4loadtEB4_' (now at 43 offset)
libbpf: prog 'masq_egress': -- BEGIN PROG LOAD LOG --
func#0 @0
func#1 @73
func#2 @86
18: (85) call pc+54
; fn egress()
48: (85) call pc+37
90: (85) call pc-18
combined stack size of 3 calls is 544. Too large
verification time 12 usec
stack depth 16+8+500
processed 1234 insns (limit 1000000) max_states_per_insn 4 total_states 5 peak_states 5 mark_read 0
-- END PROG LOAD LOG --
libbpf: prog 'masq_egress': failed to load: -13
libbpf: prog 'masq_ingress': -- BEGIN PROG LOAD LOG --
func#0 @0
func#1 @43
16: (85) call pc+26
16: R0=scalar()
43: (95) exit
stack depth 8+0
processed 99 insns (limit 1000000) max_states_per_insn 1 total_states 2 peak_states 2 mark_read 0
-- END PROG LOAD LOG --
";

    #[test]
    fn reads_each_programs_functions_calls_and_verdict() {
        let budgets = parse(LOG.as_bytes()).unwrap();
        assert_eq!(budgets.len(), 2);
        let egress = &budgets[0];
        assert_eq!(egress.program, "masq_egress");
        assert_eq!(egress.processed, Some(1234));
        let names: Vec<&str> = egress.functions.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["masq_egress", "load<u16>", "egress<V6>"]);
        assert_eq!(
            egress.calls,
            BTreeSet::from([(0, 1), (0, 2), (2, 1)]),
            "the call from egress<V6> to load lands in its caller's function"
        );
        assert_eq!(
            egress.error.as_deref(),
            Some("combined stack size of 3 calls is 544. Too large")
        );
        let ingress = &budgets[1];
        assert_eq!(ingress.error, None, "an accepted program has no error");
        assert_eq!(ingress.processed, Some(99));
    }

    #[test]
    fn the_deepest_chain_adds_frames_as_each_kernel_rounds_them() {
        let budgets = parse(LOG.as_bytes()).unwrap();
        let egress = &budgets[0];
        let old = egress.deepest(StackRule::Rounded32).unwrap();
        // 16 → 32, 500 → 512, 8 → 32: over the limit, as the kernel said.
        assert_eq!(old.bytes, 576);
        assert_eq!(old.functions, [0, 2, 1]);
        assert_eq!(
            egress.describe(&old, StackRule::Rounded32),
            "masq_egress 32 → egress<V6> 512 → load<u16> 32"
        );
        let new = egress.deepest(StackRule::Rounded16).unwrap();
        assert_eq!(new.bytes, 16 + 512 + 16);
        let ingress = &budgets[1];
        // A frame of nothing still costs 32 bytes before 6.9, and nothing after.
        assert_eq!(ingress.deepest(StackRule::Rounded32).unwrap().bytes, 64);
        assert_eq!(ingress.deepest(StackRule::Rounded16).unwrap().bytes, 16);
    }

    #[test]
    fn kernels_are_told_apart_by_release() {
        assert_eq!(
            StackRule::for_release("6.1.0-50-amd64"),
            StackRule::Rounded32
        );
        assert_eq!(
            StackRule::for_release("5.15.0-91-generic"),
            StackRule::Rounded32
        );
        assert_eq!(StackRule::for_release("6.9.0"), StackRule::Rounded16);
        assert_eq!(
            StackRule::for_release("6.18.44-fc-v857"),
            StackRule::Rounded16
        );
    }

    #[test]
    fn names_are_shortened_to_the_function_and_its_types() {
        assert_eq!(
            short_name(
                "_RINvNvNtCs8QTMUCP3hrt_4masq8programs19snat_masquerade_new19snat_masquerade_newNtNtB6_6family2V6EB6_"
            ),
            "snat_masquerade_new<V6>"
        );
        assert_eq!(
            short_name("_RNvNtCs8QTMUCP3hrt_4masq5parse9walk_ipv6"),
            "walk_ipv6"
        );
        assert_eq!(short_name("memset"), "memset");
    }
}
