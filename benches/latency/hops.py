#!/usr/bin/env python3
"""Per-message hop latencies from a loopback packet capture (Python 3.11, stdlib only).

Reads a pcap or pcapng file written by `tcpdump -i lo -w` (link types Ethernet, Linux cooked
v1/v2, BSD loopback or raw IP), reassembles each TCP direction in sequence order, and parses
AMQP 0-9-1 frames on port 5672 and Redis RESP on --redis-port. For each message id (`g\\d+` in
the body's "id" field) it takes, in order of appearance:

  t1  first client->broker body           the bench's publish to the requests queue
  t2  first broker->client body           the delivery to the worker (or relay)
  rs  first EVALSHA carrying the id       the worker's decision sent to Redis
  rr  reply to the last such EVALSHA      (before t3)
  t3  second client->broker body          the worker's republish to the dispatch exchange
  t4  second broker->client body          the delivery to the sink consumer

An id seen published again after its t4 starts its next run (run 1 may be a relay that makes
no Redis call, run 2 the worker). Each run is reported on its own: per-hop p50/p90/p99/max,
then the mean of each hop over the slowest 1% of messages end to end, which names the hop that
makes the tail.

Usage: hops.py CAPTURE.pcap [--redis-port 6379] [--amqp-port 5672] [--skip-first-seconds 1.0]
"""

from __future__ import annotations

import argparse
import math
import re
import struct
import sys
from collections import defaultdict

ID_RE = re.compile(rb'"id"\s*:\s*"(g\d+)"')
ARG_ID_RE = re.compile(rb"g\d+")
AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_END = 0xCE
MAX_FRAME = 1 << 24


# --------------------------------------------------------------------------------------------
# Capture files


def read_packets(path):
    """Yields (timestamp_seconds, linktype, bytes) from a pcap or pcapng file; stops quietly at
    a truncated final record."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 24:
        return
    magic = data[:4]
    if magic == b"\x0a\x0d\x0d\x0a":
        yield from _read_pcapng(data)
        return
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        end = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        end = ">"
    else:
        raise SystemExit(f"{path}: not a pcap/pcapng file (magic {magic.hex()})")
    nano = magic in (b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d")
    linktype = struct.unpack(end + "I", data[20:24])[0] & 0x0FFFFFFF
    div = 1e9 if nano else 1e6
    rec = struct.Struct(end + "IIII")
    off = 24
    n = len(data)
    while off + 16 <= n:
        sec, frac, incl, _orig = rec.unpack_from(data, off)
        off += 16
        if off + incl > n:
            break  # truncated final packet
        yield sec + frac / div, linktype, data[off : off + incl]
        off += incl


def _read_pcapng(data):
    off = 0
    n = len(data)
    end = "<"
    ifaces = []  # (linktype, ticks per second)
    while off + 12 <= n:
        btype, blen = struct.unpack_from(end + "II", data, off)
        if btype == 0x0A0D0D0A:  # section header: byte order
            bom = data[off + 8 : off + 12]
            end = "<" if bom == b"\x4d\x3c\x2b\x1a" else ">"
            btype, blen = struct.unpack_from(end + "II", data, off)
            ifaces = []
        if blen < 12 or off + blen > n:
            break
        body = data[off + 8 : off + blen - 4]
        if btype == 1:  # interface description
            linktype = struct.unpack_from(end + "H", body, 0)[0]
            res = 10**6
            o = 8
            while o + 4 <= len(body):
                code, ln = struct.unpack_from(end + "HH", body, o)
                if code == 0:
                    break
                if code == 9 and ln >= 1:
                    v = body[o + 4]
                    res = 2 ** (v & 0x7F) if v & 0x80 else 10 ** (v & 0x7F)
                o += 4 + ((ln + 3) & ~3)
            ifaces.append((linktype, res))
        elif btype == 6 and len(body) >= 20:  # enhanced packet
            iface, hi, lo, caplen, _orig = struct.unpack_from(end + "IIIII", body, 0)
            if iface < len(ifaces):
                linktype, res = ifaces[iface]
                yield ((hi << 32) | lo) / res, linktype, body[20 : 20 + caplen]
        elif btype == 3 and len(body) >= 4 and ifaces:  # simple packet
            yield None, ifaces[0][0], body[4:]
        off += blen


def ip_payload(linktype, pkt):
    """(ethertype-ish protocol, offset of the IP header) for a link-layer frame, or None."""
    if linktype == 1:  # Ethernet
        if len(pkt) < 14:
            return None
        proto = struct.unpack_from("!H", pkt, 12)[0]
        off = 14
        while proto in (0x8100, 0x88A8) and len(pkt) >= off + 4:
            proto = struct.unpack_from("!H", pkt, off + 2)[0]
            off += 4
        return proto, off
    if linktype == 113:  # Linux cooked v1
        if len(pkt) < 16:
            return None
        return struct.unpack_from("!H", pkt, 14)[0], 16
    if linktype == 276:  # Linux cooked v2
        if len(pkt) < 20:
            return None
        return struct.unpack_from("!H", pkt, 0)[0], 20
    if linktype == 0 or linktype == 108:  # BSD loopback (host / network order family)
        if len(pkt) < 4:
            return None
        fam = struct.unpack_from("<I", pkt, 0)[0]
        if fam > 0xFFFF:
            fam = struct.unpack_from(">I", pkt, 0)[0]
        return (0x0800 if fam == 2 else 0x86DD), 4
    if linktype in (12, 14, 101, 228, 229):  # raw IP
        if not pkt:
            return None
        return (0x0800 if pkt[0] >> 4 == 4 else 0x86DD), 0
    return None


def tcp_segment(linktype, pkt):
    """(src ip, sport, dst ip, dport, seq, flags, payload) or None."""
    lp = ip_payload(linktype, pkt)
    if lp is None:
        return None
    proto, off = lp
    if proto == 0x0800:
        if len(pkt) < off + 20:
            return None
        ihl = (pkt[off] & 0x0F) * 4
        if pkt[off + 9] != 6:
            return None
        total = struct.unpack_from("!H", pkt, off + 2)[0]
        frag = struct.unpack_from("!H", pkt, off + 6)[0]
        if frag & 0x1FFF:
            return None  # non-first fragment (never on loopback)
        src, dst = pkt[off + 12 : off + 16], pkt[off + 16 : off + 20]
        ip_end = off + total if total else len(pkt)
        off += ihl
    elif proto == 0x86DD:
        if len(pkt) < off + 40:
            return None
        nxt = pkt[off + 6]
        plen = struct.unpack_from("!H", pkt, off + 4)[0]
        src, dst = pkt[off + 8 : off + 24], pkt[off + 24 : off + 40]
        ip_end = off + 40 + plen
        off += 40
        while nxt in (0, 43, 60) and len(pkt) >= off + 8:  # hop-by-hop, routing, dest opts
            nxt, hl = pkt[off], pkt[off + 1]
            off += (hl + 1) * 8
        if nxt != 6:
            return None
    else:
        return None
    if len(pkt) < off + 20:
        return None
    sport, dport, seq = struct.unpack_from("!HHI", pkt, off)
    doff = (pkt[off + 12] >> 4) * 4
    flags = pkt[off + 13]
    payload = pkt[off + doff : min(ip_end, len(pkt))]
    return src, sport, dst, dport, seq, flags, payload


# --------------------------------------------------------------------------------------------
# TCP reassembly


class Stream:
    """One direction of a TCP connection: delivers its bytes in sequence order to `sink`, each
    chunk with the timestamp of the packet that made it contiguous."""

    __slots__ = ("next", "pending", "sink", "midstream")

    def __init__(self, sink):
        self.next = None  # next expected sequence number (absolute, mod 2**32)
        self.pending = {}  # seq -> (ts, bytes) out of order
        self.sink = sink
        self.midstream = False

    def syn(self, seq):
        self.next = (seq + 1) & 0xFFFFFFFF
        self.pending.clear()

    def segment(self, ts, seq, payload):
        if not payload:
            return
        if self.next is None:  # capture began mid-connection
            self.next = seq
            self.midstream = True
        rel = (seq - self.next) & 0xFFFFFFFF
        if rel >= 0x80000000:  # starts before what we have: retransmission / overlap
            back = 0x100000000 - rel
            if back >= len(payload):
                return
            payload = payload[back:]
            seq = self.next
            rel = 0
        if rel > 0:
            old = self.pending.get(seq)
            if old is None or len(old[1]) < len(payload):
                self.pending[seq] = (ts, payload)
            return
        self._deliver(ts, payload)
        while self.pending:
            progressed = False
            for s in list(self.pending):
                r = (s - self.next) & 0xFFFFFFFF
                if r >= 0x80000000 or r == 0:
                    _, p = self.pending.pop(s)
                    back = (0x100000000 - r) & 0xFFFFFFFF
                    if back < len(p):
                        self._deliver(ts, p[back:])
                        progressed = True
            if not progressed:
                break

    def _deliver(self, ts, data):
        self.next = (self.next + len(data)) & 0xFFFFFFFF
        self.sink(ts, data)


# --------------------------------------------------------------------------------------------
# AMQP 0-9-1


class AmqpParser:
    """Frames of one direction of an AMQP connection; calls on_body(ts, body) for each complete
    message body (content header's size reached), per channel."""

    def __init__(self, client_side, on_body):
        self.buf = bytearray()
        self.client_side = client_side
        self.need_header = client_side  # the client's 8-byte protocol header comes first
        self.synced = True
        self.on_body = on_body
        self.bodies = {}  # channel -> [expected size, bytearray]

    def midstream(self):
        self.need_header = False
        self.synced = False

    def feed(self, ts, data):
        buf = self.buf
        buf += data
        pos = 0
        if self.need_header:
            if len(buf) < 8:
                if AMQP_HEADER.startswith(bytes(buf)):
                    return
                self.need_header = False
                self.synced = False
            elif buf[:8] == AMQP_HEADER:
                pos = 8
                self.need_header = False
            else:
                self.need_header = False
                self.synced = False
        if not self.synced:
            pos = self._resync(pos)
            if pos is None:
                if len(buf) > MAX_FRAME:
                    del buf[:-8]
                return
        n = len(buf)
        while n - pos >= 7:
            ftype = buf[pos]
            channel = (buf[pos + 1] << 8) | buf[pos + 2]
            size = int.from_bytes(buf[pos + 3 : pos + 7], "big")
            end = pos + 7 + size
            plausible = ftype in (1, 2, 3, 8) and size <= MAX_FRAME
            if plausible and end >= n:
                break
            if not plausible or buf[end] != FRAME_END:
                self.synced = False
                pos = self._resync(pos + 1)
                if pos is None:
                    del buf[:]
                    return
                continue
            if channel != 0:
                self._frame(ts, ftype, channel, buf, pos + 7, size)
            pos = end + 1
        del buf[:pos]

    def _resync(self, start):
        """The offset of the first plausible frame at or after start (a valid frame whose end byte
        is in place, followed by another plausible frame start or the end of the data)."""
        buf = self.buf
        n = len(buf)
        for p in range(start, n - 7):
            if buf[p] not in (1, 2, 3, 8):
                continue
            size = int.from_bytes(buf[p + 3 : p + 7], "big")
            if size > MAX_FRAME:
                continue
            end = p + 7 + size
            if end >= n or buf[end] != FRAME_END:
                continue
            if end + 1 < n and buf[end + 1] not in (1, 2, 3, 8):
                continue
            self.synced = True
            return p
        return None

    def _frame(self, ts, ftype, channel, buf, off, size):
        if ftype == 2:  # content header: class(2) weight(2) body size(8)
            if size >= 12:
                body_size = int.from_bytes(buf[off + 4 : off + 12], "big")
                if body_size == 0:
                    self.bodies.pop(channel, None)
                else:
                    self.bodies[channel] = [body_size, bytearray()]
        elif ftype == 3:
            st = self.bodies.get(channel)
            chunk = bytes(buf[off : off + size])
            if st is None:  # header not seen (mid-stream start): take the frame as the body
                self.on_body(ts, chunk)
                return
            st[1] += chunk
            if len(st[1]) >= st[0]:
                del self.bodies[channel]
                self.on_body(ts, bytes(st[1]))
        elif ftype == 1:  # a method frame ends any body in progress on the channel
            self.bodies.pop(channel, None)


# --------------------------------------------------------------------------------------------
# RESP


class NeedMore(Exception):
    pass


def resp_value(buf, pos):
    """Parses one RESP2/RESP3 value at pos; returns (end, value-ish) where value-ish is the list
    of bulk arguments for an array (for commands) or None. Raises NeedMore when incomplete,
    ValueError on garbage."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0:
        raise NeedMore
    t = buf[pos]
    line = bytes(buf[pos + 1 : nl])
    after = nl + 2
    if t in b"+-:_,#(":  # simple string, error, integer, null, double, bool, big number
        return after, None
    if t in b"$!=":  # bulk string, bulk error, verbatim string
        ln = int(line)
        if ln < 0:
            return after, None
        if len(buf) < after + ln + 2:
            raise NeedMore
        return after + ln + 2, bytes(buf[after : after + ln])
    if t in b"*~>%|":  # array, set, push, map, attribute
        cnt = int(line)
        if cnt < 0:
            return after, None
        if t in b"%|":
            cnt *= 2
        items = []
        p = after
        for _ in range(cnt):
            p, v = resp_value(buf, p)
            items.append(v)
        if t == ord("|"):  # an attribute precedes the real reply
            return resp_value(buf, p)
        return p, items
    raise ValueError(f"bad RESP type byte {t!r}")


class RedisConn:
    """One Redis connection: commands in order, replies matched to them in order."""

    def __init__(self, port, log):
        self.port = port
        self.cbuf = bytearray()
        self.rbuf = bytearray()
        self.queue = []  # commands awaiting a reply: [cmd record or None]
        self.qhead = 0
        self.log = log
        self.broken = False
        self.saw_command = False
        self.midstream = False

    def _values(self, buf, inline=False):
        """Yields each whole RESP value in buf (None for an inline command when `inline`), then
        drops what it consumed; a value cut short waits for more data, a malformed one breaks
        the connection's matching and drops the buffer."""
        pos = 0
        try:
            while pos < len(buf):
                if inline and buf[pos] != ord("*"):  # inline command (not from a client library)
                    nl = buf.find(b"\r\n", pos)
                    if nl < 0:
                        break
                    pos = nl + 2
                    yield None
                    continue
                try:
                    pos, value = resp_value(buf, pos)
                except NeedMore:
                    break
                except ValueError:
                    self.broken = True
                    pos = len(buf)
                    return
                yield value
        finally:
            del buf[:pos]

    def client_data(self, ts, data):
        self.cbuf += data
        for items in self._values(self.cbuf, inline=True):
            rec = None
            if items is not None:
                self.saw_command = True
                if items and isinstance(items[0], bytes) and items[0].upper() == b"EVALSHA":
                    ids = [a.decode() for a in items[1:] if isinstance(a, bytes) and ARG_ID_RE.fullmatch(a)]
                    rec = {"sent": ts, "reply": None, "ids": ids, "port": self.port}
                    self.log.append(rec)
                elif items and isinstance(items[0], bytes) and items[0].upper() in (b"SUBSCRIBE", b"PSUBSCRIBE", b"MONITOR"):
                    self.broken = True  # push-style replies: no 1:1 matching
            self.queue.append(rec)

    def server_data(self, ts, data):
        if self.midstream and not self.saw_command:
            return  # replies to commands sent before the capture: cannot be matched
        self.rbuf += data
        for _ in self._values(self.rbuf):
            if self.qhead < len(self.queue):
                rec = self.queue[self.qhead]
                self.qhead += 1
                if rec is not None and not self.broken:
                    rec["reply"] = ts
            if self.qhead > 4096:
                del self.queue[: self.qhead]
                self.qhead = 0


# --------------------------------------------------------------------------------------------
# Messages and runs


class Msg:
    __slots__ = ("id", "run", "t1", "t2", "t3", "t4", "p1", "p2", "p3", "p4", "evals")

    def __init__(self, mid, run, ts, port):
        self.id, self.run = mid, run
        self.t1, self.p1 = ts, port
        self.t2 = self.t3 = self.t4 = None
        self.p2 = self.p3 = self.p4 = None
        self.evals = []


class Tracker:
    def __init__(self):
        self.current = {}  # id -> Msg
        self.all = []
        self.publisher_ports = set()  # client ports that sent some message's t1
        self.unmatched_evals = 0

    def body(self, ts, to_broker, port, body):
        m = ID_RE.search(body)
        if not m:
            return
        mid = m.group(1).decode()
        cur = self.current.get(mid)
        if to_broker:
            if cur is None or cur.t4 is not None:
                new_run = True
            elif cur.t2 is None:
                # Not delivered yet: from another connection, the next run's publish (the
                # previous one lost); from the same, a duplicate publish, ignored.
                if port == cur.p1:
                    return
                new_run = True
            elif cur.t3 is None:
                # Delivered, not yet republished: the republish, unless it comes from a
                # connection that publishes requests (e.g. a denied message, never dispatched,
                # published again by the next run).
                new_run = port in self.publisher_ports and port != cur.p2
            else:
                new_run = True  # a third publish before the sink's delivery
            if new_run:
                run = 1 if cur is None else cur.run + 1
                msg = Msg(mid, run, ts, port)
                self.current[mid] = msg
                self.all.append(msg)
                self.publisher_ports.add(port)
            else:
                cur.t3, cur.p3 = ts, port
        else:
            if cur is None:
                return
            if cur.t2 is None:
                cur.t2, cur.p2 = ts, port
            elif cur.t3 is not None and cur.t4 is None:
                cur.t4, cur.p4 = ts, port
            # else: a redelivery or a second consumer: ignored

    def evalsha(self, rec):
        for mid in rec["ids"]:
            cur = self.current.get(mid)
            if cur is not None and cur.t2 is not None and cur.t3 is None:
                cur.evals.append(rec)
                return
        self.unmatched_evals += 1


# --------------------------------------------------------------------------------------------
# Report

HOPS = [
    ("broker: requests queue to consumer", "t2-t1"),
    ("worker: delivery to EVALSHA sent", "rs-t2"),
    ("Redis round trip", "rr-rs"),
    ("worker: reply to republish", "t3-rr"),
    ("worker total", "t3-t2"),
    ("broker: dispatch to sink", "t4-t3"),
    ("end to end", "t4-t1"),
]


def hop_values(m):
    rs = rr = None
    if m.evals:
        rs = m.evals[0]["sent"]
        replies = [e["reply"] for e in m.evals if e["reply"] is not None]
        rr = max(replies) if replies else None
    v = {
        "t2-t1": m.t2 - m.t1,
        "t3-t2": m.t3 - m.t2,
        "t4-t3": m.t4 - m.t3,
        "t4-t1": m.t4 - m.t1,
        "rs-t2": rs - m.t2 if rs is not None else None,
        "rr-rs": rr - rs if rs is not None and rr is not None else None,
        "t3-rr": m.t3 - rr if rr is not None else None,
    }
    return v


def quantile(sorted_vals, q):
    if not sorted_vals:
        return float("nan")
    i = max(0, min(len(sorted_vals) - 1, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[i]


def fmt(x):
    return "      -" if x is None or x != x else f"{x * 1e3:7.3f}"


def report(tracker, skip, out=sys.stdout):
    runs = defaultdict(list)
    for m in tracker.all:
        runs[m.run].append(m)
    if not runs:
        print("no messages with an id matching g<digits> found", file=out)
        return
    for run in sorted(runs):
        msgs = runs[run]
        t0 = min(m.t1 for m in msgs)
        complete = [m for m in msgs if m.t4 is not None]
        counted = [m for m in complete if m.t1 >= t0 + skip]
        n_eval = sum(1 for m in counted if m.evals)
        n_reply = sum(1 for m in counted if m.evals and all(e["reply"] is not None for e in m.evals))
        multi = sum(1 for m in counted if len(m.evals) > 1)
        span = max(m.t1 for m in msgs) - t0
        print(f"=== run {run}: {len(msgs)} published, {len(complete)} complete (t1..t4), "
              f"{len(msgs) - len(complete)} incomplete; {len(counted)} counted after skipping "
              f"the first {skip:g} s of {span:.2f} s of publishing", file=out)
        if msgs and len(complete) < len(msgs):
            stages = defaultdict(int)
            for m in msgs:
                if m.t4 is None:
                    stages["no t2" if m.t2 is None else "no t3" if m.t3 is None else "no t4"] += 1
            print("    incomplete: " + ", ".join(f"{k} {v}" for k, v in sorted(stages.items())), file=out)
        print(f"    with an EVALSHA: {n_eval} (with every reply matched: {n_reply}; "
              f"more than one EVALSHA: {multi})", file=out)
        if not counted:
            if complete:
                print(f"    nothing counted: the run published for less than --skip-first-seconds "
                      f"{skip:g}; try --skip-first-seconds 0", file=out)
            continue
        vals = [hop_values(m) for m in counted]
        print(f"    {'hop (ms)':40s} {'n':>6s} {'p50':>7s} {'p90':>7s} {'p99':>7s} {'max':>7s} {'mean':>7s}", file=out)
        for name, key in HOPS:
            xs = sorted(v[key] for v in vals if v[key] is not None)
            if not xs:
                print(f"    {name:40s} {0:6d}  (none)", file=out)
                continue
            print(f"    {name:40s} {len(xs):6d} {fmt(quantile(xs, .5))} {fmt(quantile(xs, .9))} "
                  f"{fmt(quantile(xs, .99))} {fmt(xs[-1])} {fmt(sum(xs) / len(xs))}", file=out)
            neg = sum(1 for x in xs if x < 0)
            if neg:
                print(f"    {'':40s} !! {neg} negative values", file=out)
        order = sorted(range(len(vals)), key=lambda i: vals[i]["t4-t1"], reverse=True)
        k = max(1, math.ceil(len(vals) / 100))
        tail = [vals[i] for i in order[:k]]
        e2e_cut = tail[-1]["t4-t1"]
        print(f"    slowest 1% by end to end ({k} messages, >= {e2e_cut * 1e3:.3f} ms): mean per hop, "
              f"vs mean of all", file=out)
        for name, key in HOPS:
            ts = [v[key] for v in tail if v[key] is not None]
            xs = [v[key] for v in vals if v[key] is not None]
            if not ts:
                continue
            print(f"      {name:40s} {fmt(sum(ts) / len(ts))}   (all: {fmt(sum(xs) / len(xs))})", file=out)
        wt = sorted(v["t3-t2"] for v in vals)
        e2e = sorted(v["t4-t1"] for v in vals)
        print(f"    worker total p99 {quantile(wt, .99) * 1e3:.3f} ms against end to end p99 "
              f"{quantile(e2e, .99) * 1e3:.3f} ms", file=out)
        slow = [counted[i] for i in order[: min(5, k)]]
        print("    slowest messages (ms: t2-t1 rs-t2 rr-rs t3-rr t4-t3 = e2e; ports publish/worker/sink):", file=out)
        for m in slow:
            v = hop_values(m)
            print(f"      {m.id:>8s} " + " ".join(fmt(v[k]) for k in ("t2-t1", "rs-t2", "rr-rs", "t3-rr", "t4-t3"))
                  + f" = {fmt(v['t4-t1'])}  {m.p1}/{m.p2}->{m.p3}/{m.p4}  at +{m.t1 - t0:.3f} s", file=out)


# --------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pcap")
    ap.add_argument("--redis-port", type=int, default=6379)
    ap.add_argument("--amqp-port", type=int, default=5672)
    ap.add_argument("--skip-first-seconds", type=float, default=1.0,
                    help="drop each run's first S seconds by publish time (warm-up)")
    args = ap.parse_args(argv)

    tracker = Tracker()
    evals = []
    streams = {}  # (src ip, sport, dst ip, dport) -> Stream
    redis_conns = {}  # (client ip, client port) -> RedisConn
    stats = defaultdict(int)
    last_ts = 0.0

    def new_stream(key, sport, dport, syn=False):
        if args.amqp_port in (sport, dport):
            to_broker = dport == args.amqp_port
            port = sport if to_broker else dport
            parser = AmqpParser(to_broker, lambda ts, body: tracker.body(ts, to_broker, port, body))
            return Stream(parser.feed), parser
        to_server = dport == args.redis_port
        ckey = (key[0], sport) if to_server else (key[2], dport)
        conn = redis_conns.get(ckey)
        if conn is None or (syn and to_server):  # a SYN from the client: a fresh connection
            conn = redis_conns[ckey] = RedisConn(ckey[1], evals)
        return Stream(conn.client_data if to_server else conn.server_data), conn

    for ts, linktype, pkt in read_packets(args.pcap):
        stats["packets"] += 1
        if ts is None:
            ts = last_ts
        last_ts = ts
        seg = tcp_segment(linktype, pkt)
        if seg is None:
            stats["not tcp"] += 1
            continue
        src, sport, dst, dport, seq, flags, payload = seg
        if not ({sport, dport} & {args.amqp_port, args.redis_port}):
            stats["other ports"] += 1
            continue
        key = (src, sport, dst, dport)
        if flags & 0x02:  # SYN: a new connection on this 4-tuple
            st, _ = new_stream(key, sport, dport, syn=True)
            streams[key] = st
            st.syn(seq)
            continue
        st = streams.get(key)
        if st is None:
            if not payload:
                continue
            st, parser = new_stream(key, sport, dport)
            streams[key] = st
            if isinstance(parser, AmqpParser):
                parser.midstream()
            else:
                parser.midstream = True
            stats["mid-stream connections"] += 1
        n_before = len(evals)
        st.segment(ts, seq, payload)
        for rec in evals[n_before:]:
            if rec["ids"]:
                tracker.evalsha(rec)
        if flags & 0x05:  # FIN/RST: forget the 4-tuple (ports may be reused)
            streams.pop(key, None)

    n_ev = len(evals)
    with_id = sum(1 for e in evals if e["ids"])
    replied = sum(1 for e in evals if e["reply"] is not None)
    broken = sum(1 for c in redis_conns.values() if c.broken)
    print(f"capture {args.pcap}: {stats['packets']} packets ({stats['not tcp']} not TCP, "
          f"{stats['other ports']} other ports, {stats['mid-stream connections']} streams joined mid-way); "
          f"AMQP port {args.amqp_port}, Redis port {args.redis_port}: {len(redis_conns)} Redis connections, "
          f"{n_ev} EVALSHA ({with_id} carrying a g<digits> id, {replied} with a matched reply, "
          f"{tracker.unmatched_evals} not during a message's worker hop)"
          + (f"; {broken} Redis connections without 1:1 replies (pub/sub), not matched" if broken else ""))
    report(tracker, args.skip_first_seconds)


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        pass
