#!/usr/bin/env bash
# OpenAPI conformance check of the client API against docs/openapi.yaml.
#
#  1. Builds forkless (debug) and runs one node on a free loopback port
#     with a throwaway data dir.
#  2. schemathesis (examples, coverage, fuzzing, stateful phases) against the
#     spec: fails on any 5xx, or a status code, content type, header or body
#     that the spec does not document.
#  3. tests/openapi/edge_cases.py against the same node: raw-byte and
#     write-then-read cases that fuzzing does not reach.
#  4. Node 1 of a two-node cluster whose node 2 is a fake peer played by
#     edge_cases.py --cluster: 421 not_owner, 503 owner_unavailable (both
#     `executed` values), a relayed owner answer, the peer-only header and
#     endpoint.
#  Fails too if a node dies or panics during its run.
#
#   tests/openapi/run.sh                                # defaults below
#   MAX_EXAMPLES=300 SEED=1 tests/openapi/run.sh        # extra args go to `schemathesis run`
#
# Env: MAX_EXAMPLES (100 per operation), SEED (unset: random), PHASES (all
# four), WORKERS (1: with more, Python 3.11's ast.parse races inside
# hypothesis), SPEC (docs/openapi.yaml), SKIP_EDGE=1 skips steps 3 and 4,
# KEEP=1 keeps logs and reports (kept anyway on failure).
# Talks only to 127.0.0.1. Needs cargo, python3, curl; installs schemathesis
# with pip if it is missing.
set -euo pipefail

cd "$(dirname "$0")/../.."
ROOT=$PWD
MAX_EXAMPLES=${MAX_EXAMPLES:-100}
WORKERS=${WORKERS:-1}
PHASES=${PHASES:-examples,coverage,fuzzing,stateful}
SPEC=${SPEC:-$ROOT/docs/openapi.yaml}
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,response_headers_conformance
SECRET=openapi-conformance-secret

say() { echo "openapi: $*" >&2; }

# --- schemathesis ---------------------------------------------------------------
if ! command -v schemathesis >/dev/null 2>&1; then
    say "schemathesis not found; installing it with pip"
    if ! python3 -m pip install --quiet schemathesis; then
        say "FAILED: could not install schemathesis with pip (python3 -m pip install schemathesis)"
        exit 2
    fi
    hash -r
    if ! command -v schemathesis >/dev/null 2>&1; then
        say "FAILED: pip installed schemathesis but it is not on PATH ($(python3 -m site --user-base)/bin?)"
        exit 2
    fi
fi
ST_VERSION=$(schemathesis --version | awk '{print $NF}')
case "$ST_VERSION" in
    4.*) ;;
    *) say "FAILED: need schemathesis 4.x (its CLI changed in v4), found $ST_VERSION"; exit 2 ;;
esac

# --- build ------------------------------------------------------------------------
# The debug build (what ./scripts/test builds): conformance needs no speed,
# and the release profile (fat LTO, one codegen unit) takes minutes more.
say "building forkless (debug)"
cargo build --locked -p forkless
WORK=$(mktemp -d)
# Run a copy: the shared target/ may be rebuilt while this runs.
cp "$ROOT/target/debug/forkless" "$WORK/forkless"

PIDS=()
cleanup() {
    local rc=$? p
    for p in "${PIDS[@]}"; do
        if kill -0 "$p" 2>/dev/null; then kill "$p" 2>/dev/null || true; fi
    done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    if [ "${KEEP:-0}" = 1 ] || [ "$rc" != 0 ]; then
        say "logs and reports kept in $WORK"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_ports() { # N free loopback ports
    python3 -c '
import socket, sys
ss = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))' "$1"
}

wait_ready() { # pid base log
    local i
    for i in $(seq 1 150); do
        if ! kill -0 "$1" 2>/dev/null; then
            say "FAILED: the server exited before it was ready:"; cat "$3" >&2; exit 1
        fi
        if curl -fsS "$2/readyz" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    say "FAILED: $2 not ready after 30 s"; cat "$3" >&2; exit 1
}

FAIL=0
check_node() { # pid log name: the node must be up and must not have panicked
    if ! kill -0 "$1" 2>/dev/null; then
        say "FAILED: the $3 died during the run; its log:"; tail -50 "$2" >&2; FAIL=1
        if grep -q 'shutting down' "$2"; then
            say "(it shut down on a SIGTERM/SIGINT this script did not send: another process on the machine stopped it)"
        fi
    fi
    if grep -q 'panicked' "$2"; then
        say "FAILED: the $3 panicked ($(grep -c 'panicked' "$2") times):"
        grep -A1 'panicked' "$2" | grep -v '^--$' | sed "s/^thread '[^']*' ([0-9]*) //" | sort | uniq -c >&2
        FAIL=1
    fi
}

# --- 1. one node ------------------------------------------------------------------
read -r PORT < <(free_ports 1)
BASE=http://127.0.0.1:$PORT
LOG=$WORK/server.log
"$WORK/forkless" serve --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" >"$LOG" 2>&1 &
PID=$!
PIDS+=("$PID")
say "waiting for $BASE/readyz (pid $PID)"
wait_ready "$PID" "$BASE" "$LOG"

# --- 2. schemathesis ------------------------------------------------------------------
# Long-polls: the spec allows wait_ms up to 30000, and the stateful phase
# reads live executions, where each such read blocks for the whole wait.
# The fuzzer gets a copy of the spec with wait_ms capped at 200 ms (the
# real bound is checked by edge_cases.py); nothing else differs.
FUZZ_SPEC=$WORK/openapi-fuzz.yaml
python3 - "$SPEC" "$FUZZ_SPEC" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
n = 0
for item in doc["paths"].values():
    for op in item.values():
        for prm in op.get("parameters", []) if isinstance(op, dict) else []:
            if prm.get("name") == "wait_ms":
                prm["schema"]["maximum"] = 200
                n += 1
assert n, "no wait_ms parameter found in the spec"
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY

seed_args=()
if [ -n "${SEED:-}" ]; then seed_args=(--seed "$SEED"); fi
say "schemathesis $ST_VERSION: $MAX_EXAMPLES examples per operation, phases $PHASES"
started=$(date +%s)
set +e
# From the work dir: schemathesis keeps a crash cache (.schemathesis/) in its cwd.
(cd "$WORK" && schemathesis run "$FUZZ_SPEC" \
    --url "$BASE" \
    --checks "$CHECKS" \
    --phases "$PHASES" \
    --max-examples "$MAX_EXAMPLES" \
    --workers "$WORKERS" \
    --request-timeout 45 \
    --generation-database none \
    --report junit --report-dir "$WORK/report" \
    --no-color \
    "${seed_args[@]}" "$@")
st=$?
set -e
say "schemathesis exited $st after $(( $(date +%s) - started )) s"
# What the node answered over the run, by status (from its own metrics).
curl -fsS "$BASE/metrics" 2>/dev/null | sed -n 's/^forkless_responses_total{status="\([0-9]*\)"} \([0-9]*\).*/\1 \2/p' \
    | sort -n | awk 'BEGIN{printf "openapi: responses by status:"} {printf " %s=%s", $1, $2} END{print ""}' >&2 || true
if [ "$st" != 0 ]; then say "FAILED: schemathesis found failures (report in $WORK/report)"; FAIL=1; fi

# --- 3. edge cases, same node ------------------------------------------------------------
if [ "${SKIP_EDGE:-0}" != 1 ]; then
    say "edge cases, one node (tests/openapi/edge_cases.py)"
    if ! python3 "$ROOT/tests/openapi/edge_cases.py" "$BASE" "$SPEC"; then
        say "FAILED: edge cases, one node"; FAIL=1
    fi
fi
check_node "$PID" "$LOG" "single node"
kill "$PID" 2>/dev/null || true
wait "$PID" 2>/dev/null || true

# --- 4. cluster edge cases -----------------------------------------------------------------
if [ "${SKIP_EDGE:-0}" != 1 ]; then
    read -r A1 P1 A2 P2 < <(free_ports 4)
    cat >"$WORK/cluster.toml" <<EOF
# Node 1 runs; node 2 (owner of shard 1) is a fake peer in edge_cases.py.
shard_count = 2
secret = "$SECRET"
[peer]
forward_connect_timeout_ms = 500
forward_timeout_ms = 2000
probe_interval_ms = 100
probe_timeout_ms = 300
[[nodes]]
id = 1
api_addr = "127.0.0.1:$A1"
peer_addr = "127.0.0.1:$P1"
[[nodes]]
id = 2
api_addr = "127.0.0.1:$A2"
peer_addr = "127.0.0.1:$P2"
EOF
    CLOG=$WORK/cluster-node1.log
    "$WORK/forkless" serve --config "$WORK/cluster.toml" --node 1 --data-dir "$WORK/cluster-data" >"$CLOG" 2>&1 &
    CPID=$!
    PIDS+=("$CPID")
    wait_ready "$CPID" "http://127.0.0.1:$A1" "$CLOG"
    say "edge cases, cluster node 1 of 2 (pid $CPID), node 2 faked on port $P2"
    if ! python3 "$ROOT/tests/openapi/edge_cases.py" --cluster "$SECRET:$P2" "http://127.0.0.1:$A1" "$SPEC"; then
        say "FAILED: edge cases, cluster"; FAIL=1
    fi
    check_node "$CPID" "$CLOG" "cluster node"
fi

if [ "$FAIL" != 0 ]; then exit 1; fi
say "OK"
