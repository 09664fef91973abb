//! The operator docs (README.md and docs/*.md) cannot drift from the agent: every command they
//! show is exercised, and the flag, config and metric references are compared with what the
//! agent really takes, says and exposes.
//!
//! Commands of the agent and of the kernel tools run for real on a node of the namespace test
//! bed (`bed`), with the operator's default paths swapped for the bed's, and must succeed and
//! print what their sample output shows. Commands that need a cluster, a container engine or a
//! developer checkout are checked without running (`offline`). A command the test does not know
//! how to exercise fails it, so that new docs cannot add unexercised commands.

mod bed;
mod markdown;
mod offline;

use std::{
    collections::BTreeSet,
    process::{Command, Output},
};

use bed::{AGENT, Bed};
use markdown::DocCommand;
use masq_testbed::workspace_root;
use offline::{Offline, Repo};

/// The programs that run on the test bed's node, as an operator runs them on a node.
const NODE_PROGRAMS: [&str; 9] = [
    AGENT,
    "bpftool",
    "iptables",
    "iptables-save",
    "ipset",
    "tc",
    "ip",
    "curl",
    "conntrack",
];

fn read_doc(name: &str) -> String {
    let path = workspace_root().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}

/// What to run on the node for a documented command, or `None` when checking it offline was
/// all that can be done.
fn exercise(repo: &Repo, command: &DocCommand) -> Result<Option<Vec<String>>, String> {
    let words = markdown::words(&command.text)?;
    let program = words.first().ok_or("an empty command")?;
    if NODE_PROGRAMS.contains(&program.as_str()) {
        return Ok(Some(words));
    }
    match offline::check(repo, &words)? {
        Offline::RunOnNode(inner) if NODE_PROGRAMS.contains(&inner[0].as_str()) => Ok(Some(inner)),
        Offline::RunOnNode(inner) => Err(format!("the test cannot run {} on a node", inner[0])),
        Offline::Checked if command.sample.iter().any(|l| !l.trim().is_empty()) => Err(
            "this command cannot run here, so its sample output cannot be checked: \
             describe the output in prose instead"
                .into(),
        ),
        Offline::Checked => Ok(None),
    }
}

/// `masq-agent cleanup` removes what every other command looks at: it runs last.
fn is_cleanup(words: &[String]) -> bool {
    words[0] == AGENT && words.iter().any(|w| w == "cleanup")
}

#[test]
fn every_command_in_the_docs_runs() {
    let root = workspace_root();
    let repo = Repo::load(&root);
    let mut problems = Vec::new();
    let mut on_node: Vec<(DocCommand, Vec<String>)> = Vec::new();
    let mut offline_count = 0;
    for file in markdown::doc_files(&root) {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        let commands = markdown::commands(&name, &std::fs::read_to_string(&file).unwrap());
        for command in commands.unwrap_or_else(|e| panic!("{e}")) {
            match exercise(&repo, &command) {
                Ok(Some(words)) => on_node.push((command, words)),
                Ok(None) => offline_count += 1,
                Err(why) => problems.push(format!("{} `{}`: {why}", command.place, command.text)),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        on_node.len() >= 10 && offline_count >= 5,
        "the docs show the commands an operator needs ({} on a node, {offline_count} elsewhere)",
        on_node.len()
    );

    let bed = Bed::start();
    on_node.sort_by_key(|(_, words)| is_cleanup(words));
    for (command, words) in &on_node {
        if !is_cleanup(words) {
            bed.refresh_flows();
        }
        let output = bed.run(words);
        let printed = bed.generalize(&text(&output));
        let problem = if !output.status.success() {
            format!("exited with {}", output.status)
        } else if let Some(line) = markdown::first_unmatched(&command.sample, &printed) {
            format!("the docs show {line:?}, which the output lacks")
        } else if let Some(line) = (words[0] == AGENT)
            .then(|| markdown::first_unshown(&command.sample, &printed))
            .flatten()
        {
            // The agent's own output: a sample that leaves a line out says so with `...`.
            format!(
                "the output has {line:?}, which the docs leave out (add it, or `...` where the \
                 sample leaves lines out)"
            )
        } else {
            continue;
        };
        problems.push(format!(
            "{} `{}`: {problem}; it printed:\n{printed}",
            command.place, command.text
        ));
    }
    assert!(
        problems.is_empty(),
        "{}\nagent log:\n{}",
        problems.join("\n\n"),
        bed.agent.log_text()
    );
    if on_node.iter().any(|(_, words)| is_cleanup(words)) {
        assert!(
            !bed.topo.bpffs.exists(),
            "the documented cleanup removes the pins"
        );
    }
}

fn agent(args: &[&str]) -> Output {
    Command::new(bed::agent_binary())
        .args(args)
        .output()
        .expect("run masq-agent")
}

/// Every `--long-flag` in `text`, klog's `--log_dir` spelling too.
fn long_flags(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|word| {
            word.strip_prefix("--")
                .is_some_and(|name| name.starts_with(|c: char| c.is_ascii_alphanumeric()))
        })
        .map(String::from)
        .collect()
}

#[test]
fn every_flag_and_subcommand_is_in_the_flag_reference() {
    let help = text(&agent(&["--help"]));
    let subcommands: Vec<&str> = help
        .lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .collect();
    assert!(subcommands.contains(&"status"), "{help}");
    let mut flags = long_flags(&help);
    for subcommand in &subcommands {
        flags.extend(long_flags(&text(&agent(&[subcommand, "--help"]))));
    }
    assert!(
        flags.contains("--metrics-addr") && flags.contains("--family"),
        "{flags:?}"
    );

    let doc = read_doc("docs/flags.md");
    let documented = long_flags(&doc);
    let missing: Vec<&String> = flags.difference(&documented).collect();
    assert!(missing.is_empty(), "docs/flags.md lacks {missing:?}");
    for subcommand in &subcommands {
        assert!(
            doc.contains(&format!("`{subcommand}")),
            "docs/flags.md lacks the subcommand {subcommand}"
        );
    }
    // And the reference lists no flag the agent lacks.
    let listed: BTreeSet<String> = markdown::table_rows(&doc)
        .iter()
        .flat_map(|row| long_flags(&row[0]))
        .collect();
    let unknown: Vec<&String> = listed.difference(&flags).collect();
    assert!(
        unknown.is_empty(),
        "docs/flags.md lists {unknown:?}, which the agent lacks"
    );
}

/// Where the docs' examples say the config file is.
const DOC_CONFIG_PATH: &str = "/etc/config/ip-masq-agent";

#[test]
fn config_messages_in_the_docs_are_the_agents() {
    let doc = read_doc("docs/config.md");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ip-masq-agent");
    let (mut errors, mut warnings) = (0, 0);
    for row in markdown::table_rows(&doc) {
        let [file, message, ..] = row.as_slice() else {
            continue;
        };
        let (Some(file), Some(message)) = (markdown::code_span(file), markdown::code_span(message))
        else {
            continue;
        };
        let is_error = message.starts_with("error: ");
        if !is_error && !message.starts_with("warning: ") {
            continue;
        }
        std::fs::write(&path, format!("{file}\n")).unwrap();
        let out = agent(&["check-config", "--config", path.to_str().unwrap()]);
        let said =
            String::from_utf8_lossy(&out.stderr).replace(path.to_str().unwrap(), DOC_CONFIG_PATH);
        assert_eq!(out.status.success(), !is_error, "`{file}`: {said}");
        assert!(
            said.lines().any(|line| line == message),
            "for `{file}` docs/config.md says\n{message}\nbut the agent says\n{said}"
        );
        if is_error {
            errors += 1;
        } else {
            warnings += 1;
        }
    }
    assert!(
        errors >= 10 && warnings >= 3,
        "{errors} errors and {warnings} warnings found"
    );

    let defaults = agent(&[
        "check-config",
        "--config",
        dir.path().join("absent").to_str().unwrap(),
    ]);
    let defaults: serde_json::Value = serde_json::from_slice(&defaults.stdout).unwrap();
    for key in defaults.as_object().unwrap().keys() {
        assert!(
            doc.contains(&format!("`{key}`")),
            "docs/config.md lacks the key {key}"
        );
    }
}

/// Every `masq_agent_...` and `process_...` series name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("masq_agent_") || word.starts_with("process_"))
        .map(String::from)
        .collect()
}

#[test]
fn every_metric_is_documented_and_every_documented_metric_exists() {
    let bed = Bed::start();
    let addr = bed::METRICS_ADDR.parse().unwrap();
    let (status, metrics) =
        masq_testbed::probe::http_get(&bed.topo.node, addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    // Families as `# TYPE` names them, and their series as scraped: a counter x is x_total.
    let families: Vec<(&str, &str)> = metrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let exposed: BTreeSet<String> = families
        .iter()
        .map(|(name, kind)| match *kind {
            "counter" => format!("{name}_total"),
            _ => name.to_string(),
        })
        .collect();
    assert!(
        exposed.contains("masq_agent_packets_masqueraded_total"),
        "{metrics}"
    );
    let documented = metric_names(&read_doc("docs/operations.md"));
    let undocumented: Vec<&String> = exposed.difference(&documented).collect();
    let unexposed: Vec<&String> = documented
        .iter()
        .filter(|name| !exposed.contains(*name) && !families.iter().any(|(f, _)| f == name))
        .collect();
    assert!(
        undocumented.is_empty() && unexposed.is_empty(),
        "docs/operations.md lacks {undocumented:?} and names {unexposed:?}, which the agent does not expose"
    );
}

#[test]
fn commands_the_test_cannot_exercise_fail_it() {
    let repo = Repo::load(&workspace_root());
    let command = |text: &str, sample: &[&str]| DocCommand {
        place: "x.md:1".into(),
        text: text.into(),
        sample: sample.iter().map(|l| l.to_string()).collect(),
    };
    let exercised = |text: &str| exercise(&repo, &command(text, &[]));
    assert_eq!(
        exercised("bpftool map show").unwrap(),
        Some(owned(&["bpftool", "map", "show"]))
    );
    assert_eq!(
        exercised("kubectl -n kube-system exec daemonset/ip-masq-agent -- masq-agent status")
            .unwrap(),
        Some(owned(&[AGENT, "status"]))
    );
    assert_eq!(exercised("kubectl apply -k deploy/").unwrap(), None);
    for unknown in [
        "systemctl restart kubelet",
        "sudo masq-agent status",
        "kubectl -n kube-system exec daemonset/ip-masq-agent -- curl -s http://127.0.0.1:9830/",
        "curl -s http://127.0.0.1:9830/metrics | grep dropped",
    ] {
        assert!(exercised(unknown).is_err(), "{unknown}");
    }
    let unchecked_sample = command(
        "kubectl apply -k deploy/",
        &["daemonset.apps/ip-masq-agent created"],
    );
    assert!(exercise(&repo, &unchecked_sample).is_err());
}

fn owned(list: &[&str]) -> Vec<String> {
    list.iter().map(|w| w.to_string()).collect()
}
