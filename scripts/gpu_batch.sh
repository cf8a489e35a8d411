#!/usr/bin/env bash
# On a GPU machine after scripts/gpu_assemble.sh (the Qwen 1.5B target; the 0.5B draft too for the
# client-loop decoder): the runs behind the "Batched generation" section of benchmarks/RESULTS.md,
# each into $OUT_DIR: the batched GPU tests, `specsplit bench --batch-size` (HF generate() on the
# batch, our plain batched steps, our batched n-gram rounds; batch 1 is our single-row path; CUDA
# graphs and compile), then `specsplit bench --concurrent-clients` (clients of one batching target
# worker, a `specsplit serve` process, over gRPC loopback; the client-loop decoder's draft worker
# batches too), then (AB=1) the batch run again with CUDA graphs alone.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export SPECSPLIT_CACHE="${SPECSPLIT_CACHE:-/tmp/specsplit-cache}"
export PYTHONPATH="${SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT_DIR:-benchmarks/results}"
TAG="${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr 'H' 'h')}"
mkdir -p "$OUT"
python3 -m pytest -q tests/test_gpu.py -k "batched or chain" 2>&1 | tail -15 > "$OUT/gpu_tests-$TAG-$(date +%F)-batch.log"
python3 -m specsplit.cli bench --suite full --device cuda:0 --batch-size "${SIZES:-1,4,16,64}" \
  --max-new-tokens "${MAX_NEW:-128}" --repeats 1 --cuda-graphs ${COMPILE---compile} --out "$OUT"
python3 -m specsplit.cli bench --suite full --device cuda:0 --concurrent-clients "${CLIENTS:-1,16,64}" \
  --decoders "${CLIENT_DECODERS:-grpc-plain,grpc-ngram}" \
  --max-new-tokens "${MAX_NEW:-128}" --repeats 1 --cuda-graphs --out "$OUT"
if [ "${AB:-0}" = 1 ]; then
  python3 -m specsplit.cli bench --suite full --device cuda:0 --batch-size "${SIZES:-1,4,16,64}" \
    --decoders specsplit-plain,specsplit-ngram --max-new-tokens "${MAX_NEW:-128}" --repeats 1 --cuda-graphs \
    --tag graphs --out "$OUT"
fi
touch "$OUT/DONE"
