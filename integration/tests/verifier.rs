//! The verifier's budget, on the running kernel: both programs fit the stack limit as every
//! kernel rounds it, and the figures the budget reports are the kernel's own.

use std::sync::OnceLock;

use masq_agent::dataplane::ebpf::testbed;
use masq_ebpf::program_names;
use masq_testbed::verifier::{self, Budget, SLOT_TABLE_PROGRAM, STACK_LIMIT, StackRule};

fn object() -> tempfile::NamedTempFile {
    written(testbed::object())
}

/// Both objects the agent embeds: without the slot table, and with it.
fn objects() -> [tempfile::NamedTempFile; 2] {
    [object(), written(testbed::slot_table_object())]
}

fn written(bytes: &[u8]) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), bytes).unwrap();
    file
}

/// What the verifier's verbose log says of each of `objects()`, read once for every test: each
/// read is the verifier's whole walk of both programs with its log (some twenty seconds here),
/// and says the same each time.
fn measured() -> &'static [Vec<Budget>; 2] {
    static MEASURED: OnceLock<[Vec<Budget>; 2]> = OnceLock::new();
    MEASURED.get_or_init(|| objects().map(|object| verifier::measure(object.path()).unwrap()))
}

#[test]
fn both_programs_fit_the_stack_as_every_kernel_counts_it() {
    for budgets in measured() {
        both_programs_of_fit_the_stack(budgets);
    }
}

fn both_programs_of_fit_the_stack(budgets: &[Budget]) {
    for program in [program_names::EGRESS, program_names::INGRESS] {
        let budget = budgets
            .iter()
            .find(|b| b.program == program)
            .unwrap_or_else(|| panic!("{program} was not loaded: {budgets:?}"));
        assert_eq!(budget.error, None, "{program} was accepted");
        assert_eq!(budget.functions[0].name, program, "the entry comes first");
        assert!(
            budget
                .functions
                .iter()
                .all(|f| !f.name.starts_with("func@")),
            "libbpf named every function: {:?}",
            budget.functions
        );
        for rule in [StackRule::Rounded32, StackRule::Rounded16] {
            let chain = budget.deepest(rule).unwrap();
            assert!(
                chain.bytes <= STACK_LIMIT,
                "{program} under {rule:?}: {}",
                budget.describe(&chain, rule)
            );
        }
    }
}

#[test]
fn the_instructions_processed_are_the_kernels_own_count() {
    for (object, verbose) in objects().iter().zip(measured()) {
        let quick = verifier::load_quick(object.path()).unwrap();
        for program in [program_names::EGRESS, program_names::INGRESS] {
            let from_log = verbose.iter().find(|b| b.program == program).unwrap();
            let from_kernel = quick.iter().find(|b| b.program == program).unwrap();
            assert!(from_log.processed.is_some_and(|n| n > 1000));
            assert_eq!(
                from_log.processed, from_kernel.processed,
                "{program}: the log's count and the kernel's verified_insns"
            );
        }
    }
}

/// The stack figures docs/install.md gives for each kernel are the programs' as they are now,
/// both objects': a change that moves the stack fails here until `cargo xtask budget --vms`
/// writes the new figures. (The instructions processed are each kernel's own, and are not compared.)
#[test]
fn the_stack_in_the_docs_is_the_programs_own() {
    let doc =
        std::fs::read_to_string(masq_testbed::workspace_root().join("docs/install.md")).unwrap();
    let section = doc
        .split_once("<!-- budget:start -->")
        .and_then(|(_, rest)| rest.split_once("<!-- budget:end -->"))
        .map(|(section, _)| section)
        .expect("install.md holds the budget between its markers");
    let [without, with] = measured();
    let rows: Vec<Vec<&str>> = section
        .lines()
        .filter(|line| line.starts_with("| masq_"))
        .map(|line| line.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    assert!(rows.len() >= 4, "a row per program and kernel: {section}");
    for row in rows {
        let (program, kernel, stack, chain) = (row[0], row[1], row[3], row[4]);
        let (budgets, name) = match program.strip_suffix(SLOT_TABLE_PROGRAM) {
            Some(name) => (&with, name),
            None => (&without, program),
        };
        let budget = budgets.iter().find(|b| b.program == name).unwrap();
        let rule = StackRule::for_release(kernel);
        let deepest = budget.deepest(rule).unwrap();
        assert_eq!(
            (stack, chain.trim_matches('`')),
            (
                deepest.bytes.to_string().as_str(),
                budget.describe(&deepest, rule).as_str()
            ),
            "{program} on {kernel}: run `cargo xtask budget --vms`"
        );
    }
}
