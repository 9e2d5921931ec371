//! The producer's contract: `sendquota schema` says what the worker accepts, and the producer
//! examples of docs/producers.md (Python with pika, Node.js with amqplib) publish through the
//! real broker what the worker then decides. The examples' packages are installed by
//! deploy/local/tools.sh.

use crate::support;

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use sendquota::internals::message::SendRequest;
use serde_json::{json, Value};
use support::process::{run_for, Run};
use support::{amqp_url, TempFile, TestEnv};

/// Where the examples live: the tests run the very files the documentation shows.
const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/examples");

/// How long an example may take to publish a few messages (the interpreters' start included).
const EXAMPLE_LIMIT: Duration = Duration::from_secs(60);

/// The schema `sendquota schema` prints, in a file, as a producer would keep it.
fn schema_file(env: &TestEnv) -> TempFile {
    let run = run_for(env.cli(&["schema"]), None, Duration::from_secs(10));
    assert_eq!(run.code, Some(0), "sendquota schema: {}", run.stderr);
    let schema: Value = serde_json::from_str(&run.stdout).expect("the schema is JSON");
    assert_eq!(
        schema["$schema"], "https://json-schema.org/draft/2020-12/schema",
        "a draft 2020-12 schema"
    );
    TempFile::new(&run.stdout)
}

/// Runs `program` (python3 or node) on the example `file` with the requests as its input,
/// publishing to this test's requests exchange.
fn run_example(env: &TestEnv, program: &str, file: &str, requests: &[Value]) -> Run {
    let schema = schema_file(env);
    let mut cmd = Command::new(program);
    cmd.arg(format!("{EXAMPLES}/{file}"))
        .arg(schema.path())
        .env("AMQP_URL", amqp_url())
        .env("SENDQUOTA_EXCHANGE", &env.names.requests);
    let input: String = requests.iter().map(|r| format!("{r}\n")).collect();
    let run = run_for(cmd, Some(&input), EXAMPLE_LIMIT);
    assert!(
        run.code.is_some(),
        "{program} {file} did not finish within {EXAMPLE_LIMIT:?}; stderr: {}",
        run.stderr
    );
    run
}

/// Three requests as a producer writes them: two to one recipient (the headline rule lets the
/// first through and denies the second) and one whose channel holds a space, which the
/// schema refuses before it is published.
fn requests(prefix: &str) -> Vec<Value> {
    vec![
        json!({"id": format!("{prefix}-1"), "recipient": "user-42", "channel": "email",
               "category": "marketing", "timezone": "Europe/Paris",
               "payload": {"template": "welcome", "price": 12.5}}),
        json!({"id": format!("{prefix}-2"), "recipient": "user-42", "channel": "email",
               "category": "marketing", "timezone": "Europe/Paris"}),
        json!({"id": format!("{prefix}-3"), "recipient": "user-43", "channel": "e mail"}),
    ]
}

/// The example publishes the two valid requests (confirmed), reports the third with the
/// schema's reason and exits 1; the worker then dispatches the first, denies the second, and
/// the invalid queue stays empty: the mistake never left the producer.
async fn the_example_publishes_what_the_schema_admits(program: &str, file: &str, prefix: &str) {
    let env = TestEnv::new().await;
    let run = run_example(&env, program, file, &requests(prefix));
    assert_eq!(
        run.code,
        Some(1),
        "one request refused: exit 1; stdout: {}; stderr: {}",
        run.stdout,
        run.stderr
    );
    for id in [format!("{prefix}-1"), format!("{prefix}-2")] {
        assert!(
            run.stdout.contains(&format!("published {id}")),
            "{id} published: {}; stderr: {}",
            run.stdout,
            run.stderr
        );
    }
    assert!(
        run.stderr.contains("not published") && run.stderr.contains(&format!("{prefix}-3")),
        "the request with a bad channel is named: {}",
        run.stderr
    );
    assert!(
        run.stderr.contains("channel"),
        "the reason names the field: {}",
        run.stderr
    );
    let worker =
        support::process::Running::spawn(env.cli(&["worker", "--now", "2026-02-02T09:00:00Z"]));
    let mut seen = HashMap::new();
    assert!(
        env.outcome(&format!("{prefix}-1"), &mut seen).await,
        "the first message is dispatched"
    );
    assert!(
        !env.outcome(&format!("{prefix}-2"), &mut seen).await,
        "the second is denied by the headline rule"
    );
    drop(worker);
    let denial = env
        .denials()
        .await
        .into_iter()
        .find(|d| d.row.message_id == format!("{prefix}-2"))
        .expect("the denial row");
    assert_eq!(denial.row.rule, "headline");
    assert!(
        env.drain(&env.names.invalid).await.is_empty(),
        "nothing reached the invalid queue"
    );
}

/// docs/examples/producer.py, as docs/producers.md runs it.
#[tokio::test]
async fn the_python_producer_example_publishes_what_the_schema_admits_and_the_worker_decides_it() {
    the_example_publishes_what_the_schema_admits("python3", "producer.py", "py").await;
}

/// docs/examples/producer.mjs, as docs/producers.md runs it.
#[tokio::test]
async fn the_node_producer_example_publishes_what_the_schema_admits_and_the_worker_decides_it() {
    the_example_publishes_what_the_schema_admits("node", "producer.mjs", "node").await;
}

/// Validates each body against the schema with Python's jsonschema (the validator the Python
/// example uses): `true` for each body it admits.
fn schema_admits(env: &TestEnv, bodies: &[&str]) -> Vec<bool> {
    const VALIDATE: &str = "import json, sys, jsonschema\n\
        v = jsonschema.Draft202012Validator(json.load(open(sys.argv[1])))\n\
        for line in sys.stdin:\n    print('yes' if v.is_valid(json.loads(line)) else 'no')\n";
    let schema = schema_file(env);
    let mut cmd = Command::new("python3");
    cmd.args(["-c", VALIDATE, schema.path()]);
    let input: String = bodies.iter().map(|b| format!("{b}\n")).collect();
    let run = run_for(cmd, Some(&input), EXAMPLE_LIMIT);
    assert_eq!(run.code, Some(0), "the validator ran: {}", run.stderr);
    run.stdout.lines().map(|l| l == "yes").collect()
}

/// Bodies the worker accepts and bodies it refuses for each field's limit: the schema
/// admits exactly the former.
const AGREED: &[(&str, bool)] = &[
    (r#"{"id":"m-1","recipient":"u","channel":"sms"}"#, true),
    (
        r#"{"id":"m-1","recipient":"u","channel":"push.ios","category":"news-2","timezone":"America/New_York","cost":1000000,"payload":{"a":[1,2.5,{"b":null}]}}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","payload":null}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","timezone":"UTC"}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":{"campaign":"spring-2026","flow.step":"2"}}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":null}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":{"a b":"1"}}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":{"a":1}}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":{"a":""}}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":{"a":{"b":"c"}}}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":["a"]}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"2026-05-01T09:00:00Z"}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"2026-05-01T11:00:00.25+02:00"}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":null}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"2026-05-01T09:00:00"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"2026-05-01"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"1969-12-31T23:59:59Z"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"9000-01-01T00:00:00Z"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"2016-12-31T23:59:60Z"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":1777626000}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","priority":"critical"}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","priority":null}"#,
        true,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","priority":"urgent"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","priority":"HIGH"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","priority":1}"#,
        false,
    ),
    (r#"{"recipient":"u","channel":"sms"}"#, false),
    (r#"{"id":"m-1","channel":"sms"}"#, false),
    (r#"{"id":"m-1","recipient":"u"}"#, false),
    (r#"{"id":"","recipient":"u","channel":"sms"}"#, false),
    (r#"{"id":"m-1","recipient":"","channel":"sms"}"#, false),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","timezon":"UTC"}"#,
        false,
    ),
    (r#"{"id":"m-1","recipient":"u","channel":"e mail"}"#, false),
    (r#"{"id":"m-1","recipient":"u","channel":"a..b"}"#, false),
    (r#"{"id":"m-1","recipient":"u","channel":"sms.*"}"#, false),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","category":".x"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","timezone":"Mars/Base"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","cost":0}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","cost":1.5}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","cost":"3"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","cost":1000001}"#,
        false,
    ),
    (r#"{"id":"m\u0007","recipient":"u","channel":"sms"}"#, false),
    (r#"{"id":"m\u200b","recipient":"u","channel":"sms"}"#, false),
    (
        r#"{"id":"m-1","recipient":"u\u2028v","channel":"sms"}"#,
        false,
    ),
    (
        r#"{"id":"m-1","recipient":"u\u202ev","channel":"sms"}"#,
        false,
    ),
    (r#"{"id":7,"recipient":"u","channel":"sms"}"#, false),
    (r#"{"id":"m-1","recipient":null,"channel":"sms"}"#, false),
    (
        r#"{"id":"m-1","recipient":"u","channel":"sms","category":null,"timezone":null,"cost":null}"#,
        true,
    ),
];

/// What a JSON Schema cannot say, stated in docs/producers.md: the schema admits these and the
/// worker refuses them.
const SCHEMA_CANNOT_SAY: &[(&str, &str)] = &[
    (
        "an id of 64 four-byte characters (64 characters, 256 bytes: AMQP's limit is 255)",
        r#"{"id":"😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀😀","recipient":"u","channel":"sms"}"#,
    ),
    (
        "a format character beyond the Basic Multilingual Plane (U+E0001)",
        "{\"id\":\"m\u{E0001}\",\"recipient\":\"u\",\"channel\":\"sms\"}",
    ),
    (
        "a whole cost written with a fraction (2.0)",
        r#"{"id":"m-1","recipient":"u","channel":"sms","cost":2.0}"#,
    ),
    (
        "an attribute key given twice",
        r#"{"id":"m-1","recipient":"u","channel":"sms","attributes":{"a":"1","a":"2"}}"#,
    ),
    (
        "an expires_at on a day its month does not have (February 30)",
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"2026-02-30T09:00:00Z"}"#,
    ),
    (
        "an expires_at whose offset moves it before 1970",
        r#"{"id":"m-1","recipient":"u","channel":"sms","expires_at":"1970-01-01T00:30:00+01:00"}"#,
    ),
    (
        "a NUL character in the payload",
        r#"{"id":"m-1","recipient":"u","channel":"sms","payload":"a\u0000b"}"#,
    ),
    (
        "a payload number Postgres numeric cannot store",
        r#"{"id":"m-1","recipient":"u","channel":"sms","payload":1e-20000}"#,
    ),
];

/// The schema and the worker's decoder agree on every field's limit, and where a schema
/// cannot express a limit the schema admits what the worker refuses (so a producer validating
/// with it never loses a message the worker would take).
#[tokio::test]
async fn the_schema_admits_what_the_worker_accepts_and_refuses_what_it_refuses() {
    let env = TestEnv::new().await;
    let deep = format!(
        r#"{{"id":"m-1","recipient":"u","channel":"sms","payload":{}1{}}}"#,
        "[".repeat(128),
        "]".repeat(128)
    );
    let mut bodies: Vec<&str> = AGREED.iter().map(|(b, _)| *b).collect();
    bodies.extend(SCHEMA_CANNOT_SAY.iter().map(|(_, b)| *b));
    bodies.push(&deep);
    let admitted = schema_admits(&env, &bodies);
    assert_eq!(admitted.len(), bodies.len(), "one verdict per body");
    let max = env.settings.worker.max_body_bytes;
    for (&(body, valid), &schema) in AGREED.iter().zip(&admitted) {
        let worker = SendRequest::decode(body.as_bytes(), max);
        assert_eq!(worker.is_ok(), valid, "the worker on {body}: {worker:?}");
        assert_eq!(schema, valid, "the schema on {body}");
    }
    let cannot_say = SCHEMA_CANNOT_SAY
        .iter()
        .map(|(what, body)| (*what, *body))
        .chain([("a payload nested 128 deep", deep.as_str())]);
    for ((what, body), &schema) in cannot_say.zip(&admitted[AGREED.len()..]) {
        assert!(schema, "the schema admits {what}");
        assert!(
            SendRequest::decode(body.as_bytes(), max).is_err(),
            "the worker refuses {what}"
        );
    }
}
