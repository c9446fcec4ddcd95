#!/usr/bin/env bash
# The one command that trains the shipped DSpark drafter for the default target
# (dspark/drafters/checkpoints/dspark-smollm2-135m-instruct). Every step resumes where it stopped:
# rerun the script after an interruption.
#   bash scripts/train_default_drafter.sh [RUN_DIR]     # default RUN_DIR: runs/default-drafter
# Knobs (environment): RESPONSES (training responses to regenerate), STEPS (optimizer steps).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/default-drafter}
RESPONSES=${RESPONSES:-470}
STEPS=${STEPS:-1400}
DST=dspark/drafters/checkpoints/dspark-smollm2-135m-instruct
D=.venv/bin/dspark
mkdir -p "$RUN"
[[ -f $RUN/data/prompts.jsonl ]] || $D data prompts --out "$RUN/data" --max-prompts 6000 --max-prompt-tokens 512
$D data generate --data-dir "$RUN/data" --batch-size 64 --max-new-tokens 256 --limit "$RESPONSES"
$D cache --data-dir "$RUN/data" --out "$RUN/cache" --batch-tokens 2048
$D train --cache "$RUN/cache" --out "$RUN/train" --layers 1 --markov-rank 64 --block-size 7 --steps "$STEPS" \
    --batch-seqs 4 --anchors-per-seq 16 --lr 1e-3 --warmup 0.03 --checkpoint-every 100 --resume
$D export --drafter "$RUN/train/final" --out "$DST" --dtype bfloat16
$D calibrate --drafter "$DST" --cache "$RUN/cache" --split heldout --temperature 1 --anchors-per-seq 32
mv "$DST/reliability.png" docs/results/dspark_reliability.png
