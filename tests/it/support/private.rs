//! Private Redis, PostgreSQL and RabbitMQ servers on free ports, owned by one test: started,
//! restarted and stopped at will (the shared services are never touched), removed on drop.
//! Each fails with the way to install the server when its binary is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian installs the PostgreSQL server binaries.
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(super::unique(name));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| {
        panic!("{what}: cannot run: {e}; install the server with deploy/local/services.sh")
    });
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn wait_for_port(port: u16, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on {port} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn chown(dir: &PathBuf, user: &str) {
    run(
        Command::new("chown")
            .args(["-R", &format!("{user}:{user}")])
            .arg(dir),
        "chown",
    );
}

/// A private redis-server with an fsync-always append-only file, so a restart keeps every
/// acknowledged write (as a quota store in production should).
pub struct PrivateRedis {
    pub port: u16,
    dir: PathBuf,
    /// Arguments besides the usual ones (a cluster node's), kept for a restart.
    extra: Vec<String>,
}

impl PrivateRedis {
    pub fn start() -> PrivateRedis {
        PrivateRedis::start_with(Vec::new())
    }

    /// A server replicating `master`, returned once its link to the master is up and it holds
    /// the master's data.
    pub fn start_replica_of(master: &PrivateRedis) -> PrivateRedis {
        let replica = PrivateRedis::start_with(vec![
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            master.port.to_string(),
            "--repl-diskless-sync-delay".to_owned(),
            "0".to_owned(),
        ]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !replica
            .info("replication")
            .contains("master_link_status:up")
        {
            assert!(
                Instant::now() < deadline,
                "replica on {} did not link to its master",
                replica.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        replica
    }

    /// `INFO <section>` as text.
    pub fn info(&self, section: &str) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "info", section])
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn start_with(extra: Vec<String>) -> PrivateRedis {
        let redis = PrivateRedis {
            port: free_port(),
            dir: scratch("sqredis"),
            extra,
        };
        redis.launch();
        redis
    }

    fn launch(&self) {
        run(
            Command::new("redis-server")
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                .args([
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                ])
                .args(["--daemonize", "yes", "--dir"])
                .arg(&self.dir)
                .arg("--logfile")
                .arg(self.dir.join("redis.log"))
                .args(&self.extra),
            "redis-server",
        );
        wait_for_port(self.port, Duration::from_secs(10), "redis-server");
        // Listening is not serving: while it reads its append-only file back it answers every
        // command with LOADING, which a test would take for the outage it just ended.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.answers_ping() {
            assert!(
                Instant::now() < deadline,
                "redis-server on {} did not finish loading",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn answers_ping(&self) -> bool {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "ping"])
            .output()
            .is_ok_and(|out| out.stdout.starts_with(b"PONG"))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops the server (it writes its append-only file) and starts it again.
    pub fn restart(&self) {
        self.stop();
        self.start_again();
    }

    /// Stops the server (it writes its append-only file) and waits until its port is closed.
    pub fn stop(&self) {
        let _ = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "shutdown"])
            .output();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(Instant::now() < deadline, "redis did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts a server stopped with [`PrivateRedis::stop`] again, on the same port and files.
    pub fn start_again(&self) {
        self.launch();
    }

    /// Kills the server with SIGKILL: a machine lost, nothing written on the way out.
    pub fn kill(&self) {
        let text = self.info("server");
        let pid = text
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .expect("the server's process id")
            .trim()
            .to_owned();
        run(Command::new("kill").args(["-9", &pid]), "kill -9");
    }

    /// What `ROLE` says this server is: `master` or `slave`.
    pub fn role(&self) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "role"])
            .output()
            .expect("redis-cli");
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines().next().unwrap_or_default().trim().to_owned()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "shutdown", "nosave"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private Redis Cluster of three masters, whose nodes a test stops and starts again. Without
/// replicas ([`PrivateRedisCluster::start`]) a stopped master's slots have no server, the
/// others keep serving theirs (the node timeout is long enough that none is declared failed
/// meanwhile); with one replica each ([`PrivateRedisCluster::start_with_replicas`]) a lost
/// master's replica takes over within about 2 s.
pub struct PrivateRedisCluster {
    /// The masters first, then their replicas.
    pub nodes: Vec<PrivateRedis>,
}

impl PrivateRedisCluster {
    pub fn start() -> PrivateRedisCluster {
        PrivateRedisCluster::start_with(0, 120_000)
    }

    /// Three masters with a replica each, failing over after a 1 s node timeout.
    pub fn start_with_replicas() -> PrivateRedisCluster {
        PrivateRedisCluster::start_with(1, 1_000)
    }

    fn start_with(replicas: usize, node_timeout_ms: u64) -> PrivateRedisCluster {
        let nodes: Vec<PrivateRedis> = (0..3 * (1 + replicas))
            .map(|_| {
                PrivateRedis::start_with(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-node-timeout",
                        &node_timeout_ms.to_string(),
                        // The default bus port (port + 10000) may be taken or beyond 65535.
                        "--cluster-port",
                        &free_port().to_string(),
                        // A replica copies its master at once (the default waits 5 s).
                        "--repl-diskless-sync-delay",
                        "0",
                    ]
                    .map(String::from)
                    .to_vec(),
                )
            })
            .collect();
        let cluster = PrivateRedisCluster { nodes };
        run(
            Command::new("redis-cli")
                .arg("--cluster")
                .arg("create")
                .args(
                    cluster
                        .nodes
                        .iter()
                        .map(|n| format!("127.0.0.1:{}", n.port)),
                )
                .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]),
            "redis-cli --cluster create",
        );
        cluster.wait_ok();
        cluster.wait_replicas_linked();
        cluster
    }

    /// Waits until every replica's link to its master is up.
    fn wait_replicas_linked(&self) {
        let replicas: Vec<&PrivateRedis> =
            self.nodes.iter().filter(|n| n.role() == "slave").collect();
        wait_until_said(&replicas, &["info", "replication"], "master_link_status:up");
    }

    /// The replica of the master on `port`.
    pub fn replica_of(&self, master: &PrivateRedis) -> &PrivateRedis {
        self.nodes
            .iter()
            .find(|n| {
                let out = Command::new("redis-cli")
                    .args(["-p", &n.port.to_string(), "role"])
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                let mut lines = out.lines();
                lines.next() == Some("slave") && lines.nth(1) == Some(&master.port.to_string())
            })
            .expect("a replica of the master")
    }

    /// The seed URLs, one a node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(PrivateRedis::url).collect()
    }

    /// Waits until every running node says the cluster is ok (every slot served).
    pub fn wait_ok(&self) {
        let all: Vec<&PrivateRedis> = self.nodes.iter().collect();
        wait_until_said(&all, &["cluster", "info"], "cluster_state:ok");
    }

    /// The node serving `key`'s slot.
    pub fn owner(&self, key: &str) -> &PrivateRedis {
        let cli = |port: u16, args: &[&str]| {
            let out = Command::new("redis-cli")
                .arg("-p")
                .arg(port.to_string())
                .args(args)
                .output()
                .expect("redis-cli");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let slot: u16 = cli(self.nodes[0].port, &["cluster", "keyslot", key])
            .trim()
            .parse()
            .expect("a slot number");
        self.nodes
            .iter()
            .find(|node| {
                let nodes = cli(node.port, &["cluster", "nodes"]);
                let myself = nodes
                    .lines()
                    .find(|l| l.contains("myself"))
                    .expect("the node's own line");
                // Fields 9 and on are its slots: "0-5460", or one slot alone.
                myself.split_whitespace().skip(8).any(|range| {
                    let (from, to) = range.split_once('-').unwrap_or((range, range));
                    matches!((from.parse::<u16>(), to.parse::<u16>()),
                        (Ok(from), Ok(to)) if (from..=to).contains(&slot))
                })
            })
            .expect("a node serves every slot")
    }
}

/// Waits (up to 20 s) until `redis-cli <args>` on each of `nodes` prints `said`.
fn wait_until_said(nodes: &[&PrivateRedis], args: &[&str], said: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    for node in nodes {
        loop {
            let out = Command::new("redis-cli")
                .arg("-p")
                .arg(node.port.to_string())
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            if out.contains(said) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "redis-cli {args:?} on {} did not say {said}",
                node.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A private PostgreSQL cluster (initdb as the postgres user, which the server requires).
pub struct PrivatePostgres {
    pub port: u16,
    dir: PathBuf,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        let pg = PrivatePostgres {
            port: free_port(),
            dir: scratch("sqpg"),
        };
        chown(&pg.dir, "postgres");
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--", &format!("{PG_BIN}/initdb")])
                .arg("-D")
                .arg(pg.dir.join("data"))
                .args(["-A", "trust", "-U", "postgres", "--no-sync"]),
            "initdb",
        );
        pg.ctl("start");
        pg
    }

    fn ctl(&self, action: &str) {
        pg_ctl(&self.dir, self.port, action);
    }

    /// The URL of database `name`.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// A fast shutdown (open connections are cut) and a start.
    pub fn restart(&self) {
        self.stop();
        self.start_again();
    }

    /// A fast shutdown (open connections are cut); the port stays closed until
    /// [`PrivatePostgres::start_again`].
    pub fn stop(&self) {
        pg_stop(&self.dir, "fast");
    }

    /// Starts a cluster stopped with [`PrivatePostgres::stop`] again, on the same port.
    pub fn start_again(&self) {
        self.ctl("start");
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        pg_stop_quietly(&self.dir);
    }
}

/// A PostgreSQL binary run as the postgres user (the server refuses root).
fn as_postgres(binary: &str) -> Command {
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", "postgres", "--", &format!("{PG_BIN}/{binary}")]);
    cmd
}

/// `pg_ctl <action>` (start, restart) on the cluster in `dir`/data, listening on `port` on
/// 127.0.0.1 only, its sockets in `dir` (never the shared /var/run/postgresql), its log in
/// `dir`/postgres.log; waits for the port.
fn pg_ctl(dir: &Path, port: u16, action: &str) {
    let options = format!(
        "-p {port} -k {} -c listen_addresses=127.0.0.1",
        dir.display()
    );
    run(
        as_postgres("pg_ctl")
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-m", "fast", "-w", "-o", &options, "-l"])
            .arg(dir.join("postgres.log"))
            .arg(action),
        "pg_ctl",
    );
    wait_for_port(port, Duration::from_secs(20), "postgres");
}

/// Stops the cluster in `dir`/data: `fast` cuts open connections and shuts down cleanly.
fn pg_stop(dir: &Path, mode: &str) {
    run(
        as_postgres("pg_ctl")
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-m", mode, "-w", "stop"]),
        "pg_ctl stop",
    );
}

/// Stops the cluster in `dir`/data whatever state it is in, and removes `dir`: for Drop.
fn pg_stop_quietly(dir: &Path) {
    let _ = as_postgres("pg_ctl")
        .arg("-D")
        .arg(dir.join("data"))
        .args(["-m", "immediate", "-w", "stop"])
        .output();
    let _ = std::fs::remove_dir_all(dir);
}

/// A private PostgreSQL primary and a streaming replica of it (`pg_basebackup -R`, through a
/// physical replication slot), as `database.read_url` is meant to be used: writes on the
/// primary, seen on the replica a moment later; the replica refuses writes. Drop stops the
/// replica, then the primary (its slot goes with it).
pub struct PrivatePostgresReplica {
    /// The replica's port.
    pub port: u16,
    dir: PathBuf,
    /// The primary.
    pub primary: PrivatePostgres,
}

impl PrivatePostgresReplica {
    /// A primary with database `database` already made (so the replica has it too), and its
    /// replica, streaming.
    pub fn start(database: &str) -> PrivatePostgresReplica {
        let primary = PrivatePostgres::start();
        run(
            as_postgres("createdb")
                .args(["-h", "127.0.0.1", "-U", "postgres"])
                .args(["-p", &primary.port.to_string(), database]),
            "createdb",
        );
        let replica = PrivatePostgresReplica {
            port: free_port(),
            dir: scratch("sqpgr"),
            primary,
        };
        chown(&replica.dir, "postgres");
        run(
            as_postgres("pg_basebackup")
                .args(["-h", "127.0.0.1", "-U", "postgres"])
                .args(["-p", &replica.primary.port.to_string(), "-D"])
                .arg(replica.dir.join("data"))
                .args(["-R", "-X", "stream", "-c", "fast", "-C", "-S", "replica1"]),
            "pg_basebackup",
        );
        pg_ctl(&replica.dir, replica.port, "start");
        replica
    }

    /// The URL of database `name` on the replica.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Stops the replica (fast); the primary goes on, its slot keeping WAL for it.
    pub fn stop(&self) {
        pg_stop(&self.dir, "fast");
    }
}

impl Drop for PrivatePostgresReplica {
    fn drop(&mut self) {
        pg_stop_quietly(&self.dir);
    }
}

/// A private RabbitMQ node with its own name, ports, config, data and logs, in a directory
/// owned by the rabbitmq user (the server script switches to it when started as root).
pub struct PrivateRabbit {
    pub port: u16,
    dist_port: u16,
    node: String,
    dir: PathBuf,
}

impl PrivateRabbit {
    pub fn start() -> PrivateRabbit {
        PrivateRabbit::start_with("")
    }

    /// A node whose rabbitmq.conf has `conf` (lines of its sysctl format) besides the
    /// listener: a broker set up differently from the shared one.
    pub fn start_with(conf: &str) -> PrivateRabbit {
        let dir = scratch("sqrmq");
        let port = free_port();
        let rabbit = PrivateRabbit {
            port,
            dist_port: free_port(),
            node: format!(
                "{}@localhost",
                dir.file_name().and_then(|n| n.to_str()).unwrap_or("sqrmq")
            ),
            dir,
        };
        std::fs::create_dir_all(rabbit.dir.join("mnesia")).expect("mnesia dir");
        std::fs::create_dir_all(rabbit.dir.join("log")).expect("log dir");
        std::fs::write(rabbit.dir.join("enabled_plugins"), "[].").expect("plugins file");
        std::fs::write(
            rabbit.dir.join("rabbitmq.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n{conf}"),
        )
        .expect("rabbitmq.conf");
        chown(&rabbit.dir, "rabbitmq");
        rabbit.launch();
        rabbit
    }

    fn launch(&self) {
        let d = &self.dir;
        run(
            Command::new("rabbitmq-server")
                .arg("-detached")
                .current_dir(d)
                .env("RABBITMQ_NODENAME", &self.node)
                .env("RABBITMQ_NODE_PORT", self.port.to_string())
                .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
                .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
                .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
                .env("RABBITMQ_LOG_BASE", d.join("log"))
                .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
                .env("RABBITMQ_PID_FILE", d.join("pid")),
            "rabbitmq-server",
        );
        wait_for_port(self.port, Duration::from_secs(60), "rabbitmq");
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn halt(&self) {
        let _ = Command::new("rabbitmqctl")
            .args(["-n", &self.node, "stop"])
            .output();
    }

    /// Runs `rabbitmqctl` on this node with `args`, failing the test when it fails.
    pub fn ctl(&self, args: &[&str]) {
        if let Err(e) = self.ctl_output(args) {
            panic!("{e}");
        }
    }

    /// Runs `rabbitmqctl` on this node with `args`: what it printed, or why it failed.
    pub fn ctl_output(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("rabbitmqctl")
            .args(["-n", &self.node])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("rabbitmqctl: cannot run: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "rabbitmqctl {args:?} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Stops the node (durable queues and persistent messages survive) and starts it again.
    pub fn restart(&self) {
        self.stop();
        self.start_again();
    }

    /// Stops the node and waits until its port is closed.
    pub fn stop(&self) {
        self.halt();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(Instant::now() < deadline, "rabbitmq did not stop");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts a node stopped with [`PrivateRabbit::stop`] again, on the same ports and data.
    pub fn start_again(&self) {
        self.launch();
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        self.halt();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where RabbitMQ's own scripts are: run directly, as the /usr/sbin wrappers would switch to the
/// rabbitmq user and its HOME (the shared node's Erlang cookie).
const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";

/// A private 3-node RabbitMQ cluster (docs: /work/shared/notes/clusters.md, section 1): its own
/// node names, ports, data directories and Erlang cookie (in its own HOME), so neither the shared
/// `rabbit@localhost` nor epmd is touched. Nodes are stopped and started again one at a time to
/// test a node loss; dropping it shuts every node down and removes the directories.
pub struct PrivateRabbitCluster {
    dir: PathBuf,
    nodes: Vec<ClusterNode>,
    /// The `rabbitmq-server` scripts started, parents of the nodes' beam.smp: reaped on drop.
    launchers: std::sync::Mutex<Vec<std::process::Child>>,
}

/// One node of a [`PrivateRabbitCluster`].
struct ClusterNode {
    name: String,
    port: u16,
    dist_port: u16,
    dir: PathBuf,
}

impl PrivateRabbitCluster {
    /// Boots 3 nodes at once (about 8 s) and joins nodes 2 and 3 to node 1.
    pub fn start() -> PrivateRabbitCluster {
        let dir = scratch("sqc");
        let base = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("sqc")
            .to_owned();
        let home = dir.join("home");
        std::fs::create_dir_all(&home).expect("cluster home");
        // Any cookie but the shared node's: this run's unique name will do.
        let cookie = format!("{}COOKIE", base.replace('_', "").to_uppercase());
        std::fs::write(home.join(".erlang.cookie"), cookie).expect("cookie");
        run(
            Command::new("chmod")
                .arg("400")
                .arg(home.join(".erlang.cookie")),
            "chmod the cookie",
        );
        let nodes: Vec<ClusterNode> = (1..=3)
            .map(|n| ClusterNode {
                name: format!("{base}n{n}@localhost"),
                port: free_port(),
                dist_port: free_port(),
                dir: dir.join(format!("n{n}")),
            })
            .collect();
        let cluster = PrivateRabbitCluster {
            dir,
            nodes,
            launchers: std::sync::Mutex::new(Vec::new()),
        };
        for node in &cluster.nodes {
            std::fs::create_dir_all(&node.dir).expect("node dir");
            std::fs::write(node.dir.join("rabbitmq.conf"), "").expect("rabbitmq.conf");
            std::fs::write(node.dir.join("rabbitmq-env.conf"), "").expect("rabbitmq-env.conf");
            std::fs::write(node.dir.join("enabled_plugins"), "[].").expect("plugins file");
        }
        std::thread::scope(|s| {
            for n in 0..3 {
                let cluster = &cluster;
                s.spawn(move || cluster.start_again(n));
            }
        });
        for n in 1..3 {
            cluster.ctl_on(n, &["stop_app"]);
            cluster.ctl_on(n, &["join_cluster", &cluster.nodes[0].name]);
            cluster.ctl_on(n, &["start_app"]);
        }
        cluster
    }

    /// The AMQP URLs of the nodes, node 0 first.
    pub fn urls(&self) -> Vec<String> {
        (0..self.nodes.len()).map(|n| self.url(n)).collect()
    }

    /// The AMQP URL of node `n`.
    pub fn url(&self, n: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.nodes[n].port)
    }

    /// The AMQP port of node `n`: what a client's log names it by.
    pub fn port(&self, n: usize) -> u16 {
        self.nodes[n].port
    }

    /// A URL where no broker listens (a node that is down), for a list that starts with one.
    pub fn dead_url() -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", free_port())
    }

    /// Shuts node `n` down (it waits for the node to stop); the others go on as the cluster.
    pub fn stop(&self, n: usize) {
        self.ctl_on(n, &["shutdown"]);
    }

    /// Starts node `n` (first boot, or after [`PrivateRabbitCluster::stop`], with the same ports
    /// and data) and waits until its application runs: it rejoins the cluster by itself.
    pub fn start_again(&self, n: usize) {
        let node = &self.nodes[n];
        let log = std::fs::File::create(node.dir.join("stdout.log")).expect("node log");
        let err = log.try_clone().expect("node log");
        use std::os::unix::process::CommandExt;
        let mut server = Command::new(format!("{RABBIT_BIN}/rabbitmq-server"));
        self.node_env(n, &mut server)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0);
        let child = server.spawn().unwrap_or_else(|e| {
            panic!("rabbitmq-server: cannot run: {e}; install it with deploy/local/services.sh")
        });
        self.launchers.lock().expect("launchers").push(child);
        let pid = node.dir.join("pid");
        wait_for_pid(&pid);
        let pid = pid.to_str().expect("utf-8 path");
        self.ctl_on(n, &["wait", pid, "--timeout", "120"]);
    }

    /// Waits (up to 60 s) until every quorum queue has a member online on every node, as after
    /// a node rejoined: losing another node before that could leave a queue without a majority.
    /// How long it waited.
    pub fn wait_all_members_online(&self, through: usize) -> Duration {
        let started = Instant::now();
        loop {
            let listed = self
                .ctl_output(through, &["list_queues", "name", "type", "online", "-q"])
                .unwrap_or_default();
            let behind = listed
                .lines()
                .filter(|l| l.contains("quorum"))
                .any(|l| self.nodes.iter().any(|node| !l.contains(&node.name)));
            if !behind && !listed.is_empty() {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "quorum members back online on every node within 60 s: {listed}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The node (index) the connection named `name` (its `connection_name`) is on, if one is.
    pub fn node_of(&self, name: &str) -> Option<usize> {
        (0..self.nodes.len()).find_map(|n| {
            let listed = self
                .ctl_output(n, &["list_connections", "name", "client_properties", "-q"])
                .ok()?;
            let line = listed.lines().find(|l| l.contains(name))?;
            let (_, local) = line.split_once(" -> ")?;
            let port: u16 = local
                .split(|c: char| !c.is_ascii_digit() && c != '.' && c != ':')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            self.nodes.iter().position(|node| node.port == port)
        })
    }

    /// Runs `rabbitmqctl` on node `n` with `args`, failing the test when it fails.
    pub fn ctl_on(&self, n: usize, args: &[&str]) {
        if let Err(e) = self.ctl_output(n, args) {
            panic!("{e}");
        }
    }

    /// Runs `rabbitmqctl` on node `n` with `args`: what it printed, or why it failed.
    pub fn ctl_output(&self, n: usize, args: &[&str]) -> Result<String, String> {
        self.cli_output("rabbitmqctl", n, args)
    }

    /// Runs `rabbitmq-queues` on node `n` with `args`: what it printed, or why it failed.
    pub fn queues_output(&self, n: usize, args: &[&str]) -> Result<String, String> {
        self.cli_output("rabbitmq-queues", n, args)
    }

    /// Runs RabbitMQ's command-line `tool` on node `n` with `args` (the cluster's HOME holds
    /// its cookie): what it printed, or why it failed with everything it said.
    fn cli_output(&self, tool: &str, n: usize, args: &[&str]) -> Result<String, String> {
        let out = Command::new(format!("{RABBIT_BIN}/{tool}"))
            .env("HOME", self.dir.join("home"))
            .args(["-n", &self.nodes[n].name])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{tool}: cannot run: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{tool} {args:?} on node {n} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `cmd` with node `n`'s environment: its name, ports, files and the cluster's HOME.
    fn node_env<'c>(&self, n: usize, cmd: &'c mut Command) -> &'c mut Command {
        let node = &self.nodes[n];
        let d = &node.dir;
        let path = format!("{RABBIT_BIN}:{}", std::env::var("PATH").unwrap_or_default());
        cmd.env("HOME", self.dir.join("home"))
            .env("PATH", path)
            .env("RABBITMQ_NODENAME", &node.name)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", node.port.to_string())
            .env("RABBITMQ_DIST_PORT", node.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_CONF_ENV_FILE", d.join("rabbitmq-env.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
    }
}

/// Waits (up to 120 s) until the node's pid file holds a pid: `rabbitmqctl wait` reads the
/// file as soon as it exists, and one caught while the node was still writing it failed with
/// `garbage_in_pid_file` (3 nodes booting at once on 2 CPUs).
fn wait_for_pid(file: &Path) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let written = std::fs::read_to_string(file).unwrap_or_default();
        if written.trim().parse::<u32>().is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} holds a pid within 120 s",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for PrivateRabbitCluster {
    fn drop(&mut self) {
        for n in 0..self.nodes.len() {
            if self.ctl_output(n, &["shutdown"]).is_err() {
                // Not answering: kill its beam.smp, whose pid a clean shutdown would delete.
                if let Ok(pid) = std::fs::read_to_string(self.nodes[n].dir.join("pid")) {
                    let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
                }
            }
        }
        let launchers = self
            .launchers
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        for mut launcher in launchers {
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(launcher.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = launcher.kill();
            let _ = launcher.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
