#!/usr/bin/env bash
# Issue #4's "what moves the margins", at a budget a CPU affords: DSpark and DFlash at several
# drafter depths (the paper's Fig. 3) and EAGLE-3 (one layer, its only depth), every run on the
# same cache with the shared recipe (scripts/drafter_recipe.sh: target layers, block size, batch,
# learning rate, seed) and the same number of steps, each evaluated on the cache's held-out split
# every EVAL_EVERY steps (analytic acceptance at T = 1, no target run: dspark/training/heldout.py).
# Run scripts/train_default_drafter.sh's data and cache steps first (same RUN_DIR). Resumable.
#   bash scripts/depth_sweep.sh [RUN_DIR]          # default RUN_DIR: runs/default-drafter
# Knobs (environment): STEPS (per run, default 500), DEPTHS (default 1,2,5), RANKS (Markov head
# ranks of extra one-layer DSpark runs, e.g. 256; default none), EVAL_EVERY (100), PRECISION;
# OUT (results JSON, default docs/results/depth_sweep.json; the plot goes beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-500}
source scripts/drafter_recipe.sh
RUN=${1:-runs/default-drafter}
DEPTHS=${DEPTHS:-1,2,5}
RANKS=${RANKS:-}
EVAL_EVERY=${EVAL_EVERY:-100}
OUT=${OUT:-docs/results/depth_sweep.json}
D=.venv/bin/dspark
[[ -f $RUN/cache/cache.json ]] || { echo "no target cache in $RUN/cache: run scripts/train_default_drafter.sh first" >&2; exit 1; }
labels=()
train() {  # train LABEL ALGO LAYERS [extra flags]: the recipe, then this run's depth (the last --layers wins)
    local label=$1 algo=$2 layers=$3
    shift 3
    $D train --algo "$algo" --cache "$RUN/cache" --out "$RUN/sweep/$label" "${RECIPE_FLAGS[@]}" --layers "$layers" \
        --eval-every "$EVAL_EVERY" --no-progress "$@"
    labels+=("$label=$RUN/sweep/$label")
}
train eagle3 eagle3 1
for layers in ${DEPTHS//,/ }; do
    train "dflash-${layers}L" dflash "$layers"
    train "dspark-${layers}L" dspark "$layers" "${DSPARK_FLAGS[@]}"
done
for rank in ${RANKS//,/ }; do
    train "dspark-1L-r${rank}" dspark 1 "${DSPARK_FLAGS[@]}" --markov-rank "$rank"  # the last --markov-rank wins
done
$D runs "${labels[@]}" --reference dflash-1L --out "$OUT" --plot "${OUT%.json}.png"
