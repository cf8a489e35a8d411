#!/usr/bin/env bash
# On a GPU machine after scripts/gpu_assemble.sh (both Qwen models): the runs behind the
# "Logits processors under speculation" section of benchmarks/RESULTS.md, each into $OUT_DIR:
# the GPU tests, the per-round cost with and without the repetition penalty (target-only, n-gram,
# draft model with and without draft-side processors), the scoring step alone, and the constrained
# JSON example against HF generate() with n-gram and with model drafts.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export SPECSPLIT_CACHE="${SPECSPLIT_CACHE:-/tmp/specsplit-cache}"
export PYTHONPATH="${SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT_DIR:-benchmarks/results}"
TAG="${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]*' | tr 'H' 'h')}"
DAY="$(date +%F)"
mkdir -p "$OUT"
python3 -m pytest -q tests/test_gpu.py 2>&1 | tail -25 > "$OUT/gpu_tests-$TAG-$DAY-processors.log"
python3 benchmarks/processors_cost.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --device cuda:0 \
  --prompts-per-category 2 --max-new-tokens 128 --tag "$TAG" --out "$OUT"
python3 benchmarks/processors_cost.py --micro --device cuda:0 --tag "$TAG" --out "$OUT"
python3 benchmarks/processors_cost.py --transform-ab --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --device cuda:0 --prompts-per-category 2 --max-new-tokens 128 --tag "$TAG" --out "$OUT"
for dtype in bfloat16 float32; do  # float32: token-exact against HF generate(); bf16 may differ at near-ties
  for drafter in ngram model; do
    extra=()
    [ "$drafter" = model ] && extra=(--draft qwen2.5-coder-0.5b)
    python3 examples/constrained_json.py --cuda-graphs --warmup --dtype "$dtype" --drafter "$drafter" "${extra[@]}" \
      > "$OUT/constrained_json-$TAG-$dtype-$drafter.log" 2>&1
  done
done
