"""Fixtures: tiny seeded random Llama/Qwen2 models built from configs, and a word-level tokenizer."""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 256
EOS = 2
ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> types.ModuleType:
    """A fresh import of ``benchmarks/<name>.py`` (a script directory, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_llama(seed: int, layers: int = 2, vocab: int = VOCAB, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int, layers: int = 2, vocab: int = VOCAB, hidden: int = 64) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg).eval()


def noisy_copy(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with seeded Gaussian noise on every weight: a draft that agrees with the
    target often but not always (partial acceptance, speculation that both hits and misses)."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g).to(p.device))
    return out


@pytest.fixture
def flat_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Price trees as on a GPU, whatever this machine's timings: the planner then drafts n-gram
    trees wherever it has proposals (measured CPU costs may turn speculation off on a loaded box).
    The planner's own choices are pinned with injected costs in tests/test_drafters.py."""
    from specsplit.engines.cost_model import CostModels, FixedCosts

    flat = FixedCosts(fixed=0.001, verify=lambda n: 0.010 + 0.0001 * n, model=0.030)
    real = CostModels.get

    def get(self: CostModels, *args: Any) -> Any:
        model = real(self, *args)
        model.costs = flat
        return model

    monkeypatch.setattr(CostModels, "get", get)


@pytest.fixture
def outcome_reads(monkeypatch):
    """Counts ``VerifyOutcome.to_host`` calls, lifting CUDA's sync-debug "error" mode for exactly
    that read (the one device-to-host read a round is allowed), and only where the test armed it.
    Yields ``{"n": reads}``; the check is off again after the test."""
    from specsplit.core import verification

    reads = {"n": 0}
    orig = verification.VerifyOutcome.to_host
    cuda = torch.cuda.is_available()  # on CPU it only counts

    def allowed_read(self, *args, **kwargs):
        reads["n"] += 1
        if not cuda:
            return orig(self, *args, **kwargs)
        armed = torch.cuda.get_sync_debug_mode()  # before the test arms it (a first round): stays off
        torch.cuda.set_sync_debug_mode(0)
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(armed)

    monkeypatch.setattr(verification.VerifyOutcome, "to_host", allowed_read)
    yield reads
    if cuda:  # whatever the test did, the tests after it run unchecked
        torch.cuda.set_sync_debug_mode(0)


def assert_same_sampling(target: Any, draft: Any, ids: torch.Tensor, configs: list[Any], seed: int,
                         max_new_tokens: int) -> None:  # fmt: skip
    """Seeded sampling (temperature 0.8, top-p 0.9) gives the same tokens and accepted counts under
    every config (e.g. two engine paths that must be the same computation)."""
    from specsplit import SpecSplitGenerator

    kw = dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_p=0.9,
              return_dict_in_generate=True)  # fmt: skip
    outs = []
    for cfg in configs:
        with SpecSplitGenerator(target, draft, config=cfg) as gen:
            outs.append(gen.generate(ids, generator=torch.Generator().manual_seed(seed), **kw))
    for out in outs[1:]:
        assert torch.equal(outs[0].sequences, out.sequences)
        assert outs[0].spec_stats.accepted_counts() == out.spec_stats.accepted_counts()


def assert_heads_sample_as_target_only(model: Any, config: Any, ids: torch.Tensor) -> None:
    """A target with draft heads (``config``) samples the target-only tokens for the same seed, not
    for another, and its heads guessed in some rounds: its guesses are verified like any tree's."""
    import copy

    from specsplit import SpecSplitGenerator

    kw = dict(max_new_tokens=32, do_sample=True, temperature=0.8, top_p=0.95, return_dict_in_generate=True)
    with SpecSplitGenerator(model, None) as plain:
        ref = plain.generate(ids, generator=torch.Generator().manual_seed(5), **kw).sequences
    with SpecSplitGenerator(copy.deepcopy(model), None, config=config) as gen:
        outs = [gen.generate(ids, generator=torch.Generator().manual_seed(s), **kw) for s in (5, 6)]
    assert torch.equal(outs[0].sequences, ref) and not torch.equal(outs[1].sequences, ref)
    assert outs[0].spec_stats.rounds_by_drafter().get("heads", 0) > 0


def rewrite_in_place(
    build: Any, rewrite: Any, ids: torch.Tensor
) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """A tiny model from ``build(3)`` and a copy of it; ``rewrite`` (which swaps every ``nn.Linear``
    in place and returns how many) runs on the model. Returns ``(model, copy, logits before, after)``."""
    import copy

    model = build(3)
    ref = copy.deepcopy(model)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    with torch.inference_mode():
        want = ref(ids).logits
        assert rewrite(model) == linears
        got = model(ids).logits
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    return model, ref, want, got


def assert_rewritten_for_good(model: Any, rewrite: Any, ids: torch.Tensor, got: torch.Tensor) -> Any:
    """A rewritten model has nothing left to rewrite, and a deep copy of it computes the same logits;
    returns the copy."""
    import copy

    assert rewrite(model) == 0
    twin = copy.deepcopy(model)
    with torch.inference_mode():
        assert torch.equal(twin(ids).logits, got)
    return twin


def sharpen(model: torch.nn.Module, factor: float = 8.0) -> torch.nn.Module:
    """Scale the LM head so the random model has peaked (less tie-prone) next-token distributions."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model


@pytest.fixture(scope="session")
def llama_target() -> LlamaForCausalLM:
    return sharpen(tiny_llama(0))


@pytest.fixture(scope="session")
def llama_draft_random() -> LlamaForCausalLM:
    return sharpen(tiny_llama(1, layers=1))


@pytest.fixture(scope="session")
def qwen_target() -> Qwen2ForCausalLM:
    return sharpen(tiny_qwen2(10))


@pytest.fixture(scope="session")
def qwen_draft_random() -> Qwen2ForCausalLM:
    return sharpen(tiny_qwen2(11, layers=1))


def word(i: int) -> str:
    """The word of token ``i`` (letters only: ``xaa``, ``xab``, ...)."""
    return "x" + chr(97 + i // 26 % 26) + chr(97 + i % 26)


def word_tokenizer(vocab: int = VOCAB):
    """A word-level fast tokenizer, one word per token id (0 pad, 1 bos, 2 eos, 3 unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({word(i): i for i in range(vocab)}, unk_token=word(3)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=word(0), bos_token=word(1), eos_token=word(2), unk_token=word(3)
    )


@pytest.fixture(scope="session")
def tokenizer():
    return word_tokenizer()


# ---------------------------------------------------------------------- remote-mode tests
@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Module-wide one intra-op torch thread, as the remote workers run (the remote tests use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    from remote_support import single_thread

    with single_thread():
        yield


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The remote tests' tiny pair saved once per test module: ``(target dir, draft dir)``."""
    from remote_support import save_pair

    return save_pair(tmp_path_factory.mktemp("remote_models"))


@pytest.fixture(scope="module")
def engines(model_dirs: tuple[Path, Path]) -> tuple[Any, Any]:
    """``(DraftEngine, TargetEngine)`` over the saved pair, loaded as the workers load it."""
    from remote_support import load_saved

    from specsplit import DraftEngine, TargetEngine

    target_dir, draft_dir = model_dirs
    return DraftEngine(load_saved(draft_dir)), TargetEngine(load_saved(target_dir))
