//! Every deployment file parses, and says what the service needs: the Kubernetes manifests,
//! the compose file and the systemd units.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sendquota::config::Settings;
use serde_yaml::Value;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"))
}

/// A systemd unit as section -> key -> values (keys may repeat).
fn unit(path: &str) -> HashMap<String, HashMap<String, Vec<String>>> {
    let text = std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut sections: HashMap<String, HashMap<String, Vec<String>>> = HashMap::new();
    let mut current = None;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = Some(name.to_owned());
            sections.entry(name.to_owned()).or_default();
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("{path}:{}: not key=value: {line}", n + 1));
        let section = current
            .clone()
            .unwrap_or_else(|| panic!("{path}:{}: key outside a section", n + 1));
        sections
            .entry(section)
            .or_default()
            .entry(key.trim().to_owned())
            .or_default()
            .push(value.trim().to_owned());
    }
    sections
}

fn container(spec: &Value) -> &Value {
    &spec["containers"][0]
}

#[test]
fn every_yaml_file_under_deploy_parses() {
    let mut found = 0;
    let mut stack = vec![deploy("")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("deploy dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                let text = std::fs::read_to_string(&path).expect("read");
                let _: Value = serde_yaml::from_str(&text)
                    .unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()));
                found += 1;
            }
        }
    }
    assert_eq!(found, 5, "compose file and four Kubernetes manifests");
}

#[test]
fn the_configmap_holds_a_valid_config_with_the_admin_api_on_the_probed_port() {
    let map = yaml("kubernetes/configmap.yaml");
    assert_eq!(map["kind"], "ConfigMap");
    let toml = map["data"]["config.toml"].as_str().expect("config.toml");
    let settings = Settings::from_toml(toml, |_| None).expect("the config is valid");
    assert_eq!(settings.admin.listen, "0.0.0.0:9090");
    assert_eq!(settings.policy.rules[0].name, "headline");
}

#[test]
fn the_worker_deployment_probes_health_and_readiness_and_migrates_first() {
    let d = yaml("kubernetes/worker-deployment.yaml");
    assert_eq!(
        (d["apiVersion"].as_str(), d["kind"].as_str()),
        (Some("apps/v1"), Some("Deployment"))
    );
    let spec = &d["spec"]["template"]["spec"];
    let worker = container(spec);
    assert_eq!(worker["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(worker["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(worker["ports"][0]["containerPort"], 9090);
    assert_eq!(
        worker["args"].as_sequence().and_then(|a| a.last()),
        Some(&Value::from("worker"))
    );
    assert_eq!(
        worker["envFrom"][0]["secretRef"]["name"],
        "sendquota-secrets"
    );
    let init = &spec["initContainers"][0];
    assert_eq!(
        init["args"].as_sequence().and_then(|a| a.last()),
        Some(&Value::from("migrate"))
    );
    // The grace period outlasts the worker's own shutdown timeout.
    let map = yaml("kubernetes/configmap.yaml");
    let settings =
        Settings::from_toml(map["data"]["config.toml"].as_str().unwrap(), |_| None).expect("valid");
    let grace = spec["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace period");
    assert!(grace * 1000 > settings.worker.shutdown_timeout_ms);
}

#[test]
fn the_secret_carries_every_connection_url_and_the_admin_token() {
    let s = yaml("kubernetes/secret.yaml");
    assert_eq!(s["kind"], "Secret");
    for key in [
        "SENDQUOTA_REDIS_URL",
        "SENDQUOTA_AMQP_URL",
        "SENDQUOTA_DATABASE_URL",
        "SENDQUOTA_ADMIN_TOKEN",
    ] {
        assert!(s["stringData"][key].is_string(), "{key}");
    }
}

#[test]
fn the_replay_cronjob_replays_due_denials_at_a_bounded_rate() {
    let c = yaml("kubernetes/replay-cronjob.yaml");
    assert_eq!(
        (c["apiVersion"].as_str(), c["kind"].as_str()),
        (Some("batch/v1"), Some("CronJob"))
    );
    let args: Vec<&str> = container(&c["spec"]["jobTemplate"]["spec"]["template"]["spec"])["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        args.windows(2).any(|w| w == ["replay", "--due"]),
        "{args:?}"
    );
    assert!(args.contains(&"--rate"), "{args:?}");
}

#[test]
fn the_compose_file_runs_the_three_services_and_the_worker() {
    let c = yaml("docker-compose.yml");
    for service in ["redis", "rabbitmq", "postgres", "worker"] {
        assert!(c["services"][service].is_mapping(), "{service}");
    }
    assert!(deploy("Dockerfile").exists());
    // The broker's message size limit bounds the worker's memory for bodies.
    let mount = c["services"]["rabbitmq"]["volumes"][0]
        .as_str()
        .expect("the rabbitmq config is mounted");
    assert!(mount.starts_with("./rabbitmq/rabbitmq.conf:"), "{mount}");
    let conf = std::fs::read_to_string(deploy("rabbitmq/rabbitmq.conf")).expect("rabbitmq.conf");
    assert!(
        conf.lines()
            .any(|l| l.trim() == "max_message_size = 131072"),
        "{conf}"
    );
}

#[test]
fn the_systemd_units_run_the_worker_and_a_timed_replay() {
    let worker = unit("systemd/sendquota-worker.service");
    let exec = &worker["Service"]["ExecStart"][0];
    assert!(exec.ends_with(" worker"), "{exec}");
    assert_eq!(worker["Service"]["Restart"], ["always"]);
    assert_eq!(worker["Install"]["WantedBy"], ["multi-user.target"]);
    let replay = unit("systemd/sendquota-replay.service");
    assert_eq!(replay["Service"]["Type"], ["oneshot"]);
    assert!(replay["Service"]["ExecStart"][0].contains(" replay --due "));
    let timer = unit("systemd/sendquota-replay.timer");
    assert_eq!(timer["Timer"]["Unit"], ["sendquota-replay.service"]);
    assert_eq!(timer["Timer"]["OnCalendar"], ["*:0/15"]);
}
