#!/usr/bin/env python3
"""Publish send requests to sendquota from Python, with pika.

Reads one JSON request per line on standard input, checks each against the schema that
`sendquota schema` prints (so a mistake is caught here, not in the invalid queue), and
publishes it to the requests exchange: persistent, with the request's id as message_id,
`mandatory` and with publisher confirms, publishing again when the broker returns or nacks it.

    sendquota schema > request.schema.json
    python3 producer.py request.schema.json < requests.jsonl

Environment: AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2F) and
SENDQUOTA_EXCHANGE (default sendquota.requests: `<namespace>.requests`).
Needs: pip install pika jsonschema
"""
import json
import os
import sys
import time

import jsonschema
import pika

ATTEMPTS = 5


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        validator = jsonschema.Draft202012Validator(json.load(f))
    url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    exchange = os.environ.get("SENDQUOTA_EXCHANGE", "sendquota.requests")
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()
    failed = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        error = jsonschema.exceptions.best_match(validator.iter_errors(request))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "request"
            print(f"not published: {request.get('id')!r}: {where}: {error.message}", file=sys.stderr)
            failed += 1
            continue
        body = json.dumps(request, ensure_ascii=False).encode("utf-8")
        # sendquota-recipient: what `intake.shards` hashes to keep a recipient's order.
        properties = pika.BasicProperties(
            content_type="application/json",
            delivery_mode=2,
            message_id=request["id"],
            headers={"sendquota-recipient": request["recipient"]},
        )
        for attempt in range(1, ATTEMPTS + 1):
            try:
                # The requests exchange is a fanout: the routing key is not used.
                channel.basic_publish(exchange, "", body, properties, mandatory=True)
                print(f"published {request['id']}")
                break
            except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as e:
                # Returned (no queue bound yet) or nacked: the same id again is safe.
                print(f"publish of {request['id']!r} failed ({type(e).__name__}), attempt {attempt}", file=sys.stderr)
                time.sleep(0.2 * attempt)
        else:
            failed += 1
    connection.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
