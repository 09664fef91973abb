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
