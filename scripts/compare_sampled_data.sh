#!/usr/bin/env bash
# Which sampled regenerations serve better: the target's own answers at T = 1 (our default), or
# DeepSpec's T = 0.7 / top-p 0.8? One controlled comparison (docs/results/training.md, "T = 1 or
# 0.7 / top-p 0.8"): the same PROMPTS train prompts regenerated both ways, each cached and used
# to fine-tune the shipped drafter for STEPS steps with the same recipe and seed, then both
# drafters measured the same way: held-out τ on the greedy held-out cache (greedy and T = 1
# acceptance) and `dspark eval` on three benchmarks at T = 0 and T = 1.
# Every step resumes where it stopped: rerun the script after an interruption.
#   bash scripts/compare_sampled_data.sh [RUN_DIR]     # default RUN_DIR: runs/sampled-data
# Knobs (environment): PROMPTS (train prompts regenerated), SKIP_PROMPTS (train prompts of that
# order left out first), HELDOUT (held-out greedy sequences), STEPS, BENCH_LIMIT (prompts per
# benchmark in `dspark eval`).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/sampled-data}
PROMPTS=${PROMPTS:-480}
SKIP_PROMPTS=${SKIP_PROMPTS:-12800}
HELDOUT=${HELDOUT:-150}
STEPS=${STEPS:-400}
BENCH_LIMIT=${BENCH_LIMIT:-10}
SHARED=../shared/data/regenerated
DST=dspark/drafters/checkpoints/dspark-smollm2-135m-instruct
D=.venv/bin/dspark
mkdir -p "$RUN/prompts"
# The prompts: train prompts past the first SKIP_PROMPTS: none has a greedy answer in $SHARED (its
# records are the first 10,516 prompts) nor was among the sampled ones the shipped drafter saw.
if [[ ! -f $RUN/prompts/prompts.jsonl ]]; then
  .venv/bin/python - "$SHARED/prompts.jsonl" "$RUN/prompts/prompts.jsonl" "$SKIP_PROMPTS" "$PROMPTS" <<'PY'
import json, sys
src, dst, skip, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
train = [line for line in open(src) if json.loads(line).get("split") == "train"]
open(dst, "w").writelines(train[skip : skip + n])
PY
fi
[[ -f $RUN/init/config.json ]] || cp -r "$DST" "$RUN/init"  # both start from the drafter shipped now
declare -A SETTING=([t1]="--temperature 1" [t07p08]="--temperature 0.7 --top-p 0.8")
for name in t1 t07p08; do
  mkdir -p "$RUN/$name"
  cp -n "$RUN/prompts/prompts.jsonl" "$RUN/$name/"
  # shellcheck disable=SC2086
  $D data generate --data-dir "$RUN/$name" --batch-size 64 --max-new-tokens 192 ${SETTING[$name]} --weights dense --no-progress
  $D cache --data-dir "$RUN/$name" --out "$RUN/$name/cache" --split train --batch-tokens 2048
done
$D cache --data-dir "$SHARED" --out "$RUN/cache-heldout" --split heldout --max-sequences "$HELDOUT" --batch-tokens 2048
source scripts/drafter_recipe.sh
for name in t1 t07p08; do
  $D train --algo dspark --cache "$RUN/$name/cache" --eval-cache "$RUN/cache-heldout" --out "$RUN/$name/train" \
    "${RECIPE_FLAGS[@]}" "${DSPARK_FLAGS[@]}" --precision fp32 --anchors-per-seq 32 --lr 3e-4 \
    --eval-every 200 --eval-sequences 120 --checkpoint-every 200 --draft-vocab-size 8192 --init-from "$RUN/init"
  [[ -f $RUN/$name/heldout.json ]] || $D heldout --drafter "$RUN/$name/train/final" --cache "$RUN/cache-heldout" \
    --max-sequences 120 --anchors-per-seq 32 --precision fp32 > "$RUN/$name/heldout.json"
done
[[ -f $RUN/init-heldout.json ]] || $D heldout --drafter "$RUN/init" --cache "$RUN/cache-heldout" --max-sequences 120 \
  --anchors-per-seq 32 --precision fp32 > "$RUN/init-heldout.json"
for temperature in 0 1; do
  $D eval --drafter "init@dspark=$RUN/init" --drafter "t1@dspark=$RUN/t1/train/final" \
    --drafter "t07p08@dspark=$RUN/t07p08/train/final" --benchmarks gsm8k,humaneval,mt-bench --limit "$BENCH_LIMIT" \
    --temperature "$temperature" --gamma 7 --max-new-tokens 128 --batch-size 16 --no-progress \
    --out "$RUN/eval-T$temperature.json" --work-dir "$RUN/eval-work-T$temperature" --no-plots
done
echo "held-out: $RUN/{init,t1/,t07p08/}heldout.json; benchmarks: $RUN/eval-T0.json, $RUN/eval-T1.json"
