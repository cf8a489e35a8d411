#!/usr/bin/env bash
# On a GPU machine after `ASSEMBLE_ARGS="--models qwen2.5-coder-1.5b" bash scripts/gpu_assemble.sh`:
# the draft-heads runs of benchmarks/RESULTS.md ("Draft heads") into $OUT_DIR, each step logged there.
#   1. heads for the target (HEADS_DIR, if it holds none yet): `specsplit heads train`, CHATS chats;
#   2. their kernels a round against the same rounds without them (round_kernels.py --heads; its .md and
#      .json go to benchmarks/results/round_kernels-h200-compiled-*);
#   3. `specsplit bench`: target-only, n-gram + lookahead, and with the heads, compiled; once with the
#      dynamic guess tree and once with the static one;
#   4. the GPU tests.
# The bench needs no draft model (`--draft self:2`): stage the target alone.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export SPECSPLIT_CACHE="${SPECSPLIT_CACHE:-/tmp/specsplit-cache}"
export PYTHONPATH="${SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT_DIR:-benchmarks/results}"
HEADS="${HEADS_DIR:-.models/heads-qwen1.5b}"
mkdir -p "$OUT"
if [ ! -f "$HEADS/heads.json" ]; then
  python3 -m specsplit.cli -v heads train --target qwen2.5-coder-1.5b --out "$HEADS" \
    --conversations "${CHATS:-16384}" --generate-batch 1024 --epochs "${EPOCHS:-3}" > "$OUT/heads-train.log" 2>&1
  echo "train rc=$?" >> "$OUT/progress"
fi
python3 benchmarks/round_kernels.py --device cuda:0 --sizes 32 --compile --tag h200-compiled-no-heads \
  > "$OUT/round_kernels.log" 2>&1
python3 benchmarks/round_kernels.py --device cuda:0 --sizes 32 --compile --heads 32 --tag h200-compiled-heads \
  >> "$OUT/round_kernels.log" 2>&1
echo "round_kernels rc=$?" >> "$OUT/progress"
for tree in dynamic static; do  # the guess tree picked each round, and the fixed one
  python3 -m specsplit.cli bench --suite full --device cuda:0 --draft self:2 --repeats 1 --prompts-per-category 2 \
    --max-new-tokens 128 --dtype auto --cuda-graphs --fuse-projections --no-tie-analysis --out "$OUT" \
    --tag "heads-$tree-compiled" --draft-heads "$HEADS" --heads-nodes "${HEADS_NODES:-32}" --heads-tree "$tree" \
    --decoders specsplit-target-only-compiled,specsplit-lookahead-always-compiled,specsplit-heads-lookahead-always-compiled \
    > "$OUT/bench-heads-$tree.log" 2>&1
  echo "bench $tree rc=$?" >> "$OUT/progress"
done
python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/progress"
