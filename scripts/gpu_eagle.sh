#!/usr/bin/env bash
# On a GPU machine after `ASSEMBLE_ARGS="--models qwen2.5-coder-1.5b" bash scripts/gpu_assemble.sh`:
# the EAGLE head's runs of benchmarks/RESULTS.md ("An EAGLE head") into $OUT_DIR, each step logged there
# and noted in $OUT_DIR/progress.
#   1. the target's chats and an EAGLE head trained on them (EAGLE_DIR, if it holds none yet):
#      `specsplit heads train --kind eagle`, CHATS chats written in batches of GEN_BATCH;
#   2. beside the training, the GPU tests of draft heads (Medusa's and EAGLE's, graphs and compiled;
#      GPU_TESTS=0 skips them);
#   3. `specsplit bench`: target-only, n-gram + lookahead (the default mode), and the EAGLE head with
#      and without the window (with the window also under guess_policy="adaptive"), compiled, in one
#      run (DECODERS overrides the list), then each decoder's rounds profiled on PROFILE_PROMPTS prompts
#      (default 7, one a category; 0: none): GPU busy/idle time a round and the largest kernels;
#   4. MEDUSA_DIR set: Medusa heads on the same chats first, and their decoder in the same bench run;
#   HOME_PIECES=1 / HEAD_PIECES=DIR: the trained head in pieces to bring home, and restored from them;
#   CHATS_FILE: chats written by an earlier lease (`.jsonl` or `.jsonl.gz`), so none are generated;
#   5. EAGLE_TREES="8,8,4 8,4,5": the trained head growing those TOPK,WIDTH,DEPTH trees, a short bench each;
#   0. ROUND_KERNELS=1: first, alone on the GPU, the kernels of a compiled round with a random EAGLE
#      head against the same round without it (round_kernels.py; no staging needed, so this step may
#      also run on its own while the model's chunks are still being carried: ONLY_ROUND_KERNELS=1).
# The bench needs no draft model (`--draft self:2`): stage the target alone. TARGET / DEVICE change the
# model and the device (a dry run on a CPU: TARGET=smollm2-135m DEVICE=cpu CHATS=64 ...).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export SPECSPLIT_CACHE="${SPECSPLIT_CACHE:-/tmp/specsplit-cache}"
export PYTHONPATH="${SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT_DIR:-benchmarks/results}"
TARGET="${TARGET:-qwen2.5-coder-1.5b}"
EAGLE="${EAGLE_DIR:-.models/eagle-qwen1.5b}"
CHATS_FILE="${CHATS_FILE:-$EAGLE.chats.jsonl}"
mkdir -p "$OUT"
note() { echo "$(date -u +%H:%M:%S) $*" >> "$OUT/progress"; }
note start
if [ -n "${ROUND_KERNELS:-}${ONLY_ROUND_KERNELS:-}" ]; then
  for heads in "" "--heads ${HEADS_NODES:-32} --heads-kind eagle"; do
    tag=h200-compiled-no-heads
    [ -n "$heads" ] && tag=h200-compiled-eagle
    # shellcheck disable=SC2086  # $heads is a list of arguments
    python3 benchmarks/round_kernels.py --device "${DEVICE:-cuda:0}" --sizes 32 --compile --tag "$tag" \
      $heads >> "$OUT/round_kernels.log" 2>&1
    note "round_kernels ${heads:-no heads} rc=$?"
  done
  [ -n "${ONLY_ROUND_KERNELS:-}" ] && { note done; exit 0; }
fi
# The head travels home in pieces a device call brings back (<= 16 MiB a file), and back out the same
# way: a later lease carries the pieces of HOME_PIECES=1 as $HEAD_PIECES/ and skips the training.
if [ ! -f "$EAGLE/heads.json" ] && compgen -G "${HEAD_PIECES:-/nonexistent}/eagle-head.tar.part*" > /dev/null; then
  mkdir -p "$EAGLE" && cat "$HEAD_PIECES"/eagle-head.tar.part* | tar -x -C "$EAGLE"
  note "eagle head restored from $HEAD_PIECES rc=$?"
fi
tests=
if [ "${GPU_TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "draft_heads" > "$OUT/gpu_tests.log" 2>&1 &
  tests=$!
fi
if [ ! -f "$EAGLE/heads.json" ]; then
  chats=(--conversations "${CHATS:-16384}" --generate-batch "${GEN_BATCH:-2048}" --save-chats "$CHATS_FILE")
  [ -f "$CHATS_FILE" ] && chats=(--chats "$CHATS_FILE")
  python3 -m specsplit.cli -v heads train --kind eagle --target "$TARGET" --out "$EAGLE" "${chats[@]}" \
    ${EAGLE_ARGS:-} > "$OUT/eagle-train.log" 2>&1
  note "eagle train rc=$?"
fi
if [ -n "${HOME_PIECES:-}" ] && [ -f "$EAGLE/heads.json" ]; then
  mkdir -p "$OUT/home"
  tar -C "$EAGLE" -cf - heads.json heads.safetensors | split -b 15m -d - "$OUT/home/eagle-head.tar.part"
  note "eagle head in pieces: $(ls "$OUT/home" | tr '\n' ' ')"
fi
heads_flags=()
decoders="${DECODERS:-specsplit-target-only-compiled,specsplit-lookahead-always-compiled,specsplit-eagle-lookahead-always-compiled,specsplit-eagle-lookahead-always-adaptive-compiled,specsplit-eagle-always-compiled}"
if [ -n "${MEDUSA_DIR:-}" ]; then
  if [ ! -f "$MEDUSA_DIR/heads.json" ]; then
    python3 -m specsplit.cli -v heads train --target "$TARGET" --out "$MEDUSA_DIR" --chats "$CHATS_FILE" \
      > "$OUT/medusa-train.log" 2>&1
    note "medusa train rc=$?"
  fi
  heads_flags=(--draft-heads "$MEDUSA_DIR")
  decoders="$decoders,specsplit-heads-lookahead-always-compiled"
fi
if [ -n "$tests" ]; then
  wait "$tests"
  note "gpu tests rc=$?"
fi
python3 -m specsplit.cli bench --suite full --target "$TARGET" --device "${DEVICE:-cuda:0}" --draft self:2 --repeats 1 --prompts-per-category \
  "${PER_CATEGORY:-2}" --max-new-tokens 128 --dtype auto --cuda-graphs --fuse-projections --no-tie-analysis \
  --out "$OUT" --tag "${TAG:-eagle-compiled}" --eagle-heads "$EAGLE" --heads-nodes "${HEADS_NODES:-32}" \
  "${heads_flags[@]}" --decoders "$decoders" --profile-prompts "${PROFILE_PROMPTS:-7}" > "$OUT/bench.log" 2>&1
note "bench rc=$?"
cp "$EAGLE/heads.json" "$OUT/eagle-heads.json" 2>/dev/null
# 5. EAGLE_TREES="TOPK,WIDTH,DEPTH ...": the same head growing other trees (its weights do not depend
#    on the tree: a copy of its directory with heads.json's tree changed), each in a bench of its own
#    against target-only (TREE_DECODERS, TREE_PER_CATEGORY).
for shape in ${EAGLE_TREES:-}; do
  dir="$OUT/eagle-tree-${shape//,/-}"
  mkdir -p "$dir" && ln -sf "$(realpath "$EAGLE")/heads.safetensors" "$dir/heads.safetensors"
  python3 - "$EAGLE/heads.json" "$dir/heads.json" "$shape" <<'PY' || { note "eagle tree $shape: bad shape"; continue; }
import json, sys
info = json.load(open(sys.argv[1]))
info["eagle"]["topk"], info["eagle"]["width"], info["eagle"]["depth"] = (int(x) for x in sys.argv[3].split(","))
json.dump(info, open(sys.argv[2], "w"), indent=1)
PY
  python3 -m specsplit.cli bench --suite full --target "$TARGET" --device "${DEVICE:-cuda:0}" --draft self:2 --repeats 1 \
    --prompts-per-category "${TREE_PER_CATEGORY:-4}" --max-new-tokens 128 --dtype auto --cuda-graphs --fuse-projections \
    --no-tie-analysis --out "$OUT" --tag "eagle-tree-${shape//,/-}" --eagle-heads "$dir" --heads-nodes "${HEADS_NODES:-32}" \
    --decoders "${TREE_DECODERS:-specsplit-target-only-compiled,specsplit-eagle-lookahead-always-compiled}" \
    > "$OUT/bench-tree-${shape//,/-}.log" 2>&1
  note "eagle tree $shape bench rc=$?"
done
note done
