#!/usr/bin/env bash
# On a GPU machine after scripts/gpu_assemble.sh: the drafter comparison of benchmarks/RESULTS.md, as two
# `specsplit bench` runs (plain CUDA graphs, then torch.compile-fused), each into $OUT_DIR.
#   PER_CATEGORY (4) prompts of each category, MAX_NEW (128) tokens, one timed repeat.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export SPECSPLIT_CACHE="${SPECSPLIT_CACHE:-/tmp/specsplit-cache}"
export PYTHONPATH="${SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT_DIR:-benchmarks/results}"
COMMON=(--suite full --device cuda:0 --repeats 1 --prompts-per-category "${PER_CATEGORY:-4}" --max-new-tokens "${MAX_NEW:-128}"
        --dtype auto --dynamic-tree 4,4,24,5 --cuda-graphs --fuse-projections --no-tie-analysis --out "$OUT")
python3 -m specsplit.cli bench "${COMMON[@]}" --tag drafters \
  --decoders hf-target,hf-prompt-lookup,specsplit-target-only,specsplit-ngram,specsplit-suffix,specsplit-auto,specsplit-dynamic
python3 -m specsplit.cli bench "${COMMON[@]}" --tag drafters-compiled \
  --decoders specsplit-target-only-compiled,specsplit-ngram-compiled,specsplit-auto-compiled
