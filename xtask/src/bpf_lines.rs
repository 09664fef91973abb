//! `cargo xtask bpf-lines`: where a loaded program's run time goes, line by line of its Rust
//! source. `perf` samples the whole machine while a workload runs; each sample that falls in
//! one of the program's JIT'd functions is charged to the source line the kernel's line info
//! gives for that instruction (`jited_line_info`, one address per record of the object's BTF
//! line info). `perf annotate` and `bpftool prog dump jited` need binutils' libraries to do
//! as much, and the Debian builds here have none.

use std::collections::HashMap;

use anyhow::{Context as _, bail};
use masq_testbed::netns;

/// The command line of `bpf-lines`.
#[derive(clap::Args)]
pub struct Options {
    /// How long to sample, while the workload runs (start it first).
    #[arg(long, default_value_t = 10)]
    seconds: u32,
    /// The programs to look at, by the name bpftool shows (every loaded one of each).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "masq_egress,masq_ingress"
    )]
    programs: Vec<String>,
    /// How many lines to print, the most sampled first.
    #[arg(long, default_value_t = 40)]
    top: usize,
}

/// One JIT'd function of a program: where it lies, and where each line-info record's
/// instructions start inside it.
struct Function {
    start: u64,
    len: u64,
    /// (address, source line), by address.
    lines: Vec<(u64, String)>,
}

impl Function {
    fn holds(&self, addr: u64) -> bool {
        (self.start..self.start + self.len).contains(&addr)
    }
}

pub fn run(options: &Options) -> anyhow::Result<()> {
    let mut functions = Vec::new();
    for id in program_ids(&options.programs)? {
        functions.extend(functions_of(id)?);
    }
    if functions.is_empty() {
        bail!(
            "no program named {} is loaded: start the workload first",
            options.programs.join(" or ")
        );
    }
    let samples = record(options.seconds)?;
    let mut by_line: HashMap<&str, u64> = HashMap::new();
    let mut in_programs = 0u64;
    for ip in &samples {
        let Some(function) = functions.iter().find(|f| f.holds(*ip)) else {
            continue;
        };
        in_programs += 1;
        let at = function.lines.partition_point(|(addr, _)| addr <= ip);
        let line = at
            .checked_sub(1)
            .map_or("(before the first line record)", |i| {
                function.lines[i].1.as_str()
            });
        *by_line.entry(line).or_default() += 1;
    }
    println!(
        "{in_programs} of {} samples in the programs' own instructions (the helpers they call \
         are the kernel's: `perf report --sort sym` shows them). A sample is charged to the \
         instruction after the one that took the time: a line that follows a call carries the \
         call's return.",
        samples.len()
    );
    let mut lines: Vec<_> = by_line.into_iter().collect();
    lines.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    for (line, count) in lines.into_iter().take(options.top) {
        let share = 100.0 * count as f64 / in_programs.max(1) as f64;
        println!("{share:5.1} % {count:6}  {line}");
    }
    Ok(())
}

/// The ids of the loaded programs named any of `names`.
fn program_ids(names: &[String]) -> anyhow::Result<Vec<u32>> {
    let shown = netns::run("bpftool", &["prog", "show", "--json"])?;
    let programs: Vec<serde_json::Value> =
        serde_json::from_str(&shown).context("reading bpftool's list of programs")?;
    Ok(programs
        .iter()
        .filter(|p| {
            p["name"]
                .as_str()
                .is_some_and(|n| names.iter().any(|want| want == n))
        })
        .filter_map(|p| p["id"].as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect())
}

/// The JIT'd functions of program `id`, each with its lines.
fn functions_of(id: u32) -> anyhow::Result<Vec<Function>> {
    let info = jit_info(id)?;
    let sources = source_lines(id)?;
    let mut functions: Vec<Function> = info
        .ksyms
        .iter()
        .zip(&info.func_lens)
        .map(|(&start, &len)| Function {
            start,
            len: u64::from(len),
            lines: Vec::new(),
        })
        .collect();
    for (&addr, &insn) in info.jited_lines.iter().zip(&info.line_insns) {
        let source = sources
            .range(..=insn)
            .next_back()
            .map_or_else(|| format!("insn {insn}"), |(_, s)| s.clone());
        if let Some(function) = functions.iter_mut().find(|f| f.holds(addr)) {
            function.lines.push((addr, source));
        }
    }
    for function in &mut functions {
        function.lines.sort_by_key(|(addr, _)| *addr);
    }
    Ok(functions)
}

/// What the kernel says of a program's JIT'd image: its functions and, for each line-info
/// record, the record's first instruction (xlated) and its address.
struct JitInfo {
    ksyms: Vec<u64>,
    func_lens: Vec<u32>,
    line_insns: Vec<u32>,
    jited_lines: Vec<u64>,
}

// `struct bpf_prog_info` (include/uapi/linux/bpf.h): the offsets of the fields read here.
const INFO_LEN: usize = 256;
const NR_JITED_KSYMS: usize = 104;
const NR_JITED_FUNC_LENS: usize = 108;
const JITED_KSYMS: usize = 112;
const JITED_FUNC_LENS: usize = 120;
const NR_LINE_INFO: usize = 148;
const LINE_INFO: usize = 152;
const JITED_LINE_INFO: usize = 160;
const NR_JITED_LINE_INFO: usize = 168;
const LINE_INFO_REC_SIZE: usize = 172;
const JITED_LINE_INFO_REC_SIZE: usize = 176;
/// `struct bpf_line_info`: insn_off, file_name_off, line_off, line_col.
const LINE_RECORD: usize = 16;

const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

fn jit_info(id: u32) -> anyhow::Result<JitInfo> {
    let mut attr = [0u8; 128];
    attr[..4].copy_from_slice(&id.to_ne_bytes());
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr).with_context(|| format!("program {id}"))?;
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let raw = |info: &mut [u8; INFO_LEN]| -> anyhow::Result<()> {
        let mut attr = [0u8; 128];
        attr[..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
        attr[4..8].copy_from_slice(&(INFO_LEN as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(info.as_mut_ptr() as u64).to_ne_bytes());
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
            .map(drop)
            .with_context(|| format!("the info of program {id}"))
    };
    let u32_at = |info: &[u8; INFO_LEN], at: usize| {
        u32::from_ne_bytes(info[at..at + 4].try_into().expect("four bytes"))
    };
    let mut counts = [0u8; INFO_LEN];
    raw(&mut counts)?;
    let ksyms_n = u32_at(&counts, NR_JITED_KSYMS) as usize;
    let lens_n = u32_at(&counts, NR_JITED_FUNC_LENS) as usize;
    let lines_n = u32_at(&counts, NR_LINE_INFO) as usize;
    let jited_n = u32_at(&counts, NR_JITED_LINE_INFO) as usize;
    if jited_n == 0 {
        bail!("program {id} has no JIT'd line info (is the JIT on, and the object's BTF loaded?)");
    }
    let mut ksyms = vec![0u64; ksyms_n];
    let mut func_lens = vec![0u32; lens_n];
    let mut line_records = vec![0u8; lines_n * LINE_RECORD];
    let mut jited_lines = vec![0u64; jited_n];
    let mut info = [0u8; INFO_LEN];
    let mut put = |at: usize, bytes: &[u8]| info[at..at + bytes.len()].copy_from_slice(bytes);
    put(NR_JITED_KSYMS, &(ksyms_n as u32).to_ne_bytes());
    put(NR_JITED_FUNC_LENS, &(lens_n as u32).to_ne_bytes());
    put(JITED_KSYMS, &(ksyms.as_mut_ptr() as u64).to_ne_bytes());
    put(
        JITED_FUNC_LENS,
        &(func_lens.as_mut_ptr() as u64).to_ne_bytes(),
    );
    put(NR_LINE_INFO, &(lines_n as u32).to_ne_bytes());
    put(LINE_INFO, &(line_records.as_mut_ptr() as u64).to_ne_bytes());
    put(
        JITED_LINE_INFO,
        &(jited_lines.as_mut_ptr() as u64).to_ne_bytes(),
    );
    put(NR_JITED_LINE_INFO, &(jited_n as u32).to_ne_bytes());
    put(LINE_INFO_REC_SIZE, &(LINE_RECORD as u32).to_ne_bytes());
    put(JITED_LINE_INFO_REC_SIZE, &8u32.to_ne_bytes());
    raw(&mut info)?;
    // Without the right to read kernel addresses (kptr_restrict), the kernel leaves them 0.
    if ksyms.iter().chain(&jited_lines).any(|&addr| addr == 0) {
        bail!(
            "the kernel gave program {id}'s addresses as 0: run as root, with kernel.kptr_restrict below 2"
        );
    }
    let line_insns = line_records
        .chunks_exact(LINE_RECORD)
        .map(|r| u32::from_ne_bytes(r[..4].try_into().expect("four bytes")))
        .collect();
    Ok(JitInfo {
        ksyms,
        func_lens,
        line_insns,
        jited_lines,
    })
}

/// The bpf(2) system call with `attr`; its result, a descriptor or 0.
fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<i32> {
    // SAFETY: `attr` is a zeroed `union bpf_attr` of the size passed, filled for `cmd`; the
    // kernel writes only through the pointers the caller put in it, to buffers that outlive
    // the call and are as long as the counts beside them say.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ret as i32)
}

/// Each line-info record's source line of program `id`, by its first (xlated) instruction,
/// from bpftool's dump: `; <source> [file:<path> line_num:<n> line_col:<c>]` above the
/// instruction it starts at.
fn source_lines(id: u32) -> anyhow::Result<std::collections::BTreeMap<u32, String>> {
    let dump = netns::run(
        "bpftool",
        &["prog", "dump", "xlated", "id", &id.to_string(), "linum"],
    )?;
    let mut lines = std::collections::BTreeMap::new();
    let mut pending: Option<String> = None;
    for row in dump.lines() {
        if let Some(source) = row.strip_prefix("; ") {
            pending = Some(describe(source));
        } else if let Some((insn, _)) = row.trim_start().split_once(':')
            && let (Ok(insn), Some(source)) = (insn.parse::<u32>(), pending.take())
        {
            lines.insert(insn, source);
        }
    }
    Ok(lines)
}

/// `<source> [file:<path> line_num:<n> line_col:<c>]` as `<file name>:<n>  <source>`.
fn describe(row: &str) -> String {
    let Some((source, place)) = row.rsplit_once(" [file:") else {
        return row.to_string();
    };
    let mut fields = place.trim_end_matches(']').split(' ');
    let path = fields.next().unwrap_or("");
    let file = path.rsplit('/').next().unwrap_or(path);
    let line = fields
        .find_map(|f| f.strip_prefix("line_num:"))
        .unwrap_or("?");
    format!("{file}:{line}  {}", source.trim())
}

/// The instruction pointer of every sample `perf` takes on all CPUs in `seconds`.
fn record(seconds: u32) -> anyhow::Result<Vec<u64>> {
    let data = std::env::temp_dir().join(format!("masq-bpf-lines-{}.data", std::process::id()));
    let data = data.to_str().context("a temporary path")?.to_string();
    let recorded = netns::run(
        "perf",
        &[
            "record",
            "-a",
            "-o",
            &data,
            "--",
            "sleep",
            &seconds.to_string(),
        ],
    );
    let script = recorded.and_then(|_| netns::run("perf", &["script", "-i", &data, "-F", "ip"]));
    let _ = std::fs::remove_file(&data);
    Ok(script?
        .lines()
        .filter_map(|l| u64::from_str_radix(l.trim(), 16).ok())
        .collect())
}
