//! Straightens branches in a linked BPF object: where a conditional jump leaps over the
//! unconditional jump right behind it, its condition is inverted to take that jump's target,
//! and the unconditional jump becomes a jump to the next instruction, which the kernel's
//! verifier removes for a loader with CAP_BPF or CAP_SYS_ADMIN, as the agent is (and x86's JIT
//! emits nothing for one anyway).
//!
//! Why: LLVM lays a function's blocks out by how likely each is (`core::hint::cold_path` in
//! masq-ebpf marks the rare ones), but its BPF backend cannot analyse or invert a conditional
//! branch (`BPFInstrInfo::analyzeBranch` gives up on one). Where the likely successor of a test
//! is laid out right after it, the test is left jumping to it, one instruction on, over an
//! unconditional jump to the other successor:
//!
//! ```text
//! if r3 == 0 goto +1     ; the common case takes this branch...
//! goto +516              ; ...over the way to the rare one
//! ```
//!
//! On either path that is a branch taken. End to end a program runs with the CPU's branch
//! predictors cold (docs/bench/profiles.md, "A run end to end, cold"), and a cold predictor
//! guesses every conditional branch not taken: each of these costs the common path a pipeline
//! thrown away. Straightened, the common path falls through, and the rare one takes one branch
//! where it took two:
//!
//! ```text
//! if r3 != 0 goto +517
//! goto +0                ; removed by the verifier, or by the JIT
//! ```
//!
//! Nothing moves: every instruction keeps its index, so relocations, BTF's line and function
//! information and every other jump stay valid. A pair is left alone where anything else could
//! jump to the unconditional jump (another jump's target, a function's entry, a relocation's
//! place), where the condition has no inverse (`JSET`), and where the longer offset would not
//! fit; a section that jumps through a register (`gotox`) is left whole.

use anyhow::Context as _;
use object::{Object as _, ObjectSection as _, ObjectSymbol as _, SectionKind, SymbolKind};

/// Bytes in one instruction slot; a 64-bit immediate load takes two.
const SLOT: usize = 8;

/// Instruction classes (the low three bits of the opcode).
const CLASS_MASK: u8 = 0x07;
const CLASS_JMP: u8 = 0x05;
const CLASS_JMP32: u8 = 0x06;

/// Jump operations (the high four bits).
const OP_MASK: u8 = 0xf0;
const OP_JA: u8 = 0x00;
const OP_CALL: u8 = 0x80;
const OP_EXIT: u8 = 0x90;

/// `goto off`: a 64-bit class unconditional jump, its target in the offset field.
const JA: u8 = CLASS_JMP | OP_JA;
/// `gotox reg`: a jump through a register, to targets in a table of the object's (LLVM's
/// jump tables for BPF, CPU v4 and later), which this pass does not read.
const GOTOX: u8 = CLASS_JMP | OP_JA | 0x08;
/// The first slot of `r = imm64`, whose second slot is no instruction of its own.
const LD_IMM64: u8 = 0x18;
/// The source register of a call to a BPF function, whose target is in the immediate.
const PSEUDO_CALL: u8 = 1;
/// The source register of a wide load of a BPF function's address (a callback's, for
/// `bpf_loop` or `bpf_for_each_map_elem`), its target in the immediate as a call's.
const PSEUDO_FUNC: u8 = 4;

/// The operation that takes a branch exactly when `op` does not; `None` for `JSET`.
fn inverse(op: u8) -> Option<u8> {
    const PAIRS: [(u8, u8); 5] = [
        (0x10, 0x50), // JEQ, JNE
        (0x20, 0xb0), // JGT, JLE
        (0x30, 0xa0), // JGE, JLT
        (0x60, 0xd0), // JSGT, JSLE
        (0x70, 0xc0), // JSGE, JSLT
    ];
    PAIRS.iter().find_map(|&(a, b)| {
        if op == a {
            Some(b)
        } else if op == b {
            Some(a)
        } else {
            None
        }
    })
}

/// One instruction slot, as its fields.
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    fn read(slot: &[u8]) -> Insn {
        Insn {
            code: slot[0],
            regs: slot[1],
            off: i16::from_le_bytes([slot[2], slot[3]]),
            imm: i32::from_le_bytes([slot[4], slot[5], slot[6], slot[7]]),
        }
    }

    fn write(self, slot: &mut [u8]) {
        slot[0] = self.code;
        slot[1] = self.regs;
        slot[2..4].copy_from_slice(&self.off.to_le_bytes());
        slot[4..8].copy_from_slice(&self.imm.to_le_bytes());
    }

    fn is_jump_class(self) -> bool {
        matches!(self.code & CLASS_MASK, CLASS_JMP | CLASS_JMP32)
    }

    /// Where control may go from slot `at` other than the next slot: a jump's target, a BPF
    /// function call's entry, or the callback whose address a wide load takes.
    fn target(self, at: usize) -> Option<i64> {
        let next = at as i64 + 1;
        if self.code == LD_IMM64 {
            return (self.regs >> 4 == PSEUDO_FUNC).then(|| next + i64::from(self.imm));
        }
        if !self.is_jump_class() {
            return None;
        }
        match self.code & OP_MASK {
            OP_EXIT => None,
            OP_CALL if self.regs >> 4 == PSEUDO_CALL => Some(next + i64::from(self.imm)),
            OP_CALL => None,
            // `gotol`: the 32-bit class's unconditional jump keeps its target in the immediate.
            OP_JA if self.code & CLASS_MASK == CLASS_JMP32 => Some(next + i64::from(self.imm)),
            _ => Some(next + i64::from(self.off)),
        }
    }
}

/// Straightens the code of one section, `code`, which code elsewhere may reach at the slots
/// `entries` (its functions' entries, the places relocations name). Says how many branches it
/// straightened.
pub fn straighten(code: &mut [u8], entries: &[usize]) -> usize {
    let slots = code.len() / SLOT;
    let insns: Vec<Insn> = code.chunks_exact(SLOT).map(Insn::read).collect();
    if insns.iter().any(|insn| insn.code == GOTOX) {
        return 0;
    }
    // Slots that something other than the slot before may reach, and second halves of wide
    // loads, which are no instructions.
    let mut reached = vec![false; slots];
    let mut second_half = vec![false; slots];
    for &entry in entries {
        if let Some(slot) = reached.get_mut(entry) {
            *slot = true;
        }
    }
    let mut at = 0;
    while at < slots {
        let insn = insns[at];
        if let Some(target) = insn.target(at)
            && let Ok(target) = usize::try_from(target)
            && let Some(slot) = reached.get_mut(target)
        {
            *slot = true;
        }
        if insn.code == LD_IMM64 {
            if let Some(half) = second_half.get_mut(at + 1) {
                *half = true;
            }
            at += 2;
        } else {
            at += 1;
        }
    }
    let mut straightened = 0;
    for at in 0..slots.saturating_sub(1) {
        let (test, over) = (insns[at], insns[at + 1]);
        if second_half[at] || !test.is_jump_class() || test.off != 1 {
            continue;
        }
        let Some(inverted) = inverse(test.code & OP_MASK) else {
            continue;
        };
        if over.code != JA || over.off == 0 || reached[at + 1] {
            continue;
        }
        let Some(off) = over.off.checked_add(1) else {
            continue;
        };
        Insn {
            code: (test.code & !OP_MASK) | inverted,
            off,
            ..test
        }
        .write(&mut code[at * SLOT..(at + 1) * SLOT]);
        Insn { off: 0, ..over }.write(&mut code[(at + 1) * SLOT..(at + 2) * SLOT]);
        straightened += 1;
    }
    straightened
}

/// Straightens every code section of the BPF object file at `path`, in place. Says how many
/// branches it straightened.
pub fn straighten_object(path: &std::path::Path) -> anyhow::Result<usize> {
    let mut bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let straightened =
        straighten_elf(&mut bytes).with_context(|| format!("straightening {}", path.display()))?;
    std::fs::write(path, &bytes).with_context(|| format!("writing {}", path.display()))?;
    Ok(straightened)
}

/// Straightens every code section of the BPF object (an ELF file) in `bytes`, in place. Says
/// how many branches it straightened: none in an object straightened before.
pub fn straighten_elf(bytes: &mut [u8]) -> anyhow::Result<usize> {
    let sections = code_sections(bytes)?;
    let mut straightened = 0;
    for (range, entries) in sections {
        let code = bytes
            .get_mut(range)
            .context("a code section past the file's end")?;
        straightened += straighten(code, &entries);
    }
    Ok(straightened)
}

/// How many jumps to the next instruction the code sections of the object in `bytes` hold:
/// what straightening leaves (LLVM emits none).
pub fn jumps_to_next(bytes: &[u8]) -> anyhow::Result<usize> {
    let mut jumps = 0;
    for (range, _) in code_sections(bytes)? {
        let code = bytes
            .get(range)
            .context("a code section past the file's end")?;
        jumps += code
            .chunks_exact(SLOT)
            .map(Insn::read)
            .filter(|insn| insn.code == JA && insn.off == 0)
            .count();
    }
    Ok(jumps)
}

/// The object's code sections: where each lies in the file, and the slots of it that code
/// elsewhere may reach. Those are every symbol's place (a function's entry, a label) and every
/// place a relocation names: in this relocatable object a call's or a callback's target is the
/// loader's to fill in, and one against a section symbol keeps the place in its immediate, in
/// slots less one for a call and in bytes for a wide load. Both readings are taken: a slot
/// taken for reachable that is not only leaves a pair alone.
fn code_sections(bytes: &[u8]) -> anyhow::Result<Vec<(std::ops::Range<usize>, Vec<usize>)>> {
    let file = object::File::parse(bytes).context("not an object file")?;
    // By section index.
    let mut reached: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for symbol in file.symbols() {
        if let Some(index) = symbol.section_index() {
            reached
                .entry(index.0)
                .or_default()
                .push(symbol.address() as usize / SLOT);
        }
    }
    let code: Vec<_> = file
        .sections()
        .filter(|section| section.kind() == SectionKind::Text)
        .collect();
    for section in &code {
        let data = section.data().context("a code section's bytes")?;
        for (offset, relocation) in section.relocations() {
            let object::RelocationTarget::Symbol(index) = relocation.target() else {
                continue;
            };
            let symbol = file.symbol_by_index(index)?;
            let Some(in_section) = symbol.section_index() else {
                continue;
            };
            let base = symbol.address() as usize / SLOT;
            let places = reached.entry(in_section.0).or_default();
            places.push(base);
            if symbol.kind() == SymbolKind::Section {
                let at = usize::try_from(offset)?;
                let imm = data
                    .get(at..at + SLOT)
                    .map(|slot| i64::from(Insn::read(slot).imm))
                    .context("a relocation past its section's end")?;
                for slots in [imm + 1, imm / SLOT as i64] {
                    if let Ok(slots) = usize::try_from(slots) {
                        places.push(base + slots);
                    }
                }
            }
        }
    }
    let mut sections = Vec::new();
    for section in code {
        let Some((offset, size)) = section.file_range() else {
            continue;
        };
        let start = usize::try_from(offset)?;
        let end = start
            .checked_add(usize::try_from(size)?)
            .context("a code section past the end of memory")?;
        let places = reached.remove(&section.index().0).unwrap_or_default();
        sections.push((start..end, places));
    }
    Ok(sections)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The instructions the tests build, encoded here apart from the pass's own constants.
    const JEQ: u8 = 0x10;
    const JGT: u8 = 0x20;
    const JGE: u8 = 0x30;
    const JSET: u8 = 0x40;
    const JNE: u8 = 0x50;
    const JSGT: u8 = 0x60;
    const JSGE: u8 = 0x70;
    const JLT: u8 = 0xa0;
    const JLE: u8 = 0xb0;
    const JSLT: u8 = 0xc0;
    const JSLE: u8 = 0xd0;
    const TESTS: [u8; 11] = [JEQ, JGT, JGE, JSET, JNE, JSGT, JSGE, JLT, JLE, JSLT, JSLE];

    fn slot(code: u8, regs: u8, off: i16, imm: i32) -> [u8; 8] {
        let mut bytes = [0; 8];
        bytes[0] = code;
        bytes[1] = regs;
        bytes[2..4].copy_from_slice(&off.to_le_bytes());
        bytes[4..8].copy_from_slice(&imm.to_le_bytes());
        bytes
    }
    /// `r0 = imm`: a mark of where control went.
    fn mark(imm: i32) -> [u8; 8] {
        slot(0xb7, 0, 0, imm)
    }
    /// `if r1 <op> imm goto off`, in the 64-bit class or the 32-bit one.
    fn test(op: u8, wide: bool, imm: i32, off: i16) -> [u8; 8] {
        slot(op | if wide { 0x05 } else { 0x06 }, 1, off, imm)
    }
    fn goto(off: i16) -> [u8; 8] {
        slot(0x05, 0, off, 0)
    }
    fn gotol(imm: i32) -> [u8; 8] {
        slot(0x06, 0, 0, imm)
    }
    fn exit() -> [u8; 8] {
        slot(0x95, 0, 0, 0)
    }
    fn wide_load(imm: u64) -> [[u8; 8]; 2] {
        [
            slot(0x18, 2, 0, imm as u32 as i32),
            slot(0, 0, 0, (imm >> 32) as u32 as i32),
        ]
    }
    fn code(slots: &[[u8; 8]]) -> Vec<u8> {
        slots.concat()
    }
    /// `test` over a `goto`: each way to a mark of its own.
    fn diamond(test: [u8; 8]) -> Vec<u8> {
        code(&[test, goto(2), mark(1), exit(), mark(2), exit()])
    }
    /// Asserts that `after` passes the marks `before` does, for every value of `VALUES`.
    fn assert_same_marks(before: &[u8], after: &[u8], what: &str) {
        for r1 in VALUES {
            assert_eq!(run(after, r1), run(before, r1), "{what}, r1 = {r1:#x}");
        }
    }

    /// Runs `code` from slot 0 with `r1` and says which marks it passed, in order, by an
    /// interpreter of the few instructions the tests build, written apart from the pass.
    fn run(code: &[u8], r1: u64) -> Vec<i32> {
        let field = |at: usize| {
            let s = &code[at * 8..at * 8 + 8];
            (
                s[0],
                i16::from_le_bytes([s[2], s[3]]) as i64,
                i32::from_le_bytes([s[4], s[5], s[6], s[7]]),
            )
        };
        let mut marks = Vec::new();
        let mut pc = 0usize;
        for _ in 0..10_000 {
            let (op, off, imm) = field(pc);
            let jump = |pc: usize, by: i64| (pc as i64 + 1 + by) as usize;
            pc = match op {
                0xb7 => {
                    marks.push(imm);
                    pc + 1
                }
                0x18 => pc + 2,
                0x95 => return marks,
                0x05 => jump(pc, off),
                0x06 => jump(pc, i64::from(imm)),
                _ => {
                    let wide = op & 0x07 == 0x05;
                    let (a, b) = if wide {
                        (r1, imm as i64 as u64)
                    } else {
                        (u64::from(r1 as u32), u64::from(imm as u32))
                    };
                    let (sa, sb) = if wide {
                        (a as i64, b as i64)
                    } else {
                        (i64::from(a as u32 as i32), i64::from(b as u32 as i32))
                    };
                    let taken = match op & 0xf0 {
                        JEQ => a == b,
                        JNE => a != b,
                        JGT => a > b,
                        JGE => a >= b,
                        JLT => a < b,
                        JLE => a <= b,
                        JSGT => sa > sb,
                        JSGE => sa >= sb,
                        JSLT => sa < sb,
                        JSLE => sa <= sb,
                        JSET => a & b != 0,
                        other => panic!("no test {other:#x}"),
                    };
                    if taken { jump(pc, off) } else { pc + 1 }
                }
            };
        }
        panic!("no exit");
    }

    const VALUES: [u64; 12] = [
        0,
        1,
        2,
        5,
        7,
        0x7fff_ffff,
        0x8000_0000,
        0xffff_ffff,
        0x1_0000_0005,
        i64::MIN as u64,
        i64::MAX as u64,
        u64::MAX,
    ];

    #[test]
    fn a_test_over_a_jump_takes_that_jumps_target_and_falls_through_otherwise() {
        let before = diamond(test(JEQ, true, 5, 1));
        let mut after = before.clone();
        assert_eq!(straighten(&mut after, &[0]), 1);
        let mut expected = diamond(test(JNE, true, 5, 3));
        expected[8..16].copy_from_slice(&goto(0));
        assert_eq!(after, expected);
        assert_same_marks(&before, &after, "JEQ");
    }

    #[test]
    fn every_invertible_test_of_either_class_keeps_its_outcomes() {
        for op in TESTS.into_iter().filter(|&op| op != JSET) {
            for wide in [true, false] {
                for imm in [0, 5, -1, i32::MIN, i32::MAX] {
                    let before = diamond(test(op, wide, imm, 1));
                    let mut after = before.clone();
                    assert_eq!(straighten(&mut after, &[0]), 1, "op {op:#x}");
                    let what = format!("op {op:#x}, wide {wide}, imm {imm}");
                    assert_same_marks(&before, &after, &what);
                }
                // Against a register, which the interpreter does not read: the same inverse
                // as against an immediate, and the source bit and both registers kept.
                let mut against_imm = diamond(test(op, wide, 0, 1));
                straighten(&mut against_imm, &[0]);
                let class = if wide { 0x05 } else { 0x06 };
                let mut against_r2 = diamond(slot(op | class | 0x08, 1 | 2 << 4, 1, 0));
                assert_eq!(straighten(&mut against_r2, &[0]), 1, "op {op:#x}, X");
                let mut expected = against_imm;
                expected[0] |= 0x08;
                expected[1] = 1 | 2 << 4;
                assert_eq!(against_r2, expected, "op {op:#x}, wide {wide}, X");
            }
        }
    }

    #[test]
    fn what_anything_else_may_reach_is_left_alone() {
        // A test, a long jump, a call or a callback's address, to the `goto` of the diamond
        // behind it.
        let call = slot(0x85, PSEUDO_CALL << 4, 0, 1);
        let [_, second_half] = wide_load(0);
        let callback = [slot(0x18, 2 | PSEUDO_FUNC << 4, 0, 2), second_half];
        for reaching in [
            vec![test(JGT, true, 3, 1)],
            vec![gotol(1)],
            vec![call],
            callback.to_vec(),
        ] {
            let program = [code(&reaching), diamond(test(JEQ, true, 5, 1))].concat();
            let mut after = program.clone();
            assert_eq!(straighten(&mut after, &[0]), 0);
            assert_eq!(after, program);
        }

        let an_entry = code(&[test(JEQ, true, 5, 1), goto(1), exit(), exit()]);
        let mut after = an_entry.clone();
        assert_eq!(straighten(&mut after, &[0, 1]), 0);
        assert_eq!(after, an_entry);

        // A jump through a register, whose targets are in a table the pass does not read.
        let jumping_through_a_register =
            [diamond(test(JEQ, true, 5, 1)), code(&[slot(0x0d, 3, 0, 0)])].concat();
        let mut after = jumping_through_a_register.clone();
        assert_eq!(straighten(&mut after, &[0]), 0);
        assert_eq!(after, jumping_through_a_register);
    }

    #[test]
    fn tests_without_an_inverse_and_offsets_out_of_range_are_left_alone() {
        let set = code(&[test(JSET, true, 4, 1), goto(1), exit(), exit()]);
        let mut after = set.clone();
        assert_eq!(straighten(&mut after, &[0]), 0);
        assert_eq!(after, set);

        let far = code(&[test(JEQ, true, 4, 1), goto(i16::MAX), exit()]);
        let mut after = far.clone();
        assert_eq!(straighten(&mut after, &[0]), 0);
        assert_eq!(after, far);
    }

    #[test]
    fn a_wide_loads_second_half_is_no_instruction() {
        // A second half holds the immediate's upper half, whatever its bytes: here they read
        // as a test over a `goto`, which the pass must not take for one.
        let [first, _] = wide_load(7);
        let program = code(&[first, test(JEQ, true, 4, 1), goto(1), exit(), exit()]);
        let mut after = program.clone();
        assert_eq!(straighten(&mut after, &[0]), 0);
        assert_eq!(after, program);
    }

    /// Numbers below `n`, the same on every run (a 64-bit linear congruential generator).
    struct Numbers(u64);
    impl Numbers {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) % n
        }
    }

    #[test]
    fn random_programs_pass_the_same_marks_before_and_after() {
        let mut rng = Numbers(0x2545_f491_4f6c_dd1d);
        let mut straightened = 0;
        for _ in 0..500 {
            let len = 8 + rng.below(40) as usize;
            let mut slots = Vec::with_capacity(len + 1);
            while slots.len() < len {
                let at = slots.len();
                // Forward jumps only, to somewhere up to the final exit: every program ends.
                let ahead =
                    |rng: &mut Numbers, from: usize| rng.below((len - from + 1) as u64) as i16;
                let op = TESTS[rng.below(TESTS.len() as u64) as usize];
                let (wide, imm) = (rng.below(2) == 0, rng.below(9) as i32 - 2);
                match rng.below(5) {
                    0 | 1 if at + 2 < len => {
                        slots.push(test(op, wide, imm, 1));
                        let over = ahead(&mut rng, at + 2);
                        slots.push(goto(over));
                    }
                    2 => {
                        let off = ahead(&mut rng, at + 1);
                        slots.push(test(op, wide, imm, off));
                    }
                    3 => slots.push(exit()),
                    _ => slots.push(mark(at as i32)),
                }
            }
            slots.push(exit());
            let before = code(&slots);
            let mut after = before.clone();
            straightened += straighten(&mut after, &[0]);
            assert_same_marks(&before, &after, "a random program");
        }
        assert!(straightened > 500, "only {straightened} straightened");
    }
}
