# The training recipe shared by the shipped DSpark drafter (train_default_drafter.sh) and the
# baselines it is compared with (compare_drafters.sh): one place, so that the comparison stays
# fair (same cache, target layers, block size, optimizer steps, batch, learning rate and seed).
# Sourced, not run. Knobs (environment): STEPS, PRECISION (auto = bf16 where the hardware has it).
STEPS=${STEPS:-1000}
PRECISION=${PRECISION:-auto}
RECIPE_FLAGS=(--layers 1 --block-size 7 --steps "$STEPS" --batch-seqs 4 --anchors-per-seq 16 --lr 1e-3 --warmup 0.03
              --seed 0 --precision "$PRECISION" --checkpoint-every 100 --eval-every 100 --resume)
DSPARK_FLAGS=(--markov-rank 64)
