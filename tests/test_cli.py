"""`specsplit generate` end to end on tiny models saved to disk."""

from __future__ import annotations

import json

import pytest
import torch

from specsplit.cli import main
from tests.conftest import word, word_tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, llama_target, llama_draft_random):
    root = tmp_path_factory.mktemp("models")
    tok = word_tokenizer()
    for name, model in (("target", llama_target), ("draft", llama_draft_random)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def test_generate_cli_json(model_dirs, llama_target, capsys):
    prompt_ids = [5, 17, 33]
    prompt = " ".join(word(i) for i in prompt_ids)
    rc = main([
        "generate", prompt, "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"),
        "--raw", "--max-new-tokens", "12", "--tree", "static", "--json", "--device", "cpu",
    ])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = llama_target.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False)[0, 3:]
    assert out["text"] == word_tokenizer().decode(ref.tolist(), skip_special_tokens=True)
    assert out["stats"]["new_tokens"] == 12 and out["stats"]["rounds"] >= 1


def test_generate_cli_reports_errors(model_dirs, capsys):
    rc = main(
        [
            "generate",
            "xaa",
            "--target",
            str(model_dirs / "nope"),
            "--draft",
            str(model_dirs / "draft"),
            "--raw",
        ]
    )
    assert rc == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("attention", [[], ["--no-fold-gqa"], ["--fuse-projections"]])
def test_generate_cli_static_path_and_overlap(model_dirs, llama_target, capsys, attention):
    """--cuda-graphs (the static workspace path; eager on CPU) and --overlap keep HF's output, with
    SpecSplit's folded GQA attention, with transformers' own (--no-fold-gqa) and with fused
    projections (--fuse-projections)."""
    prompt_ids = [9, 4, 41, 7]
    prompt = " ".join(word(i) for i in prompt_ids)
    rc = main([
        "generate", prompt, "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"),
        "--raw", "--max-new-tokens", "16", "--tree", "dynamic", "--json", "--device", "cpu",
        "--cuda-graphs", "--overlap", *attention,
    ])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = llama_target.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False)[0, 4:]
    assert out["text"] == word_tokenizer().decode(ref.tolist(), skip_special_tokens=True)
    assert out["stats"]["spec_rounds"] >= 1  # the overlapped pipeline ran (adaptive: probes speculate)


@pytest.mark.parametrize("flag", ["--compile", "--prefill-graphs"])
def test_generate_cli_graph_options_need_cuda_graphs(model_dirs, capsys, flag):
    rc = main([
        "generate", "xaa", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"),
        "--raw", flag,
    ])  # fmt: skip
    assert rc == 2
    assert "--cuda-graphs" in capsys.readouterr().err


def test_serve_prefill_graphs_needs_cuda_graphs(capsys):
    assert main(["serve", "draft", "--model", "m", "--prefill-graphs"]) == 2
    assert "--cuda-graphs" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--prefill-graphs", "--no-prefill-graphs"])
def test_generate_cli_prefill_graphs(model_dirs, llama_target, capsys, flag):
    """Padded prompt forwards (the default with --cuda-graphs; replayed eagerly on CPU) and eager ones
    (--no-prefill-graphs) keep HF's output."""
    prompt_ids = [(7 * i) % 200 + 4 for i in range(40)]  # longer than a round's padded ingest
    rc = main([
        "generate", " ".join(word(i) for i in prompt_ids), "--target", str(model_dirs / "target"),
        "--draft", str(model_dirs / "draft"), "--raw", "--max-new-tokens", "16", "--json", "--device", "cpu",
        "--cuda-graphs", flag,
    ])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = llama_target.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False)[0, 40:]
    assert out["text"] == word_tokenizer().decode(ref.tolist(), skip_special_tokens=True)


def test_generate_and_serve_cli_restricted_draft_vocabulary(model_dirs, llama_target, capsys, tmp_path):
    """``models rank-vocab`` writes a ranking from text files; ``generate --draft-vocab N
    --draft-vocab-ranking FILE`` keeps HF's output; ``serve target --draft-vocab`` is refused."""
    texts = tmp_path / "texts.txt"
    texts.write_text(" ".join(word(i) for i in [9, 9, 9, 4, 4, 41]))
    ranking = tmp_path / "ranking.json"
    assert main(["models", "rank-vocab", str(model_dirs / "target"), str(texts), "--out", str(ranking)]) == 0
    assert "distinct tokens" in capsys.readouterr().out
    ranked = json.loads(ranking.read_text())["ranked_ids"]
    assert ranked[:2] == [9, 4]  # most used first
    prompt_ids = [9, 4, 41, 7]
    rc = main([
        "generate", " ".join(word(i) for i in prompt_ids), "--target", str(model_dirs / "target"),
        "--draft", str(model_dirs / "draft"), "--drafter", "model", "--raw", "--max-new-tokens", "16",
        "--json", "--device", "cpu", "--draft-vocab", "64", "--draft-vocab-ranking", str(ranking),
    ])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = llama_target.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False)[0, 4:]
    assert out["text"] == word_tokenizer().decode(ref.tolist(), skip_special_tokens=True)
    assert main(["serve", "target", "--model", "m", "--draft-vocab", "64"]) == 2
    assert "draft options" in capsys.readouterr().err
    rc = main([
        "generate", "xaa", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"),
        "--raw", "--draft-vocab-ranking", str(ranking),
    ])  # fmt: skip
    assert rc == 2 and "set vocab_subset" in capsys.readouterr().err


def test_the_default_tree_is_a_confident_chain_unless_configured(model_dirs, monkeypatch, capsys):
    """``from_pretrained()`` and ``specsplit generate`` draft with ``DEFAULT_TREE`` (a chain up to 8 deep
    that stops where the draft doubts) unless a config, a SPECSPLIT_TREE_* variable or a flag says
    otherwise; ``SpecSplitConfig()`` keeps ``TreeConfig()``."""
    from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
    from specsplit.generator import DEFAULT_TREE

    target, draft = str(model_dirs / "target"), str(model_dirs / "draft")
    with SpecSplitGenerator.from_pretrained(target, draft) as gen:
        assert gen.config.tree == DEFAULT_TREE and gen.config.drafter == "auto"
    with SpecSplitGenerator.from_pretrained(target, draft, config=SpecSplitConfig()) as gen:
        assert gen.config.tree == TreeConfig()
    monkeypatch.setenv("SPECSPLIT_TREE_NUM_DRAFT_TOKENS", "3")
    with SpecSplitGenerator.from_pretrained(target, draft) as gen:
        assert gen.config.tree == TreeConfig(num_draft_tokens=3)
    monkeypatch.delenv("SPECSPLIT_TREE_NUM_DRAFT_TOKENS")

    seen = []
    real = SpecSplitGenerator.from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls, *a, **kw):
        seen.append(kw["config"].tree)
        return real(cls, *a, **kw)

    monkeypatch.setattr(SpecSplitGenerator, "from_pretrained", classmethod(spy))
    base = [
        "generate",
        "a b",
        "--target",
        target,
        "--draft",
        draft,
        "--raw",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    ]
    for flags in ([], ["--tree", "dynamic"], ["--num-draft-tokens", "3"], ["--min-confidence", "0"]):
        assert main(base + flags) == 0
    capsys.readouterr()
    assert seen[0] == DEFAULT_TREE
    assert seen[1].shape == "dynamic" and seen[1].min_confidence == 0.0
    assert seen[2] == TreeConfig(num_draft_tokens=3, min_confidence=0.5)
    assert seen[3] == TreeConfig(num_draft_tokens=8, min_confidence=0.0)
