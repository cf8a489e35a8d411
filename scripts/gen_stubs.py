#!/usr/bin/env python
"""Generate the gRPC stubs of ``proto/specsplit/v1/spec_decoding.proto`` into ``specsplit/remote/_generated/``.

Usage::

    python scripts/gen_stubs.py            # regenerate the committed stubs (needs grpcio-tools)
    python scripts/gen_stubs.py --check    # exit 1 if the committed stubs are stale

The raw output of ``grpc_tools.protoc`` is post-processed so that the committed stubs import on
every supported runtime, not only on the versions that generated them:

* ``*_pb2_grpc.py``: grpcio-tools >= 1.63 writes a hard check ``grpcio >= <grpcio-tools version>``
  (``GRPC_GENERATED_VERSION``), which fails on the GPU machines (grpcio 1.84) when the stubs were
  generated with a newer grpcio-tools. It is replaced by a check against the oldest grpcio that has
  the APIs the stubs call (:data:`GRPC_MIN_VERSION`). The absolute import ``from specsplit.v1
  import ...`` (which would collide with our own ``specsplit`` package) becomes a relative import.
* ``*_pb2.py``: protobuf's own gencode/runtime check (runtime must be >= the gencode version) is
  kept; this script refuses to emit gencode newer than :data:`MAX_GENCODE_VERSION` (the oldest
  protobuf runtime we support) unless ``--allow-newer-gencode`` is given. The module name baked
  into the message classes becomes ``__name__`` so pickling and reprs name the real module.

Only the standard library and grpcio-tools are needed; nothing is imported from ``specsplit``.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = "specsplit/v1/spec_decoding.proto"
OUT_DIR = ROOT / "specsplit" / "remote" / "_generated"
STEM = "spec_decoding"

# Oldest grpcio with everything the generated code calls (`_registered_method=True` on channel
# methods needs 1.63, `Server.add_registered_method_handlers` needs 1.65 on the sync stack).
GRPC_MIN_VERSION = "1.65.0"
# Oldest protobuf runtime we support (the GPU machines run 7.36.2). protobuf refuses to load
# gencode that is newer than the runtime, so the generator must not be newer than this.
MAX_GENCODE_VERSION = (7, 36, 2)

HEADER = "# Post-processed by scripts/gen_stubs.py from proto/{proto}. DO NOT EDIT; regenerate.\n"

INIT_PY = '''"""Generated gRPC stubs for ``proto/specsplit/v1/spec_decoding.proto``.

Do not edit: regenerate with ``python scripts/gen_stubs.py``.
"""
'''

_GRPC_CHECK = f"""# Version floor written by scripts/gen_stubs.py (replaces grpcio-tools' check against its own
# version, which would reject older but compatible grpcio releases).
GRPC_MIN_VERSION = '{GRPC_MIN_VERSION}'


def _version_tuple(v):
    return tuple(int(p) for p in re.findall(r'\\d+', v)[:3])


if _version_tuple(grpc.__version__) < _version_tuple(GRPC_MIN_VERSION):
    raise RuntimeError(
        f'specsplit remote mode needs grpcio>={{GRPC_MIN_VERSION}}, found {{grpc.__version__}}; '
        "run: pip install -U 'specsplit[grpc]'"
    )
"""


def _run_protoc(out: Path) -> None:
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit("grpcio-tools is not installed: pip install 'specsplit[dev]'") from None
    import importlib.resources

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO_ROOT / PROTO_FILE),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def _gencode_version(pb2: str) -> tuple[int, int, int]:
    m = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
        pb2,
    )
    if not m:
        raise SystemExit("could not find the protobuf gencode version in the generated _pb2.py")
    return int(m[1]), int(m[2]), int(m[3])


def _fix_pb2(src: str) -> str:
    module = PROTO_FILE[: -len(".proto")].replace("/", ".") + "_pb2"
    needle = f"'{module}'"
    if needle not in src:
        raise SystemExit(f"unexpected _pb2.py layout: {needle} not found")
    return HEADER.format(proto=PROTO_FILE) + src.replace(needle, "__name__")


def _fix_pb2_grpc(src: str) -> str:
    pkg = PROTO_FILE.rsplit("/", 1)[0].replace("/", ".")
    src, n = re.subn(
        rf"^from {re.escape(pkg)} import {STEM}_pb2 as", f"from . import {STEM}_pb2 as", src, flags=re.M
    )
    if n != 1:
        raise SystemExit("unexpected _pb2_grpc.py layout: absolute import of the _pb2 module not found")
    # The hard version check runs from `GRPC_GENERATED_VERSION = ...` to the end of the
    # `if _version_not_supported:` block (older grpcio-tools do not write it at all).
    m = re.search(
        r"^GRPC_GENERATED_VERSION = .*?^if _version_not_supported:\n(?:    [^\n]*\n|\n)*",
        src,
        flags=re.M | re.S,
    )
    if m:
        src = src[: m.start()] + _GRPC_CHECK + "\n\n" + src[m.end() :]
    else:
        src = src.replace("import grpc\n", "import grpc\n" + _GRPC_CHECK, 1)
    src = src.replace("import grpc\n", "import re\n\nimport grpc\n", 1)
    return HEADER.format(proto=PROTO_FILE) + src


def generate(out_dir: Path, allow_newer_gencode: bool = False) -> list[Path]:
    """Generate and post-process the stubs into ``out_dir``; return the files written."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp)
        _run_protoc(raw)
        gen = raw / Path(PROTO_FILE).parent
        pb2 = (gen / f"{STEM}_pb2.py").read_text()
        version = _gencode_version(pb2)
        if version > MAX_GENCODE_VERSION and not allow_newer_gencode:
            raise SystemExit(
                f"this grpcio-tools emits protobuf gencode {'.'.join(map(str, version))}, newer than the "
                f"oldest supported runtime {'.'.join(map(str, MAX_GENCODE_VERSION))}: such stubs would not "
                "import there. Use an older grpcio-tools (e.g. in a temporary venv) or pass "
                "--allow-newer-gencode after raising the protobuf floor in pyproject.toml."
            )
        files = {
            "__init__.py": INIT_PY,
            f"{STEM}_pb2.py": _fix_pb2(pb2),
            f"{STEM}_pb2.pyi": HEADER.format(proto=PROTO_FILE) + (gen / f"{STEM}_pb2.pyi").read_text(),
            f"{STEM}_pb2_grpc.py": _fix_pb2_grpc((gen / f"{STEM}_pb2_grpc.py").read_text()),
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


def stale_files(committed: Path = OUT_DIR) -> list[str]:
    """Unified diffs between freshly generated stubs and ``committed`` (empty = current)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), allow_newer_gencode=True)
        diffs = []
        for path in fresh:
            old = committed / path.name
            new_text = path.read_text()
            old_text = old.read_text() if old.exists() else ""
            if _normalise(new_text) != _normalise(old_text):
                diffs.append(
                    "".join(
                        difflib.unified_diff(
                            old_text.splitlines(True), new_text.splitlines(True), str(old), "fresh"
                        )
                    )
                )
        return diffs


def _normalise(text: str) -> str:
    """Drop the generator's version stamps so an unchanged .proto compares equal across tool versions."""
    text = re.sub(r"^# Protobuf Python Version: .*$", "", text, flags=re.M)
    return re.sub(
        r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,",
        r"\1",
        text,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="only check that the committed stubs are current"
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"output directory (default {OUT_DIR})")
    parser.add_argument("--allow-newer-gencode", action="store_true", help="see the module docstring")
    args = parser.parse_args(argv)
    if args.check:
        diffs = stale_files(args.out)
        for d in diffs:
            sys.stdout.write(d)
        if diffs:
            print("stubs are stale: run python scripts/gen_stubs.py", file=sys.stderr)
            return 1
        print("stubs are current")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), args.allow_newer_gencode)  # nothing is touched if this fails
        if args.out.exists():
            shutil.rmtree(args.out)  # drop files a renamed .proto would leave behind
        args.out.mkdir(parents=True)
        for path in fresh:
            dest = args.out / path.name
            shutil.copyfile(path, dest)
            print(f"wrote {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
