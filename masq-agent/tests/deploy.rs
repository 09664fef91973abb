//! The files in deploy/ say what a production install needs, and agree with the agent's flags,
//! defaults and config parser, and with the metrics contract. (Schema validation is
//! `cargo xtask validate-manifests`; the kubelet experience, and the metrics the agent really
//! exposes, are tests/kubelet.rs.)

use std::collections::BTreeSet;

use masq_agent::{
    agent::config_options,
    cli::{Cli, LogFormat},
    config,
    telemetry::Answers as _,
};
use masq_testbed::deploy::{
    agent_args, agent_container, component_kustomization, component_names, component_resources,
    dashboard, dashboard_queries, example_config, find, groupings, manifest, read, series, strings,
};
use serde_yaml::Value;

fn pod_spec(daemonset: &Value) -> &Value {
    &daemonset["spec"]["template"]["spec"]
}

/// The agent's flags as it parses the DaemonSet's args.
fn agent_flags() -> masq_agent::cli::Flags {
    let argv = std::iter::once("masq-agent".to_string()).chain(agent_args());
    Cli::parse_args(argv)
        .expect("the agent accepts the DaemonSet's args")
        .0
        .flags
}

/// Checks that `ds` is a DaemonSet in kube-system whose pods run in the node's network, ahead of
/// other pods and whatever the node's taints; returns its pod spec.
fn node_daemonset_pod(ds: &Value) -> &Value {
    assert_eq!(ds["kind"], "DaemonSet");
    assert_eq!(ds["metadata"]["namespace"], "kube-system");
    let pod = pod_spec(ds);
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    // Every taint: an `Exists` toleration with no key and no effect.
    let tolerations = pod["tolerations"].as_sequence().expect("tolerations");
    assert!(
        tolerations
            .iter()
            .any(|t| t["operator"] == "Exists" && t["key"].is_null() && t["effect"].is_null()),
        "{tolerations:?}"
    );
    pod
}

/// The DaemonSet of the default install, `kubectl apply -k deploy/`: the one file it lists.
/// (tests/manifests.rs of masq-integration builds it with kustomize itself.)
fn default_daemonset() -> Value {
    assert_eq!(
        strings(&manifest("kustomization.yaml")["resources"]),
        ["daemonset.yaml"]
    );
    manifest("daemonset.yaml")
}

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).unwrap()
}

#[test]
fn the_default_daemonset_replaces_upstream_s_in_place_on_every_linux_node() {
    let ds = default_daemonset();
    let pod = node_daemonset_pod(&ds);
    // What applying over upstream's DaemonSet must keep (kubernetes-sigs/ip-masq-agent,
    // ip-masq-agent.yaml): the object's name and namespace, the selector, which Kubernetes does
    // not let change, and the ConfigMap volume, so that the same file reaches the agent.
    assert_eq!(ds["metadata"]["name"], "ip-masq-agent");
    assert_eq!(ds["metadata"]["namespace"], "kube-system");
    assert_eq!(
        ds["spec"]["selector"],
        yaml("matchLabels: {k8s-app: ip-masq-agent}")
    );
    assert_eq!(
        ds["spec"]["template"]["metadata"]["labels"]["k8s-app"],
        "ip-masq-agent"
    );
    assert_eq!(
        find(&pod["volumes"], "config"),
        &yaml(
            "{name: config, configMap: {name: ip-masq-agent, optional: true, \
              items: [{key: config, path: ip-masq-agent}]}}"
        )
    );
    assert_eq!(
        find(&agent_container()["volumeMounts"], "config")["mountPath"],
        "/etc/config"
    );
    // Upstream's manifest selects no nodes: anything beyond the OS would take the agent off
    // nodes it runs on today.
    assert_eq!(pod["nodeSelector"], yaml("kubernetes.io/os: linux"));
    assert!(pod["affinity"].is_null(), "{:?}", pod["affinity"]);
}

#[test]
fn the_default_install_creates_and_changes_no_config_map() {
    let kustomization = manifest("kustomization.yaml");
    assert_eq!(kustomization["kind"], "Kustomization");
    // Resources only: no generators, no components, nothing that could make a ConfigMap.
    let keys: Vec<&str> = kustomization
        .as_mapping()
        .unwrap()
        .keys()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(keys, ["apiVersion", "kind", "resources"]);
    assert_eq!(default_daemonset()["kind"], "DaemonSet");
    // Nor do the components: the example ConfigMap is created by hand, where there is none.
    for name in component_names() {
        assert!(
            component_resources(&name)
                .iter()
                .all(|o| o["kind"] != "ConfigMap"),
            "components/{name}"
        );
    }
    assert!(read("configmap.yaml").contains("kubectl create -f deploy/configmap.yaml"));
}

#[test]
fn every_component_is_explained_where_the_layout_is() {
    let layout = read("kustomization.yaml");
    let install = read("../docs/install.md");
    for name in component_names() {
        let path = format!("components/{name}");
        assert!(layout.contains(&path), "kustomization.yaml explains {path}");
        assert!(install.contains(&path), "docs/install.md explains {path}");
    }
    // Upstream's older README labelled nodes with the beta key; the install guide says what
    // becomes of them.
    assert!(install.contains("beta.kubernetes.io/masq-agent-ds-ready"));
}

#[test]
fn the_container_args_are_the_contract_and_the_agent_accepts_them() {
    assert_eq!(
        agent_args(),
        [
            "--masq-chain=IP-MASQ-AGENT",
            "--config=/etc/config/ip-masq-agent",
            "--metrics-addr=0.0.0.0:9830",
            "--health-addr=127.0.0.1:9831",
            "--log-format=json",
        ]
    );
    let flags = agent_flags();
    assert_eq!(flags.chain.masq_chain, "IP-MASQ-AGENT");
    assert_eq!(flags.logging.log_format, LogFormat::Json);
    assert_eq!(
        flags.daemon.metrics_addr.map(|a| a.to_string()).as_deref(),
        Some("0.0.0.0:9830")
    );
}

#[test]
fn probes_ask_the_health_address_on_loopback_and_only_metrics_is_exposed() {
    let container = agent_container();
    let port = find(&container["ports"], "metrics");
    let flags = agent_flags();
    let metrics = flags.daemon.metrics_addr.expect("--metrics-addr");
    assert_eq!(
        port["containerPort"].as_u64(),
        Some(u64::from(metrics.port()))
    );
    assert_eq!(container["ports"].as_sequence().map(Vec::len), Some(1));
    let health = flags.daemon.health_addr.expect("--health-addr");
    assert!(health.ip().is_loopback(), "{health}");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(get["host"].as_str(), Some(health.ip().to_string().as_str()));
        assert_eq!(
            get["port"].as_u64(),
            Some(u64::from(health.port())),
            "{probe}"
        );
    }
}

#[test]
fn the_config_map_is_mounted_where_the_agent_reads_it_and_is_optional() {
    let ds = manifest("daemonset.yaml");
    let volume = find(&pod_spec(&ds)["volumes"], "config");
    assert_eq!(volume["configMap"]["name"], "ip-masq-agent");
    assert_eq!(volume["configMap"]["optional"], true);
    let item = &volume["configMap"]["items"][0];
    assert_eq!(item["key"], "config");
    let container = agent_container();
    let mount = find(&container["volumeMounts"], "config");
    let mount_path = mount["mountPath"].as_str().unwrap();
    let file = format!("{mount_path}/{}", item["path"].as_str().unwrap());
    assert_eq!(agent_flags().config.path.to_str(), Some(file.as_str()));
    assert_eq!(
        manifest("configmap.yaml")["metadata"]["name"],
        volume["configMap"]["name"],
        "the example ConfigMap is the one mounted"
    );
}

#[test]
fn bpffs_comes_from_the_host_mounted_by_the_init_container() {
    let ds = manifest("daemonset.yaml");
    let pod = pod_spec(&ds);
    let volume = find(&pod["volumes"], "bpffs");
    assert_eq!(volume["hostPath"]["path"], "/sys/fs/bpf");
    let container = agent_container();
    let mount = find(&container["volumeMounts"], "bpffs");
    assert_eq!(mount["mountPath"], "/sys/fs/bpf");
    // The agent sees what the init container (or the node) mounted there.
    assert_eq!(mount["mountPropagation"], "HostToContainer");
    assert_eq!(
        agent_flags().pins.bpffs.parent().and_then(|p| p.to_str()),
        mount["mountPath"].as_str()
    );
    // The init container's mount must reach the node, so that the pins outlive the pod:
    // Bidirectional, which Kubernetes accepts from privileged containers only.
    let init = find(&pod["initContainers"], "mount-bpffs");
    let init_mount = find(&init["volumeMounts"], "bpffs");
    assert_eq!(init_mount["mountPath"], "/sys/fs/bpf");
    assert_eq!(init_mount["mountPropagation"], "Bidirectional");
    assert_eq!(init["securityContext"]["privileged"], true);
    assert_eq!(init["image"], container["image"], "one image to pull");
}

/// The lines of `text` right above the first line that trims to `line`: its comment.
fn comment_above(text: &str, line: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.trim() == line)
        .unwrap_or_else(|| panic!("no line {line:?}"));
    let mut comment: Vec<&str> = lines[..at]
        .iter()
        .rev()
        .take_while(|l| l.trim_start().starts_with('#'))
        .copied()
        .collect();
    comment.reverse();
    comment.join("\n")
}

#[test]
fn every_privilege_is_explained() {
    let context = &agent_container()["securityContext"];
    assert_eq!(context["privileged"], false);
    assert_eq!(strings(&context["capabilities"]["drop"]), ["ALL"]);
    let text = read("daemonset.yaml");
    for capability in strings(&context["capabilities"]["add"]) {
        let why = comment_above(&text, &format!("- {capability}"));
        assert!(!why.is_empty(), "no comment says why {capability}");
    }
    let init = comment_above(&text, "initContainers:");
    for reason in ["CAP_SYS_ADMIN", "Bidirectional", "privileged"] {
        assert!(init.contains(reason), "{reason} in: {init}");
    }
    let seccomp = comment_above(&text, "seccompProfile:");
    assert!(seccomp.contains("bpf()"), "{seccomp}");
}

#[test]
fn resources_are_requested() {
    let requests = &agent_container()["resources"]["requests"];
    assert!(requests["cpu"].is_string(), "{requests:?}");
    assert!(requests["memory"].is_string(), "{requests:?}");
}

#[test]
fn a_rollout_replaces_one_node_at_a_time_without_surge() {
    let strategy = &manifest("daemonset.yaml")["spec"]["updateStrategy"];
    assert_eq!(strategy["type"], "RollingUpdate");
    assert_eq!(strategy["rollingUpdate"]["maxUnavailable"], 1);
    // A surge pod could never start: the old one holds the host port.
    assert_eq!(strategy["rollingUpdate"]["maxSurge"], 0);
}

#[test]
fn the_example_config_is_valid_under_the_daemonset_flags() {
    let loaded = config::parse(
        example_config().as_bytes(),
        "configmap.yaml",
        &config_options(&agent_flags().config),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let json = loaded.config.to_upstream_json();
    assert_eq!(
        json["nonMasqueradeCIDRs"],
        serde_json::json!(["10.0.0.0/8"])
    );
    assert_eq!(loaded.config.resync_interval.as_secs(), 60);
}

#[test]
fn the_uninstaller_cleans_every_node_of_the_agent_chain_and_pins() {
    let ds = manifest("uninstall.yaml");
    let pod = node_daemonset_pod(&ds);
    assert!(
        pod["nodeSelector"].is_null(),
        "every node, labelled or not any more"
    );
    let cleanup = &pod["initContainers"][0];
    assert_eq!(cleanup["image"], agent_container()["image"]);
    let args = strings(&cleanup["args"]);
    assert_eq!(args[0], "cleanup");
    let chain = agent_args()
        .into_iter()
        .find(|a| a.starts_with("--masq-chain="))
        .unwrap();
    assert!(args.contains(&chain), "the agent's chain: {args:?}");
    // Cleanup works from the default --bpffs, under the same mount as the agent's.
    assert!(!args.iter().any(|a| a.starts_with("--bpffs")), "{args:?}");
    assert_eq!(
        find(&cleanup["volumeMounts"], "bpffs")["mountPath"],
        find(&agent_container()["volumeMounts"], "bpffs")["mountPath"]
    );
}

#[test]
fn the_image_is_multi_stage_with_both_iptables_backends_behind_the_entrypoint() {
    let dockerfile = read("Dockerfile");
    let stages: Vec<&str> = dockerfile
        .lines()
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert_eq!(stages.len(), 2, "{stages:?}");
    let runtime = &dockerfile[dockerfile.rfind("\nFROM ").unwrap()..];
    for package in ["iptables", "ipset"] {
        assert!(
            runtime.contains(&format!(" {package} ")),
            "{package} in the runtime image"
        );
    }
    assert!(
        runtime.contains("COPY --from="),
        "the agent from the build stage"
    );
    assert!(runtime.contains(r#"ENTRYPOINT ["/usr/local/bin/masq-agent-entrypoint"]"#));
    assert!(runtime.contains("deploy/entrypoint.sh /usr/local/bin/masq-agent-entrypoint"));
}

/// The metrics the agent exports, with the labels the dashboard splits them by.
const METRICS: [&str; 20] = [
    "masq_agent_packets_masqueraded_total",
    "masq_agent_packets_not_masqueraded_total",
    "masq_agent_packets_reverse_translated_total",
    "masq_agent_packets_dropped_total",
    "masq_agent_packets_not_inspected_total",
    "masq_agent_inbound_connections_tracked_total",
    "masq_agent_nat_entries",
    "masq_agent_nat_flows",
    "masq_agent_nat_capacity_entries",
    "masq_agent_nat_allocation_failures_total",
    "masq_agent_nat_early_drops_total",
    "masq_agent_nat_node_flow_drops_total",
    "masq_agent_nat_gc_runs_total",
    "masq_agent_nat_gc_expired_flows_total",
    "masq_agent_config_reloads_total",
    "masq_agent_last_successful_sync_timestamp_seconds",
    "masq_agent_non_masquerade_prefixes",
    "masq_agent_dataplane_mode",
    "masq_agent_fallback_events_total",
    "masq_agent_build_info",
];

/// The series of how full the NAT tables are. Each family's table fills on its own, and a pod's
/// new flow is refused when its own family's is full: summed over the families, a full IPv4
/// table beside an empty IPv6 one would read half full.
const NAT_FULLNESS: [&str; 2] = ["masq_agent_nat_entries", "masq_agent_nat_capacity_entries"];

/// A query on how full the NAT tables are keeps each family's series apart.
fn assert_keeps_the_families_apart(query: &str) {
    if series(query).any(|(name, _)| NAT_FULLNESS.contains(&name)) {
        let groupings = groupings(query);
        assert!(
            !groupings.is_empty() && groupings.iter().all(|by| by.contains(&"family")),
            "split by family: {query}"
        );
    }
}

#[test]
fn the_dashboard_reads_each_familys_nat_table_on_its_own() {
    let queries = dashboard_queries();
    let reads_fullness = |q: &String| series(q).any(|(name, _)| NAT_FULLNESS.contains(&name));
    assert!(
        queries.iter().any(reads_fullness),
        "a panel shows how full the NAT tables are"
    );
    for query in &queries {
        assert_keeps_the_families_apart(query);
    }
}

#[test]
fn the_dashboard_shows_every_metric_and_no_other() {
    let queries = dashboard_queries();
    let shown: BTreeSet<&str> = queries
        .iter()
        .flat_map(|q| series(q).map(|(name, _)| name))
        .collect();
    assert_eq!(shown, BTreeSet::from(METRICS));
}

#[test]
fn every_dashboard_query_follows_the_node_variable() {
    let dashboard = dashboard();
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let node = variables
        .iter()
        .find(|v| v["name"] == "node")
        .expect("a node variable");
    assert_eq!(node["includeAll"], true);
    assert_eq!(node["multi"], true);
    for query in dashboard_queries() {
        for (name, selector) in series(&query) {
            assert!(
                selector.starts_with(r#"{node=~"$node""#),
                "{name} filtered by node in: {query}"
            );
        }
    }
}

/// The label names in the first `{...}` of `text`, a selector or an exposed series:
/// `metric{node=~"$node", mode="ebpf"}` -> node, mode.
fn matcher_labels(text: &str) -> Vec<String> {
    let Some((_, rest)) = text.split_once('{') else {
        return Vec::new();
    };
    let inside = rest.split_once('}').map_or(rest, |(inside, _)| inside);
    inside
        .split(',')
        .map(|matcher| matcher.split(['=', '!', '~']).next().unwrap().trim())
        .filter(|name| !name.is_empty())
        .map(String::from)
        .collect()
}

/// Every label the dashboard selects series on: its queries' matchers and its variables'
/// `label_values(metric, label)`.
fn labels_the_dashboard_selects_on() -> BTreeSet<String> {
    let mut labels = BTreeSet::new();
    for query in dashboard_queries() {
        for (_, selector) in series(&query) {
            labels.extend(matcher_labels(selector));
        }
    }
    for variable in dashboard()["templating"]["list"].as_array().unwrap() {
        let Some(query) = variable["query"]["query"].as_str() else {
            continue;
        };
        let Some(args) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
        else {
            continue;
        };
        let (metric, label) = args.split_once(',').expect("label_values(metric, label)");
        labels.extend(matcher_labels(metric));
        labels.insert(label.trim().to_string());
    }
    labels
}

/// The labels the agent itself puts on its series, as it exposes them after a sync.
fn agent_labels() -> BTreeSet<String> {
    use masq_agent::{dataplane::Mode, telemetry};
    let bpffs = tempfile::tempdir().unwrap();
    let metrics = telemetry::Telemetry::new(bpffs.path().join("ip-masq-agent"));
    metrics.mode(Mode::Ebpf);
    metrics.synced(telemetry::ReloadResult::Success, Some((4, 0)));
    let text = metrics.encode();
    let labels: BTreeSet<String> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .flat_map(matcher_labels)
        .collect();
    assert!(labels.contains("mode"), "{text}");
    labels
}

/// The one object the component `name` adds, a Prometheus Operator `kind`, with no patches.
fn prometheus_operator_object(name: &str, kind: &str) -> Value {
    assert!(component_kustomization(name)["patches"].is_null());
    let resources = component_resources(name);
    let [object] = resources.as_slice() else {
        panic!("one {kind}: {resources:?}");
    };
    assert_eq!(object["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(object["kind"], kind);
    object.clone()
}

/// The PodMonitor of components/podmonitor, checked field by field: the validator has no schema
/// for a Prometheus Operator CRD (xtask/src/manifests.rs), so this allows only the fields of
/// monitoring.coreos.com/v1 it needs, and checks that they point at the agent's pods and port.
fn pod_monitor() -> Value {
    let monitor = &prometheus_operator_object("podmonitor", "PodMonitor");
    let keys = |v: &Value| -> Vec<String> {
        v.as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap().to_string())
            .collect()
    };
    let known = |v: &Value, fields: &[&str]| {
        for key in keys(v) {
            assert!(fields.contains(&key.as_str()), "PodMonitor field {key}");
        }
    };
    known(monitor, &["apiVersion", "kind", "metadata", "spec"]);
    known(&monitor["spec"], &["selector", "podMetricsEndpoints"]);
    // Without a namespaceSelector, a PodMonitor selects pods in its own namespace.
    let ds = default_daemonset();
    assert_eq!(
        monitor["metadata"]["namespace"],
        ds["metadata"]["namespace"]
    );
    known(&monitor["spec"]["selector"], &["matchLabels"]);
    assert_eq!(monitor["spec"]["selector"], ds["spec"]["selector"]);
    let endpoints = monitor["spec"]["podMetricsEndpoints"]
        .as_sequence()
        .unwrap();
    assert_eq!(endpoints.len(), 1);
    let endpoint = &endpoints[0];
    known(endpoint, &["port", "path", "relabelings"]);
    // `port` names a container port; `path` is the one the scrape annotations give.
    find(
        &agent_container()["ports"],
        endpoint["port"].as_str().unwrap(),
    );
    assert_eq!(
        endpoint["path"],
        ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
    );
    for relabeling in endpoint["relabelings"].as_sequence().unwrap() {
        known(relabeling, &["action", "sourceLabels", "targetLabel"]);
    }
    monitor.clone()
}

/// Labels the PodMonitor's relabelings set from pod discovery's metadata, with their sources.
fn relabelled() -> Vec<(String, Vec<String>)> {
    pod_monitor()["spec"]["podMetricsEndpoints"][0]["relabelings"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "replace")
        .map(|r| {
            (
                r["targetLabel"].as_str().unwrap().to_string(),
                strings(&r["sourceLabels"]),
            )
        })
        .collect()
}

#[test]
fn every_label_the_dashboard_selects_on_is_produced_by_what_deploy_ships() {
    let selected = labels_the_dashboard_selects_on();
    assert!(selected.contains("node"), "{selected:?}");
    let agent = agent_labels();
    let relabelled = relabelled();
    for label in &selected {
        assert!(
            agent.contains(label) || relabelled.iter().any(|(target, _)| target == label),
            "the dashboard selects on {label}, which neither the agent {agent:?} nor the \
             PodMonitor {relabelled:?} produces"
        );
    }
    // The node is the pod's node, as Kubernetes pod discovery names it.
    assert!(
        relabelled
            .iter()
            .any(|(target, sources)| target == "node"
                && sources == &["__meta_kubernetes_pod_node_name"]),
        "{relabelled:?}"
    );
}

#[test]
fn dashboard_panels_have_unique_ids() {
    let dashboard = dashboard();
    let ids: Vec<u64> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_u64().expect("every panel has an id"))
        .collect();
    let unique: BTreeSet<&u64> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
}

#[test]
fn the_image_is_labelled_with_the_workspace_s_source_version_and_licence() {
    let dockerfile = read("Dockerfile");
    let runtime = &dockerfile[dockerfile.rfind("\nFROM ").unwrap()..];
    let arg = runtime
        .lines()
        .find_map(|l| l.strip_prefix("ARG VERSION="))
        .expect("ARG VERSION= in the runtime stage");
    assert_eq!(arg, env!("CARGO_PKG_VERSION"), "the workspace's version");
    let label = |key: &str| -> String {
        let at = runtime
            .find(&format!("org.opencontainers.image.{key}="))
            .unwrap_or_else(|| panic!("org.opencontainers.image.{key}"));
        let value = &runtime[at..].split_once("=\"").unwrap().1;
        value.split_once('"').unwrap().0.to_string()
    };
    assert_eq!(label("version"), "${VERSION}");
    // The workspace's `repository`, which this package does not inherit.
    let workspace = read("../Cargo.toml");
    let repository = workspace
        .lines()
        .find_map(|l| l.strip_prefix("repository = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("the workspace's repository");
    assert_eq!(label("source"), repository);
    assert_eq!(label("licenses"), env!("CARGO_PKG_LICENSE"));
    assert_eq!(label("title"), "masq-agent");
    assert!(!label("description").is_empty());
    // The chart's app is this version, and the manifests run its image.
    assert_eq!(manifest("helm/masq-agent/Chart.yaml")["appVersion"], arg);
    for file in ["daemonset.yaml", "uninstall.yaml"] {
        assert!(
            read(file).contains(&format!("image: masq-agent:{arg}")),
            "{file} runs masq-agent:{arg}"
        );
    }
    // And the licence the labels name is the one in the repository.
    let licence = read("../LICENSE");
    assert_eq!(env!("CARGO_PKG_LICENSE"), "Apache-2.0");
    assert!(licence.contains("Apache License") && licence.contains("Version 2.0, January 2004"));
}

/// The PrometheusRule of components/alerts: fields of monitoring.coreos.com/v1 it needs only
/// (the validator has no schema for it), in the agent's namespace, every alert explained, and
/// every query on a metric the agent exports, split by the node label the PodMonitor adds.
#[test]
fn the_alerts_watch_what_the_agent_exports_by_node() {
    let rule = &prometheus_operator_object("alerts", "PrometheusRule");
    assert_eq!(
        rule["metadata"]["namespace"],
        default_daemonset()["metadata"]["namespace"]
    );
    let exported: BTreeSet<&str> = METRICS
        .into_iter()
        .chain(["masq_agent_ebpf_counter_read_errors_total"])
        .collect();
    let mut alerts = BTreeSet::new();
    for group in rule["spec"]["groups"].as_sequence().unwrap() {
        for alert in group["rules"].as_sequence().unwrap() {
            let keys: BTreeSet<&str> = alert
                .as_mapping()
                .unwrap()
                .keys()
                .map(|k| k.as_str().unwrap())
                .collect();
            assert_eq!(
                keys,
                BTreeSet::from(["alert", "expr", "for", "labels", "annotations"]),
                "{alert:?}"
            );
            let expr = alert["expr"].as_str().unwrap();
            let named: Vec<&str> = series(expr).map(|(name, _)| name).collect();
            assert!(!named.is_empty(), "{expr}");
            for name in named {
                assert!(exported.contains(name), "{name} is not exported: {expr}");
            }
            let groupings = groupings(expr);
            assert!(
                !groupings.is_empty() && groupings.iter().all(|by| by.contains(&"node")),
                "split by node: {expr}"
            );
            assert_keeps_the_families_apart(expr);
            for annotation in ["summary", "description"] {
                assert!(alert["annotations"][annotation].is_string(), "{alert:?}");
            }
            alerts.insert(alert["alert"].as_str().unwrap().to_string());
        }
    }
    for wanted in [
        "MasqAgentNatTableNearlyFull",
        "MasqAgentNatTableRefusingFlows",
    ] {
        assert!(alerts.contains(wanted), "{wanted} in {alerts:?}");
    }
}
