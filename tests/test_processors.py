"""Every HF generation option that shapes the scores, applied exactly under speculation.

The matrix: each option x {chain, dynamic tree, n-gram drafter} x {local, gRPC}; greedy float32
output token-exact against HF ``generate()`` on the same model, seeded sampling identical whatever
was drafted (the engines draw by position, so equal tokens mean equal processed distributions at
every position), ``output_scores`` / ``output_logits`` equal to HF's. A control checks that every
option really changes HF's output on this prompt (an ignored option would fail the matrix).
The sampled distribution itself is checked statistically in ``test_processors_distribution``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

from specsplit import SpecSplitConfig, SpecSplitGenerator, TargetEngine, TreeConfig
from specsplit.errors import ConfigError

pytest.importorskip("grpc")

from remote_support import load_saved  # noqa: E402

from specsplit.remote import serve_draft, serve_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# A prompt that repeats itself (the n-gram drafter finds matches) and that the tiny target
# continues with repetitions (penalties and n-gram bans change its output).
PROMPT = [5, 17, 33, 81, 9, 100, 5, 17, 33, 81, 9, 100, 5, 17]
NEW = 24

# name -> (the option, the other options it needs to matter: an EOS id the target emits here)
EOS_HERE = {"eos_token_id": 192}
GREEDY_OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "repetition_penalty": ({"repetition_penalty": 1.4}, {}),
    "no_repeat_ngram_size": ({"no_repeat_ngram_size": 2}, {}),
    "min_new_tokens": ({"min_new_tokens": 18}, EOS_HERE),
    "min_length": ({"min_length": len(PROMPT) + 17}, EOS_HERE),
    "bad_words_ids": ({"bad_words_ids": [[106], [228, 237]]}, {}),
    "suppress_tokens": ({"suppress_tokens": [106, 192]}, {}),
    "begin_suppress_tokens": ({"begin_suppress_tokens": [122]}, {}),
    "sequence_bias": ({"sequence_bias": [[[192], 6.0], [[114, 228], -20.0]]}, {}),
    "forced_eos_token_id": ({"forced_eos_token_id": 7}, {}),
    "exponential_decay_length_penalty": ({"exponential_decay_length_penalty": (4, 1.3)}, EOS_HERE),
    "renormalize_logits": ({"renormalize_logits": True, "repetition_penalty": 1.3}, {}),
}
SAMPLING_OPTIONS: dict[str, dict[str, Any]] = {
    "repetition_penalty": {"repetition_penalty": 1.3, "temperature": 0.9},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 3},
    "typical_p": {"typical_p": 0.8},
    "min_p": {"min_p": 0.05},
    "epsilon_cutoff": {"epsilon_cutoff": 0.01},
    "eta_cutoff": {"eta_cutoff": 0.01},
    "min_new_tokens": {"min_new_tokens": 16, "top_k": 20, **EOS_HERE},
    "suppress_tokens": {"suppress_tokens": [106, 192], "top_p": 0.9},
}
DRAFTERS = {
    "chain": ("model", TreeConfig(shape="chain", num_draft_tokens=4)),
    "dynamic": ("model", TreeConfig(shape="dynamic", topk=3, width=3, budget=12, max_depth=4)),
    "ngram": ("ngram", TreeConfig()),
}


@pytest.fixture(scope="module")
def pair(model_dirs: tuple[Path, Path]) -> tuple[torch.nn.Module, torch.nn.Module]:
    target, draft = (load_saved(p) for p in model_dirs)
    eos = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = draft.generation_config.eos_token_id = [7] if eos is None else eos
    return target, draft


@pytest.fixture(scope="module")
def servers(pair) -> Iterator[tuple[str, str]]:
    from specsplit import DraftEngine

    target, draft = pair
    with serve_draft(DraftEngine(draft)) as d, serve_target(TargetEngine(target)) as t:
        yield d.address, t.address


def _generator(pair, servers, transport: str, drafter: str) -> SpecSplitGenerator:
    mode, tree = DRAFTERS[drafter]
    target, draft = pair
    if transport == "local":
        cfg = SpecSplitConfig(tree=tree, drafter=mode)
        gen = SpecSplitGenerator(target, draft if mode == "model" else None, config=cfg)
    else:
        d_addr, t_addr = servers
        cfg = SpecSplitConfig(transport="grpc", draft_address=d_addr if mode == "model" else "",
                              target_address=t_addr, tree=tree, drafter=mode)  # fmt: skip
        gen = SpecSplitGenerator(config=cfg)
    gen.generation_config = target.generation_config
    return gen


def _hf(target: torch.nn.Module, ids: torch.Tensor, **kw: Any) -> torch.Tensor:
    with torch.no_grad():
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, **kw)


@pytest.mark.parametrize("option", sorted(GREEDY_OPTIONS))
def test_every_option_changes_hf_output(pair, option: str) -> None:
    """The control: an option SpecSplit ignored would fail the matrix below."""
    ids = torch.tensor([PROMPT])
    opt, ctx = GREEDY_OPTIONS[option]
    assert not torch.equal(_hf(pair[0], ids, **opt, **ctx), _hf(pair[0], ids, **ctx))


@pytest.mark.parametrize("transport", ["local", "grpc"])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_equals_hf_for_every_option(pair, servers, transport: str, drafter: str, request) -> None:
    if DRAFTERS[drafter][0] == "ngram":
        request.getfixturevalue("flat_costs")
    ids = torch.tensor([PROMPT])
    accepted = 0
    with _generator(pair, servers, transport, drafter) as gen:
        for name, (opt, ctx) in GREEDY_OPTIONS.items():
            kw = {**opt, **ctx}
            out = gen.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True, **kw)
            ref = _hf(pair[0], ids, **kw)
            assert torch.equal(out.sequences, ref), f"{name}: {out.sequences.tolist()} != {ref.tolist()}"
            accepted += sum(out.spec_stats.accepted_counts())
    assert accepted > 0  # the trees were verified, not only plain steps


@pytest.mark.parametrize("transport", ["local", "grpc"])
def test_seeded_sampling_is_the_same_whatever_drafts(pair, servers, transport: str) -> None:
    """Position-keyed draws: with the same processed distribution at every position, a seeded
    generation commits the same tokens with any drafter, tree or none, in-process or remote."""
    ids = torch.tensor([PROMPT])
    target = pair[0]
    for name, kw in SAMPLING_OPTIONS.items():
        outs = {}
        with SpecSplitGenerator(target, None) as plain:
            plain.generation_config = target.generation_config
            outs["target-only"] = plain.generate(
                ids, max_new_tokens=NEW, do_sample=True, generator=torch.Generator().manual_seed(3), **kw
            )
        for drafter in ("dynamic", "ngram"):
            with _generator(pair, servers, transport, drafter) as gen:
                outs[drafter] = gen.generate(
                    ids, max_new_tokens=NEW, do_sample=True, generator=torch.Generator().manual_seed(3), **kw
                )
        ref = outs.pop("target-only")
        for drafter, out in outs.items():
            assert torch.equal(out, ref), f"{name} / {drafter}: {out.tolist()} != {ref.tolist()}"


def test_seeded_sampled_chains_are_the_same_in_process_and_over_grpc(pair, servers) -> None:
    """A sampled chain draws its tokens from the draft's processed q (rejection sampling, not
    position-keyed draws), so its seeded output is its own: the same in-process and remote, for
    every option (its distribution is checked in ``test_processors_distribution``)."""
    ids = torch.tensor([PROMPT])
    for name, kw in SAMPLING_OPTIONS.items():
        outs = []
        for transport in ("local", "grpc"):
            with _generator(pair, servers, transport, "chain") as gen:
                outs.append(gen.generate(ids, max_new_tokens=NEW, do_sample=True,
                                         generator=torch.Generator().manual_seed(5), **kw))  # fmt: skip
        assert torch.equal(outs[0], outs[1]), f"{name}: {outs[0].tolist()} != {outs[1].tolist()}"


@pytest.mark.parametrize("transport", ["local", "grpc"])
def test_output_scores_and_logits_equal_hf(pair, servers, transport: str) -> None:
    ids = torch.tensor([PROMPT])
    kw: dict[str, Any] = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, output_scores=True,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip
    ref = _hf(pair[0], ids, **kw)
    with _generator(pair, servers, transport, "dynamic") as gen:
        out = gen.generate(ids, max_new_tokens=NEW, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.scores is not None and out.logits is not None
    assert len(out.scores) == len(ref.scores) == NEW and len(out.logits) == NEW
    for ours, theirs in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-4)


def test_output_scores_under_sampling_are_the_processed_scores_of_the_chosen_tokens(pair) -> None:
    """Sampling: each step's scores are HF's processors (temperature, top-k included) applied to
    the target's logits for the sampled sequence (teacher-forced through the target)."""
    target, draft = pair
    ids = torch.tensor([PROMPT])
    kw: dict[str, Any] = dict(do_sample=True, temperature=0.7, top_k=12, repetition_penalty=1.2,
                              output_scores=True, return_dict_in_generate=True)  # fmt: skip
    with SpecSplitGenerator(target, draft, config=SpecSplitConfig(tree=DRAFTERS["dynamic"][1])) as gen:
        out = gen.generate(ids, max_new_tokens=NEW, generator=torch.Generator().manual_seed(1), **kw)
    seq = out.sequences
    gc = target.generation_config
    gc = type(gc)(
        **{**gc.to_dict(), "do_sample": True, "temperature": 0.7, "top_k": 12, "repetition_penalty": 1.2}
    )
    target._prepare_special_tokens(gc, True, torch.device("cpu"))
    procs = target._get_logits_processor(gc, input_ids_seq_length=len(PROMPT), device="cpu", model_kwargs={})
    with torch.no_grad():
        logits = target(seq).logits[0].float()
    for t, ours in enumerate(out.scores):
        at = len(PROMPT) + t
        theirs = procs(seq[:, :at], logits[at - 1 : at].clone())
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-4)
        assert torch.isfinite(ours[0, seq[0, at]])  # the chosen token was allowed


class _ForbidAfter(LogitsProcessor):
    """A custom processor: after token ``a``, token ``b`` is forbidden (row by row, from the context)."""

    def __init__(self, a: int, b: int):
        self.a, self.b = a, b

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        hit = input_ids[:, -1] == self.a
        scores[hit, self.b] = float("-inf")
        return scores


class _StopAt(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_custom_processor_criteria_and_prefix_fn_equal_hf(pair, drafter: str) -> None:
    ids = torch.tensor([PROMPT])
    base = _hf(pair[0], ids)[0, len(PROMPT) :].tolist()
    a, b = base[0], base[1]  # the target's own continuation: forbidding it changes the output
    stop = base[4]
    procs = [_ForbidAfter(a, b)]
    ref = _hf(pair[0], ids, logits_processor=procs, stopping_criteria=[_StopAt(stop)])
    assert not torch.equal(ref[0, len(PROMPT) :], torch.tensor(base))
    with _generator(pair, None, "local", drafter) as gen:
        out = gen.generate(ids, max_new_tokens=NEW, logits_processor=procs, stopping_criteria=[_StopAt(stop)])
    assert torch.equal(out, ref)

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        return list(range(40, 80)) if int(sent[-1]) % 2 else list(range(100, 140))

    ref = _hf(pair[0], ids, prefix_allowed_tokens_fn=allowed)
    with _generator(pair, None, "local", drafter) as gen:
        out = gen.generate(ids, max_new_tokens=NEW, prefix_allowed_tokens_fn=allowed)
    assert torch.equal(out, ref)


def test_left_padded_batch_sees_the_padding_as_hf_does(pair) -> None:
    """HF's processors see a row's left padding (a repetition penalty penalises the pad token,
    min_length counts it): so do SpecSplit's."""
    target, draft = pair
    ids = torch.tensor([[0, 0, 0, 0] + PROMPT[:10], PROMPT])
    mask = torch.tensor([[0, 0, 0, 0] + [1] * 10, [1] * len(PROMPT)])
    kw: dict[str, Any] = dict(repetition_penalty=1.5, min_length=len(PROMPT) + 10, max_new_tokens=NEW)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, **kw)
    with SpecSplitGenerator(target, draft) as gen:
        gen.generation_config = target.generation_config
        out = gen.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out[:, : ref.shape[1]], ref)


def test_num_return_sequences_samples_independent_rows(pair) -> None:
    target, draft = pair
    ids = torch.tensor([PROMPT])
    with SpecSplitGenerator(target, draft) as gen:
        out = gen.generate(ids, max_new_tokens=NEW, do_sample=True, num_return_sequences=3,
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert out.shape == (3, len(PROMPT) + NEW)
        assert len({tuple(r) for r in out[:, len(PROMPT) :].tolist()}) == 3
        with pytest.raises(ValueError, match="num_return_sequences"):  # HF's own check, or ours
            gen.generate(ids, max_new_tokens=4, num_return_sequences=2)


@pytest.mark.parametrize(
    "option",
    [
        {"num_beams": 2},
        {"guidance_scale": 1.5},
        {"penalty_alpha": 0.6, "top_k": 4},
        {"output_attentions": True},
        {"diversity_penalty": 0.5},
        {"dola_layers": "low"},
    ],  # fmt: skip
    ids=lambda o: next(iter(o)),
)
def test_unsupported_options_are_refused_loudly(pair, option: dict[str, Any]) -> None:
    with SpecSplitGenerator(pair[0], None) as gen, pytest.raises(ConfigError, match="not supported"):
        gen.generate(torch.tensor([PROMPT]), max_new_tokens=4, **option)


def test_custom_processors_are_refused_over_grpc_before_any_round(pair, servers) -> None:
    with _generator(pair, servers, "grpc", "ngram") as gen, pytest.raises(ConfigError, match="remote"):
        gen.generate(torch.tensor([PROMPT]), max_new_tokens=4, logits_processor=[_ForbidAfter(1, 2)])


def test_worker_loop_applies_processing_options(pair, servers) -> None:
    """``grpc_loop="target"``: the options travel in the Generate request; same tokens as HF."""
    d_addr, t_addr = servers
    ids = torch.tensor([PROMPT])
    cfg = SpecSplitConfig(transport="grpc", draft_address=d_addr, target_address=t_addr, grpc_loop="target",
                          tree=DRAFTERS["dynamic"][1])  # fmt: skip
    with SpecSplitGenerator(config=cfg) as gen:
        gen.generation_config = pair[0].generation_config
        for kw in (GREEDY_OPTIONS["repetition_penalty"][0], GREEDY_OPTIONS["min_new_tokens"][0] | EOS_HERE):
            assert torch.equal(gen.generate(ids, max_new_tokens=NEW, **kw), _hf(pair[0], ids, **kw))


def test_bad_processing_options_from_a_client_are_invalid_requests(pair, servers) -> None:
    import grpc

    from specsplit.remote._generated import spec_decoding_pb2 as pb
    from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc

    _, t_addr = servers
    greedy = pb.SamplingParams(top_p=1.0, temperature=1.0)
    bad = [
        "{not json",
        '{"options": {"num_beams": 4}, "prompt_length": 3}',
        '{"options": {"repetition_penalty": "x"}, "prompt_length": 3}',
        '{"options": {}, "prompt_length": 3, "prefix": [99999999]}',
        '{"options": {"bad_words_ids": [[1]]}, "prompt_length": 3, "pad": ' + "1," * 40000 + "1}",
    ]
    with grpc.insecure_channel(t_addr) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        for text in bad:
            req = pb.VerifyRequest(session_id="bad", tree=pb.TokenTree(), pending_token_ids=[5, 6, 7],
                                   sampling=greedy, processing=text)  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                stub.VerifyDrafts(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (text[:40], err.value.details())
        ok = stub.VerifyDrafts(pb.VerifyRequest(session_id="ok", tree=pb.TokenTree(), pending_token_ids=[5, 6, 7],
                                                sampling=greedy, processing='{"options": {"repetition_penalty": 1.2}, '
                                                '"prompt_length": 3}'), timeout=30)  # fmt: skip
        assert ok.prefix_length == 3  # the worker keeps serving


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_tree_scores_equal_hf_processors_row_by_row(pair, sample: bool) -> None:
    """Every row of a branching tree gets exactly what HF's processor list gives its own context
    (prompt + committed + the row's path), compared on the scores themselves, not just the argmax."""
    from specsplit.core.tree import TokenTree
    from specsplit.engines.processing import TreeProcessors
    from specsplit.messages import LogitsProcessing

    target = pair[0]
    options: dict[str, Any] = {"repetition_penalty": 1.7, "no_repeat_ngram_size": 2, "min_new_tokens": 6,
                               "eos_token_id": 7, "bad_words_ids": [[40, 41]], "sequence_bias": [[[5, 6], 3.0]],
                               "max_length": 64, "begin_suppress_tokens": [9]}  # fmt: skip
    if sample:
        options |= {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.01}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 60, (10,), generator=g).tolist()
    committed = [40, 5, 6]
    # depth 1: 3 roots; depth 2: children of roots 0 and 1; depth 3: one grandchild (tokens repeat the context)
    tokens = [41, 6, 9, 5, 40, 41, 6]
    parents = [-1, -1, -1, 0, 0, 1, 3]
    depths = [1, 1, 1, 2, 2, 2, 3]
    tree = TokenTree(
        torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(len(tokens))
    )
    spec = LogitsProcessing(options, len(prompt), [2, 2])  # two pads before the prompt
    proc = TreeProcessors(target, spec, torch.device("cpu"))
    proc.begin(0, prompt)
    length = proc.begin(len(prompt), committed)
    logits = torch.randn(len(tokens) + 1, 256, generator=g) * 4
    ours = proc.scores(logits, tree, depths, length)
    flag = proc.overflow()  # sampling: top-k + top-p fused over the best candidates, no tie past them
    assert (flag is not None and flag.item() == 0) if sample else flag is None
    exact = proc.scores(logits, tree, depths, length, exact=True)  # HF's own warpers

    hf = _hf_processors(target, options, len(prompt))
    for row in range(len(tokens) + 1):
        ctx = [2, 2] + prompt + committed + _row_path(row, tokens, parents)
        theirs = hf(torch.tensor([ctx]), logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], theirs, msg=f"row {row}")
        torch.testing.assert_close(exact[row : row + 1], theirs, msg=f"row {row}")


def _hf_processors(target: Any, options: dict[str, Any], prompt_length: int, custom: Any = ()) -> Any:
    """The processor list HF ``generate()`` builds for ``options``."""
    from transformers import GenerationConfig

    gc = GenerationConfig(**options)
    target._prepare_special_tokens(gc, True, torch.device("cpu"))
    return target._get_logits_processor(gc, input_ids_seq_length=prompt_length, device="cpu",
                                        logits_processor=list(custom), model_kwargs={})  # fmt: skip


def _row_path(row: int, tokens: list[int], parents: list[int]) -> list[int]:
    """The tokens on row ``row``'s path from the root (row 0: the context row, no path)."""
    path: list[int] = []
    node = row - 1
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path


@pytest.mark.parametrize("kind", ["graph", "ignore-prompt"])
def test_penalty_mask_and_graph_scores_equal_hf_row_by_row(pair, kind: str) -> None:
    """The repetition penalty as a token mask (and, for processors with a graph key, the
    fixed-shape device path a one-graph greedy round captures) equals HF's list row by row; a
    penalty that ignores part of the prompt takes the generic context path, also exact."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from specsplit.core.tree import TokenTree
    from specsplit.engines.processing import TreeProcessors, device_scores
    from specsplit.messages import LogitsProcessing

    target = pair[0]
    options: dict[str, Any] = {"repetition_penalty": 1.7}
    custom = []
    if kind == "graph":
        options |= {"suppress_tokens": [3, 9], "renormalize_logits": True}
    else:
        custom = [RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=6)]
    prompt = [11, 12, 40, 13, 5, 14, 15, 16]
    committed = [17, 5]
    tokens, parents, depths = [40, 6, 5, 13, 17], [-1, -1, 0, 2, 1], [1, 1, 2, 3, 2]
    tree = TokenTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(5))
    proc = TreeProcessors(target, LogitsProcessing(options, len(prompt), [2], custom), torch.device("cpu"))
    assert (proc.graph_key is not None) == (kind == "graph")
    proc.begin(0, prompt)
    length = proc.begin(len(prompt), committed)
    logits = torch.randn(len(tokens) + 1, 256, generator=torch.Generator().manual_seed(1)) * 4
    ours = [proc.scores(logits, tree, depths, length)]
    if kind == "graph":
        ours.append(device_scores(proc.stages, logits, tree, proc.presence(256, length)))
    hf = _hf_processors(target, options, len(prompt), custom)
    for row in range(len(tokens) + 1):
        ctx = [2] + prompt + committed + _row_path(row, tokens, parents)
        theirs = hf(torch.tensor([ctx]), logits[row : row + 1].clone())
        for x in ours:
            torch.testing.assert_close(x[row : row + 1], theirs, rtol=0, atol=0, msg=f"row {row}")


def test_constrained_json_example_equals_hf_and_is_valid_json(pair) -> None:
    """``examples/constrained_json.py``: its processor, over a vocabulary whose tokens spell JSON
    pieces, gives HF ``generate()``'s output under speculation, and that output is a JSON array."""
    import importlib.util
    import json

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location(
        "constrained_json", ROOT / "examples" / "constrained_json.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    target, draft = pair
    pieces = ["[", "]", ",", ", ", "1", "2", "3", "17", "42", "100", "7]", "[1", "abc", "{", "x,", "]]"]
    texts = [pieces[i % len(pieces)] if i >= 8 else "" for i in range(256)]
    ids = torch.tensor([PROMPT])
    constrain = mod.JsonIntArrayProcessor(texts, len(PROMPT), eos_token_id=7)
    kw: dict[str, Any] = dict(logits_processor=[constrain], eos_token_id=7)
    ref = _hf(target, ids, **kw)
    for drafter in ("ngram", "dynamic"):
        with _generator(pair, None, "local", drafter) as gen:
            out = gen.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True, **kw)
        assert torch.equal(out.sequences, ref)
    new = ref[0, len(PROMPT) :].tolist()
    body = new[: new.index(7)] if 7 in new else new
    assert constrain.state(body) >= 0  # a prefix of a JSON array of integers
    if 7 in new:  # closed, then EOS
        assert isinstance(json.loads("".join(texts[t] for t in body)), list)


@pytest.mark.parametrize("transport", ["local", "grpc"])
def test_forced_bos_on_a_one_token_prompt_and_criteria_over_either_transport(
    pair, servers, transport
) -> None:
    """``forced_bos_token_id`` acts when the prompt is one token long; stopping criteria run where
    the loop runs (the client), whatever the transport."""
    ids = torch.tensor([[5]])
    ref = _hf(pair[0], ids, forced_bos_token_id=33)
    assert ref[0, 1] == 33
    with _generator(pair, servers, transport, "dynamic") as gen:
        assert torch.equal(gen.generate(ids, max_new_tokens=NEW, forced_bos_token_id=33), ref)
        stop = int(ref[0, 6])
        ref2 = _hf(pair[0], ids, forced_bos_token_id=33, stopping_criteria=[_StopAt(stop)])
        out = gen.generate(ids, max_new_tokens=NEW, forced_bos_token_id=33, stopping_criteria=[_StopAt(stop)])
    assert ref2.shape[1] < ref.shape[1] and torch.equal(out, ref2)


def test_local_and_grpc_give_the_same_tokens_and_acceptance(pair, servers) -> None:
    """Same code both ways: with processors on, the two transports commit the same tokens and
    accept the same counts every round."""
    ids = torch.tensor([PROMPT])
    kw: dict[str, Any] = dict(max_new_tokens=NEW, return_dict_in_generate=True, repetition_penalty=1.3,
                              no_repeat_ngram_size=3)  # fmt: skip
    outs = []
    for transport in ("local", "grpc"):
        with _generator(pair, servers, transport, "dynamic") as gen:
            outs.append(gen.generate(ids, **kw))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].spec_stats.accepted_counts() == outs[1].spec_stats.accepted_counts()


# ---------------------------------------------------------------------- the draft side
DRAFT_OPTIONS: dict[str, Any] = {"repetition_penalty": 1.6, "no_repeat_ngram_size": 2,
                                 "sequence_bias": [[[33], 3.0]]}  # fmt: skip
DRAFT_TREES = {
    "chain": TreeConfig(shape="chain", num_draft_tokens=6),
    "static": TreeConfig(shape="static", paths=[[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": TreeConfig(shape="dynamic", topk=2, width=2, budget=64, max_depth=5),
}


@pytest.mark.parametrize("shape", sorted(DRAFT_TREES))
def test_draft_main_path_is_hf_greedy_of_the_draft_with_the_processors(pair, shape: str) -> None:
    """The draft applies the processors to every node with that node's own context: the tree's
    main path (first child at each level) is what HF ``generate()`` of the DRAFT model writes with
    the same options, also after the session has grown by committed tokens."""
    from specsplit import DraftEngine, DraftRequest
    from specsplit.core.growth import main_path
    from specsplit.messages import LogitsProcessing

    draft = pair[1]
    tree = DRAFT_TREES[shape]
    depth = tree.depth_limit
    ids = torch.tensor([PROMPT])

    def hf(n: int, **opts: Any) -> list[int]:
        """HF's greedy loop with the processors ``generate()`` builds (past any EOS: a draft tree
        does not stop at one)."""
        gc = GenerationConfig(do_sample=False, **opts)
        procs = draft._get_logits_processor(
            gc, input_ids_seq_length=len(PROMPT), device="cpu", model_kwargs={}
        )
        seq = ids
        with torch.no_grad():
            for _ in range(n):
                scores = procs(seq, draft(seq).logits[:, -1].float())
                seq = torch.cat([seq, scores.argmax(-1, keepdim=True)], dim=1)
        return seq[0, len(PROMPT) :].tolist()

    ref, raw = hf(3 + depth, **DRAFT_OPTIONS), hf(depth)
    assert ref[:depth] != raw  # the options change the draft's own greedy path here
    engine = DraftEngine(draft)
    try:
        spec = LogitsProcessing(dict(DRAFT_OPTIONS), len(PROMPT))
        res = engine.generate(DraftRequest("s", PROMPT, 0, tree, processing=spec))
        assert main_path(res.tree) == ref[:depth]
        res = engine.generate(DraftRequest("s", ref[:3], len(PROMPT), tree, processing=spec))
        assert main_path(res.tree) == ref[3 : 3 + depth]
        res = engine.generate(DraftRequest("t", PROMPT, 0, tree))  # without: the raw greedy path
        assert main_path(res.tree) == raw
    finally:
        engine.shutdown()


@pytest.mark.parametrize("transport", ["local", "grpc"])
def test_draft_processors_raise_acceptance_and_change_no_token(pair, servers, transport: str) -> None:
    """A bias the target follows (token 33 after every token) is invisible to a raw draft; with the
    draft applying the processors its chains are accepted. The output is HF's either way."""
    from specsplit.config import PipelineTuning

    ids = torch.tensor([PROMPT])
    kw: dict[str, Any] = dict(max_new_tokens=NEW, return_dict_in_generate=True,
                              sequence_bias=[[[33], 40.0]])  # fmt: skip
    ref = _hf(pair[0], ids, sequence_bias=[[[33], 40.0]])
    accepted = {}
    for on in (False, True):
        gen = _generator(pair, servers, transport, "chain")
        gen.config.tuning = PipelineTuning(draft_processors=on)
        with gen:
            out = gen.generate(ids, **kw)
        assert torch.equal(out.sequences, ref)
        accepted[on] = sum(out.spec_stats.accepted_counts())
    assert accepted[False] <= NEW // 4 < NEW // 2 <= accepted[True], accepted


def test_greedy_rounds_with_a_penalty_replay_as_one_round_graph(pair) -> None:
    """On the static (CUDA-graph) path a greedy round whose processors are a repetition penalty
    and capture-safe ones runs as the one whole-round graph (eagerly on the CPU, the same code);
    per-depth processors take the eager round. HF's output either way."""
    from specsplit.config import EngineTuning, TargetConfig

    target, draft = pair
    ids = torch.tensor([PROMPT])
    tuning = EngineTuning(graph_capacity=256)
    cfg = SpecSplitConfig(tree=DRAFTERS["chain"][1], target=TargetConfig(cuda_graphs=True, tuning=tuning))
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        gen.generation_config = target.generation_config
        for opts, one_graph in (
            ({"repetition_penalty": 1.4, "suppress_tokens": [106, 192], "renormalize_logits": True}, True),
            ({"repetition_penalty": 1.4, "no_repeat_ngram_size": 2}, False),
        ):
            before = set(gen.target_engine._rounds)
            out = gen.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True, **opts)
            assert torch.equal(out.sequences, _hf(target, ids, **opts)), opts
            assert sum(out.spec_stats.accepted_counts()) > 0
            new = set(gen.target_engine._rounds) - before
            assert any(key[-1] is not None for key in new) == one_graph, (opts, new)


def test_presence_mask_is_rebuilt_when_the_history_is_rewritten(pair) -> None:
    """A draft's speculative extension that turns out wrong is overwritten in its history: the
    penalty's presence mask must forget the overwritten tokens, not only add new ones."""
    from specsplit.engines.processing import TreeProcessors
    from specsplit.messages import LogitsProcessing

    proc = TreeProcessors(pair[0], LogitsProcessing({"repetition_penalty": 1.5}, 3), torch.device("cpu"))
    proc.record(0, [5, 6, 7, 8])
    assert proc.presence(256, 4).nonzero().flatten().tolist() == [5, 6, 7, 8]
    proc.record(2, [9, 10])  # positions 2.. rewritten: 7 and 8 are gone
    assert proc.presence(256, 4).nonzero().flatten().tolist() == [5, 6, 9, 10]
    proc.record(4, [11])  # appending keeps the mask and adds
    assert proc.presence(256, 5).nonzero().flatten().tolist() == [5, 6, 9, 10, 11]
