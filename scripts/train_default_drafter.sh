#!/usr/bin/env bash
# The one command that trains the shipped DSpark drafter for the default target
# (dspark/drafters/checkpoints/dspark-smollm2-135m-instruct). Every step resumes where it stopped:
# rerun the script after an interruption.
#   bash scripts/train_default_drafter.sh [RUN_DIR]     # default RUN_DIR: runs/default-drafter
# Knobs (environment): RESPONSES (training responses to regenerate), STEPS (optimizer steps),
# PRECISION (fp32 | bf16 | auto). The recipe itself: scripts/drafter_recipe.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/drafter_recipe.sh
RUN=${1:-runs/default-drafter}
RESPONSES=${RESPONSES:-1400}
DST=dspark/drafters/checkpoints/dspark-smollm2-135m-instruct
D=.venv/bin/dspark
mkdir -p "$RUN"
[[ -f $RUN/data/prompts.jsonl ]] || $D data prompts --out "$RUN/data" --max-prompts 6000 --max-prompt-tokens 512
$D data generate --data-dir "$RUN/data" --batch-size 64 --max-new-tokens 256 --limit "$RESPONSES"
$D cache --data-dir "$RUN/data" --out "$RUN/cache" --batch-tokens 2048
$D train --algo dspark --cache "$RUN/cache" --out "$RUN/train" "${RECIPE_FLAGS[@]}" "${DSPARK_FLAGS[@]}"
$D export --drafter "$RUN/train/final" --out "$DST" --dtype bfloat16
$D calibrate --drafter "$DST" --cache "$RUN/cache" --split heldout --temperature 1 --anchors-per-seq 32
mv "$DST/reliability.png" docs/results/dspark_reliability.png
