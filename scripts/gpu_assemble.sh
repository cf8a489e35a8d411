#!/usr/bin/env bash
# On the GPU machine (no package registry), in the repository root, once `.whl/` and the `.models/`
# chunks made by `python scripts/gpu_prepare.py split` have been carried there (see benchmarks/README.md):
#   1. install the carried wheels (gguf, grpcio, protobuf) into $SITE (default /tmp/site),
#   2. verify every chunk's sha256, join them, verify the whole file's sha256,
#   3. convert each GGUF to bf16 safetensors into $SPECSPLIT_CACHE (default /tmp/specsplit-cache) with
#      the same code as `specsplit models fetch`, so the aliases resolve,
#   4. with arguments: run `specsplit bench <arguments>` with that environment.
#
#   bash scripts/gpu_assemble.sh                                      # steps 1-3
#   bash scripts/gpu_assemble.sh --suite full --device cuda:0         # steps 1-4
#
# Environment: PYTHON (python3), SITE, WHEELS_DIR (.whl), MODELS_DIR (.models), SPECSPLIT_CACHE,
# ASSEMBLE_ARGS (extra arguments of `gpu_prepare.py assemble`, e.g. --remove-chunks).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/site}"
WHEELS="${WHEELS_DIR:-$ROOT/.whl}"
MODELS="${MODELS_DIR:-$ROOT/.models}"
export SPECSPLIT_CACHE="${SPECSPLIT_CACHE:-/tmp/specsplit-cache}"

if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
fi
if [ -d "$SITE" ]; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's specsplit, not an installed one

if ! "$PY" -c "import gguf" 2>/dev/null; then
  echo "gguf is not importable: carry .whl/ (python scripts/gpu_prepare.py split) and run this again" >&2
  exit 1
fi
# shellcheck disable=SC2086  # ASSEMBLE_ARGS is a list of options
"$PY" scripts/gpu_prepare.py --models-dir "$MODELS" assemble ${ASSEMBLE_ARGS:-}

if [ "$#" -gt 0 ]; then
  exec "$PY" -m specsplit.cli bench "$@"
fi
