#!/usr/bin/env bash
# One prepared device run for issue 17: the CUDA tests, the shipped-pair benchmark (adaptive vs target-only vs fixed
# k, per workload, ITL p99), the realistic-size sweep (random weights, simulated acceptance) and a gRPC phase with the
# client in its own process. Every table goes into one folder. Needs no network: it uses the Python it finds
# (.venv/bin/python, else python3) and this repository, and says what is missing.
#
#   tools/gpu_check.sh [OUT]                    # on the GPU machine (about 4 minutes on an H200)
#   tools/gpu_check.sh --device cpu --quick OUT # rehearsal on a CPU: tiny shapes, a few tokens
#   OUT=/some/dir tools/gpu_check.sh            # OUT may also come from the environment
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) OUT="$1"; shift ;;
  esac
done
OUT="${OUT:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
STATUS=0

say() { echo "gpu_check: $*" | tee -a "$LOG"; }
phase() {  # phase NAME SECONDS CMD...: run with a time limit, log its output, remember a failure
  local name="$1" limit="$2"; shift 2
  say "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "== $name: exit $rc after $((SECONDS - t0))s"
  [ $rc -eq 0 ] || STATUS=1
  return $rc
}

say "output folder $OUT; python $PY; device $DEVICE; quick $QUICK"
if ! $PY - >>"$LOG" 2>&1 <<PYEOF
import importlib, sys
missing = []
for name in ("torch", "transformers", "safetensors", "grpc", "pytest", "specrpc"):
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing.append(f"{name} ({exc})")
if missing:
    print("MISSING python packages: " + ", ".join(missing) + " (run make install, offline: pip install --no-index)")
    sys.exit(2)
import torch
print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}, cuda build: {torch.version.cuda}")
if "$DEVICE" == "cuda" and not torch.cuda.is_available():
    print("MISSING: a CUDA build of torch with a visible GPU (torch.cuda.is_available() is False); "
          "use --device cpu for a rehearsal")
    sys.exit(2)
if torch.cuda.is_available():
    print("GPU:", torch.cuda.get_device_name())
PYEOF
then
  tail -n 3 "$LOG"; say "stopping: prerequisites missing (see above)"; exit 2
fi
tail -n 2 "$LOG"

if [ ! -f specrpc/v1/generator_pb2.py ]; then
  say "gRPC stubs not generated; trying tools/gen_proto.py (needs grpcio-tools)"
  $PY tools/gen_proto.py >>"$LOG" 2>&1 || say "MISSING: gRPC stubs (grpcio-tools absent?): the gRPC phase will fail"
fi
if [ ! -f specrpc/assets/target/config.json ]; then
  say "MISSING: the shipped pair (specrpc/assets): the CUDA tests and the shipped-pair benchmark will be skipped/fail"
fi

if [ "$QUICK" = 1 ]; then
  BENCH=(--cases 1 --ks 2 --max-new-tokens 12 --threads 1)
  REAL=(--quick --threads 1 --pair qwen2.5-coder-7b/0.5b)
  STREAM=(--cases 1)
else
  BENCH=(--cases 2 --ks 1,2,3,4,6,8)
  REAL=()
  STREAM=(--cases 2)
fi

# 1. CUDA tests (graph replay = eager, exact speculation with graphs, the guard both ways with a stall injected)
if [ "$DEVICE" = cuda ]; then
  phase "cuda tests" 100 $PY -m pytest -m gpu tests/test_cuda.py -q -p no:cacheprovider \
    --junitxml="$OUT/cuda_tests.xml"
else
  say "== cuda tests: skipped on --device $DEVICE"
fi

# 2. Shipped pair in process: adaptive vs target-only vs fixed k, per workload with ITL p99 (results.md)
phase "shipped-pair benchmark" 90 $PY -m specrpc.bench.run --no-hf --no-grpc \
  "${BENCH[@]}" --out "$OUT/shipped"

# 3. Realistic sizes: random weights of the 7B/0.5B and 8B/1B shapes, measured costs, simulated acceptance
phase "realistic sweep" 120 $PY -m specrpc.bench.realistic --device "$DEVICE" "${REAL[@]}" --out "$OUT/realistic"

# 4. gRPC with the client in its own process, on the same prompts as the shipped-pair benchmark
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
say "== grpc: starting specrpc serve on 127.0.0.1:$PORT"
SERVE_ARGS=(--host 127.0.0.1 --port "$PORT" --device "$DEVICE" --log-format console --max-sessions 2)
[ "$QUICK" = 1 ] && SERVE_ARGS+=(--threads 1)
$PY -m specrpc.cli serve "${SERVE_ARGS[@]}" >"$OUT/serve.log" 2>&1 &
SERVER=$!
if $PY - "$PORT" >>"$LOG" 2>&1 <<'PYEOF'
import sys, grpc
grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}")).result(timeout=60)
PYEOF
then
  mkdir -p "$OUT/grpc"
  phase "grpc stream speed" 60 sh -c "$PY tools/stream_speed.py --target 127.0.0.1:$PORT --ks adaptive,0 \
    ${STREAM[*]} --rounds 1 > '$OUT/grpc/stream_speed.txt'"
  cat "$OUT/grpc/stream_speed.txt" | tee -a "$LOG"
else
  say "== grpc: the server did not come up within 60 s (see $OUT/serve.log)"; STATUS=1
fi
kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null

say "tables: $OUT/shipped/results.md, $OUT/realistic/realistic.md, $OUT/grpc/stream_speed.txt; log $LOG"
say "compare gRPC decode tokens/s with the in-process adaptive/target-only rows of shipped/results.md (same prompts)"
say "total ${SECONDS}s"
[ $STATUS -eq 0 ] && say "all phases passed" || say "SOME PHASES FAILED (see the log)"
exit $STATUS
