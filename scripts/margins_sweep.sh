#!/usr/bin/env bash
# Issue #4's "what moves the margins", at a budget a CPU affords: DSpark, DFlash and EAGLE-3 at
# several block sizes (the paper's Fig. 4) and drafter depths (Fig. 3; EAGLE-3 has one layer
# only), every run on the same cache with the shared recipe (scripts/drafter_recipe.sh: target
# layers, batch, learning rate, seed) and the same number of steps, each evaluated on the cache's
# held-out split every EVAL_EVERY steps (analytic acceptance at T = 1, no target run:
# dspark/training/heldout.py). `dspark runs` then tabulates every run against DFlash at the same
# block size and depth 1, and plots held-out τ over steps and against the block size.
# Run scripts/train_default_drafter.sh's data and cache steps first (same RUN_DIR). Resumable.
#   bash scripts/margins_sweep.sh [RUN_DIR]          # default RUN_DIR: runs/default-drafter
# Knobs (environment): STEPS (per run, default 500), ALGOS (default dspark,dflash,eagle3),
# BLOCKS (block sizes γ, default 7), DEPTHS (default 1,2,5), RANKS (Markov head ranks of extra
# one-layer DSpark runs, e.g. 256; default none), EVAL_EVERY (100), PRECISION;
# OUT (results JSON, default docs/results/margins_sweep.json; the plot goes beside it).
#   STEPS=400 DEPTHS=1,2,5 RANKS=256 OUT=docs/results/depth_sweep.json bash scripts/margins_sweep.sh
#   STEPS=300 PRECISION=fp32 ALGOS=dspark,dflash BLOCKS=4,8,12,16 DEPTHS=1 OUT=docs/results/block_sweep.json bash scripts/margins_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-500}
source scripts/drafter_recipe.sh
RUN=${1:-runs/default-drafter}
ALGOS=,${ALGOS:-dspark,dflash,eagle3},
BLOCKS=${BLOCKS:-7}
DEPTHS=${DEPTHS:-1,2,5}
RANKS=${RANKS:-}
EVAL_EVERY=${EVAL_EVERY:-100}
OUT=${OUT:-docs/results/margins_sweep.json}
SWEEP=$RUN/sweep-${STEPS}steps  # runs of another step count never resume into these
D=.venv/bin/dspark
[[ -f $RUN/cache/cache.json ]] || { echo "no target cache in $RUN/cache: run scripts/train_default_drafter.sh first" >&2; exit 1; }
labels=()
train() {  # train LABEL ALGO LAYERS BLOCK [extra flags]: the recipe, then this run's values (the last flag wins)
    local label=$1 algo=$2 layers=$3 block=$4
    shift 4
    $D train --algo "$algo" --cache "$RUN/cache" --out "$SWEEP/$label" "${RECIPE_FLAGS[@]}" --layers "$layers" \
        --block-size "$block" --eval-every "$EVAL_EVERY" --no-progress "$@"
    labels+=("$label=$SWEEP/$label")
}
wants() { [[ $ALGOS == *,$1,* ]]; }
for block in ${BLOCKS//,/ }; do
    wants eagle3 && train "eagle3-g$block" eagle3 1 "$block"
    for layers in ${DEPTHS//,/ }; do
        wants dflash && train "dflash-${layers}L-g$block" dflash "$layers" "$block"
        wants dspark && train "dspark-${layers}L-g$block" dspark "$layers" "$block" "${DSPARK_FLAGS[@]}"
    done
    for rank in ${RANKS//,/ }; do  # the last --markov-rank wins
        wants dspark && train "dspark-1L-r$rank-g$block" dspark 1 "$block" "${DSPARK_FLAGS[@]}" --markov-rank "$rank"
    done
done
reference=$(wants dflash && echo "dflash-1L-g${BLOCKS%%,*}" || echo "${labels[0]%%=*}")
$D runs "${labels[@]}" --reference "$reference" --out "$OUT" --plot "${OUT%.json}.png"
