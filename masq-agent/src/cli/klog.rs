//! klog's flags, which upstream's binary takes (`klog.InitFlags`), so that a DaemonSet carried
//! over starts. `-v` is one of masq-agent's logging flags; the others change nothing, since the
//! agent logs every level to stderr, but their values are read as klog reads them, so that a
//! value upstream refuses is refused here too.

use clap::{Arg, ArgMatches, parser::ValueSource};

use crate::config::parse_go_bool;
use Effect::{Ignored, Stderr};
use Value::{Bool, Megabytes, Severity, Text};

/// What masq-agent does with a klog flag.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Effect {
    /// It asks where to log, and the answer is stderr anyway.
    Stderr,
    /// It asks for what masq-agent does not do (log files, other headers, verbosity per
    /// source file): it is ignored, with a warning.
    Ignored,
}

/// How klog reads a flag's value.
#[derive(Clone, Copy)]
enum Value {
    /// Go's booleans: `-flag`, `-flag=false`, never `-flag false`.
    Bool,
    /// A number of megabytes.
    Megabytes,
    /// A severity by name (INFO, WARNING, ERROR, FATAL, in any case) or number.
    Severity,
    /// Any text; what it stands for.
    Text(&'static str),
}

struct Flag {
    name: &'static str,
    value: Value,
    effect: Effect,
    /// What it does in klog.
    about: &'static str,
}

const fn flag(name: &'static str, value: Value, effect: Effect, about: &'static str) -> Flag {
    Flag {
        name,
        value,
        effect,
        about,
    }
}

// One flag a line, as a table.
#[rustfmt::skip]
const FLAGS: [Flag; 12] = [
    flag("logtostderr", Bool, Stderr, "Log to stderr instead of files"),
    flag("alsologtostderr", Bool, Stderr, "Log to stderr as well as files"),
    flag("stderrthreshold", Severity, Stderr, "The least severity also logged to stderr"),
    flag("log_dir", Text("DIR"), Ignored, "Write log files in this directory"),
    flag("log_file", Text("FILE"), Ignored, "Write the log to this file"),
    flag("log_file_max_size", Megabytes, Ignored, "The size a log file may grow to, in megabytes"),
    flag("skip_headers", Bool, Ignored, "Log lines without their header"),
    flag("skip_log_headers", Bool, Ignored, "Log files without their header"),
    flag("add_dir_header", Bool, Ignored, "Add the source file's directory to each line's header"),
    flag("one_output", Bool, Ignored, "Write each line to the file of its severity only"),
    flag("vmodule", Text("PATTERN=N,..."), Ignored, "Verbosity per source file"),
    flag("log_backtrace_at", Text("FILE:N"), Ignored, "Log a stack trace when logging hits file:N"),
];

/// The klog flags as arguments: global, so that they are taken after a subcommand too, and
/// under their own heading in the agent's help.
pub fn args() -> Vec<Arg> {
    FLAGS
        .iter()
        .map(|flag| {
            let effect = match flag.effect {
                Effect::Stderr => "no effect: masq-agent logs every level to stderr",
                Effect::Ignored => "ignored, with a warning",
            };
            let arg = Arg::new(flag.name)
                .long(flag.name)
                .global(true)
                .help_heading("klog's flags, taken as upstream takes them")
                .help(format!("{} ({effect})", flag.about));
            match flag.value {
                Value::Bool => arg
                    .num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true")
                    .value_name("BOOL")
                    .value_parser(parse_go_bool),
                Value::Megabytes => arg.value_name("MB").value_parser(clap::value_parser!(u64)),
                Value::Severity => arg.value_name("SEVERITY").value_parser(parse_severity),
                Value::Text(stands_for) => arg.value_name(stands_for),
            }
        })
        .collect()
}

/// The ignored klog flags given on the command line, as `--name`.
pub fn ignored_given(matches: &ArgMatches) -> Vec<String> {
    FLAGS
        .iter()
        .filter(|flag| flag.effect == Effect::Ignored)
        .filter(|flag| matches.value_source(flag.name) == Some(ValueSource::CommandLine))
        .map(|flag| format!("--{}", flag.name))
        .collect()
}

/// A severity as klog's `-stderrthreshold` reads it.
fn parse_severity(s: &str) -> Result<String, String> {
    let named = ["INFO", "WARNING", "ERROR", "FATAL"]
        .iter()
        .any(|name| name.eq_ignore_ascii_case(s));
    if named || s.parse::<i32>().is_ok() {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?} is not a severity: INFO, WARNING, ERROR, FATAL or a number"
        ))
    }
}
