//! deploy/ as the real tools build it: the Helm chart through `helm lint` and `helm template`,
//! the kustomize base and its components through `kubectl kustomize`. Every build is checked
//! for what a takeover of upstream's DaemonSet needs and for what the agent will accept; the
//! chart's defaults and each of its opt-in values give exactly what kustomize gives. (The
//! builds' schema validation is `cargo xtask validate-manifests`, which the test command runs.)
//! These need no root, only the tools `cargo xtask setup` provides.

use std::collections::BTreeSet;

use masq_agent::{
    agent::config_options,
    cli::{Cli, Flags},
    config,
    dataplane::state,
    privileges::{FOR_THE_CHAIN, FOR_THE_PROGRAMS},
};
use masq_testbed::{
    deploy::{
        self, RENDERED, chart_dir, chart_values_files, component_names, find, helm_template,
        helm_template_text, kustomize, set_args, strings,
    },
    kube_tools::KubeTool,
};
use serde_yaml::Value;

/// Each component under deploy/components/ and the chart's value that does the same.
const COMPONENT_VALUES: [(&str, &str); 4] = [
    ("alerts", "prometheusRule.enabled=true"),
    ("node-label", "addonNodeLabel=true"),
    ("one-node-first", "oneNodeFirst=true"),
    ("podmonitor", "podMonitor.enabled=true"),
];

fn helm(args: &[&str]) -> Vec<Value> {
    helm_template(args).unwrap_or_else(|e| panic!("{e:#}"))
}

fn kustomized(components: &[&str]) -> Vec<Value> {
    kustomize(components).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The chart rendered with one `--set` per value.
fn helm_with(values: &[&str]) -> Vec<Value> {
    helm(&set_args(values))
}

fn the<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let mut of_kind = objects.iter().filter(|o| o["kind"] == kind);
    let object = of_kind
        .next()
        .unwrap_or_else(|| panic!("no {kind} in {objects:?}"));
    assert!(of_kind.next().is_none(), "one {kind}");
    object
}

/// `objects`, in an order that does not depend on the tool that built them.
fn sorted(mut objects: Vec<Value>) -> Vec<Value> {
    objects.sort_by_key(|o| {
        format!(
            "{}/{}/{}",
            o["kind"].as_str().unwrap_or_default(),
            o["metadata"]["namespace"].as_str().unwrap_or_default(),
            o["metadata"]["name"].as_str().unwrap_or_default()
        )
    });
    objects
}

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).unwrap()
}

#[test]
fn deploy_s_rendered_files_are_the_chart_s_current_renders() {
    for rendered in RENDERED {
        let want = rendered.render().unwrap_or_else(|e| panic!("{e:#}"));
        let have = std::fs::read_to_string(rendered.path()).unwrap();
        assert!(
            have == want,
            "deploy/{} is not the chart's render of {}: run `cargo xtask render-manifests`",
            rendered.file,
            rendered.template
        );
    }
}

#[test]
fn helm_lint_strict_passes_with_every_values_file() {
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let files = chart_values_files();
    assert!(
        files
            .iter()
            .any(|(name, _)| name == "everything-on-values.yaml"),
        "{files:?}"
    );
    for (name, path) in &files {
        let out = KubeTool::Helm
            .run(&[
                "lint",
                "--strict",
                chart,
                "--values",
                path.to_str().unwrap(),
            ])
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert!(out.contains("0 chart(s) failed"), "{name}: {out}");
    }
}

/// The values every render of the chart is checked with, and that one file turns everything on.
#[test]
fn the_everything_on_values_file_sets_every_value_the_chart_has() {
    let (_, everything) = chart_values_files()
        .into_iter()
        .find(|(name, _)| name == "everything-on-values.yaml")
        .unwrap();
    let everything: Value = serde_yaml::from_str(&std::fs::read_to_string(everything).unwrap())
        .expect("everything-on-values.yaml");
    let defaults = chart_defaults();
    // Every value but `uninstall`, which renders something else in place of all of them.
    for key in keys_of(&defaults, "") {
        if key == "uninstall" {
            continue;
        }
        let set = key
            .split('.')
            .try_fold(&everything, |v, part| v.get(part))
            .is_some_and(|v| !v.is_null());
        assert!(set, "everything-on-values.yaml sets {key}");
    }
}

#[test]
fn the_chart_s_readme_lists_every_value() {
    let readme = std::fs::read_to_string(chart_dir().join("README.md")).unwrap();
    for key in keys_of(&chart_defaults(), "") {
        assert!(
            readme.contains(&format!("| `{key}` |")),
            "the chart's README.md lists {key}"
        );
    }
}

fn chart_defaults() -> Value {
    serde_yaml::from_str(&std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap())
        .expect("values.yaml")
}

/// The dotted paths of a values tree's leaves, and of its maps that hold user-given maps.
fn keys_of(value: &Value, prefix: &str) -> Vec<String> {
    let Some(map) = value.as_mapping() else {
        return vec![prefix.trim_end_matches('.').to_string()];
    };
    let mut keys = Vec::new();
    for (key, child) in map {
        let path = format!("{prefix}{}", key.as_str().unwrap());
        match child {
            // A map whose keys the user chooses (labels, annotations, a node selector) or an
            // empty one is a leaf.
            Value::Mapping(m) if !m.is_empty() && !FREE_MAPS.contains(&path.as_str()) => {
                keys.extend(keys_of(child, &format!("{path}.")));
            }
            _ => keys.push(path),
        }
    }
    keys
}

/// Values that are maps of the user's own keys.
const FREE_MAPS: [&str; 3] = ["nodeSelector", "resources", "updateStrategy"];

/// The agent's container, and the flags it parses from the container's args.
fn agent_of(daemonset: &Value) -> (&Value, Flags) {
    let container = find(
        &daemonset["spec"]["template"]["spec"]["containers"],
        "ip-masq-agent",
    );
    let argv = std::iter::once("masq-agent".to_string()).chain(strings(&container["args"]));
    let (cli, _) = Cli::parse_args(argv).unwrap_or_else(|e| panic!("the agent refuses: {e}"));
    (container, cli.flags)
}

/// What any build of the agent's DaemonSet must hold, from either tool: `what` names the build.
fn check_agent_daemonset(what: &str, ds: &Value) {
    // The takeover: upstream's name, namespace, selector and pod labels.
    assert_eq!(ds["metadata"]["name"], "ip-masq-agent", "{what}");
    assert_eq!(ds["metadata"]["namespace"], deploy::NAMESPACE, "{what}");
    assert_eq!(
        ds["spec"]["selector"],
        yaml("matchLabels: {k8s-app: ip-masq-agent}"),
        "{what}"
    );
    let template = &ds["spec"]["template"];
    assert_eq!(
        template["metadata"]["labels"]["k8s-app"], "ip-masq-agent",
        "{what}"
    );
    let pod = &template["spec"];
    assert_eq!(pod["hostNetwork"], true, "{what}");
    let (container, flags) = agent_of(ds);

    // Exactly the capabilities the agent checks for at start.
    let wanted: BTreeSet<String> = FOR_THE_CHAIN
        .iter()
        .chain(&FOR_THE_PROGRAMS)
        .map(|c| c.name().trim_start_matches("CAP_").to_string())
        .collect();
    let capabilities = &container["securityContext"]["capabilities"];
    assert_eq!(strings(&capabilities["drop"]), ["ALL"], "{what}");
    let added: BTreeSet<String> = strings(&capabilities["add"]).into_iter().collect();
    assert_eq!(added, wanted, "{what}");
    assert_eq!(container["securityContext"]["privileged"], false, "{what}");

    // The probes ask the health address, on loopback; the metrics port is the one exposed.
    let health = flags.daemon.health_addr.expect("--health-addr");
    assert!(health.ip().is_loopback(), "{what}: {health}");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{what}: {probe}");
        let host: std::net::IpAddr = get["host"].as_str().unwrap().parse().unwrap();
        assert_eq!(host, health.ip(), "{what}: {probe}");
        assert_eq!(
            get["port"].as_u64(),
            Some(u64::from(health.port())),
            "{what}: {probe}"
        );
    }
    let metrics = flags.daemon.metrics_addr.expect("--metrics-addr");
    assert_eq!(
        find(&container["ports"], "metrics")["containerPort"].as_u64(),
        Some(u64::from(metrics.port())),
        "{what}"
    );

    check_state_from_the_node(what, pod, container);

    // The config volume puts the cluster's ConfigMap where the agent reads it: the file, or
    // in the directory it reads, beside the other ConfigMaps' files.
    let mount = find(&container["volumeMounts"], "config")["mountPath"]
        .as_str()
        .unwrap();
    let volume = find(&pod["volumes"], "config");
    let sources: Vec<&Value> = match volume["projected"]["sources"].as_sequence() {
        Some(sources) => sources.iter().map(|s| &s["configMap"]).collect(),
        None => vec![&volume["configMap"]],
    };
    assert_eq!(sources[0]["name"], "ip-masq-agent", "{what}");
    assert_eq!(sources[0]["items"][0]["key"], "config", "{what}");
    for source in &sources {
        assert_eq!(source["optional"], true, "{what}: {source:?}");
    }
    let paths: Vec<String> = sources
        .iter()
        .map(|s| format!("{mount}/{}", s["items"][0]["path"].as_str().unwrap()))
        .collect();
    let config = flags.config.path.to_str().unwrap();
    if sources.len() == 1 {
        assert_eq!(config, paths[0], "{what}");
    } else {
        assert_eq!(config, mount, "{what}: the directory");
        for path in &paths {
            let file = path.rsplit('/').next().unwrap();
            assert!(
                file.starts_with("ip-masq"),
                "{what}: the agent reads {file}"
            );
        }
        let unique: BTreeSet<&String> = paths.iter().collect();
        assert_eq!(unique.len(), paths.len(), "{what}: {paths:?}");
    }
}

/// The agent's record and verifier logs sit on the node, where a later container, or
/// `status` run on the node, finds what an exited one left.
fn check_state_from_the_node(what: &str, pod: &Value, container: &Value) {
    let mount = find(&container["volumeMounts"], "state");
    assert_eq!(mount["mountPath"], state::STATE_DIR, "{what}");
    let volume = find(&pod["volumes"], "state");
    assert_eq!(volume["hostPath"]["path"], state::STATE_DIR, "{what}");
    assert_eq!(volume["hostPath"]["type"], "DirectoryOrCreate", "{what}");
}

/// A ConfigMap the chart created parses as the agent parses it under the DaemonSet's flags.
fn check_config_map(what: &str, objects: &[Value], flags: &Flags) {
    let map = the(objects, "ConfigMap");
    assert_eq!(map["metadata"]["name"], "ip-masq-agent", "{what}");
    let text = map["data"]["config"].as_str().expect("data.config");
    let loaded = config::parse(text.as_bytes(), what, &config_options(&flags.config))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(loaded.warnings.is_empty(), "{what}: {:?}", loaded.warnings);
}

#[test]
fn every_values_file_renders_what_the_takeover_and_the_agent_need() {
    for (name, path) in chart_values_files() {
        let objects = helm(&["--values", path.to_str().unwrap()]);
        let values: Value =
            serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap_or_default();
        if values["uninstall"] == true {
            let kinds: Vec<&Value> = objects.iter().map(|o| &o["kind"]).collect();
            assert_eq!(kinds, ["DaemonSet"], "{name}: the cleanup alone");
            assert_eq!(
                objects[0]["metadata"]["name"], "ip-masq-agent-cleanup",
                "{name}"
            );
            // The cleanup removes the agent's record with the rest.
            let pod = &objects[0]["spec"]["template"]["spec"];
            let cleanup = find(&pod["initContainers"], "cleanup");
            check_state_from_the_node(&name, pod, cleanup);
            continue;
        }
        let ds = the(&objects, "DaemonSet");
        check_agent_daemonset(&name, ds);
        let annotations = &ds["spec"]["template"]["metadata"]["annotations"];
        if values["config"]["create"] == true {
            check_config_map(&name, &objects, &agent_of(ds).1);
            assert!(
                annotations["checksum/config"].is_string(),
                "{name}: {annotations:?}"
            );
        } else {
            assert!(objects.iter().all(|o| o["kind"] != "ConfigMap"), "{name}");
            assert!(annotations["checksum/config"].is_null(), "{name}");
        }
    }
}

#[test]
fn kustomize_builds_the_base_and_every_component_with_what_the_takeover_needs() {
    let base = kustomized(&[]);
    let kinds: Vec<&Value> = base.iter().map(|o| &o["kind"]).collect();
    assert_eq!(kinds, ["DaemonSet"], "the default install: no ConfigMap");
    check_agent_daemonset("kubectl kustomize deploy/", &base[0]);
    for component in component_names() {
        let built = kustomized(&[&component]);
        check_agent_daemonset(&format!("with {component}"), the(&built, "DaemonSet"));
        assert!(
            built.iter().all(|o| o["kind"] != "ConfigMap"),
            "{component}"
        );
    }
}

#[test]
fn the_chart_s_defaults_are_kustomize_s_default_install() {
    assert_eq!(sorted(helm(&[])), sorted(kustomized(&[])));
}

#[test]
fn each_component_is_the_chart_with_its_value() {
    let names: Vec<&str> = COMPONENT_VALUES.iter().map(|(c, _)| *c).collect();
    assert_eq!(names, component_names(), "every component has its value");
    for (component, value) in COMPONENT_VALUES {
        assert_eq!(
            sorted(helm_with(&[value])),
            sorted(kustomized(&[component])),
            "components/{component} and {value}"
        );
    }
    // And all of them together.
    let values: Vec<&str> = COMPONENT_VALUES.iter().map(|(_, v)| *v).collect();
    assert_eq!(sorted(helm_with(&values)), sorted(kustomized(&names)));
}

#[test]
fn the_opt_in_values_change_only_what_they_name() {
    let default = helm(&[]);
    let default = the(&default, "DaemonSet");
    let labelled = helm_with(&["addonNodeLabel=true"]);
    let mut labelled = the(&labelled, "DaemonSet").clone();
    assert_eq!(
        labelled["spec"]["template"]["spec"]["nodeSelector"],
        yaml("{kubernetes.io/os: linux, node.kubernetes.io/masq-agent-ds-ready: \"true\"}")
    );
    labelled["spec"]["template"]["spec"]["nodeSelector"] =
        default["spec"]["template"]["spec"]["nodeSelector"].clone();
    assert_eq!(&labelled, default);
    // One node first keeps the pod template, so that applying without it later does not
    // replace the pod tried first.
    let first = helm_with(&["oneNodeFirst=true"]);
    let mut first = the(&first, "DaemonSet").clone();
    assert_eq!(first["spec"]["updateStrategy"], yaml("type: OnDelete"));
    first["spec"]["updateStrategy"] = default["spec"]["updateStrategy"].clone();
    assert_eq!(&first, default);
}

#[test]
fn the_schema_refuses_bad_values_and_says_which() {
    let cases: [(&[&str], &str); 6] = [
        (&["--set", "dataplane=bpf"], "/dataplane"),
        (
            &[
                "--set",
                "config.create=true",
                "--set-json",
                r#"config.nonMasqueradeCIDRs=["10.0.0.0/33"]"#,
            ],
            "/config/nonMasqueradeCIDRs/0",
        ),
        (
            &["--set-json", r#"config.masqueradeSrcCIDRs=["pods"]"#],
            "/config/masqueradeSrcCIDRs/0",
        ),
        (&["--set", "natCapacity=-1"], "/natCapacity"),
        (&["--set", "healthAddr=0.0.0.0:9831"], "/healthAddr"),
        (&["--set", "resyncInterval=60s"], "resyncInterval"),
    ];
    for (args, path) in cases {
        let refused = helm_template_text(args)
            .expect_err(&format!("{args:?} is refused"))
            .to_string();
        assert!(
            refused.contains("schema") && refused.contains(path),
            "{args:?} names {path}: {refused}"
        );
    }
}

/// The keys of a map, which must all be among `fields`: the validator has no schema for the
/// Prometheus Operator's kinds, so their fields are checked here against monitoring.coreos.com/v1.
fn only_fields(what: &str, value: &Value, fields: &[&str]) {
    for key in value
        .as_mapping()
        .unwrap_or_else(|| panic!("{what}"))
        .keys()
    {
        let key = key.as_str().unwrap();
        assert!(fields.contains(&key), "{what}: field {key}");
    }
}

#[test]
fn the_service_monitor_scrapes_every_agent_by_node_through_a_headless_service() {
    let objects = helm_with(&[
        "serviceMonitor.enabled=true",
        "serviceMonitor.interval=30s",
        "serviceMonitor.labels.release=prometheus",
    ]);
    let ds = the(&objects, "DaemonSet");
    let service = the(&objects, "Service");
    let monitor = the(&objects, "ServiceMonitor");
    // The Service selects the agents' pods, on their metrics port, headless: Prometheus
    // scrapes each pod, not one behind a virtual address.
    assert_eq!(service["spec"]["clusterIP"], "None");
    assert_eq!(
        service["spec"]["selector"],
        ds["spec"]["selector"]["matchLabels"]
    );
    let [port] = service["spec"]["ports"].as_sequence().unwrap().as_slice() else {
        panic!("one port");
    };
    let (container, flags) = agent_of(ds);
    find(&container["ports"], port["targetPort"].as_str().unwrap());
    assert_eq!(
        port["port"].as_u64(),
        flags.daemon.metrics_addr.map(|a| u64::from(a.port()))
    );
    // The monitor selects that Service in its own namespace, and labels series by node as
    // the PodMonitor does.
    only_fields(
        "ServiceMonitor",
        monitor,
        &["apiVersion", "kind", "metadata", "spec"],
    );
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(
        monitor["metadata"]["namespace"],
        service["metadata"]["namespace"]
    );
    assert_eq!(monitor["metadata"]["labels"], yaml("release: prometheus"));
    only_fields(
        "ServiceMonitor spec",
        &monitor["spec"],
        &["selector", "endpoints"],
    );
    for (key, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .unwrap()
    {
        assert_eq!(&service["metadata"]["labels"][key], value);
    }
    let [endpoint] = monitor["spec"]["endpoints"]
        .as_sequence()
        .unwrap()
        .as_slice()
    else {
        panic!("one endpoint");
    };
    only_fields(
        "ServiceMonitor endpoint",
        endpoint,
        &["port", "path", "interval", "relabelings"],
    );
    assert_eq!(endpoint["port"], port["name"]);
    assert_eq!(endpoint["interval"], "30s");
    let pod_monitor = helm_with(&["podMonitor.enabled=true"]);
    let pod_endpoint = &the(&pod_monitor, "PodMonitor")["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["path"], pod_endpoint["path"]);
    assert_eq!(endpoint["relabelings"], pod_endpoint["relabelings"]);
}

/// With more ConfigMaps, the projected volume lays their files where the agent reads them, under
/// names it reads, and the agent joins their lists: the chart's own ConfigMap and two of the
/// cluster's, one under another key.
#[test]
fn the_projected_config_maps_are_files_the_agent_joins() {
    let objects = helm(&[
        "--set",
        "config.create=true",
        "--set-json",
        r#"config.nonMasqueradeCIDRs=["10.0.0.0/8"]"#,
        "--set-json",
        r#"config.extraConfigMaps=[{"name":"pool-a"},{"name":"ip-masq-pool-b","key":"pools"}]"#,
    ]);
    let ds = the(&objects, "DaemonSet");
    let (container, flags) = agent_of(ds);
    let mount = find(&container["volumeMounts"], "config")["mountPath"]
        .as_str()
        .unwrap();
    assert_eq!(flags.config.path.to_str(), Some(mount), "the directory");
    // Each ConfigMap's data, by name and key, as the cluster would hold them.
    let chart_config = the(&objects, "ConfigMap")["data"]["config"]
        .as_str()
        .unwrap()
        .to_string();
    let data = |name: &str, key: &str| -> String {
        match (name, key) {
            ("ip-masq-agent", "config") => chart_config.clone(),
            ("pool-a", "config") => "nonMasqueradeCIDRs: [192.0.2.0/24]\n".into(),
            ("ip-masq-pool-b", "pools") => "nonMasqueradeCIDRs: [198.51.100.0/24]\n".into(),
            other => panic!("no ConfigMap {other:?}"),
        }
    };
    // Projected as kubelet projects them: each item's key at its path in the mount.
    let dir = tempfile::tempdir().unwrap();
    let volume = find(&ds["spec"]["template"]["spec"]["volumes"], "config");
    for source in volume["projected"]["sources"].as_sequence().unwrap() {
        let map = &source["configMap"];
        let item = &map["items"][0];
        let text = data(map["name"].as_str().unwrap(), item["key"].as_str().unwrap());
        std::fs::write(dir.path().join(item["path"].as_str().unwrap()), text).unwrap();
    }
    let out = std::process::Command::new(masq_testbed::agent_binary())
        .args([
            "check-config",
            &format!("--config={}", dir.path().display()),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let effective: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        effective["nonMasqueradeCIDRs"],
        serde_json::json!(["10.0.0.0/8", "192.0.2.0/24", "198.51.100.0/24"])
    );
}

/// What `helm install` prints after installing, in each of the chart's two roles.
fn notes(values: &[&str]) -> String {
    let chart = chart_dir();
    let mut args = vec![
        "install",
        "masq-agent",
        chart.to_str().unwrap(),
        "--namespace",
        deploy::NAMESPACE,
        "--dry-run=client",
    ];
    args.extend(set_args(values));
    let out = KubeTool::Helm
        .run(&args)
        .unwrap_or_else(|e| panic!("{e:#}"));
    out.split_once("NOTES:")
        .map(|(_, notes)| notes.to_string())
        .unwrap_or_else(|| panic!("no notes in {out}"))
}

#[test]
fn the_notes_say_what_to_watch_next_in_each_role() {
    let agent = notes(&[]);
    assert!(
        agent.contains("rollout status daemonset/ip-masq-agent\n"),
        "{agent}"
    );
    assert!(agent.contains("config.create=false"), "{agent}");
    assert!(notes(&["config.create=true"]).contains("that this release created"));
    let cleanup = notes(&["uninstall=true"]);
    assert!(
        cleanup.contains("rollout status daemonset/ip-masq-agent-cleanup"),
        "{cleanup}"
    );
    assert!(cleanup.contains("helm uninstall masq-agent"), "{cleanup}");
}
