#!/usr/bin/env python3
"""Hand-written edge cases that property-based fuzzing does not reach.

Each case sends raw bytes (so it can send what no JSON serializer would:
trailing garbage, invalid UTF-8 in a path, numbers out of f64 range, lone
surrogate escapes, deep nesting, a peer-only header) and then holds the
answer to docs/openapi.yaml: an HTTP answer at all (not a dropped
connection), not a 5xx, a status the operation documents, the expected
status, `application/json`, a body that matches the documented schema, and
an `x-forkless-node` header.

Some cases write something and then read it back: whatever a write accepts,
a later read of it must still answer.

    python3 tests/openapi/edge_cases.py http://127.0.0.1:7070 [docs/openapi.yaml]

Cluster mode checks the answers only a cluster gives (421 not_owner,
503 owner_unavailable with both `executed` values, a relayed owner answer,
the peer-only header and endpoint). It expects node 1 of a two-node
cluster (shard_count 2, node 2 owning shard 1) and plays node 2 itself: a
fake peer on node 2's peer port that answers probes, and answers forwards
either as an owner would or with a non-owner error page, or stops answering:

    python3 tests/openapi/edge_cases.py --cluster SECRET:FAKE_PEER_PORT URL [SPEC]

Needs only what schemathesis brings along (pyyaml, jsonschema_rs).
Ends with the line 'N passed, M failed'; exits 1 if any failed.
"""

from __future__ import annotations

import copy
import http.client
import http.server
import json
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import jsonschema_rs
import yaml

ROOT = Path(__file__).resolve().parents[2]


class Spec:
    def __init__(self, path: Path):
        self.doc = yaml.safe_load(path.read_text())

    def _ref(self, ref: str):
        node = self.doc
        for part in ref.lstrip("#/").split("/"):
            node = node[part]
        return node

    def resolve(self, node):
        """Inlines every $ref (the spec has no recursive schemas) and turns
        OpenAPI 3.0 `nullable: true` into JSON Schema."""
        if isinstance(node, list):
            return [self.resolve(x) for x in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return self.resolve(copy.deepcopy(self._ref(node["$ref"])))
        out = {k: self.resolve(v) for k, v in node.items() if k not in ("discriminator", "example")}
        if out.pop("nullable", False):
            return {"anyOf": [out, {"type": "null"}]}
        return out

    def responses(self, template: str, method: str) -> dict:
        op = self.doc["paths"][template][method.lower()]
        return {code: self.resolve(r) for code, r in op["responses"].items()}


class Client:
    def __init__(self, base: str):
        u = urllib.parse.urlsplit(base)
        self.host, self.port = u.hostname, u.port

    def send(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """Returns (status, headers, body bytes), or None if the server
        closed the connection without an answer."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            h = {"content-type": "application/json"} if body is not None else {}
            h.update(headers or {})
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, http.client.IncompleteRead):
            return None
        finally:
            conn.close()


class Runner:
    def __init__(self, base: str, spec: Spec):
        self.c = Client(base)
        self.spec = spec
        self.passed = 0
        self.failed: list[str] = []

    def check(self, name, template, method, path, body=None, headers=None, expect=None):
        """Sends one request and checks its answer; returns the parsed body."""
        r = self.c.send(method, path, body, headers)
        problems = []
        parsed = None
        if r is None:
            problems.append("no HTTP answer: the server closed the connection (a handler panic?)")
        else:
            status, h, raw = r
            docs = self.spec.responses(template, method)
            expected = set(expect) if isinstance(expect, (set, tuple)) else {expect}
            if status >= 500 and status not in expected:
                problems.append(f"server error {status}")
            if expect is not None and status not in expected:
                problems.append(f"status {status}, expected {expect}")
            doc = docs.get(str(status))
            if doc is None:
                problems.append(f"status {status} is not documented for {method} {template}")
            ctype = h.get("content-type", "")
            if not ctype.startswith("application/json"):
                problems.append(f"content-type {ctype!r}, not application/json")
            if "x-forkless-node" not in h:
                problems.append("no x-forkless-node header")
            try:
                parsed = json.loads(raw)
            except ValueError:
                problems.append(f"body is not JSON: {raw[:200]!r}")
            if doc is not None and parsed is not None:
                schema = doc.get("content", {}).get("application/json", {}).get("schema")
                if schema is not None:
                    errs = [e.message for e in jsonschema_rs.validator_for(schema).iter_errors(parsed)]
                    if errs:
                        problems.append(f"body does not match the documented schema: {errs[:3]} in {raw[:300]!r}")
                for hname, hdoc in (doc.get("headers") or {}).items():
                    if hdoc.get("required") and hname.lower() not in h:
                        problems.append(f"documented header {hname} missing")
        what = f"{name}: {method} {path[:80]}"
        if problems:
            self.failed.append(what)
            print(f"FAIL {what}")
            for p in problems:
                print(f"     - {p}")
        else:
            self.passed += 1
            print(f"ok   {what} -> {r[0]}")
        return parsed

    def finish(self) -> int:
        print()
        if self.failed:
            print("failed:")
            for f in self.failed:
                print(f"  {f}")
        print(f"{self.passed} passed, {len(self.failed)} failed")
        return 1 if self.failed else 0

    def start(self, body: dict | bytes = b'{"workflow":"edge"}'):
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        r = self.c.send("POST", "/api/executions", body)
        assert r is not None and r[0] == 201, f"could not start an execution: {r}"
        return json.loads(r[2])["execution_id"]


def main() -> int:
    args = sys.argv[1:]
    cluster = None
    if args[:1] == ["--cluster"]:
        cluster, args = args[1], args[2:]
    base = args[0] if args else "http://127.0.0.1:7070"
    spec = Spec(Path(args[1]) if len(args) > 1 else ROOT / "docs/openapi.yaml")
    t = Runner(base, spec)
    if cluster is not None:
        secret, port = cluster.rsplit(":", 1)
        cluster_cases(t, secret, int(port))
        return t.finish()
    single_node_cases(t)
    return t.finish()


def single_node_cases(t: Runner) -> None:
    EX = "/api/executions"
    ID = "/api/executions/{id}"
    EV = "/api/executions/{id}/events"

    # --- request bodies: malformed JSON must be refused, not half-read -----
    t.check("trailing garbage after the body", EX, "POST", EX, b'{"workflow":"a"} trailing', expect=400)
    t.check("two JSON objects in one body", EX, "POST", EX, b'{"workflow":"a"}{"workflow":"b"}', expect=400)
    t.check("invalid UTF-8 in a body string", EX, "POST", EX, b'{"workflow":"a\xff"}', expect=400)
    t.check("unknown field", EX, "POST", EX, b'{"workflow":"a","bogus":1}', expect=400)
    t.check("execution id as a number", "/api/events", "POST", "/api/events",
            b'{"execution_id":1,"events":[{"type":"x"}]}', expect=400)
    t.check("body over the size limit", EX, "POST", EX,
            b'{"workflow":"' + b"a" * (8 * 1024 * 1024 + 16) + b'"}', expect=413)

    # --- paths and query ------------------------------------------------------
    t.check("invalid UTF-8 in an id path segment", ID, "GET", "/api/executions/%FF", expect=400)
    t.check("invalid UTF-8 in a routing key", "/api/keys/{routing_key}", "GET", "/api/keys/a%FFb", expect=400)
    t.check("control character in a routing key", "/api/keys/{routing_key}", "GET", "/api/keys/a%01b", expect=400)
    t.check("id above i64::MAX", ID, "GET", "/api/executions/9223372036854775808", expect=400)
    t.check("id zero", ID, "GET", "/api/executions/0", expect=400)
    t.check("empty routing key", "/api/keys/{routing_key}", "GET", "/api/keys/", expect=404)
    t.check("routing key with '/' raw", "/api/keys/{routing_key}", "GET", "/api/keys/tenant-a/order-1", expect=200)
    t.check("routing key with '/' encoded", "/api/keys/{routing_key}", "GET", "/api/keys/tenant-a%2Forder-1", expect=200)

    # --- peer-only header -----------------------------------------------------------
    t.check("client sets x-forkless-hops", EX, "POST", EX, b'{"workflow":"a"}',
            headers={"x-forkless-hops": "1"}, expect=403)
    t.check("peer status without a token", "/internal/v1/status", "GET", "/internal/v1/status", expect=403)

    # --- an execution's life ----------------------------------------------------------
    e = t.start()
    p = f"/api/executions/{e}"
    t.check("limit 0", EV, "GET", f"{p}/events?limit=0", expect=400)
    t.check("wait_ms over the maximum", EV, "GET", f"{p}/events?wait_ms=30001", expect=400)
    t.check("reserved event type", EV, "POST", f"{p}/events",
            b'{"events":[{"type":"execution.started"}]}', expect=400)
    t.check("terminal event not last", EV, "POST", f"{p}/events",
            b'{"events":[{"type":"execution.completed"},{"type":"x"}]}', expect=400)
    t.check("repeated idempotency key in a batch", EV, "POST", f"{p}/events",
            b'{"events":[{"type":"x","idempotency_key":"k"},{"type":"y","idempotency_key":"k"}]}', expect=400)
    t.check("sequence conflict", EV, "POST", f"{p}/events",
            b'{"events":[{"type":"x"}],"expected_last_seq":7}', expect=409)
    t.check("append", EV, "POST", f"{p}/events",
            b'{"events":[{"type":"x","payload":{"a":[1,2]},"idempotency_key":"k1"}],"expected_last_seq":1}', expect=200)
    t.check("append, deduplicated", EV, "POST", f"{p}/events",
            b'{"events":[{"type":"x","payload":{"a":[1,2]},"idempotency_key":"k1"}]}', expect=200)
    t.check("used idempotency key, another payload", EV, "POST", f"{p}/events",
            b'{"events":[{"type":"x","idempotency_key":"k1"}]}', expect=409)
    t.check("short long-poll, nothing new", EV, "GET", f"{p}/events?after=2&wait_ms=50", expect=200)
    t.check("cancel with an empty body", "/api/executions/{id}/cancel", "POST", f"{p}/cancel", b"", expect=200)
    t.check("append after cancel", EV, "POST", f"{p}/events", b'{"events":[{"type":"x"}]}', expect=409)
    t.check("read a cancelled execution", EV, "GET", f"{p}/events", expect=200)
    t.check("unknown execution", ID, "GET", "/api/executions/1", expect=404)

    # --- what a write accepts, a read must answer --------------------------------------
    # Each payload below is valid JSON text. The server may refuse it (400),
    # but if it stores it, reading the events back must still work.
    odd = {
        "number out of f64 range": b"1e400",
        "lone surrogate escape": b'"\\ud800"',
        "nesting 200 deep": b"[" * 200 + b"]" * 200,
    }
    for what, payload in odd.items():
        e = t.start()
        p = f"/api/executions/{e}"
        t.check(f"append payload: {what}", EV, "POST", f"{p}/events",
                b'{"events":[{"type":"x","payload":' + payload + b"}]}", expect={200, 400})
        t.check(f"read back after payload: {what}", EV, "GET", f"{p}/events", expect=200)
    body = b'{"workflow":"w","input":' + odd["number out of f64 range"] + b"}"
    r = t.c.send("POST", EX, body)
    if r is not None and r[0] == 201:
        e = json.loads(r[2])["execution_id"]
        t.check("read back after start input 1e400", EV, "GET", f"/api/executions/{e}/events", expect=200)
        t.check("get after start input 1e400", ID, "GET", f"/api/executions/{e}", expect=200)


class FakePeer:
    """Node 2's peer port: answers probes as node 2 owning shard 1, and
    forwards as `mode` says: "owner" (a JSON 404 from node 2, as the real
    owner would give for an unknown execution) or "garbage" (a proxy's
    text error page). `stop()` closes the port."""

    def __init__(self, port: int):
        self.mode = "owner"
        peer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self):
                n = int(self.headers.get("content-length") or 0)
                if n:
                    self.rfile.read(n)
                if self.path == "/internal/v1/status":
                    body = json.dumps({"node": 2, "map_version": 1, "owned": [{"shard": 1, "epoch": 1}]}).encode()
                    self._send(200, body, {"content-type": "application/json", "x-forkless-node": "2"})
                elif peer.mode == "owner":
                    body = json.dumps({"error": "execution_not_found", "message": "execution not found"}).encode()
                    self._send(404, body, {
                        "content-type": "application/json", "x-forkless-node": "2",
                        "x-forkless-shard": "1", "x-forkless-owner": "2", "x-forkless-epoch": "1",
                        "x-forkless-map-version": "1", "x-forkless-hops": self.headers.get("x-forkless-hops", "0"),
                    })
                else:
                    self._send(502, b"<html>bad gateway</html>", {"content-type": "text/html"})

            def _send(self, code, body, headers):
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def node2_alive(t: Runner) -> bool | None:
    r = t.c.send("GET", "/api/cluster")
    if r is None or r[0] != 200:
        return None
    for n in json.loads(r[2])["nodes"]:
        if n["id"] == 2:
            return n["alive"]
    return None


def wait_for(cond, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def cluster_cases(t: Runner, secret: str, fake_port: int) -> None:
    ID = "/api/executions/{id}"
    EX = "/api/executions"
    peer = {"x-forkless-peer-token": secret}

    # Which ids live on which shard: the route headers say.
    local_id = remote_id = None
    for i in range(1, 200):
        r = t.c.send("GET", f"/api/executions/{i}")
        shard = r[1].get("x-forkless-shard") if r else None
        if shard == "0" and local_id is None:
            local_id = i
        if shard == "1" and remote_id is None:
            remote_id = i
        if local_id and remote_id:
            break
    assert local_id and remote_id, "could not find ids on both shards; is this node 1 of a 2-shard cluster?"
    remote_key = next(k for k in (f"key-{i}" for i in range(200))
                      if (t.c.send("GET", f"/api/keys/{k}") or (0, {}, b""))[1].get("x-forkless-shard") == "1")

    t.check("peer status with the token", "/internal/v1/status", "GET", "/internal/v1/status", headers=peer, expect=200)
    t.check("peer status with a wrong token", "/internal/v1/status", "GET", "/internal/v1/status",
            headers={"x-forkless-peer-token": "x" * 26}, expect=403)
    t.check("hop header from a peer, local shard", ID, "GET", f"/api/executions/{local_id}",
            headers={**peer, "x-forkless-hops": "1"}, expect=404)
    t.check("hop header from a peer, not a number", ID, "GET", f"/api/executions/{local_id}",
            headers={**peer, "x-forkless-hops": "many"}, expect=400)
    t.check("forwarded request reaches a non-owner", ID, "GET", f"/api/executions/{remote_id}",
            headers={**peer, "x-forkless-hops": "1"}, expect=421)
    t.check("client sets the hop header in a cluster", ID, "GET", f"/api/executions/{remote_id}",
            headers={"x-forkless-hops": "1"}, expect=403)

    fake = FakePeer(fake_port)
    try:
        if not wait_for(lambda: node2_alive(t) is True):
            t.failed.append("fake node 2 never came alive in /api/cluster")
            print("FAIL fake node 2 never came alive in /api/cluster")
            return
        fake.mode = "owner"
        t.check("owner's answer relayed", ID, "GET", f"/api/executions/{remote_id}", expect=404)
        fake.mode = "garbage"
        b = t.check("owner answered with a non-owner page", ID, "GET", f"/api/executions/{remote_id}", expect=503)
        if b is not None and b.get("executed") != "unknown":
            t.failed.append("non-owner page: executed should be \"unknown\"")
            print(f"FAIL non-owner page: executed is {b.get('executed')!r}, expected \"unknown\"")
        t.check("steered start, owner answered garbage", EX, "POST", EX,
                json.dumps({"workflow": "w", "routing_key": remote_key}).encode(), expect=503)
    finally:
        fake.stop()
    wait_for(lambda: node2_alive(t) is False)
    b = t.check("owner down", ID, "GET", f"/api/executions/{remote_id}", expect=503)
    if b is not None and b.get("executed") is not False:
        t.failed.append("owner down: executed should be false")
        print(f"FAIL owner down: executed is {b.get('executed')!r}, expected false")
    t.check("steered start, owner down", EX, "POST", EX,
            json.dumps({"workflow": "w", "routing_key": remote_key}).encode(), expect=503)
    t.check("key lookup, owner down", "/api/keys/{routing_key}", "GET", f"/api/keys/{remote_key}", expect=503)
    t.check("append, owner down", "/api/executions/{id}/events", "POST", f"/api/executions/{remote_id}/events",
            b'{"events":[{"type":"x"}]}', expect=503)
    t.check("unsteered start still placed locally", EX, "POST", EX, b'{"workflow":"w"}', expect=201)


if __name__ == "__main__":
    sys.exit(main())
