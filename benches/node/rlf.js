#!/usr/bin/env node
// Comparison bench: rate-limiter-flexible's RateLimiterRedis (over ioredis)
// making "all allowed" decisions against a Redis of your choice, so that its
// decisions per second can be set beside sendquota's Rust bench run against
// the same Redis (run them alternately; see rlf.sh).
//
// Usage:
//   node benches/node/rlf.js --url redis://127.0.0.1:PORT
//        [--decisions N] [--concurrency C] [--slices S] [--auto-pipelining 0|1]
//
// Defaults: N=60000, C=50, S=1, auto-pipelining 0.
//
// What one run does:
//   * one ioredis client, created with default options from the URL, as a
//     user would. ioredis's default is enableAutoPipelining: false (see
//     node_modules/ioredis/built/redis/RedisOptions.js), so that is what is
//     measured unless --auto-pipelining 1 is given, which turns it on so
//     both modes can be measured;
//   * one RateLimiterRedis { points: 1, duration: 86400,
//     keyPrefix: 'rlfbench' + random, storeClient: client,
//     useRedisPackage: false }: a fixed-window counter, one consume per key;
//   * waits for the client to be ready, warms up with 1,000 consumes on
//     keys w0..w999 (this also loads the Lua script on the connection);
//   * then N consumes of 1 point, each on a new key r0..r(N-1), keeping
//     exactly C in flight (C workers, each starting the next consume as its
//     previous one resolves). Every one must be allowed: rejections and
//     errors are counted and the exit status is 1 if there are any;
//   * prints one line to stdout:
//       rlf decisions=N concurrency=C seconds=... decisions_per_s=... auto_pipelining=0|1
//           redis_cpu_us_per_decision=... decisions_per_redis_core_s=...
//     (Redis's CPU from INFO cpu before and after: run it against a private Redis);
//     with, when S > 1, slices=S slices_decisions_per_s=r1,r2,...: the rate of
//     each of S equal consecutive slices of the N decisions (by completion
//     order, each slice timed from the previous slice's last completion);
//   * progress (done/N) goes to stderr once a second;
//   * at the end it deletes every key under its prefix (SCAN MATCH + DEL in
//     batches) and quits the client, also when the run failed.
//
// Per consume, RateLimiterRedis 11.x sends ONE command over ioredis: the
// script it registered with defineCommand('rlflxIncr'), i.e.
//   EVALSHA <sha> 1 <prefix>:<key> 1 86400 1 86400
// (EVAL with the script body the first time on a connection), and the
// script runs SET key 0 EX 86400 NX; INCRBY key 1; PTTL key (plus EXPIRE
// only if the key had no TTL).

'use strict';

const crypto = require('crypto');
const Redis = require('ioredis');
const { RateLimiterRedis } = require('rate-limiter-flexible');

const WARMUP = 1000;

function usage(msg) {
  if (msg) process.stderr.write(`rlf.js: ${msg}\n`);
  process.stderr.write(
    'usage: node rlf.js --url redis://HOST:PORT [--decisions N] [--concurrency C] ' +
      '[--slices S] [--auto-pipelining 0|1]\n',
  );
  process.exit(2);
}

function parseArgs(argv) {
  const opts = { url: null, decisions: 60000, concurrency: 50, slices: 1, autoPipelining: false };
  const intArg = (name, v, min) => {
    if (v === undefined || !/^[0-9]+$/.test(v)) usage(`${name} needs a whole number`);
    const n = Number(v);
    if (!Number.isSafeInteger(n) || n < min) usage(`${name} must be >= ${min}`);
    return n;
  };
  for (let i = 0; i < argv.length; i++) {
    let a = argv[i];
    let v;
    const eq = a.indexOf('=');
    if (a.startsWith('--') && eq > 0) {
      v = a.slice(eq + 1);
      a = a.slice(0, eq);
    } else if (a !== '-h' && a !== '--help') {
      v = argv[++i];
    }
    switch (a) {
      case '--url':
        if (!v) usage('--url needs a value');
        opts.url = v;
        break;
      case '--decisions':
        opts.decisions = intArg(a, v, 1);
        break;
      case '--concurrency':
        opts.concurrency = intArg(a, v, 1);
        break;
      case '--slices':
        opts.slices = intArg(a, v, 1);
        break;
      case '--auto-pipelining':
        if (v !== '0' && v !== '1') usage('--auto-pipelining takes 0 or 1');
        opts.autoPipelining = v === '1';
        break;
      case '-h':
      case '--help':
        usage();
        break;
      default:
        usage(`unknown argument ${a}`);
    }
  }
  if (!opts.url) usage('--url is required');
  if (opts.slices > opts.decisions) usage('--slices must not exceed --decisions');
  return opts;
}

const nowNs = () => process.hrtime.bigint();
const secs = (ns) => Number(ns) / 1e9;

function waitReady(client) {
  return new Promise((resolve, reject) => {
    if (client.status === 'ready') return resolve();
    const onReady = () => {
      client.off('error', onError);
      resolve();
    };
    const onError = (err) => {
      client.off('ready', onReady);
      reject(err);
    };
    client.once('ready', onReady);
    client.once('error', onError);
  });
}

// Runs `count` consumes on keyOf(i), keeping `concurrency` in flight.
// Calls onDone(i, ok) as each settles. Returns {rejected, errors, firstError}.
async function runConsumes(limiter, count, concurrency, keyOf, onDone) {
  let next = 0;
  let rejected = 0;
  let errors = 0;
  let firstError = null;
  async function worker() {
    while (next < count) {
      const i = next++;
      let ok = false;
      try {
        await limiter.consume(keyOf(i), 1);
        ok = true;
      } catch (e) {
        if (e instanceof Error) {
          errors++;
          if (!firstError) firstError = e;
        } else {
          rejected++; // RateLimiterRes: over the limit
        }
      }
      if (onDone) onDone(i, ok);
    }
  }
  const workers = [];
  for (let w = 0; w < Math.min(concurrency, count); w++) workers.push(worker());
  await Promise.all(workers);
  return { rejected, errors, firstError };
}

// Redis's own CPU time so far (user + system), in microseconds, from INFO cpu: the
// server-side cost of the consumes, whatever the client's speed, so that decisions per
// Redis core can be set beside sendquota's (benches/decisions.rs prints the same figure).
async function redisCpuUs(client) {
  const info = await client.info('cpu');
  const field = (name) => {
    const m = info.match(new RegExp(`^${name}:([0-9.]+)`, 'm'));
    return m ? Number(m[1]) : 0;
  };
  return Math.round((field('used_cpu_user') + field('used_cpu_sys')) * 1e6);
}

async function cleanup(client, prefix) {
  let cursor = '0';
  let deleted = 0;
  do {
    const [next, keys] = await client.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', 1000);
    cursor = next;
    for (let i = 0; i < keys.length; i += 500) {
      deleted += await client.del(...keys.slice(i, i + 500));
    }
  } while (cursor !== '0');
  return deleted;
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const N = opts.decisions;
  const C = opts.concurrency;
  const S = opts.slices;

  // Default ioredis options, as a user would write `new Redis(url)`;
  // enableAutoPipelining is false by default and only set when asked for.
  const client = opts.autoPipelining
    ? new Redis(opts.url, { enableAutoPipelining: true })
    : new Redis(opts.url);
  const prefix = 'rlfbench' + crypto.randomBytes(6).toString('hex');
  const limiter = new RateLimiterRedis({
    storeClient: client,
    useRedisPackage: false,
    points: 1,
    duration: 86400,
    keyPrefix: prefix,
  });

  try {
    await waitReady(client);
  } catch (e) {
    process.stderr.write(`rlf.js: cannot connect to ${opts.url}: ${e.message}\n`);
    client.disconnect();
    return 1;
  }
  // After ready, log connection errors instead of crashing on an unhandled 'error'.
  client.on('error', (e) => process.stderr.write(`rlf.js: redis error: ${e.message}\n`));

  let status = 0;
  let progress = null;
  try {
    const warm = await runConsumes(limiter, WARMUP, C, (i) => `w${i}`);
    if (warm.rejected || warm.errors) {
      process.stderr.write(
        `rlf.js: warm-up failed: rejected=${warm.rejected} errors=${warm.errors}` +
          (warm.firstError ? ` first_error=${warm.firstError.message}` : '') + '\n',
      );
      return 1;
    }

    // Completion time of the decision that ends each slice.
    const sliceEnd = [];
    for (let s = 1; s <= S; s++) sliceEnd.push(Math.floor((s * N) / S));
    const sliceEndNs = new Array(S);
    let done = 0;
    let nextSlice = 0;

    const cpu0 = await redisCpuUs(client);
    const t0 = nowNs();
    progress = setInterval(() => {
      process.stderr.write(`rlf: ${done}/${N} (${secs(nowNs() - t0).toFixed(1)} s)\n`);
    }, 1000);
    const res = await runConsumes(limiter, N, C, (i) => `r${i}`, () => {
      done++;
      while (nextSlice < S && done >= sliceEnd[nextSlice]) sliceEndNs[nextSlice++] = nowNs();
    });
    const t1 = nowNs();
    clearInterval(progress);
    progress = null;
    const redisUs = (await redisCpuUs(client)) - cpu0;

    const seconds = secs(t1 - t0);
    let line =
      `rlf decisions=${N} concurrency=${C} seconds=${seconds.toFixed(3)} ` +
      `decisions_per_s=${(N / seconds).toFixed(0)} auto_pipelining=${opts.autoPipelining ? 1 : 0} ` +
      `redis_cpu_us_per_decision=${(redisUs / N).toFixed(2)} ` +
      `decisions_per_redis_core_s=${(N / (redisUs / 1e6)).toFixed(0)}`;
    if (S > 1) {
      const rates = [];
      let prevNs = t0;
      let prevCount = 0;
      for (let s = 0; s < S; s++) {
        const count = sliceEnd[s] - prevCount;
        rates.push((count / secs(sliceEndNs[s] - prevNs)).toFixed(0));
        prevNs = sliceEndNs[s];
        prevCount = sliceEnd[s];
      }
      line += ` slices=${S} slices_decisions_per_s=${rates.join(',')}`;
    }
    if (res.rejected || res.errors) {
      line += ` rejected=${res.rejected} errors=${res.errors}`;
      status = 1;
    }
    process.stdout.write(line + '\n');
    if (res.firstError) process.stderr.write(`rlf.js: first error: ${res.firstError.message}\n`);
  } catch (e) {
    process.stderr.write(`rlf.js: ${e.stack || e}\n`);
    status = 1;
  } finally {
    if (progress) clearInterval(progress);
    try {
      const deleted = await cleanup(client, prefix);
      process.stderr.write(`rlf: deleted ${deleted} keys under ${prefix}:\n`);
      await client.quit();
    } catch (e) {
      process.stderr.write(`rlf.js: cleanup failed: ${e.message}\n`);
      client.disconnect();
      status = 1;
    }
  }
  return status;
}

main().then(
  (code) => {
    process.exitCode = code;
  },
  (e) => {
    process.stderr.write(`rlf.js: ${e.stack || e}\n`);
    process.exitCode = 1;
  },
);
