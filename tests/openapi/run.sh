#!/usr/bin/env bash
# OpenAPI conformance check: builds forkless, runs one node on a free
# loopback port with a throwaway data dir, and points schemathesis at
# docs/openapi.yaml. Fails if any response is a 5xx, or its status code,
# content type, headers or body do not match the spec, or the server dies
# or panics; then runs tests/openapi/edge_cases.py (raw-byte and
# write-then-read cases fuzzing does not reach) against the same node.
#
#   tests/openapi/run.sh                 # defaults below
#   MAX_EXAMPLES=200 tests/openapi/run.sh --seed 1   # extra args go to `schemathesis run`
#
# Env: MAX_EXAMPLES (100), WORKERS (1: with more, Python 3.11's ast.parse
# races inside hypothesis), SEED (unset: random), PHASES (all four), SPEC (docs/openapi.yaml), SKIP_EDGE=1 skips the edge cases,
# KEEP=1 keeps the data dir, server log and reports.
set -euo pipefail

cd "$(dirname "$0")/../.."
ROOT=$PWD
MAX_EXAMPLES=${MAX_EXAMPLES:-100}
WORKERS=${WORKERS:-1}
PHASES=${PHASES:-examples,coverage,fuzzing,stateful}
SPEC=${SPEC:-$ROOT/docs/openapi.yaml}
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,response_headers_conformance

say() { echo "openapi: $*" >&2; }

# --- schemathesis -----------------------------------------------------------
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

# --- build and start one node ----------------------------------------------
say "building forkless (release)"
cargo build --release -p forkless

WORK=$(mktemp -d)
DATA=$WORK/data
LOG=$WORK/server.log
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
BASE=http://127.0.0.1:$PORT

"$ROOT/target/release/forkless" serve --data-dir "$DATA" --listen "127.0.0.1:$PORT" >"$LOG" 2>&1 &
PID=$!

cleanup() {
    local rc=$?
    if kill -0 "$PID" 2>/dev/null; then
        kill "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
    fi
    if [ "${KEEP:-0}" = 1 ] || [ "$rc" != 0 ]; then
        say "server log and reports kept in $WORK"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "waiting for $BASE/readyz (pid $PID)"
ready=0
for _ in $(seq 1 150); do
    if ! kill -0 "$PID" 2>/dev/null; then
        say "FAILED: the server exited before it was ready:"; cat "$LOG" >&2; exit 1
    fi
    if curl -fsS "$BASE/readyz" >/dev/null 2>&1; then ready=1; break; fi
    sleep 0.2
done
if [ "$ready" != 1 ]; then say "FAILED: not ready after 30 s"; cat "$LOG" >&2; exit 1; fi

# --- schemathesis -------------------------------------------------------------
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
say "schemathesis exited $st after $(( $(date +%s) - started )) s"
# What the node answered over the run, by status (from its own metrics).
curl -fsS "$BASE/metrics" 2>/dev/null | sed -n 's/^forkless_responses_total{status="\([0-9]*\)"} \([0-9]*\).*/\1 \2/p' \
    | sort -n | awk 'BEGIN{printf "openapi: responses by status:"} {printf " %s=%s", $1, $2} END{print ""}' >&2 || true

# Hand-written edge cases fuzzing does not reach (raw bytes, write-then-read).
edge=0
if [ "${SKIP_EDGE:-0}" != 1 ]; then
    say "edge cases (tests/openapi/edge_cases.py)"
    python3 "$ROOT/tests/openapi/edge_cases.py" "$BASE" "$SPEC"
    edge=$?
fi
set -e

# The server must still be up and must not have panicked.
fail=0
if ! kill -0 "$PID" 2>/dev/null; then
    say "FAILED: the server died during the run; its log:"; tail -50 "$LOG" >&2; fail=1
    if grep -q 'shutting down' "$LOG"; then
        say "(it shut down on SIGTERM/SIGINT that this script did not send: another process on the machine stopped it)"
    fi
fi
if grep -q 'panicked' "$LOG"; then
    say "FAILED: the server panicked ($(grep -c 'panicked' "$LOG") times):"
    grep -A1 'panicked' "$LOG" | grep -v '^--$' | sed "s/^thread '[^']*' ([0-9]*) //" | sort | uniq -c >&2
    fail=1
fi
if [ "$st" != 0 ]; then say "FAILED: schemathesis found failures (report in $WORK/report)"; fail=1; fi
if [ "$edge" != 0 ]; then say "FAILED: edge cases failed (see above)"; fail=1; fi
if [ "$fail" != 0 ]; then exit 1; fi
say "OK"
