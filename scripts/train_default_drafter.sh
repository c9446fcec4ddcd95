#!/usr/bin/env bash
# The one command that trains the shipped DSpark drafter for the default target
# (dspark/drafters/checkpoints/dspark-smollm2-135m-instruct). Every step resumes where it stopped:
# rerun the script after an interruption.
#   bash scripts/train_default_drafter.sh [RUN_DIR]     # default RUN_DIR: runs/default-drafter
#
# Recipe (docs/results/training.md): the target's own GREEDY regenerations of ShareGPT/CHAMP
# prompts (../shared/data/regenerated, made by `dspark data generate --temperature 0`), cached
# shortest prompts first (the most response tokens, i.e. anchors, per target forward on a CPU),
# a draft vocabulary of the DRAFT_VOCAB most frequent response tokens (FR-Spec, docs/method.md §6),
# warm-started from INIT (default: the drafter shipped before this run, copied aside first, so
# a rerun does not start from its own output), held-out τ and greedy τ logged every 200 steps,
# then export (bf16) and STS calibration for sampled (T = 1) and greedy (T = 0) requests.
# Knobs (environment): GREEDY_DATA (the regenerations: the greedy folder, or a greedy + sampled
# mix written by scripts/mix_responses.py, held-out greedy records first), SEQUENCES (train sequences cached), HELDOUT (held-out
# sequences cached), SKIP (train sequences of that order left out, e.g. the slice INIT was trained on), DRAFT_VOCAB, STEPS, BATCH_SEQS, ANCHORS, LR, INIT (a checkpoint, or "none").
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-3000}  # the shipped drafter: 3,000 steps (docs/results/training.md); set before the recipe, which has its own default
source scripts/drafter_recipe.sh
RUN=${1:-runs/default-drafter}
GREEDY_DATA=${GREEDY_DATA:-../shared/data/regenerated}
SEQUENCES=${SEQUENCES:-5596}
SKIP=${SKIP:-0}
HELDOUT=${HELDOUT:-518}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
BATCH_SEQS=${BATCH_SEQS:-4}
ANCHORS=${ANCHORS:-32}
LR=${LR:-6e-4}
DST=dspark/drafters/checkpoints/dspark-smollm2-135m-instruct
D=.venv/bin/dspark
mkdir -p "$RUN"
[[ -f $RUN/greedy/responses.jsonl ]] || { mkdir -p "$RUN/greedy"; cp "$GREEDY_DATA"/*.jsonl "$GREEDY_DATA"/*.json "$RUN/greedy/"; }
INIT=${INIT:-$RUN/init}
if [[ $INIT == "$RUN/init" && ! -f $RUN/init/config.json ]]; then cp -r "$DST" "$RUN/init"; fi
INIT_FLAGS=(--init-from "$INIT")
[[ $INIT == none ]] && INIT_FLAGS=()
$D cache --data-dir "$RUN/greedy" --out "$RUN/cache-train" --split train --shortest-prompts-first --skip-sequences "$SKIP" --max-sequences "$SEQUENCES" --batch-tokens 2048
$D cache --data-dir "$RUN/greedy" --out "$RUN/cache-heldout" --split heldout --max-sequences "$HELDOUT" --batch-tokens 2048
$D train --algo dspark --cache "$RUN/cache-train" --eval-cache "$RUN/cache-heldout" --out "$RUN/train" \
  "${RECIPE_FLAGS[@]}" "${DSPARK_FLAGS[@]}" --precision fp32 --batch-seqs "$BATCH_SEQS" --anchors-per-seq "$ANCHORS" \
  --lr "$LR" --eval-every 200 --eval-sequences 120 --checkpoint-every 200 --draft-vocab-size "$DRAFT_VOCAB" "${INIT_FLAGS[@]}"
$D export --drafter "$RUN/train/final" --out "$DST" --dtype bfloat16
$D calibrate --drafter "$DST" --cache "$RUN/cache-heldout" --split heldout --temperature 1 --anchors-per-seq 16 --max-sequences 150
mv "$DST/reliability.png" docs/results/dspark_reliability.png
$D calibrate --drafter "$DST" --cache "$RUN/cache-heldout" --split heldout --temperature 0 --anchors-per-seq 16 --max-sequences 150
mv "$DST/reliability_greedy.png" docs/results/dspark_reliability_greedy.png
