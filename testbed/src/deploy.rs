//! The files in deploy/, for the tests that check them and the tests that run what they say.

use std::path::PathBuf;

use serde_yaml::Value;

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

/// The objects of the default install, `kubectl apply -k deploy/`: those of the files
/// deploy/kustomization.yaml lists.
pub fn default_objects() -> Vec<Value> {
    strings(&manifest("kustomization.yaml")["resources"])
        .iter()
        .flat_map(|file| objects(&deploy_dir().join(file)))
        .collect()
}

/// Every object in a YAML file of one or more documents.
pub fn objects(path: &std::path::Path) -> Vec<Value> {
    use serde::Deserialize as _;
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| {
            Value::deserialize(document).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect()
}

/// A kustomize component under deploy/components/, which an operator adds to the default install
/// with `kustomize edit add component components/NAME`.
pub struct Component {
    pub name: String,
    pub kustomization: Value,
    /// The objects it adds.
    pub resources: Vec<Value>,
    /// Its patches, each naming the object it changes.
    pub patches: Vec<Value>,
}

/// Every component under deploy/components/, by name.
pub fn components() -> Vec<Component> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(deploy_dir().join("components"))
        .expect("deploy/components")
        .map(|entry| entry.expect("deploy/components").path())
        .filter(|path| path.is_dir())
        .collect();
    dirs.sort();
    dirs.into_iter().map(read_component).collect()
}

pub fn component(name: &str) -> Component {
    read_component(deploy_dir().join("components").join(name))
}

/// Reads the parts of a component that deploy/'s use: resource files in its directory and
/// inline patches. Anything else panics, so that a component cannot hold what the checks of
/// deploy/ would not see.
fn read_component(dir: PathBuf) -> Component {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let kustomization: Value = serde_yaml::from_str(
        &std::fs::read_to_string(dir.join("kustomization.yaml"))
            .unwrap_or_else(|e| panic!("components/{name}: {e}")),
    )
    .unwrap_or_else(|e| panic!("components/{name}: {e}"));
    assert_eq!(kustomization["kind"], "Component", "components/{name}");
    for key in kustomization.as_mapping().unwrap().keys() {
        let key = key.as_str().unwrap_or_default();
        assert!(
            ["apiVersion", "kind", "resources", "patches"].contains(&key),
            "components/{name}: {key} is not read by the checks of deploy/"
        );
    }
    let resources = match &kustomization["resources"] {
        Value::Null => Vec::new(),
        list => strings(list)
            .iter()
            .flat_map(|file| {
                assert!(
                    !file.contains('/'),
                    "components/{name}: {file} is not its own"
                );
                objects(&dir.join(file))
            })
            .collect(),
    };
    let patches = match &kustomization["patches"] {
        Value::Null => Vec::new(),
        list => list
            .as_sequence()
            .expect("patches is a list")
            .iter()
            .map(|entry| {
                let patch = entry["patch"]
                    .as_str()
                    .unwrap_or_else(|| panic!("components/{name}: only inline patches are read"));
                serde_yaml::from_str(patch).unwrap_or_else(|e| panic!("components/{name}: {e}"))
            })
            .collect(),
    };
    Component {
        name,
        kustomization,
        resources,
        patches,
    }
}

impl Component {
    /// `objects` with this component added, as kustomize builds them: its patches applied to the
    /// objects they name, and its resources appended.
    pub fn apply(&self, objects: &[Value]) -> Vec<Value> {
        let mut out = objects.to_vec();
        for patch in &self.patches {
            let id = |o: &Value| {
                [
                    &o["kind"],
                    &o["metadata"]["name"],
                    &o["metadata"]["namespace"],
                ]
                .map(|v| v.as_str().unwrap_or_default().to_string())
            };
            let target = out
                .iter_mut()
                .find(|o| id(o) == id(patch))
                .unwrap_or_else(|| panic!("components/{}: patches no object", self.name));
            merge_patch(target, patch);
        }
        out.extend(self.resources.iter().cloned());
        out
    }
}

/// Merges `patch` into `target` as a strategic-merge patch merges maps: key by key, a null
/// removing the key, any other value replacing it. A list in the patch panics: kustomize merges
/// some lists by key, which this does not, so such a patch needs another check.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Mapping(patch) = patch else {
        panic!("a patch of maps only, not {patch:?}");
    };
    if !target.is_mapping() {
        *target = Value::Mapping(Default::default());
    }
    let target = target.as_mapping_mut().unwrap();
    for (key, value) in patch {
        match value {
            Value::Null => {
                target.remove(key);
            }
            Value::Sequence(_) => panic!("a list in a patch, at {key:?}"),
            Value::Mapping(_) => {
                merge_patch(target.entry(key.clone()).or_insert(Value::Null), value)
            }
            scalar => {
                target.insert(key.clone(), scalar.clone());
            }
        }
    }
}
