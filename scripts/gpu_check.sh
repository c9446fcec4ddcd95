#!/usr/bin/env bash
# The GPU check (issue #18), prepared once and run as ONE command on a lent GPU machine:
#   bash scripts/gpu_check.sh                        # --device cuda, about 5-8 minutes on one GPU
#   bash scripts/gpu_check.sh --device cpu --quick   # the smoke test CI runs (tests/scripts/test_gpu_check.py)
#   options: --device D (cuda | cuda:N | cpu; default cuda), --quick (smaller benchmarks),
#            --out DIR (default gpu_check_results; $OUT when the device tool sets it)
# Stages, each timed and logged; a failed stage is recorded and the next one still runs:
#   env      torch / CUDA / GPU versions
#   tests    the `device`-marked tests on D (pytest --device D): the target's varlen attention
#            against the CPU reference, a checkpoint loaded onto D, greedy speculative == plain
#            decoding (the n-gram drafter, and a DSpark drafter on D), chi-square losslessness at
#            T = 1 and at T = 0.7 with top-k / top-p (dense and sparse draft rows), and on CUDA
#            the compiled Triton rejection kernel against the torch reference (vocabularies
#            49,152 and 151,936, a few hundred requests)
#   forward  benchmarks/bench_forward.py on D: ms per step for B = 1..64 against the roofline
#   decode   benchmarks/bench_peers.py on D: one request, greedy, our plain decoding vs DSpark
# Writes DIR/results.md (a table of the stages, then each stage's output tail) and DIR/*.log;
# exits 1 if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."

device=cuda
quick=0
out="${OUT:-gpu_check_results}"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --out) out="$2"; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --device D, --quick, --out DIR)" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
mkdir -p "$out"
results="$out/results.md"
failed=0
rows=()

stage() {  # stage NAME COMMAND...: run it, log it, time it
  local name="$1"; shift
  local log="$out/$name.log" start end rc
  echo "== $name: $*" | tee "$log"
  start=$(date +%s)
  "$@" >>"$log" 2>&1
  rc=$?
  end=$(date +%s)
  if [ $rc -eq 0 ]; then rows+=("| $name | ok | $((end - start)) |"); else rows+=("| $name | FAILED (rc $rc) | $((end - start)) |"); failed=1; fi
  tail -n 5 "$log"
}

if [ "$quick" = 1 ]; then
  max_batch=2; repeats=1; prompts=1; max_tokens=8; sets=humaneval
else
  max_batch=64; repeats=3; prompts=2; max_tokens=128; sets=humaneval,gsm8k,mt-bench
fi
# dense weights (the compact kernels are CPU code); dtype auto: bf16 on a GPU, on a CPU what it multiplies natively
weights=dense
dtype=auto

stage env "$python" -c "
import platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda build', torch.version.cuda)
print('cuda available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print('  ', i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory // 2**20, 'MiB')
from dspark.model.target_runtime import resolve_device
print('device', resolve_device('$device'))
"
stage tests "$python" -m pytest -q -p no:cacheprovider -m device --device "$device" \
  tests/model/test_devices.py tests/engine/test_engine_on_device.py tests/drafters/test_dspark_serving.py \
  tests/sampling/test_rejection_kernel.py
stage forward "$python" benchmarks/bench_forward.py --device "$device" --dtype "$dtype" --weights "$weights" \
  --max-batch "$max_batch" --repeats "$repeats"
stage decode "$python" benchmarks/bench_peers.py --device "$device" --dtype "$dtype" --weights "$weights" --skip-hf --skip-llama \
  --drafters dspark --benchmarks "$sets" --prompts "$prompts" --max-tokens "$max_tokens" --repeats "$repeats"

{
  echo "# GPU check: --device $device$([ "$quick" = 1 ] && echo ' --quick'), $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "| stage | result | seconds |"
  echo "|---|---|---:|"
  printf '%s\n' "${rows[@]}"
  for name in env tests forward decode; do
    echo
    echo "## $name"
    echo
    echo '```'
    tail -n 40 "$out/$name.log"
    echo '```'
  done
} >"$results"
echo "results: $results"
exit $failed
