#!/usr/bin/env bash
# Issue #4's comparison: the DFlash and EAGLE-3 baselines trained on the cache the shipped DSpark
# drafter was trained on, with its recipe (scripts/drafter_recipe.sh: same target layers, block
# size, optimizer steps, batch, learning rate, seed), then the offline evaluation of all three.
# Run scripts/train_default_drafter.sh first (same RUN_DIR). Resumable.
#   bash scripts/compare_drafters.sh [RUN_DIR]          # default RUN_DIR: runs/default-drafter
# Knobs (environment): STEPS, PRECISION (as for the shipped drafter), LIMIT (prompts per
# benchmark), MAX_NEW_TOKENS, TEMPERATURES, BLOCK_SIZES (extra gamma values for Fig. 4, e.g. 4,8,12,16;
# each one repeats the whole evaluation).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/drafter_recipe.sh
RUN=${1:-runs/default-drafter}
LIMIT=${LIMIT:-3}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
TEMPERATURES=${TEMPERATURES:-1,0}
BLOCK_SIZES=${BLOCK_SIZES:-}
D=.venv/bin/dspark
[[ -f $RUN/train/final/config.json ]] || { echo "no DSpark drafter in $RUN/train/final: run scripts/train_default_drafter.sh first" >&2; exit 1; }
for algo in dflash eagle3; do
    $D train --algo "$algo" --cache "$RUN/cache" --out "$RUN/$algo" "${RECIPE_FLAGS[@]}"
done
$D eval --drafter dspark=dspark/drafters/checkpoints/dspark-smollm2-135m-instruct \
    --drafter "dflash=$RUN/dflash/final" --drafter "eagle3=$RUN/eagle3/final" \
    --limit "$LIMIT" --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURES" \
    ${BLOCK_SIZES:+--block-sizes "$BLOCK_SIZES"} --out docs/results/offline_eval.json --work-dir "$RUN/eval"
