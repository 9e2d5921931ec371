// Publish send requests to sendquota from Node.js, with amqplib.
//
// Reads one JSON request per line on standard input, checks each against the schema that
// `sendquota schema` prints (so a mistake is caught here, not in the invalid queue), and
// publishes it to the requests exchange: persistent, with the request's id as messageId,
// `mandatory` and on a confirm channel, publishing again when the broker returns or nacks it.
//
//     sendquota schema > request.schema.json
//     node producer.mjs request.schema.json < requests.jsonl
//
// Environment: AMQP_URL (default amqp://guest:guest@127.0.0.1:5672) and SENDQUOTA_EXCHANGE
// (default sendquota.requests: `<namespace>.requests`).
// Needs: npm install amqplib ajv
import { readFileSync } from "node:fs";
import { createInterface } from "node:readline";
import amqp from "amqplib";
import Ajv2020 from "ajv/dist/2020.js";

const ATTEMPTS = 5;

const schema = JSON.parse(readFileSync(process.argv[2], "utf8"));
const validate = new Ajv2020({ strict: false }).compile(schema);
const url = process.env.AMQP_URL ?? "amqp://guest:guest@127.0.0.1:5672";
const exchange = process.env.SENDQUOTA_EXCHANGE ?? "sendquota.requests";

const connection = await amqp.connect(url);
const channel = await connection.createConfirmChannel();
// The broker returns a mandatory publish no queue took before it confirms it.
const returned = new Set();
channel.on("return", (message) => returned.add(message.properties.messageId));

// Publishes and waits for the broker's confirm; true when a queue took the message.
function publish(request) {
  const body = Buffer.from(JSON.stringify(request), "utf8");
  const options = {
    mandatory: true,
    persistent: true,
    contentType: "application/json",
    messageId: request.id,
    // What `intake.shards` hashes to keep a recipient's messages in order.
    headers: { "sendquota-recipient": request.recipient },
  };
  return new Promise((resolve) => {
    // The requests exchange is a fanout: the routing key is not used.
    channel.publish(exchange, "", body, options, (nacked) => {
      resolve(!nacked && !returned.delete(request.id));
    });
  });
}

let failed = 0;
for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  const request = JSON.parse(line);
  if (!validate(request)) {
    const [error] = validate.errors;
    console.error(`not published: ${JSON.stringify(request.id)}: ${error.instancePath || "request"} ${error.message}`);
    failed += 1;
    continue;
  }
  let taken = false;
  for (let attempt = 1; attempt <= ATTEMPTS && !taken; attempt += 1) {
    taken = await publish(request);
    if (!taken) {
      // Returned (no queue bound yet) or nacked: the same id again is safe.
      console.error(`publish of ${JSON.stringify(request.id)} failed, attempt ${attempt}`);
      await new Promise((r) => setTimeout(r, 200 * attempt));
    }
  }
  if (taken) console.log(`published ${request.id}`);
  else failed += 1;
}
await channel.close();
await connection.close();
process.exitCode = failed ? 1 : 0;
