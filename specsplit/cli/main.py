"""The ``specsplit`` command: dispatch to one module per sub-command."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

DESCRIPTION = """\
Speculative decoding where a small draft model and a large target model may sit on different GPUs or
machines. The output is exactly the target's (greedy) or follows its distribution (sampling).

  specsplit generate "Write a quicksort in Python"      run the default model pair on a prompt
  specsplit serve target --model qwen2.5-coder-1.5b     run an engine as a gRPC worker
  specsplit models fetch qwen2.5-coder-pair             fetch offline weights into the cache
  specsplit bench --suite quick                         compare against Hugging Face baselines
  specsplit heads train --out heads/                    train draft heads for the target (GPU)
"""

# Sub-command modules, each with add_cli(subparsers), loaded by name: `serve` needs the grpc extra, and
# `bench` lives with the optional benchmark harness (nothing outside it imports it). A command whose
# module cannot be imported is left out (and named in --help).
COMMANDS = {
    "generate": "specsplit.cli.generate",
    "serve": "specsplit.cli.serve",
    "models": "specsplit.cli.models",
    "heads": "specsplit.cli.heads",
    "bench": "specsplit.bench.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specsplit", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    missing = []
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # optional parts (the grpc extra) may be missing
            logging.getLogger(__name__).debug("`specsplit %s` unavailable: %s", name, e)
            missing.append(f"{name} ({e})")
            continue
        mod.add_cli(sub)
    if missing:
        parser.epilog = "unavailable here: " + "; ".join(missing)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specsplit.errors import SpecSplitError

    try:
        return int(args.func(args) or 0)
    except SpecSplitError as e:
        print(f"specsplit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
