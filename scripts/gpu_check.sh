#!/usr/bin/env bash
# The GPU check, one device call (< 10 minutes; seen on the H200: the test stages side by side in
# two shards each ~3.5 minutes, the sanitizer passes ~50 s (now beside the tests), benchmark ~60 s,
# plus a minute or more of machine start):
# installs the carried libraries (.gpu/, built by scripts/build_gpu_artifacts.sh; .whl/ wheels) through
# scripts/device_env.sh, stops unless the CUDA handlers register, reports the
# backends, runs the test suite on the GPU (CUDA backend, fast paths, the rest) and beside it
# compute-sanitizer (memcheck, racecheck) over scripts/sanitize_driver.py, then, alone on the GPU,
# a short benchmark against jax.lax.ragged_dot. Logs, JUnit XML and JSON land in $OUT; a summary
# table prints last.
#
#   scripts/gpu_check.sh                      # everything
#   HJ_STAGES=cuda_tests,memcheck scripts/gpu_check.sh
#   HJ_PYTEST_ARGS="--maxfail=30" scripts/gpu_check.sh
#   HJ_PACK=1 scripts/gpu_check.sh            # logs and JUnit files packed into one archive
#   HJ_TEST_SHARDS=3 scripts/gpu_check.sh     # the long test stages as 3 processes each (default 2)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
STAGES=${HJ_STAGES:-report,cuda_tests,fast_tests,tests,memcheck,racecheck,bench}
PYTEST_ARGS=${HJ_PYTEST_ARGS:---maxfail=50}
LOG="$OUT/gpu_check.log"
T0=$(date +%s)
declare -A STATUS

want() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() { echo; echo ">>> $1 ($(( $(date +%s) - T0 )) s)"; }

{
  source scripts/device_env.sh || exit 2

  if want report; then
    stage report
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
    python3 -c 'import humming_jax, jax; print("jax", jax.__version__, jax.devices()); print(humming_jax._ffi.backend_report()); print("cuda_available:", humming_jax.cuda_available())'
    STATUS[report]=$?
  fi
  # Without the CUDA handlers every GPU test would skip and the check would pass on nothing.
  python3 -c 'import humming_jax, sys; sys.exit(0 if humming_jax.cuda_available() else 1)' \
    || { echo "the CUDA handlers are not registered (see the report above): stopping"; exit 2; }

  # The test stages run side by side (their time is mostly compilation, on the host's cores), the
  # long ones as HJ_TEST_SHARDS processes each (tests/conftest.py: $HUMMING_JAX_TEST_SHARD);
  # each process allocates GPU memory as it goes instead of taking most of it up front.
  declare -A PIDS
  SHARDS=${HJ_TEST_SHARDS:-2}
  test_stage() {  # name timeout junit shard pytest-args... (shard: i/n, or "" for the whole selection)
    local name=$1 limit=$2 junit=$3 shard=$4; shift 4
    ( HUMMING_JAX_TEST_SHARD=$shard XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$limit" \
        python3 -m pytest -q -p no:cacheprovider -rf --junitxml="$OUT/$junit" "$@" > "$OUT/$name.log" 2>&1 ) &
    PIDS[$name]=$!
  }
  sharded_stage() {  # name timeout pytest-args...: name_0 .. name_{SHARDS-1}, junit_name_i.xml
    local name=$1 limit=$2 i; shift 2
    for (( i = 0; i < SHARDS; i++ )); do
      test_stage "${name}_$i" "$limit" "junit_${name}_$i.xml" "$i/$SHARDS" "$@"
    done
  }
  if want cuda_tests; then
    stage "cuda backend tests (background)"
    test_stage cuda_tests ${HJ_CUDA_TESTS_TIMEOUT:-200} junit_cuda.xml "" tests/test_cuda_backend.py ${HJ_PYTEST_ARGS:-}
  fi
  if want fast_tests; then
    stage "fast-path tests (background)"
    sharded_stage fast_prefill ${HJ_FAST_TESTS_TIMEOUT:-420} tests/test_cuda_fast_paths.py -k prefill $PYTEST_ARGS
    sharded_stage fast_decode ${HJ_FAST_TESTS_TIMEOUT:-420} tests/test_cuda_fast_paths.py -k "not prefill" $PYTEST_ARGS
  fi
  if want tests; then
    stage "test suite (background)"
    sharded_stage tests ${HJ_TESTS_TIMEOUT:-420} tests --ignore=tests/test_cuda_backend.py \
      --ignore=tests/test_cuda_fast_paths.py $PYTEST_ARGS
  fi
  # The sanitizer passes run beside the test stages too, one after the other (each pass checks
  # only its own process; seen alone on the H200: ~16 s and ~33 s, whose time the tests then hide).
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  sanitize() {  # tool: its pass over scripts/sanitize_driver.py into $OUT/tool.log, exit status in $OUT/tool.rc
    local tool=$1
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_autotune_level=0" timeout ${HJ_SANITIZER_TIMEOUT:-240} \
      "$SAN" --tool "$tool" --error-exitcode 17 --print-limit 30 python3 scripts/sanitize_driver.py > "$OUT/$tool.log" 2>&1
    echo $? > "$OUT/$tool.rc"
  }
  SAN_TOOLS=()
  for tool in memcheck racecheck; do want $tool && SAN_TOOLS+=("$tool"); done
  if (( ${#SAN_TOOLS[@]} )); then
    stage "compute-sanitizer ${SAN_TOOLS[*]} (background)"
    ( for tool in "${SAN_TOOLS[@]}"; do sanitize "$tool"; done ) &
    SAN_PID=$!
  fi
  for name in $(printf '%s\n' "${!PIDS[@]}" | sort); do
    wait "${PIDS[$name]}"
    STATUS[$name]=$?
    stage "$name: exit ${STATUS[$name]}"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name.log" | tail -25
  done
  if (( ${#SAN_TOOLS[@]} )); then
    wait "$SAN_PID"
    for tool in "${SAN_TOOLS[@]}"; do
      STATUS[$tool]=$(cat "$OUT/$tool.rc" 2>/dev/null || echo "no status")
      rm -f "$OUT/$tool.rc"
      stage "compute-sanitizer $tool: exit ${STATUS[$tool]}"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|Hazard|sanitize_driver:" "$OUT/$tool.log" | tail -15
    done
  fi

  if want bench; then
    stage benchmark
    timeout ${HJ_BENCH_TIMEOUT:-110} python3 benchmarks/bench_quick.py --out "$OUT/bench_quick.json" --samples 20
    STATUS[bench]=$?
  fi

  stage summary
  python3 - "$OUT" <<'EOF'
import glob, json, os, re, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
# A stage's shards (junit_NAME_i.xml) summed into one line, junit_NAME.xml.
counts = {}
for path in sorted(glob.glob(os.path.join(out, "junit*.xml"))):
    name = re.sub(r"_\d+\.xml$", ".xml", os.path.basename(path))
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    c = counts.setdefault(name, {"files": 0, "tests": 0, "failures": 0, "errors": 0, "skipped": 0})
    c["files"] += 1
    for k in ("tests", "failures", "errors", "skipped"):
        c[k] += sum(int(s.get(k, 0)) for s in suites)
for name, c in counts.items():
    print(f"{name:24s} tests={c['tests']} failures={c['failures']} errors={c['errors']} skipped={c['skipped']}"
          + (f" ({c['files']} shards)" if c["files"] > 1 else ""))
for tool in ("memcheck", "racecheck"):
    path = os.path.join(out, f"{tool}.log")
    if os.path.exists(path):
        lines = [l.strip() for l in open(path, errors="replace") if "SUMMARY" in l or "sanitize_driver:" in l]
        print(f"{tool:16s} " + (" | ".join(lines[-2:]) if lines else "no summary (see log)"))
path = os.path.join(out, "bench_quick.json")
if os.path.exists(path):
    r = json.load(open(path))
    print("ceilings", r["ceilings"])
    print(f"{'shape':14s} {'fmt':6s} {'M':>5s} {'ours ms':>9s} {'idx ms':>9s} {'grp ms':>9s} {'ragged ms':>10s} {'x ragged':>8s}")
    rows = r["rows"]
    key = lambda x: (x["shape"], x["format"], x["M"])
    for x in rows:
        if x["system"] != "humming_jax":
            continue
        same = {y["system"]: y["median_ms"] for y in rows if key(y) == key(x)}
        print(f"{x['shape']:14s} {x['format']:6s} {x['M']:5d} {same['humming_jax']:9.3f} {same['humming_jax/indexed']:9.3f} "
              f"{same['humming_jax/grouped']:9.3f} {same['ragged_dot']:10.3f} {same['ragged_dot'] / same['humming_jax']:7.2f}x")
EOF
  for s in "${!STATUS[@]}"; do echo "stage $s: exit ${STATUS[$s]}"; done
  echo "total $(( $(date +%s) - T0 )) s"
} 2>&1 | tee "$LOG"

# HJ_PACK=1: the stage logs and JUnit files into one archive, $OUT/gpu_check_files.tar.gz, beside
# gpu_check.log and bench_quick.json (for a caller that takes back only a few files).
if [[ ${HJ_PACK:-0} == 1 ]]; then
  (cd "$OUT" && files=$(ls -1 -- *.log *.xml 2>/dev/null | grep -vx gpu_check.log) &&
    [[ -n $files ]] && tar czf gpu_check_files.tar.gz $files && rm -f $files)
fi
