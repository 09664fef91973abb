//! The files in deploy/, for the tests that check them and the tests that run what they say.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
};

use anyhow::Context as _;
use serde_yaml::Value;

use crate::kube_tools::KubeTool;

pub fn deploy_dir() -> PathBuf {
    crate::workspace_root().join("deploy")
}

pub fn read(file: &str) -> String {
    let path = deploy_dir().join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A manifest of one object.
pub fn manifest(file: &str) -> Value {
    serde_yaml::from_str(&read(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The agent's container in the DaemonSet.
pub fn agent_container() -> Value {
    manifest("daemonset.yaml")["spec"]["template"]["spec"]["containers"][0].clone()
}

/// The capabilities the agent's container is given; its securityContext drops every other one.
pub fn agent_capabilities() -> Vec<String> {
    let capabilities = &agent_container()["securityContext"]["capabilities"];
    assert_eq!(strings(&capabilities["drop"]), ["ALL"], "{capabilities:?}");
    strings(&capabilities["add"])
}

/// The command of the DaemonSet's init container `name`.
pub fn init_command(name: &str) -> Vec<String> {
    let pod = &manifest("daemonset.yaml")["spec"]["template"]["spec"];
    strings(&find(&pod["initContainers"], name)["command"])
}

/// `setpriv` and its arguments, for running a command as root with only `capabilities` (as a
/// container runtime names them: `NET_ADMIN`) in its bounding, permitted and effective sets,
/// and none inheritable or ambient: as a container runtime starts an unprivileged container.
pub fn with_only(capabilities: &[String]) -> Vec<String> {
    let kept: String = capabilities
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    vec![
        "setpriv".into(),
        format!("--bounding-set=-all{kept}"),
        "--inh-caps=-all".into(),
        "--ambient-caps=-all".into(),
        "--".into(),
    ]
}

/// The container's args, exactly as kubelet passes them.
pub fn agent_args() -> Vec<String> {
    strings(&agent_container()["args"])
}

/// The example ConfigMap's `config` key: the agent's config file.
pub fn example_config() -> String {
    manifest("configmap.yaml")["data"]["config"]
        .as_str()
        .expect("configmap.yaml has data.config")
        .to_string()
}

/// A YAML sequence of strings; panics on anything else.
pub fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .unwrap_or_else(|| panic!("expected a list, got {value:?}"))
        .iter()
        .map(|v| v.as_str().expect("a string").to_string())
        .collect()
}

/// The item named `name` in a list of named items (containers, volumes, ports).
pub fn find<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_sequence()
        .and_then(|items| items.iter().find(|item| item["name"] == name))
        .unwrap_or_else(|| panic!("no {name:?} in {list:?}"))
}

pub fn dashboard() -> serde_json::Value {
    serde_json::from_str(&read("grafana-dashboard.json")).expect("the dashboard is JSON")
}

/// The PromQL of every panel of the dashboard.
pub fn dashboard_queries() -> Vec<String> {
    dashboard()["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| {
            t["expr"]
                .as_str()
                .expect("every target has a query")
                .to_string()
        })
        .collect()
}

/// Each masq-agent metric a query selects, with the text that follows its name.
pub fn series(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query.match_indices("masq_agent_").map(|(at, _)| {
        let rest = &query[at..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        rest.split_at(end)
    })
}

/// The labels of each `by (...)` clause of a query, in order: `max by (node, family) (x)` ->
/// [[node, family]].
pub fn groupings(query: &str) -> Vec<Vec<&str>> {
    query
        .match_indices("by (")
        .map(|(at, clause)| {
            let rest = &query[at + clause.len()..];
            let labels = &rest[..rest.find(')').expect("a closed `by (...)`")];
            labels.split(',').map(str::trim).collect()
        })
        .collect()
}

/// Every object in a YAML file of one or more documents.
pub fn objects(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse_objects(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every object in YAML text of one or more documents; empty documents (a template that
/// rendered nothing) are left out.
pub fn parse_objects(text: &str) -> anyhow::Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut objects = Vec::new();
    for document in serde_yaml::Deserializer::from_str(text) {
        let object = Value::deserialize(document)?;
        if !object.is_null() {
            objects.push(object);
        }
    }
    Ok(objects)
}

/// The kustomize components under deploy/components/, which an operator adds to the default
/// install with `kustomize edit add component components/NAME`, by name.
pub fn component_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(deploy_dir().join("components"))
        .expect("deploy/components")
        .map(|entry| entry.expect("deploy/components").path())
        .filter(|path| path.is_dir())
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The component's kustomization.yaml.
pub fn component_kustomization(name: &str) -> Value {
    manifest(&format!("components/{name}/kustomization.yaml"))
}

/// The objects of the files a component's kustomization lists as its resources.
pub fn component_resources(name: &str) -> Vec<Value> {
    let dir = deploy_dir().join("components").join(name);
    match &component_kustomization(name)["resources"] {
        Value::Null => Vec::new(),
        list => strings(list)
            .iter()
            .flat_map(|file| objects(&dir.join(file)))
            .collect(),
    }
}

/// The objects `kubectl kustomize` builds from deploy/ with `components` added, as
/// `kubectl apply -k deploy/` would apply them after `kustomize edit add component` of each.
pub fn kustomize(components: &[&str]) -> anyhow::Result<Vec<Value>> {
    static BUILDS: AtomicUsize = AtomicUsize::new(0);
    // Kustomize loads bases and components by paths relative to the kustomization, within
    // the tree: the build's directory is under target/, two levels down.
    let build = crate::workspace_root().join(format!(
        "target/kustomize/{}-{}",
        std::process::id(),
        BUILDS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&build)?;
    let mut kustomization = String::from(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n  - ../../../deploy\n",
    );
    if !components.is_empty() {
        kustomization.push_str("components:\n");
        for component in components {
            kustomization.push_str(&format!("  - ../../../deploy/components/{component}\n"));
        }
    }
    std::fs::write(build.join("kustomization.yaml"), kustomization)?;
    let built = KubeTool::Kubectl.run(&["kustomize", build.to_str().context("target/ path")?]);
    std::fs::remove_dir_all(&build)?;
    parse_objects(&built?)
}

/// The Helm chart in deploy/helm/.
pub fn chart_dir() -> PathBuf {
    deploy_dir().join("helm/masq-agent")
}

/// The namespace the chart is rendered into, as the DaemonSet it takes over lives there.
pub const NAMESPACE: &str = "kube-system";

/// `helm template` of the chart into `NAMESPACE`, with `args` (`-f FILE`, `--set K=V`, ...):
/// the text it prints.
pub fn helm_template_text(args: &[&str]) -> anyhow::Result<String> {
    let chart = chart_dir();
    let mut all = vec![
        "template",
        "masq-agent",
        chart.to_str().context("the chart's path")?,
        "--namespace",
        NAMESPACE,
    ];
    all.extend(args);
    KubeTool::Helm.run(&all)
}

/// `--set VALUE` for each of `values` (`key=value`), as helm takes them.
pub fn set_args<'a>(values: &[&'a str]) -> Vec<&'a str> {
    values.iter().flat_map(|value| ["--set", value]).collect()
}

/// The objects `helm template` renders with `args`.
pub fn helm_template(args: &[&str]) -> anyhow::Result<Vec<Value>> {
    parse_objects(&helm_template_text(args)?)
}

/// An object file of deploy/ that is the chart's render: one template with some values set.
/// The chart is the one source of these objects and of the comments that explain them.
pub struct Rendered {
    /// The file, under deploy/.
    pub file: &'static str,
    /// The chart's template it is the render of.
    pub template: &'static str,
    /// The values it is rendered with, besides the chart's defaults.
    pub set: &'static [&'static str],
}

pub const RENDERED: [Rendered; 4] = [
    Rendered {
        file: "daemonset.yaml",
        template: "templates/daemonset.yaml",
        set: &[],
    },
    Rendered {
        file: "uninstall.yaml",
        template: "templates/uninstall.yaml",
        set: &["uninstall=true"],
    },
    Rendered {
        file: "components/podmonitor/podmonitor.yaml",
        template: "templates/podmonitor.yaml",
        set: &["podMonitor.enabled=true"],
    },
    Rendered {
        file: "components/alerts/prometheusrule.yaml",
        template: "templates/prometheusrule.yaml",
        set: &["prometheusRule.enabled=true"],
    },
];

impl Rendered {
    /// What the file must hold: a line that says where it comes from, then the render.
    pub fn render(&self) -> anyhow::Result<String> {
        let mut args = vec!["--show-only", self.template];
        args.extend(set_args(self.set));
        let text = helm_template_text(&args)?;
        let source = format!("---\n# Source: masq-agent/{}\n", self.template);
        let body = text
            .strip_prefix(&source)
            .with_context(|| format!("helm's render of {} starts {source:?}", self.template))?;
        let with = match self.set {
            [] => "its default values".to_string(),
            set => set.join(" "),
        };
        Ok(format!(
            "# Rendered from the chart's {}, with {with};\n\
             # change the chart (deploy/helm/masq-agent), then run `cargo xtask render-manifests`.\n\
             {body}",
            self.template
        ))
    }

    pub fn path(&self) -> PathBuf {
        deploy_dir().join(self.file)
    }
}

/// The values files under the chart's ci/ directory, by file name: the renders its checks make
/// (`default-values.yaml`, empty, is the chart's defaults).
pub fn chart_values_files() -> Vec<(String, PathBuf)> {
    let dir = chart_dir().join("ci");
    let mut files: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("the chart's ci/").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .map(|path| {
            (
                path.file_name().unwrap().to_string_lossy().into_owned(),
                path,
            )
        })
        .collect();
    files.sort();
    files
}
