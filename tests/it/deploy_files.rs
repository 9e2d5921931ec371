//! Every deployment file parses, and says what the service needs: the Kubernetes manifests,
//! the compose file, the systemd units, and the Grafana dashboard and Prometheus alert rules,
//! which use only metrics a real worker exports.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sendquota::config::Settings;
use sendquota::internals::telemetry::FAMILIES;
use serde_yaml::Value;

use crate::support::http::{http, wait_until_ready};
use crate::support::private::free_port;
use crate::support::process::Running;
use crate::support::{TempFile, TestEnv};

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut value: Value =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"));
    // Compose's `<<: *anchor`, merged as compose merges it.
    value
        .apply_merge()
        .unwrap_or_else(|e| panic!("{path}: merge keys: {e}"));
    value
}

/// The configmap's config.toml.
fn configmap_toml() -> String {
    let map = yaml("kubernetes/configmap.yaml");
    map["data"]["config.toml"]
        .as_str()
        .expect("config.toml")
        .to_owned()
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
    assert_eq!(
        found, 9,
        "two compose files (one clustered), five Kubernetes manifests, the alert rules and \
         their unit tests"
    );
}

#[test]
fn the_configmap_holds_a_valid_config_with_the_admin_api_on_the_probed_port() {
    let map = yaml("kubernetes/configmap.yaml");
    assert_eq!(map["kind"], "ConfigMap");
    let settings = Settings::from_toml(&configmap_toml(), |_| None).expect("the config is valid");
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
        "SENDQUOTA_AMQP_URLS",
        "SENDQUOTA_DATABASE_URL",
        "SENDQUOTA_DATABASE_READ_URL",
        "SENDQUOTA_ADMIN_TOKEN",
    ] {
        assert!(s["stringData"][key].is_string(), "{key}");
    }
    // SENDQUOTA_REDIS_URL would replace the configmap's cluster seeds.
    assert!(s["stringData"]["SENDQUOTA_REDIS_URL"].is_null());
    let env = string_map(&s["stringData"]);
    let settings = Settings::from_toml(&configmap_toml(), |k| env.get(k).cloned())
        .expect("the configmap's file with the secret's variables is valid");
    assert_eq!(settings.redis.cluster_urls.len(), 3);
    assert_ne!(settings.database.read_url, settings.database.url);
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

/// A YAML mapping of strings (an `environment:` or a Secret's `stringData`) as a map.
fn string_map(value: &Value) -> HashMap<String, String> {
    value
        .as_mapping()
        .expect("a mapping")
        .iter()
        .map(|(k, v)| {
            let k = k.as_str().expect("a string key").to_owned();
            let v = v
                .as_str()
                .unwrap_or_else(|| panic!("{k}: a string value"))
                .to_owned();
            (k, v)
        })
        .collect()
}

/// Whether the worker reads `var`: its settings with `var = value` differ from the defaults,
/// or the command line takes it (`SENDQUOTA_CONFIG`). A value the settings refuse fails.
fn read_by_the_worker(var: &str, value: &str) -> bool {
    use clap::CommandFactory;
    let by_cli = sendquota::cli::Cli::command()
        .get_arguments()
        .any(|a| a.get_env() == Some(std::ffi::OsStr::new(var)));
    let defaults = Settings::from_toml("", |_| None).expect("defaults");
    let set = Settings::from_toml("", |k| (k == var).then(|| value.to_owned()))
        .unwrap_or_else(|e| panic!("{var}={value} is refused: {e}"));
    by_cli || format!("{set:?}") != format!("{defaults:?}")
}

/// Every `SENDQUOTA_*` variable of `env` is one the worker reads.
fn assert_read_by_the_worker(file: &str, env: &HashMap<String, String>) {
    assert!(!env.is_empty(), "{file}");
    for (var, value) in env {
        assert!(var.starts_with("SENDQUOTA_"), "{file}: {var}");
        assert!(
            read_by_the_worker(var, value),
            "{file}: the worker does not read {var}"
        );
    }
}

#[test]
fn a_variable_the_worker_does_not_read_is_found() {
    assert!(!read_by_the_worker(
        "SENDQUOTA_DATABASE_READ_ULR",
        "postgres://h/db"
    ));
    assert!(read_by_the_worker(
        "SENDQUOTA_DATABASE_READ_URL",
        "postgres://h/db"
    ));
    assert!(read_by_the_worker(
        "SENDQUOTA_CONFIG",
        "/etc/sendquota/config.toml"
    ));
}

#[test]
fn every_variable_the_deploy_files_set_is_one_the_worker_reads() {
    let secret = yaml("kubernetes/secret.yaml");
    assert_read_by_the_worker("kubernetes/secret.yaml", &string_map(&secret["stringData"]));
    for file in ["docker-compose.yml", "cluster/docker-compose.yml"] {
        let compose = yaml(file);
        for (name, service) in compose["services"].as_mapping().expect("services") {
            let env = &service["environment"];
            let command = command_text(&service["command"]);
            if command.contains("sendquota") {
                assert_read_by_the_worker(&format!("{file} {name:?}"), &string_map(env));
            }
        }
    }
}

/// A compose `command` (a list of words, or one string) as one line, words a space apart.
fn command_text(command: &Value) -> String {
    match command.as_sequence() {
        Some(words) => words
            .iter()
            .map(|w| w.as_str().expect("a word"))
            .collect::<Vec<_>>()
            .join(" "),
        None => command.as_str().unwrap_or_default().to_owned(),
    }
}

/// The hosts of a comma-separated list of URLs (`scheme://[user@]host:port/...`).
fn hosts(urls: &str) -> Vec<String> {
    urls.split(',')
        .map(|u| {
            let rest = u.trim().split_once("://").expect("a URL").1;
            let authority = rest.split('/').next().unwrap_or(rest);
            let host_port = authority.rsplit('@').next().unwrap_or(authority);
            host_port.split(':').next().unwrap_or(host_port).to_owned()
        })
        .collect()
}

/// The clustered compose file's services whose command runs `sendquota worker`, with their
/// environment.
fn cluster_workers(compose: &Value) -> Vec<HashMap<String, String>> {
    compose["services"]
        .as_mapping()
        .expect("services")
        .values()
        .filter(|s| s["command"] == Value::from(vec!["sendquota", "worker"]))
        .map(|s| string_map(&s["environment"]))
        .collect()
}

#[test]
fn the_clustered_compose_file_runs_three_broker_nodes_a_redis_cluster_a_replica_and_two_workers() {
    let compose = yaml("cluster/docker-compose.yml");
    let services = &compose["services"];
    let rabbit = ["rabbitmq-1", "rabbitmq-2", "rabbitmq-3"];
    let cookies: BTreeSet<&str> = rabbit
        .iter()
        .map(|n| {
            assert_eq!(services[n]["hostname"], Value::from(*n));
            services[n]["environment"]["RABBITMQ_ERLANG_COOKIE"]
                .as_str()
                .expect("a cookie")
        })
        .collect();
    assert_eq!(cookies.len(), 1, "one Erlang cookie: {cookies:?}");
    let conf = std::fs::read_to_string(deploy("cluster/rabbitmq.conf")).expect("rabbitmq.conf");
    for (i, n) in rabbit.iter().enumerate() {
        let line = format!(
            "cluster_formation.classic_config.nodes.{} = rabbit@{n}",
            i + 1
        );
        assert!(conf.lines().any(|l| l == line), "{line}");
    }
    assert!(conf.lines().any(|l| l == "default_queue_type = quorum"));
    let plugins = std::fs::read_to_string(deploy("cluster/enabled_plugins")).expect("plugins");
    assert!(
        plugins.contains("rabbitmq_consistent_hash_exchange"),
        "{plugins}"
    );

    for n in 1..=6 {
        let command = command_text(&services[format!("redis-{n}").as_str()]["command"]);
        assert!(
            command.contains(" --cluster-enabled yes "),
            "redis-{n}: {command}"
        );
    }
    let create = command_text(&services["redis-cluster-create"]["command"]);
    for part in [
        "redis-cli --cluster create",
        "for n in 1 2 3 4 5 6",
        "--cluster-replicas 1",
    ] {
        assert!(create.contains(part), "{part}: {create}");
    }
    let replica = command_text(&services["postgres-replica"]["command"]);
    for part in [
        "pg_basebackup -h postgres-primary",
        " -R ",
        "-X stream",
        "-S replica1",
    ] {
        assert!(replica.contains(part), "{part}: {replica}");
    }

    let workers = cluster_workers(&compose);
    assert!(workers.len() >= 2, "{} workers", workers.len());
    let config = std::fs::read_to_string(deploy("cluster/config.toml")).expect("config.toml");
    for env in &workers {
        assert_eq!(hosts(&env["SENDQUOTA_AMQP_URLS"]), rabbit);
        let seeds = hosts(&env["SENDQUOTA_REDIS_CLUSTER_URLS"]);
        assert!(seeds.len() >= 3, "{seeds:?}");
        assert!(
            seeds.iter().all(|s| services[s.as_str()].is_mapping()),
            "{seeds:?}"
        );
        assert_eq!(hosts(&env["SENDQUOTA_DATABASE_URL"]), ["postgres-primary"]);
        assert_eq!(
            hosts(&env["SENDQUOTA_DATABASE_READ_URL"]),
            ["postgres-replica"]
        );
        let settings = Settings::from_toml(&config, |k| env.get(k).cloned())
            .expect("the workers' file with their variables is valid");
        assert_eq!(settings.redis.cluster_urls.len(), seeds.len());
        assert_eq!(settings.admin.listen, "0.0.0.0:9090");
    }
}

#[test]
fn the_workers_run_several_replicas_spread_over_nodes_under_a_disruption_budget() {
    let d = yaml("kubernetes/worker-deployment.yaml");
    let replicas = d["spec"]["replicas"].as_u64().expect("replicas");
    assert!(replicas >= 2, "{replicas}");
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    let spread = &d["spec"]["template"]["spec"]["topologySpreadConstraints"][0];
    assert_eq!(spread["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(&spread["labelSelector"]["matchLabels"], labels);
    let pdb = yaml("kubernetes/worker-pdb.yaml");
    assert_eq!(
        (pdb["apiVersion"].as_str(), pdb["kind"].as_str()),
        (Some("policy/v1"), Some("PodDisruptionBudget"))
    );
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);
    let unavailable = pdb["spec"]["maxUnavailable"]
        .as_u64()
        .expect("maxUnavailable");
    assert!(
        (1..replicas).contains(&unavailable),
        "{unavailable} of {replicas}"
    );
}

/// Metrics the dashboard and the alert rules may use that the worker does not export, and
/// where they come from.
const EXTERNAL_METRICS: [(&str, &str); 2] = [
    ("up", "Prometheus itself: whether each scrape succeeded"),
    (
        "rabbitmq_queue_messages_ready",
        "RabbitMQ's rabbitmq_prometheus plugin, documented in alerts.yml",
    ),
];

/// Runs promtool in deploy/prometheus, or fails saying how to install it.
fn promtool(args: &[&str]) -> std::process::Output {
    std::process::Command::new("promtool")
        .args(args)
        .current_dir(deploy("prometheus"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "promtool cannot run ({e}): install it with deploy/local/tools.sh (Debian's \
                 prometheus package; deploy/local/test.sh does this itself)"
            )
        })
}

fn assert_promtool(args: &[&str]) {
    let out = promtool(args);
    assert!(
        out.status.success(),
        "promtool {}:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The expression of every alert rule.
fn alert_expressions() -> Vec<String> {
    let rules = yaml("prometheus/alerts.yml");
    let groups = rules["groups"].as_sequence().expect("groups");
    groups
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("rules"))
        .map(|r| r["expr"].as_str().expect("expr").to_owned())
        .collect()
}

/// The dashboard.
fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(deploy("grafana/sendquota.json")).expect("dashboard");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every query of every panel (rows' panels included) of the dashboard.
fn dashboard_queries() -> Vec<String> {
    let dashboard = dashboard();
    let mut panels: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .collect();
    let mut queries = Vec::new();
    while let Some(panel) = panels.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            panels.extend(nested);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().expect("a PromQL expr").to_owned());
        }
    }
    queries
}

/// The metrics the dashboard's variables list values of (`label_values(metric, label)`).
fn dashboard_variable_metrics() -> Vec<String> {
    let dashboard = dashboard();
    dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .filter_map(|v| v["definition"].as_str())
        .map(|d| {
            let args = d
                .strip_prefix("label_values(")
                .expect("label_values(metric, label)");
            args.split(',').next().expect("a metric").trim().to_owned()
        })
        .collect()
}

/// The metric names a PromQL expression selects: what is left once strings, label matchers,
/// ranges, grouping labels, function names, keywords and numbers are taken out.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut bare = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        let close = match c {
            '"' | '\'' | '`' => c,
            '{' => '}',
            '[' => ']',
            _ => {
                bare.push(c);
                continue;
            }
        };
        while let Some(inner) = chars.next() {
            if inner == '\\' && close != '`' {
                chars.next();
            } else if inner == close {
                break;
            }
        }
        bare.push(' ');
    }
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const KEYWORDS: [&str; 7] = ["and", "or", "unless", "bool", "offset", "inf", "nan"];
    let mut names = BTreeSet::new();
    let mut rest = bare.as_str();
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
        rest = &rest[start..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | ':' | '.')))
            .unwrap_or(rest.len());
        let (word, after) = rest.split_at(end);
        let after = after.trim_start();
        rest = after;
        if GROUPING.contains(&word) {
            // Its label list, if any, is not metrics.
            if let Some(list) = after.strip_prefix('(') {
                rest = list.split_once(')').map_or("", |(_, r)| r);
            }
        } else if word.starts_with(|c: char| c.is_ascii_digit() || c == '.')
            || KEYWORDS.contains(&word.to_ascii_lowercase().as_str())
            || after.starts_with('(')
            || ["by", "without"].iter().any(|g| {
                after
                    .strip_prefix(g)
                    .is_some_and(|r| r.starts_with([' ', '(']))
            })
        {
            // A number or duration, a keyword, or a function (`sum by (x) (...)` too).
        } else {
            names.insert(word.to_owned());
        }
    }
    names
}

#[test]
fn metric_names_are_found_in_promql_and_nothing_else() {
    let expr = r#"sum by (le) (rate(a_seconds_bucket{instance=~"$i",x="b_total"}[5m])) /
        ignoring(kind) group_left sum(c_total offset 1h) > 0.5 and on () d:rule unless e"#;
    let names: Vec<String> = metric_names(expr).into_iter().collect();
    assert_eq!(names, ["a_seconds_bucket", "c_total", "d:rule", "e"]);
}

#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    assert_promtool(&["check", "rules", "alerts.yml"]);
    // Each alert fires on the failure it names and stays quiet on a healthy worker.
    assert_promtool(&["test", "rules", "alerts.test.yml"]);
    let text = std::fs::read_to_string(deploy("prometheus/alerts.yml")).expect("alerts.yml");
    for alert in [
        "SendquotaWorkerDown",
        "SendquotaWorkerNotReady",
        "SendquotaDecisionsStalled",
        "SendquotaDenialWritesFailing",
        "SendquotaQuarantineGrowing",
        "SendquotaClockSkew",
        "SendquotaRequestsNotConsumed",
    ] {
        assert!(text.contains(&format!("- alert: {alert}\n")), "{alert}");
    }
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    // promtool checks expressions in rule files: each query becomes a recording rule, Grafana's
    // variables replaced as Grafana would.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let queries = dashboard_queries();
    assert!(queries.len() >= 10, "{queries:?}");
    for (i, query) in queries.iter().enumerate() {
        let expr = query
            .replace("$__rate_interval", "5m")
            .replace("$instance", ".*")
            .replace("$outcome", ".*");
        assert!(!expr.contains('$'), "an unknown variable in {query}");
        let quoted = serde_json::to_string(&expr).expect("a JSON string is a YAML scalar");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {quoted}\n"
        ));
    }
    let file = TempFile::new(&rules);
    assert_promtool(&["check", "rules", file.path()]);
}

/// A real worker, with the admin API, that handled an allowed, a denied and an invalid
/// message: what its `/metrics` shows, each family's name (a histogram's with `_bucket`,
/// `_sum` and `_count`) and each sample's.
async fn names_a_real_worker_exports() -> (BTreeSet<String>, String) {
    let env = TestEnv::new().await;
    let port = free_port();
    let mut cmd = env.cli(&["worker", "--now", "2026-02-02T09:00:00Z"]);
    cmd.env("SENDQUOTA_ADMIN_LISTEN", format!("127.0.0.1:{port}"));
    let worker = Running::spawn(cmd);
    wait_until_ready(port).await;
    env.publish_allowed_denied_invalid().await;
    let invalid_counted = "sendquota_invalid_messages_total 1";
    let mut metrics = String::new();
    for _ in 0..250 {
        metrics = http(port, "GET", "/metrics", None, "").await.body;
        if metrics.lines().any(|l| l == invalid_counted) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(worker);
    let mut names = BTreeSet::new();
    for line in metrics.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let (name, kind) = declared.split_once(' ').expect("# TYPE name kind");
            names.insert(name.to_owned());
            if kind == "histogram" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_owned());
        }
    }
    (names, metrics)
}

#[tokio::test]
async fn every_metric_the_dashboard_and_the_alert_rules_use_is_one_a_real_worker_exports() {
    let (exported, metrics) = names_a_real_worker_exports().await;
    for family in FAMILIES {
        assert!(
            exported.contains(family.name),
            "the worker does not export {} in\n{metrics}",
            family.name
        );
    }
    let alerts = alert_expressions();
    let queries = dashboard_queries();
    let used: BTreeSet<String> = alerts
        .iter()
        .chain(&queries)
        .flat_map(|e| metric_names(e))
        .chain(dashboard_variable_metrics())
        .collect();
    assert!(
        used.contains("sendquota_decisions_total") && used.contains("sendquota_ready"),
        "{used:?}"
    );
    let unknown: Vec<&String> = used
        .iter()
        .filter(|n| !exported.contains(*n))
        .filter(|n| !EXTERNAL_METRICS.iter().any(|(external, _)| external == n))
        .collect();
    assert!(
        unknown.is_empty(),
        "used but not exported by the worker: {unknown:?}\n{metrics}"
    );
    let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml")).expect("alerts.yml");
    assert!(
        rules.contains("rabbitmq_prometheus"),
        "the RabbitMQ metric's source is documented"
    );
}
