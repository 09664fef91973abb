//! A node as the docs describe it: the namespace topology with masq-agent running on the eBPF
//! data plane, flows in its NAT table, and metrics on 127.0.0.1:9830. Commands written for an
//! operator run in its node namespace, with the operator's default paths replaced by the bed's.

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Output, Stdio},
    time::{Duration, Instant},
};

use masq_testbed::{
    probe::{self, Observer},
    topology::{self, Process, Topology},
    wait_for, write_config,
};

pub const AGENT: &str = "masq-agent";
/// Where an operator finds the pins and the config file; the bed has its own.
const DEFAULT_BPFFS: &str = "/sys/fs/bpf/ip-masq-agent";
const DEFAULT_CONFIG: &str = "/etc/config/ip-masq-agent";
pub const METRICS_ADDR: &str = "127.0.0.1:9830";
pub const HEALTH_ADDR: &str = "127.0.0.1:9831";
const SERVER_PORT: u16 = 8080;
/// The pod's UDP flow keeps this source port, so that refreshing it adds no flows.
const POD_UDP_PORT: u16 = 40000;
/// Longer than any documented command takes; a command still running then is a failure.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Fields drop in order: the agent and the server stop before their namespaces go.
pub struct Bed {
    pub agent: Process,
    /// Kept running for the pod's probes.
    _server: Observer,
    config: PathBuf,
    pub topo: Topology,
}

impl Bed {
    /// The topology, with the agent started as the DaemonSet starts it (JSON logs, metrics)
    /// and traffic through it.
    pub fn start() -> Bed {
        let topo = Topology::new(1).expect("topology");
        let server = Observer::start(&topo.ext, &topology::EXT_ADDRS, SERVER_PORT).unwrap();
        let config_dir = topo.path("config");
        std::fs::create_dir_all(&config_dir).unwrap();
        let config = config_dir.join("ip-masq-agent");
        // The example ConfigMap's, as an operator who installs deploy/ gets it.
        write_config(&config, &masq_testbed::deploy::example_config()).unwrap();
        let args = [
            format!("--config={}", config.display()),
            format!("--bpffs={}", topo.bpffs.display()),
            format!("--metrics-addr={METRICS_ADDR}"),
            format!("--health-addr={HEALTH_ADDR}"),
            "--log-format=json".to_string(),
            // The docs describe the eBPF data plane: a fallback must fail the test.
            "--fallback-to-iptables=false".to_string(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let agent = topo
            .spawn_in_node(&agent_binary(), &args, &[], "agent.log")
            .expect("start the agent");
        wait_for(|| Ok(agent.log_text().contains("policy applied")))
            .unwrap_or_else(|e| panic!("the agent never synced: {e}\n{}", agent.log_text()));
        let bed = Bed {
            agent,
            _server: server,
            config,
            topo,
        };
        let outside = SocketAddr::from((topology::EXT_ADDR, SERVER_PORT));
        let seen = probe::tcp_probe(bed.pod(), outside, 0).unwrap();
        assert_eq!(seen.ip(), topology::NODE_UPLINK, "the bed masquerades");
        bed.refresh_flows();
        // As on a node past its agent's first second: no flow outlived the policy.
        let status = [AGENT, "status", "--json"].map(String::from);
        wait_for(|| {
            let out = bed.run(&status);
            let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            Ok(json["ebpf"]["strays_cleared"] == true)
        })
        .expect("the agent checked its flows against the policy");
        bed
    }

    fn pod(&self) -> &str {
        &self.topo.pods[0]
    }

    /// Sends on the pod's UDP flow, so that the NAT table holds it whenever a command looks.
    pub fn refresh_flows(&self) {
        let outside = SocketAddr::from((topology::EXT_ADDR, SERVER_PORT));
        let seen = probe::udp_probe(self.pod(), outside, POD_UDP_PORT).unwrap();
        assert_eq!(
            seen.ip(),
            topology::NODE_UPLINK,
            "the pod's UDP is masqueraded"
        );
    }

    /// `word` with the operator's default paths replaced by the bed's.
    pub fn localize(&self, word: &str) -> String {
        word.replace(DEFAULT_BPFFS, &self.topo.bpffs.to_string_lossy())
            .replace(DEFAULT_CONFIG, &self.config.to_string_lossy())
    }

    /// `text` (a command's output) with the bed's paths shown as the operator's defaults.
    pub fn generalize(&self, text: &str) -> String {
        text.replace(&*self.topo.bpffs.to_string_lossy(), DEFAULT_BPFFS)
            .replace(&*self.config.to_string_lossy(), DEFAULT_CONFIG)
    }

    /// Runs an operator's command in the node namespace. The agent's subcommands get the
    /// bed's `--bpffs` and `--config` unless the command names its own (already localized).
    pub fn run(&self, words: &[String]) -> Output {
        let mut args: Vec<String> = words[1..].iter().map(|w| self.localize(w)).collect();
        let program = if words[0] == AGENT {
            for (flag, value) in [("--bpffs", &self.topo.bpffs), ("--config", &self.config)] {
                if !args.iter().any(|a| a.starts_with(flag)) {
                    args.push(format!("{flag}={}", value.display()));
                }
            }
            agent_binary().to_string_lossy().into_owned()
        } else {
            words[0].clone()
        };
        // Files rather than pipes: a command never blocks on output nobody reads yet.
        let (stdout, stderr) = (self.topo.path("command.out"), self.topo.path("command.err"));
        let mut child = self
            .topo
            .node_command(&program)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program}: {e}"));
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > COMMAND_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{} did not finish within {COMMAND_TIMEOUT:?}",
                    words.join(" ")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Output {
            status,
            stdout: std::fs::read(stdout).unwrap(),
            stderr: std::fs::read(stderr).unwrap(),
        }
    }
}

pub fn agent_binary() -> std::path::PathBuf {
    masq_testbed::agent_binary()
}
