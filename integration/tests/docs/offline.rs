//! Commands that need a cluster, a container engine or a developer's checkout: `kubectl`,
//! `kustomize`, `helm`, `docker` and `cargo xtask`. They are checked as far as they can be
//! without running them: the files they name exist, the Kubernetes objects, labels and images
//! they name are the ones deploy/ defines (with any of its components added), a Helm install's
//! values render (by `helm template`), and every flag is one the tool takes as the docs use it. What `kubectl exec` runs inside the agent's container is
//! handed back to be run in the test bed.

use std::path::{Path, PathBuf};

use masq_testbed::{deploy, kube_tools::KubeTool};
use serde::Deserialize as _;
use serde_yaml::Value;

/// What checking a command found to do next.
pub enum Offline {
    /// Nothing: the command is as good as it can be shown to be here.
    Checked,
    /// `kubectl exec` into the agent: this command runs in its container, that is on the node.
    RunOnNode(Vec<String>),
}

/// The repository, with the Kubernetes objects under deploy/.
pub struct Repo {
    root: PathBuf,
    objects: Vec<Object>,
}

struct Object {
    kind: String,
    name: String,
    namespace: String,
    doc: Value,
}

impl Object {
    fn new(doc: Value) -> Object {
        let field = |path: &[&str]| text_at(&doc, path).unwrap_or_default().to_string();
        Object {
            kind: field(&["kind"]),
            name: field(&["metadata", "name"]),
            namespace: field(&["metadata", "namespace"]),
            doc,
        }
    }
}

impl Repo {
    pub fn load(root: &Path) -> Repo {
        let mut objects = Vec::new();
        for entry in std::fs::read_dir(root.join("deploy"))
            .expect("deploy/")
            .flatten()
        {
            let path = entry.path();
            if !path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for document in serde_yaml::Deserializer::from_str(&text) {
                let doc = Value::deserialize(document)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                objects.push(Object::new(doc));
            }
        }
        // What each component adds or changes, as kustomize builds it: a label only the
        // node-label component selects on is still deploy/'s.
        let base = deploy::kustomize(&[]).unwrap_or_else(|e| panic!("{e:#}"));
        for component in deploy::component_names() {
            let built = deploy::kustomize(&[&component]).unwrap_or_else(|e| panic!("{e:#}"));
            for doc in built {
                if !base.contains(&doc) {
                    objects.push(Object::new(doc));
                }
            }
        }
        Repo {
            root: root.to_path_buf(),
            objects,
        }
    }

    fn existing(&self, path: &str) -> Result<PathBuf, String> {
        let full = self.root.join(path);
        if full.exists() {
            Ok(full)
        } else {
            Err(format!("{path} does not exist in the repository"))
        }
    }

    /// A kustomization directory whose resources all exist.
    fn kustomization(&self, dir: &str) -> Result<Value, String> {
        let dir = self.existing(dir)?;
        let file = dir.join("kustomization.yaml");
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let kustomization: Value = serde_yaml::from_str(&text).map_err(|e| e.to_string())?;
        for resource in strings_at(&kustomization, &["resources"]) {
            if !dir.join(&resource).exists() {
                return Err(format!(
                    "{}: resource {resource} is missing",
                    file.display()
                ));
            }
        }
        Ok(kustomization)
    }

    fn object(&self, kind: &str, name: &str, namespace: &str) -> Result<&Object, String> {
        self.objects
            .iter()
            .find(|o| o.kind == kind && o.name == name && o.namespace == namespace)
            .ok_or_else(|| format!("deploy/ defines no {kind} {namespace}/{name}"))
    }

    /// The DaemonSets in `namespace`, or in any namespace.
    fn workloads<'a>(&'a self, namespace: Option<&'a str>) -> impl Iterator<Item = &'a Object> {
        self.objects.iter().filter(move |o| {
            o.kind == "DaemonSet" && namespace.is_none_or(|namespace| o.namespace == namespace)
        })
    }

    /// Whether the agent's image has `program`: the container build file names it.
    fn image_has(&self, program: &str) -> Result<(), String> {
        let file = self.existing("deploy/Dockerfile")?;
        let text = std::fs::read_to_string(file).unwrap();
        let named = text
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .any(|word| word == program);
        named
            .then_some(())
            .ok_or_else(|| format!("deploy/Dockerfile does not put {program} in the image"))
    }

    /// The image names (without registry or tag) the manifests run.
    fn image_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for object in &self.objects {
            for list in ["containers", "initContainers"] {
                let containers = at(&object.doc, &["spec", "template", "spec", list]);
                for container in containers
                    .and_then(Value::as_sequence)
                    .into_iter()
                    .flatten()
                {
                    if let Some(image) = text_at(container, &["image"]) {
                        names.push(image_name(image).to_string());
                    }
                }
            }
        }
        names
    }

    fn check_image(&self, reference: &str) -> Result<(), String> {
        let name = image_name(reference);
        let known = self.image_names();
        if known.iter().any(|n| n == name) {
            Ok(())
        } else {
            Err(format!("image {reference}: the manifests run {known:?}"))
        }
    }
}

fn at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(key))
}

fn text_at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a str> {
    at(value, path)?.as_str()
}

fn strings_at(value: &Value, path: &[&str]) -> Vec<String> {
    at(value, path)
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(String::from))
        .collect()
}

/// `registry.example.com/masq-agent:0.1.0` -> `masq-agent`.
fn image_name(reference: &str) -> &str {
    let last = reference.rsplit('/').next().unwrap_or(reference);
    last.split([':', '@']).next().unwrap_or(last)
}

/// Checks a command that cannot run here; `Err` says why it is wrong or not understood.
pub fn check(repo: &Repo, words: &[String]) -> Result<Offline, String> {
    let (program, args) = words.split_first().ok_or("an empty command")?;
    match program.as_str() {
        "kubectl" => kubectl(repo, args),
        "helm" => helm(repo, args).map(|()| Offline::Checked),
        "kustomize" => kustomize(repo, args).map(|()| Offline::Checked),
        "docker" => docker(repo, args).map(|()| Offline::Checked),
        "cargo" => cargo_xtask(repo, args).map(|()| Offline::Checked),
        other => Err(format!(
            "the docs test does not know how to exercise {other}"
        )),
    }
}

/// `--flag=value` as the flag and its value; any other word as itself.
fn split_flag(arg: &str) -> (&str, Option<&str>) {
    match arg.split_once('=') {
        Some((flag, value)) if flag.starts_with('-') => (flag, Some(value)),
        _ => (arg, None),
    }
}

/// One `--flag value`, `--flag=value` or `-f value` from `args`.
fn flag_value<'a>(
    flag: &str,
    inline: Option<&'a str>,
    args: &mut impl Iterator<Item = &'a String>,
) -> Result<&'a str, String> {
    inline
        .or_else(|| args.next().map(String::as_str))
        .ok_or_else(|| format!("{flag} needs a value"))
}

/// A resource named on a kubectl command line.
struct Reference {
    kind: &'static str,
    name: Option<String>,
}

fn kind_of(word: &str) -> Option<&'static str> {
    Some(match word {
        "daemonset" | "daemonsets" | "ds" => "DaemonSet",
        "configmap" | "configmaps" | "cm" => "ConfigMap",
        "pod" | "pods" | "po" => "Pod",
        "node" | "nodes" | "no" => "Node",
        _ => return None,
    })
}

fn kubectl(repo: &Repo, args: &[String]) -> Result<Offline, String> {
    let mut namespace = "default";
    let mut positionals: Vec<&str> = Vec::new();
    let mut selectors: Vec<&str> = Vec::new();
    let mut manifests = 0;
    let mut in_container: Option<Vec<String>> = None;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let (flag, inline) = split_flag(arg);
        match flag {
            "--" => in_container = Some(iter.by_ref().cloned().collect()),
            "-n" | "--namespace" => namespace = flag_value(flag, inline, &mut iter)?,
            "-f" | "--filename" => {
                repo.existing(flag_value(flag, inline, &mut iter)?)?;
                manifests += 1;
            }
            "-k" | "--kustomize" => {
                repo.kustomization(flag_value(flag, inline, &mut iter)?)?;
                manifests += 1;
            }
            "-l" | "--selector" => selectors.push(flag_value(flag, inline, &mut iter)?),
            "-o" | "--output" | "--tail" | "--timeout" | "--to-revision" | "--cascade" => {
                flag_value(flag, inline, &mut iter)?;
            }
            "--overwrite" | "--all-containers" => {}
            flag if flag.starts_with('-') => {
                return Err(format!("kubectl {flag} is not known to the docs test"));
            }
            _ => positionals.push(arg),
        }
    }
    let (verb, rest) = positionals.split_first().ok_or("kubectl without a verb")?;
    let rest = match *verb {
        "rollout" => match rest.split_first() {
            Some((action, rest)) if ["status", "undo", "restart", "history"].contains(action) => {
                rest
            }
            _ => return Err(format!("kubectl rollout {rest:?}")),
        },
        "apply" | "create" | "delete" | "get" | "describe" | "edit" | "logs" | "exec" | "label"
        | "annotate" => rest,
        other => return Err(format!("kubectl {other} is not known to the docs test")),
    };
    let (references, labels) = references(verb, rest)?;
    if references.is_empty() && manifests == 0 {
        return Err(format!("kubectl {verb} names nothing to act on"));
    }
    for reference in &references {
        check_reference(repo, reference, namespace)?;
    }
    for selector in selectors {
        let matches = repo.workloads(Some(namespace)).any(|w| {
            selector.split(',').all(|pair| {
                pair.split_once('=').is_some_and(|(key, value)| {
                    text_at(&w.doc, &["spec", "template", "metadata", "labels", key]) == Some(value)
                })
            })
        });
        if !matches {
            return Err(format!(
                "-l {selector} selects the pods of no workload in deploy/"
            ));
        }
    }
    // A node's label must be one a workload selects on; an object of deploy/ takes any.
    let on_nodes = references.iter().any(|r| r.kind == "Node");
    for label in labels.into_iter().filter(|_| on_nodes) {
        let (key, value) = label.split_once('=').unwrap_or((label, ""));
        let selected = repo.workloads(None).any(|w| {
            text_at(&w.doc, &["spec", "template", "spec", "nodeSelector", key]) == Some(value)
        });
        if !selected {
            return Err(format!(
                "label {label} is no workload's nodeSelector in deploy/"
            ));
        }
    }
    match (*verb, in_container) {
        ("exec", Some(command)) if !command.is_empty() => {
            repo.image_has(&command[0])?;
            Ok(Offline::RunOnNode(command))
        }
        ("exec", _) => Err("kubectl exec without `-- COMMAND`".into()),
        (_, Some(_)) => Err(format!("kubectl {verb} does not take `--`")),
        (_, None) => Ok(Offline::Checked),
    }
}

/// The resources and the `KEY=VALUE` labels among a kubectl verb's arguments. A bare name is a
/// pod's for `exec` and `logs`, and otherwise follows its type (`daemonset ip-masq-agent`).
fn references<'a>(verb: &str, words: &[&'a str]) -> Result<(Vec<Reference>, Vec<&'a str>), String> {
    let mut references = Vec::new();
    let mut labels = Vec::new();
    let mut words = words.iter().copied().peekable();
    while let Some(word) = words.next() {
        if word.contains('=') {
            labels.push(word);
        } else if let Some((kind, name)) = word.split_once('/') {
            let kind = kind_of(kind).ok_or_else(|| format!("unknown resource type in {word}"))?;
            references.push(Reference {
                kind,
                name: Some(name.to_string()),
            });
        } else if let Some(kind) = kind_of(word) {
            let name = words.next_if(|w| !w.contains('=')).map(String::from);
            references.push(Reference { kind, name });
        } else if matches!(verb, "exec" | "logs") {
            references.push(Reference {
                kind: "Pod",
                name: Some(word.to_string()),
            });
        } else {
            return Err(format!("kubectl {verb}: {word} is not a resource type"));
        }
    }
    Ok((references, labels))
}

fn check_reference(repo: &Repo, reference: &Reference, namespace: &str) -> Result<(), String> {
    match (reference.kind, &reference.name) {
        // The operator's own nodes, or every pod of a listing.
        ("Node", _) | ("Pod", None) => Ok(()),
        // A workload's pods are named after it.
        ("Pod", Some(pod)) => repo
            .workloads(Some(namespace))
            .any(|w| pod.strip_prefix(&format!("{}-", w.name)).is_some())
            .then_some(())
            .ok_or_else(|| format!("pod {pod} belongs to no workload in deploy/ in {namespace}")),
        (kind, Some(name)) => repo.object(kind, name, namespace).map(drop),
        (kind, None) => Err(format!("a {kind} without a name")),
    }
}

/// `helm install|upgrade RELEASE CHART` and `helm uninstall RELEASE`, into deploy/'s
/// namespace. An install or upgrade is rendered for real, by `helm template` with the same
/// values, so that the chart's schema and templates take what the docs give them.
fn helm(repo: &Repo, args: &[String]) -> Result<(), String> {
    let (verb, rest) = args.split_first().ok_or("helm without a verb")?;
    let mut namespace = None;
    let mut positionals: Vec<&str> = Vec::new();
    let mut values: Vec<String> = Vec::new();
    let mut iter = rest.iter();
    while let Some(arg) = iter.next() {
        let (flag, inline) = split_flag(arg);
        match (verb.as_str(), flag) {
            (_, "-n" | "--namespace") => namespace = Some(flag_value(flag, inline, &mut iter)?),
            ("install" | "upgrade", "--set" | "--set-string" | "--set-json") => {
                values.push(flag.to_string());
                values.push(flag_value(flag, inline, &mut iter)?.to_string());
            }
            ("install" | "upgrade", "-f" | "--values") => {
                let file = repo.existing(flag_value(flag, inline, &mut iter)?)?;
                values.extend(["--values".to_string(), file.display().to_string()]);
            }
            ("upgrade", "--reuse-values") | ("install" | "upgrade" | "uninstall", "--wait") => {}
            ("uninstall", "--cascade") => {
                let how = flag_value(flag, inline, &mut iter)?;
                if !["background", "foreground", "orphan"].contains(&how) {
                    return Err(format!("helm uninstall --cascade {how}"));
                }
            }
            (_, flag) if flag.starts_with('-') => {
                return Err(format!("helm {verb} {flag} is not known to the docs test"));
            }
            _ => positionals.push(arg),
        }
    }
    if namespace != Some(deploy::NAMESPACE) {
        return Err(format!(
            "helm {verb} into {namespace:?}: the agent's DaemonSet lives in {}",
            deploy::NAMESPACE
        ));
    }
    match (verb.as_str(), positionals.as_slice()) {
        ("install" | "upgrade", [release, chart]) => {
            let chart = repo.existing(chart)?;
            if chart != deploy::chart_dir() {
                return Err(format!("{} is not the chart", chart.display()));
            }
            let mut template = vec!["template", release, chart.to_str().unwrap()];
            template.extend(["--namespace", deploy::NAMESPACE]);
            template.extend(values.iter().map(String::as_str));
            KubeTool::Helm
                .run(&template)
                .map(drop)
                .map_err(|e| format!("{e:#}"))
        }
        ("uninstall", [_release]) => Ok(()),
        _ => Err(format!("helm {args:?} is not known to the docs test")),
    }
}

/// `kustomize edit set image NAME=NEW` and `kustomize edit add component PATH`, run in deploy/.
fn kustomize(repo: &Repo, args: &[String]) -> Result<(), String> {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    repo.kustomization("deploy")?;
    match words.as_slice() {
        ["edit", "set", "image", change] => {
            let (name, new) = change
                .split_once('=')
                .ok_or_else(|| format!("{change} is not NAME=IMAGE"))?;
            repo.check_image(name)?;
            repo.check_image(new)
        }
        ["edit", "add", "component", path] => {
            let component = repo.kustomization(&format!("deploy/{path}"))?;
            match text_at(&component, &["kind"]) {
                Some("Component") => Ok(()),
                _ => Err(format!("deploy/{path} is not a kustomize Component")),
            }
        }
        _ => Err(format!("kustomize {args:?} is not known to the docs test")),
    }
}

fn docker(repo: &Repo, args: &[String]) -> Result<(), String> {
    let (verb, rest) = args.split_first().ok_or("docker without a verb")?;
    let mut positionals = Vec::new();
    let mut iter = rest.iter();
    while let Some(arg) = iter.next() {
        let (flag, inline) = split_flag(arg);
        match (verb.as_str(), flag) {
            ("build", "-f" | "--file") => {
                repo.existing(flag_value(flag, inline, &mut iter)?)?;
            }
            ("build", "-t" | "--tag") => repo.check_image(flag_value(flag, inline, &mut iter)?)?,
            (_, flag) if flag.starts_with('-') => {
                return Err(format!(
                    "docker {verb} {flag} is not known to the docs test"
                ));
            }
            _ => positionals.push(arg.as_str()),
        }
    }
    match (verb.as_str(), positionals.as_slice()) {
        ("build", [context]) => repo.existing(context).map(drop),
        ("push", [image]) => repo.check_image(image),
        _ => Err(format!("docker {args:?} is not known to the docs test")),
    }
}

/// `cargo xtask TASK [FLAGS]`, against the tasks and flags xtask's sources define.
fn cargo_xtask(repo: &Repo, args: &[String]) -> Result<(), String> {
    let [xtask, task, rest @ ..] = args else {
        return Err(format!("cargo {args:?}: only `cargo xtask TASK` is known"));
    };
    if xtask != "xtask" {
        return Err(format!("cargo {xtask}: only `cargo xtask TASK` is known"));
    }
    let main = std::fs::read_to_string(repo.root.join("xtask/src/main.rs")).unwrap();
    let tasks = xtask_tasks(&main);
    let (_, arguments) = tasks
        .iter()
        .find(|(name, _)| name == task)
        .ok_or_else(|| format!("cargo xtask {task}: xtask has {tasks:?}"))?;
    let flags = match arguments {
        TaskArguments::None => Vec::new(),
        TaskArguments::Any => return Ok(()),
        TaskArguments::Options(module) => {
            let source = repo.root.join(format!("xtask/src/{module}.rs"));
            long_flags(&std::fs::read_to_string(source).unwrap(), "struct Options")
        }
    };
    let mut iter = rest.iter();
    while let Some(arg) = iter.next() {
        let (name, inline) = arg
            .split_once('=')
            .map_or((arg.as_str(), None), |(f, v)| (f, Some(v)));
        let (_, takes_value) = flags
            .iter()
            .find(|(flag, _)| flag == name)
            .ok_or_else(|| format!("cargo xtask {task} {arg}: its flags are {flags:?}"))?;
        if *takes_value {
            flag_value(name, inline, &mut iter)?;
        }
    }
    Ok(())
}

/// What a task takes after its name.
#[derive(Debug)]
enum TaskArguments {
    None,
    /// Anything (a trailing argument list).
    Any,
    /// The flags of `struct Options` in this module.
    Options(String),
}

/// The tasks of xtask's `enum Task`, by command-line name.
fn xtask_tasks(main: &str) -> Vec<(String, TaskArguments)> {
    let body = main
        .split_once("enum Task {")
        .and_then(|(_, rest)| rest.split_once("\n}"))
        .map_or("", |(body, _)| body);
    let mut tasks: Vec<(String, TaskArguments)> = Vec::new();
    for line in body.lines() {
        let Some(variant) = line.strip_prefix("    ") else {
            continue;
        };
        if variant.starts_with(char::is_uppercase) {
            let name: String = variant
                .chars()
                .take_while(char::is_ascii_alphanumeric)
                .collect();
            let arguments = match variant[name.len()..].trim() {
                "," => TaskArguments::None,
                rest => match rest.strip_prefix('(').and_then(|r| r.split_once("::")) {
                    Some((module, _)) => TaskArguments::Options(module.to_string()),
                    None => TaskArguments::None,
                },
            };
            tasks.push((kebab_case(&name), arguments));
        } else if variant.contains("trailing_var_arg")
            && let Some(last) = tasks.last_mut()
        {
            last.1 = TaskArguments::Any;
        }
    }
    tasks
}

/// The `#[arg(long)]` fields of `struct_decl` in `source`, as `--flag-name`, and whether each
/// takes a value (anything but a `bool`).
fn long_flags(source: &str, struct_decl: &str) -> Vec<(String, bool)> {
    let body = source
        .split_once(&format!("{struct_decl} {{"))
        .and_then(|(_, rest)| rest.split_once("\n}"))
        .map_or("", |(body, _)| body);
    let mut flags = Vec::new();
    let mut long = false;
    for line in body.lines().map(str::trim) {
        if line.starts_with("#[arg(") {
            long = line.contains("long");
        } else if let Some((field, ty)) = line.split_once(':')
            && !line.starts_with("//")
        {
            if long {
                let field = field.trim_start_matches("pub ").trim();
                let takes_value = ty.trim().trim_end_matches(',') != "bool";
                flags.push((format!("--{}", field.replace('_', "-")), takes_value));
            }
            long = false;
        }
    }
    flags
}

fn kebab_case(camel: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('-');
        }
        out.extend(c.to_lowercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> Repo {
        Repo::load(&masq_testbed::workspace_root())
    }

    fn check_words(line: &str) -> Result<Offline, String> {
        check(&repo(), &crate::markdown::words(line).unwrap())
    }

    #[test]
    fn xtask_tasks_and_flags_come_from_its_sources() {
        assert!(check_words("cargo xtask demo").is_ok());
        assert!(check_words("cargo xtask test -- --nocapture").is_ok());
        assert!(check_words("cargo xtask bench --quick").is_ok());
        assert!(check_words("cargo xtask bench --sizes 4,10000 --rounds 2").is_ok());
        for wrong in [
            "cargo xtask bench --fast",
            "cargo xtask deploy",
            "cargo xtask demo --quick",
            "cargo build",
        ] {
            assert!(check_words(wrong).is_err(), "{wrong}");
        }
    }

    #[test]
    fn kubectl_names_must_be_deploys() {
        assert!(check_words("kubectl apply -k deploy/").is_ok());
        assert!(
            check_words("kubectl -n kube-system rollout status daemonset/ip-masq-agent").is_ok()
        );
        assert!(check_words("kubectl create -f deploy/configmap.yaml").is_ok());
        // Selected on by a component only.
        assert!(
            check_words("kubectl label node n1 node.kubernetes.io/masq-agent-ds-ready=true")
                .is_ok()
        );
        for wrong in [
            "kubectl apply -k docs/",
            "kubectl apply -f deploy/nothing.yaml",
            "kubectl -n default rollout status daemonset/ip-masq-agent",
            "kubectl -n kube-system rollout status daemonset/other",
            "kubectl label node n1 some.label/x=true",
            "kubectl -n kube-system get pods -l k8s-app=nothing",
            "kubectl -n kube-system exec daemonset/ip-masq-agent",
            "kubectl -n kube-system port-forward daemonset/ip-masq-agent 9830",
            "kubectl -n kube-system get ds ip-masq-agent --unknown-flag",
        ] {
            assert!(check_words(wrong).is_err(), "{wrong}");
        }
        let Ok(Offline::RunOnNode(inner)) =
            check_words("kubectl -n kube-system exec ip-masq-agent-x7k2p -- masq-agent status")
        else {
            panic!("exec hands its command to the bed");
        };
        assert_eq!(inner, ["masq-agent", "status"]);
    }

    #[test]
    fn helm_commands_render_the_chart_with_their_values() {
        for right in [
            "helm install masq-agent deploy/helm/masq-agent -n kube-system",
            "helm upgrade masq-agent deploy/helm/masq-agent -n kube-system --reuse-values \
             --set oneNodeFirst=false",
            "helm install x deploy/helm/masq-agent -n kube-system --set-json \
             'config.nonMasqueradeCIDRs=[\"10.0.0.0/8\"]'",
            "helm uninstall masq-agent -n kube-system --cascade foreground --wait",
        ] {
            assert!(check_words(right).is_ok(), "{right}");
        }
        for wrong in [
            // The schema refuses the value.
            "helm install masq-agent deploy/helm/masq-agent -n kube-system --set dataplane=xdp",
            // No such value.
            "helm install masq-agent deploy/helm/masq-agent -n kube-system --set oneNode=true",
            "helm install masq-agent deploy/helm/masq-agent",
            "helm install masq-agent deploy/ -n kube-system",
            "helm install masq-agent deploy/helm/masq-agent -n kube-system --atomic",
            "helm uninstall masq-agent -n kube-system --cascade sideways",
        ] {
            assert!(check_words(wrong).is_err(), "{wrong}");
        }
    }

    #[test]
    fn kustomize_components_must_be_deploys() {
        assert!(check_words("kustomize edit add component components/node-label").is_ok());
        for wrong in [
            "kustomize edit add component components/nothing",
            // A directory with a kustomization, but not a component.
            "kustomize edit add component .",
            "kustomize edit add resource configmap.yaml",
        ] {
            assert!(check_words(wrong).is_err(), "{wrong}");
        }
    }

    #[test]
    fn images_and_build_files_must_exist() {
        assert!(check_words("docker build -f deploy/nothing -t masq-agent:1 .").is_err());
        assert!(check_words("docker push registry.example.com/other:1").is_err());
        assert!(check_words("docker run masq-agent:1").is_err());
        assert_eq!(
            image_name("registry.example.com:5000/x/masq-agent:0.1.0"),
            "masq-agent"
        );
    }
}
