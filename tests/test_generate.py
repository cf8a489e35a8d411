"""Greedy exactness against HF generate() (float32, tiny random Llama and Qwen2) and the HF-style API."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, TextIteratorStreamer

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.bench.batch import left_padded
from specsplit.errors import ConfigError

SHAPES = [
    TreeConfig(shape="chain", num_draft_tokens=4),
    TreeConfig(shape="static"),
    TreeConfig(shape="dynamic", topk=3, width=3, budget=12, max_depth=5),
]
PROMPTS = [[5, 17, 33, 81, 9, 100], [7, 7, 12], [44, 3, 19, 250, 61, 62, 63, 64, 9]]


def _batch(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(prompts, pad)


def _hf(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "qwen"])
@pytest.mark.parametrize("tree", SHAPES, ids=lambda t: t.shape)
@pytest.mark.parametrize("draft_kind", ["same", "random"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_hf_generate(request, family, tree, draft_kind, batch):
    target = request.getfixturevalue(f"{family}_target")
    draft = target if draft_kind == "same" else request.getfixturevalue(f"{family}_draft_random")
    ids, mask = _batch(PROMPTS[:batch])
    ref = _hf(target, ids, mask, 40)
    with SpecSplitGenerator(target, draft, config=SpecSplitConfig(tree=tree)) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=40, return_dict_in_generate=True)
    assert out.sequences.shape == ref.shape
    assert torch.equal(out.sequences, ref)
    stats = out.spec_stats
    if draft_kind == "same":  # everything drafted is accepted
        assert stats.acceptance_rate > 0.95 or tree.shape == "dynamic"
        assert stats.tau > 2.0
    else:  # an unrelated draft: almost nothing accepted, output still exact
        assert stats.acceptance_rate < 0.3


def test_same_draft_accepts_full_chain(llama_target):
    ids = torch.tensor([PROMPTS[0]])
    with SpecSplitGenerator(llama_target, llama_target, config=SpecSplitConfig()) as gen:
        out = gen.generate(ids, max_new_tokens=41, return_dict_in_generate=True)
    # 41 = 8 rounds of (4 accepted + 1) + 1: every drafted token accepted, last round capped.
    assert out.spec_stats.accepted_counts()[:8] == [4] * 8
    assert out.spec_stats.per_position_acceptance() == [1.0] * 4


def test_target_only_without_draft(llama_target):
    ids = torch.tensor([PROMPTS[1]])
    ref = _hf(llama_target, ids, None, 25)
    with SpecSplitGenerator(llama_target, None) as gen:
        assert torch.equal(gen.generate(ids, max_new_tokens=25), ref)


@pytest.mark.parametrize("n", [1, 2, 5, 13])
def test_max_new_tokens_never_overshoots(llama_target, n):
    ids = torch.tensor([PROMPTS[0]])
    with SpecSplitGenerator(
        llama_target, llama_target, config=SpecSplitConfig(tree=TreeConfig(shape="static"))
    ) as gen:
        out = gen.generate(ids, max_new_tokens=n)
    assert out.shape == (1, len(PROMPTS[0]) + n)
    assert torch.equal(out, _hf(llama_target, ids, None, n))


def test_eos_stops_and_pads_like_hf(llama_target):
    ids, mask = _batch(PROMPTS)
    ref = _hf(llama_target, ids, mask, 30)
    # Pick as EOS a token that appears early in one row's greedy continuation.
    eos = int(ref[1, ids.shape[1] + 3])
    ref_eos = llama_target.generate(
        ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    with SpecSplitGenerator(llama_target, llama_target) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref_eos)
    start = ids.shape[1]
    assert int(out[1, start + 3]) == eos and (out[1, start + 4 :] == 0).all()  # stopped, padded


def test_several_eos_ids(llama_target):
    ids = torch.tensor([PROMPTS[2]])
    ref = _hf(llama_target, ids, None, 30)[0, ids.shape[1] :].tolist()
    eos_ids = [ref[9], ref[5]]
    with SpecSplitGenerator(llama_target, llama_target) as gen:
        out = gen.generate(ids, max_new_tokens=30, eos_token_id=eos_ids)
    new = out[0, ids.shape[1] :].tolist()
    first = min(ref.index(e) for e in eos_ids)
    assert new == ref[: first + 1]


def test_generation_config_object_and_kwargs_override(llama_target):
    ids = torch.tensor([PROMPTS[0]])
    ref = _hf(llama_target, ids, None, 12)
    with SpecSplitGenerator(llama_target, llama_target) as gen:
        out = gen.generate(ids, generation_config=GenerationConfig(max_new_tokens=7, do_sample=False))
        assert out.shape[1] == ids.shape[1] + 7
        out2 = gen.generate(ids, generation_config=GenerationConfig(max_new_tokens=7), max_new_tokens=12)
        assert torch.equal(out2, ref)
        with pytest.raises(TypeError, match="unexpected keyword"):
            gen.generate(ids, max_new_tokens=3, not_a_generate_arg=1)
        with pytest.raises(ConfigError, match="num_beams"):
            gen.generate(ids, max_new_tokens=3, num_beams=4)


def test_a_given_generation_config_takes_the_models_defaults_where_it_is_unset(llama_target):
    """As HF generate(): fields a passed GenerationConfig leaves unset come from the model's own
    generation_config (here a repetition penalty), fields it sets win."""
    import copy

    model = copy.deepcopy(llama_target)
    model.generation_config.repetition_penalty = 1.5
    ids = torch.tensor([PROMPTS[0]])
    for gc in (
        GenerationConfig(max_new_tokens=16, do_sample=False),  # penalty from the model: 1.5
        GenerationConfig(max_new_tokens=16, do_sample=False, repetition_penalty=1.0),  # set: none
    ):
        ref = model.generate(ids, generation_config=copy.deepcopy(gc))
        with SpecSplitGenerator(model, None, config=SpecSplitConfig(drafter="ngram")) as gen:
            out = gen.generate(ids, generation_config=gc)
        assert torch.equal(out, ref), gc.repetition_penalty
        assert gc.repetition_penalty in (None, 1.0)  # the caller's config is not changed
    plain = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=16, repetition_penalty=1.0))
    assert not torch.equal(plain, model.generate(ids, generation_config=GenerationConfig(max_new_tokens=16)))


def test_streamer_receives_all_new_text(llama_target, tokenizer):
    ids = torch.tensor([PROMPTS[0]])
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    with SpecSplitGenerator(llama_target, llama_target, tokenizer=tokenizer) as gen:
        out = gen.generate(ids, max_new_tokens=20, streamer=streamer)
    text = "".join(streamer).strip()
    assert text == tokenizer.decode(out[0, ids.shape[1] :].tolist()).strip()
    assert len(text.split()) == 20


def test_stop_strings(llama_target, tokenizer):
    ids = torch.tensor([PROMPTS[0]])
    with SpecSplitGenerator(llama_target, llama_target, tokenizer=tokenizer) as gen:
        full = gen.generate(ids, max_new_tokens=30)[0, ids.shape[1] :].tolist()
        stop_word = tokenizer.decode([full[6]])
        out = gen.generate(ids, max_new_tokens=30, stop_strings=[stop_word])
    new = out[0, ids.shape[1] :].tolist()
    assert new == full[: full.index(full[6]) + 1]


def test_generate_text_chat_template(llama_target, tokenizer):
    tok = tokenizer
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with SpecSplitGenerator(llama_target, llama_target, tokenizer=tok) as gen:
        text, stats = gen.generate_text("xaf xar xbh", chat=True, max_new_tokens=10, return_stats=True)
        plain = gen.generate_text("xaf xar xbh", max_new_tokens=10)
    assert len(text.split()) <= 10 and stats.new_tokens == 10
    assert text == plain


def test_return_dict_stats_are_consistent(llama_target, llama_draft_random):
    ids, mask = _batch(PROMPTS)
    with SpecSplitGenerator(
        llama_target, llama_draft_random, config=SpecSplitConfig(tree=TreeConfig(shape="static"))
    ) as gen:
        res = gen.generate(ids, attention_mask=mask, max_new_tokens=15, return_dict_in_generate=True)
    assert len(res.per_sequence_stats) == 3
    assert res.spec_stats.new_tokens == sum(s.new_tokens for s in res.per_sequence_stats) == 45
    summary = res.spec_stats.summary()
    assert summary["rounds"] == len(res.spec_stats.rounds)
    assert summary["tau"] >= 1.0


def test_decode_rounds_yields_each_round_and_a_closed_generator_ends_the_session(llama_target):
    """The round generator the target worker streams from: rounds as ``decode`` would commit them, and
    closing it early (a cancelled stream) frees the session on both engines at once."""
    from specsplit import DraftEngine, LocalTransport, TargetEngine
    from specsplit.pipeline import DecodeParams, decode, decode_rounds
    from specsplit.telemetry import SpecStats

    engines = DraftEngine(llama_target), TargetEngine(llama_target)
    transport = LocalTransport(*engines)
    params = DecodeParams(max_new_tokens=24, tree=TreeConfig(shape="chain", num_draft_tokens=3))
    prompt = PROMPTS[0]
    ref, ref_stats = decode(transport, prompt, params)
    out: list[int] = []
    stats = SpecStats(prompt_tokens=len(prompt))
    rounds = decode_rounds(transport, prompt, params, out, stats, "sid-1")
    tokens, first = next(rounds)
    assert tokens == ref[: len(tokens)] and first is stats.rounds[0]
    assert all(e.info().active_sessions == 1 for e in engines)
    rounds.close()
    assert all(e.info().active_sessions == 0 for e in engines)
    full = [t for toks, _ in decode_rounds(transport, prompt, params, [], SpecStats(), "sid-2") for t in toks]
    assert full == ref and all(e.info().active_sessions == 0 for e in engines)
    assert len(ref_stats.rounds) > 1


@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_deferred_updates_yield_each_round_after_the_next_draft_call(llama_target, stop_at_eos):
    """``defer_updates`` (the target worker's stream): each round is yielded only once the next
    round's draft call has returned, so the consumer's work overlaps the draft's GPU work; the
    same rounds, tokens and stats as yielding at once, the last round included (EOS or length)."""
    from specsplit import DraftEngine, LocalTransport, TargetEngine
    from specsplit.pipeline import DecodeParams, decode_rounds
    from specsplit.telemetry import SpecStats

    events: list[str] = []

    class Recording(LocalTransport):
        def draft(self, request):
            events.append("draft")
            return super().draft(request)

    transport = Recording(DraftEngine(llama_target), TargetEngine(llama_target))
    prompt = PROMPTS[1]
    params = DecodeParams(max_new_tokens=20, tree=TreeConfig(shape="chain", num_draft_tokens=3))
    expected = 20
    if stop_at_eos:  # make a token late in the plain run the EOS: the generation stops there
        ref = [t for toks, _ in decode_rounds(transport, prompt, params, [], SpecStats()) for t in toks]
        expected = next(k for k in range(12, 19) if ref[k] not in ref[:k]) + 1
        params = DecodeParams(
            max_new_tokens=20, tree=params.tree, eos_token_ids=frozenset({ref[expected - 1]})
        )
    runs = {}
    for defer in (False, True):
        events.clear()
        got = []
        for toks, rs in decode_rounds(transport, prompt, params, [], SpecStats(), defer_updates=defer):
            events.append("round")
            got.append((toks, rs.accepted, rs.committed))
        runs[defer] = (got, list(events))
    (plain, plain_events), (deferred, deferred_events) = runs[False], runs[True]
    assert deferred == plain and len(plain) > 2
    assert sum(len(t) for t, _, _ in plain) == expected
    # yielding at once: draft, round, draft, round, ...; deferred: round N after draft N+1
    assert plain_events[:4] == ["draft", "round", "draft", "round"]
    assert deferred_events[:4] == ["draft", "draft", "round", "draft"]
    assert deferred_events.count("round") == plain_events.count("round")
    assert all(e.info().active_sessions == 0 for e in (transport.draft_engine, transport.target_engine))


@pytest.mark.parametrize("defer", [False, True])
def test_leave_ends_the_rounds_before_a_verification_and_keeps_what_was_committed(llama_target, defer):
    """``leave`` is asked once each round's draft is back, before its verification: True ends the
    generation there, with every committed round yielded, that draft never verified, the sessions
    ended on both sides, and ``out`` a prefix of the full run's tokens."""
    from specsplit import DraftEngine, LocalTransport, TargetEngine
    from specsplit.pipeline import DecodeParams, decode_rounds
    from specsplit.telemetry import SpecStats

    verifies = [0]

    class Counting(LocalTransport):
        def verify(self, request):
            verifies[0] += 1
            return super().verify(request)

    transport = Counting(DraftEngine(llama_target), TargetEngine(llama_target))
    prompt = PROMPTS[2]
    params = DecodeParams(max_new_tokens=24, tree=TreeConfig(shape="chain", num_draft_tokens=3))
    ref = [t for toks, _ in decode_rounds(transport, prompt, params, [], SpecStats()) for t in toks]
    for after in (0, 2):
        asked, out = [0], []
        verifies[0] = 0

        def leave(after=after, asked=asked) -> bool:  # noqa: ANN001
            asked[0] += 1
            return asked[0] > after

        got = [toks for toks, _ in decode_rounds(transport, prompt, params, out, SpecStats(),
                                                 defer_updates=defer, leave=leave)]  # fmt: skip
        assert verifies[0] == after and len(got) == after and asked[0] == after + 1
        assert out == [t for toks in got for t in toks] == ref[: len(out)]
        assert all(e.info().active_sessions == 0 for e in (transport.draft_engine, transport.target_engine))


def test_transport_time_excludes_the_workers_handling(llama_target):
    """``RoundStats.transport_s`` is call time NOT spent on the workers' side: over gRPC a draft
    worker's handler waits for the device while serialising the tree, after the engine returned,
    and that wait (``WorkerStats.server_time_s``) is the worker's time, not the network's."""
    import time as _time

    from specsplit import DraftEngine, LocalTransport, TargetEngine
    from specsplit.pipeline import DecodeParams, decode

    class SlowHandler(LocalTransport):  # the engine returns at once; the "handler" then waits 30 ms
        def draft(self, request):
            res = super().draft(request)
            _time.sleep(0.03)
            res.stats.server_time_s = res.stats.wall_time_s + 0.03
            return res

    transport = SlowHandler(DraftEngine(llama_target), TargetEngine(llama_target))
    params = DecodeParams(max_new_tokens=12, tree=TreeConfig(shape="chain", num_draft_tokens=3))
    _, stats = decode(transport, PROMPTS[0], params)
    drafted = [r for r in stats.rounds if r.drafted_depth]
    assert drafted and all(r.draft_s >= 0.03 for r in drafted)
    assert all(r.transport_s < 0.02 for r in drafted), [r.transport_s for r in drafted]
