"""Batched rounds: many rows in one target forward, exact against HF generate() row by row."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from specsplit import SpecSplitConfig, SpecSplitGenerator
from specsplit.bench.batch import left_padded
from specsplit.core.sampling import SamplingParams
from specsplit.engines.batch_plan import BatchPlanner
from specsplit.engines.batched import BatchedTarget, RowTree, batch_bucket
from specsplit.engines.drafters import NgramDrafter
from specsplit.errors import ResourceExhausted
from specsplit.pipeline.batch import BatchRequest, decode_batch
from specsplit.pipeline.params import DecodeParams
from specsplit.runtime.batched_kv import BatchedKVCache
from specsplit.runtime.runner import ModelRunner

EOS = 2
# Repetitive rows (n-gram trees get accepted), an EOS-bound one and rows of different lengths.
PROMPTS = [
    [5, 17, 33, 81, 9, 100, 5, 17, 33, 81, 9],
    [7, 7, 12],
    [44, 3, 19, 250, 61, 62, 63, 64, 9],
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
    [90],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 11, 12, 13],
]


def _alone(model, prompt: list[int], n: int) -> list[int]:
    """HF generate() of one prompt alone, new tokens up to and including EOS."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _trim(row: list[int]) -> list[int]:
    return row[: row.index(EOS) + 1] if EOS in row else row


@pytest.mark.parametrize("family", ["llama", "qwen"])
@pytest.mark.parametrize("drafter", ["ngram", "auto", "target-only"])
def test_batch_rows_equal_hf_alone(request, family, drafter):
    """drafter="auto" with a draft model: batched rows draft n-grams; no draft model and drafter
    "model": plain batched steps."""
    target = request.getfixturevalue(f"{family}_target")
    draft = request.getfixturevalue(f"{family}_draft_random") if drafter == "auto" else None
    ids, mask = left_padded(PROMPTS)
    # 4 rows a round for 6 rows: two join as the first ones finish.
    cfg = SpecSplitConfig(drafter="model" if drafter == "target-only" else drafter, max_batch=4)
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        before = gen.target_engine.forward_count
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=30, return_dict_in_generate=True)
        assert gen._batched is not None  # the rows went through batched rounds
        forwards = gen.target_engine.runner.forward_count - before
    for b, p in enumerate(PROMPTS):
        got = _trim(out.sequences[b, ids.shape[1] :].tolist())
        assert got == _alone(target, p, 30), f"row {b}"
    assert forwards <= sum(len(s.rounds) for s in out.per_sequence_stats) / 2
    if drafter == "target-only":
        assert all(r.tree_nodes == 0 for s in out.per_sequence_stats for r in s.rounds)


def test_batched_equals_sequential_rows_and_counts_fewer_forwards(llama_target):
    ids, mask = left_padded(PROMPTS[:4])
    outs, forwards = [], []
    for max_batch in (0, 4):
        with SpecSplitGenerator(
            llama_target, None, config=SpecSplitConfig(drafter="ngram", max_batch=max_batch)
        ) as gen:
            before = gen.target_engine.runner.forward_count
            outs.append(gen.generate(ids, attention_mask=mask, max_new_tokens=24))
            forwards.append(gen.target_engine.runner.forward_count - before)
    assert torch.equal(outs[0], outs[1])
    # Sequential rows make a forward per row per round; batched rounds one per round (+ a prefill).
    assert forwards[1] < forwards[0] / 2


def test_rows_join_and_leave_with_their_own_limits(qwen_target):
    """Per-row max_new_tokens (0, 1, and long ones) and EOS: rows leave at different rounds, the
    waiting ones take their slots, every row stays exact."""
    runner = ModelRunner(qwen_target, None, "cpu", None, "float32")
    pool = BatchedTarget(runner, slots=4, capacity=128)
    limits = [2, 40, 0, 25, 1, 33]
    reqs = [
        BatchRequest(p, DecodeParams(max_new_tokens=n, eos_token_ids=frozenset([EOS])))
        for p, n in zip(PROMPTS, limits, strict=True)
    ]
    res = decode_batch(pool, reqs, max_batch=3, ngram=NgramDrafter(), planner=BatchPlanner(skip_first=False))
    for (toks, stats), p, n in zip(res, PROMPTS, limits, strict=True):
        assert toks == _trim(_alone(qwen_target, p, n)) if n else toks == []
        assert stats.new_tokens == len(toks)


def test_per_row_generators_sample_what_each_row_samples_alone(llama_target):
    kw = dict(do_sample=True, temperature=0.9, top_p=0.9, max_new_tokens=20)
    prompts = PROMPTS[:3]
    ids, mask = left_padded(prompts)
    cfg = SpecSplitConfig(drafter="ngram", max_batch=4)
    with SpecSplitGenerator(llama_target, None, config=cfg) as gen:
        gens = [torch.Generator().manual_seed(100 + b) for b in range(3)]
        batch = gen.generate(ids, attention_mask=mask, generator=gens, **kw)
        for b, p in enumerate(prompts):
            alone = gen.generate(torch.tensor([p]), generator=torch.Generator().manual_seed(100 + b), **kw)
            assert _trim(batch[b, ids.shape[1] :].tolist()) == _trim(alone[0, len(p) :].tolist())
        # A different seed for one row changes that row only.
        gens = [torch.Generator().manual_seed(s) for s in (100, 7, 102)]
        other = gen.generate(ids, attention_mask=mask, generator=gens, **kw)
        assert torch.equal(other[0], batch[0]) and torch.equal(other[2], batch[2])
        assert not torch.equal(other[1], batch[1])
        with pytest.raises(ValueError, match="one per row"):
            gen.generate(ids, attention_mask=mask, generator=gens[:2], **kw)


def test_shared_generator_matches_the_sequential_path(qwen_target):
    ids, mask = left_padded(PROMPTS)
    kw = dict(do_sample=True, temperature=0.8, top_k=40, max_new_tokens=16)
    outs = []
    for max_batch in (0, 8):
        with SpecSplitGenerator(
            qwen_target, None, config=SpecSplitConfig(drafter="ngram", max_batch=max_batch)
        ) as gen:
            outs.append(
                gen.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(5), **kw)
            )
    assert torch.equal(outs[0], outs[1])


def test_processors_keep_the_sequential_path(llama_target):
    """Options applied row by row (here a repetition penalty) decode the rows one after another:
    still exact, never silently dropped."""
    ids, mask = left_padded(PROMPTS[:3])
    with SpecSplitGenerator(llama_target, None, config=SpecSplitConfig(drafter="ngram")) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=12, repetition_penalty=1.3)
        assert gen._batched is None
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, repetition_penalty=1.3, pad_token_id=0)
    assert torch.equal(out, llama_target.generate(ids, attention_mask=mask, generation_config=gc))


def test_pool_grows_for_a_bigger_batch(llama_target):
    with SpecSplitGenerator(llama_target, None, config=SpecSplitConfig(drafter="ngram", max_batch=16)) as gen:
        ids, mask = left_padded(PROMPTS[:2])
        gen.generate(ids, attention_mask=mask, max_new_tokens=4)
        first = gen._batched
        assert first is not None and first.slots == 16  # max_batch rows: concurrent calls share it
        gen.generate(ids, attention_mask=mask, max_new_tokens=4)
        assert gen._batched is first  # reused
        ids, mask = left_padded(PROMPTS)
        gen.generate(ids, attention_mask=mask, max_new_tokens=300)
        assert gen._batched is not first and gen._batched.capacity >= 313


def test_batched_round_accepts_ragged_paths_and_moves_their_kv(llama_target):
    """Rows accept different paths of branching trees; each row's KV then equals a plain forward
    over its committed tokens."""
    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    pool = BatchedTarget(runner, slots=4, capacity=64)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    pool.prefill(0, [p[:-1] for p in prompts])
    truth = [_alone(llama_target, p, 4) for p in prompts]
    # Row 0: the true path behind a wrong first sibling; row 1: a wrong root only; row 2: the true
    # chain of 2 then a wrong token.
    trees = [
        RowTree(
            len(prompts[0]) - 1,
            prompts[0][-1],
            [truth[0][0] + 1, truth[0][0], truth[0][1]],
            [-1, -1, 1],
            [1, 1, 2],
        ),
        RowTree(len(prompts[1]) - 1, prompts[1][-1], [truth[1][0] + 1], [-1], [1]),
        RowTree(
            len(prompts[2]) - 1,
            prompts[2][-1],
            [truth[2][0], truth[2][1], truth[2][2] + 1],
            [-1, 0, 1],
            [1, 2, 3],
        ),
    ]
    out = pool.round(trees, SamplingParams(), 4)
    assert [o.nodes for o in out] == [[1, 2], [], [0, 1]]
    assert [o.tokens for o in out] == [truth[0][:2], [], truth[2][:2]]
    assert [o.next_token for o in out] == [truth[0][2], truth[1][0], truth[2][2]]
    for b, (p, o) in enumerate(zip(prompts, out, strict=True)):
        committed = p + o.tokens
        ref = llama_target(torch.tensor([committed]), use_cache=True).past_key_values
        k_ref = ref.layers[0].keys[0]  # [H, T, D]
        k_got = pool.cache.kv[0, 0, b, :, : len(committed)]
        torch.testing.assert_close(k_got, k_ref, rtol=1e-5, atol=1e-5)


def test_bucketed_prefill_writes_each_prompts_kv_and_rounds_follow(llama_target):
    """The graphed prefill's path (bucketed shapes, padding rows in the spare slot), run eagerly on
    a CPU, beside a row the eager grouping wrote: every slot then holds the KV of an HF forward over
    its prompt, and a round continues every row as HF does."""
    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    pool = BatchedTarget(runner, slots=8, capacity=64)
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[1], PROMPTS[2], PROMPTS[5], PROMPTS[3]]
    pool.prefill(0, [prompts[0][:-1]])  # a live row, written by the eager groups
    pool.cache.kv[:, :, pool.slots].normal_()
    spare = pool.cache.kv[:, :, pool.slots].clone()
    pool.bucketed_prefill = True
    rest = sorted(prompts[1:], key=len)
    pool.prefill(1, [p[:-1] for p in rest])
    ordered = [prompts[0], *rest]
    for b, p in enumerate(ordered):
        if len(p) < 2:
            continue  # a one-token prompt has nothing to prefill
        ref = llama_target(torch.tensor([p[:-1]]), use_cache=True).past_key_values
        for layer in (0, len(ref.layers) - 1):
            for kind, got in ((ref.layers[layer].keys, 0), (ref.layers[layer].values, 1)):
                torch.testing.assert_close(
                    pool.cache.kv[layer, got, b, :, : len(p) - 1], kind[0], rtol=1e-5, atol=1e-5
                )
    assert not torch.equal(pool.cache.kv[:, :, pool.slots], spare)  # padding rows wrote there
    with pytest.raises(ResourceExhausted):  # longer than a slot: refused, as the eager groups do
        pool.prefill(6, [list(range(5, 70))])
    out = pool.round([RowTree(len(p) - 1, p[-1]) for p in ordered], SamplingParams(), 0)
    assert [o.next_token for o in out] == [_alone(llama_target, p, 1)[0] for p in ordered]


def test_bucketed_prefill_groups_cover_the_rows_within_the_token_budget(llama_target):
    from specsplit.engines.batched import PREFILL_TOKENS

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    pool = BatchedTarget(runner, slots=2, capacity=16384)
    bench = sorted([154, 78, 91, 227, 165, 81, 168, 87, 94, 171, 190, 102, 144, 110, 59, 190])
    for lengths in (bench, sorted(bench * 4), [500] * 64, [0, 0, 3], [40, 12000, 12000]):
        groups = pool._graph_groups(lengths)
        covered = [i for lo, hi, _, _ in groups for i in range(lo, hi)]
        assert covered == [i for i, n in enumerate(lengths) if n or any(lengths)][: len(covered)]
        assert sorted(set(covered)) == covered
        assert all(n == 0 for i, n in enumerate(lengths) if i not in covered)
        for lo, hi, rows, width in groups:
            assert rows >= hi - lo and width >= max(lengths[lo:hi])
            assert rows * width <= PREFILL_TOKENS or hi - lo == 1
    # The 16 bench prompts: padding is cheap next to a forward's fixed cost, so few groups.
    assert len(pool._graph_groups(bench)) <= 2
    assert [g[:2] for g in pool._graph_groups([500] * 64)] == [(i, i + 16) for i in range(0, 64, 16)]
    assert pool._graph_groups([0, 0]) == []


def test_round_shapes_a_worker_captures_cover_every_round_and_run(llama_target):
    """``capture_rounds``: the shapes cover whatever batch size, tree size and length a round can
    have; each runs on padding rows alone (eagerly here), and the pool's rows are then decoded as
    if nothing had run (the warm-ups write into free slots only)."""
    import random

    from specsplit.runtime.graphs import kv_bucket

    pool = BatchedTarget(ModelRunner(llama_target, None, "cpu", None, "float32"), slots=6, capacity=600)
    sizes = (0, 4, 8)
    shapes = set(pool.round_shapes(sizes))
    rng = random.Random(0)
    for _ in range(500):
        b, n, end = rng.randint(1, 6), rng.choice(sizes), rng.randint(1, 600)
        assert (batch_bucket(b, 6), n, kv_bucket(end, 600)) in shapes
    assert {bp for bp, _, _ in shapes} == {1, 2, 4, 6} and pool.capture_rounds(sizes) == 0
    with torch.inference_mode():
        for bp, n, kv in sorted(shapes)[:: max(1, len(shapes) // 8)]:
            rnd = pool._round_buffers(bp, n, kv, True)
            pool._stage(rnd, [], n)
            pool._body(rnd, n, SamplingParams())
    prompts = [PROMPTS[0], PROMPTS[2]]
    pool.prefill(0, [p[:-1] for p in prompts])
    out = pool.round([RowTree(len(p) - 1, p[-1]) for p in prompts], SamplingParams(), 0)
    assert [o.next_token for o in out] == [_alone(llama_target, p, 1)[0] for p in prompts]


@pytest.mark.parametrize("capacity", [96, 768])
def test_every_prefill_shape_a_worker_captures_runs(llama_target, capacity):
    """The shapes captured up front (``capture_prefills``): widths up to the capacity (not past it
    when the capacity is no power of two), each within the token budget; each runs (eagerly here)."""
    from specsplit.engines.batched import PREFILL_TOKENS

    pool = BatchedTarget(ModelRunner(llama_target, None, "cpu", None, "float32"), slots=8, capacity=capacity)
    shapes = pool.prefill_shapes()
    widths = sorted({w for _, w in shapes})
    assert widths[-1] == capacity and all(w <= capacity for w in widths)
    assert all(r * w <= PREFILL_TOKENS for r, w in shapes) and {r for r, _ in shapes} == {1, 2, 4, 8}
    assert pool.capture_prefills() == 0  # no graphs on a CPU
    with torch.inference_mode():
        for rows, width in shapes:
            pool._prefill_graphed(0, [], rows, width)


def test_pool_slot_moves_and_limits():
    cache = BatchedKVCache(2, 1, 4, torch.float32, torch.device("cpu"), slots=3, capacity=8)
    cache.kv.normal_()
    before = cache.kv[:, :, 2, :, :5].clone()
    cache.move_slot(2, 0, 5)
    assert torch.equal(cache.kv[:, :, 0, :, :5], before)
    src = torch.tensor([[3, 4], [1, 1]])
    dst = torch.tensor([[1, 2], [1, 1]])
    row0 = cache.kv[:, :, 0, :, [3, 4]].clone()
    cache.keep_paths(src, dst)
    assert torch.equal(cache.kv[:, :, 0, :, 1:3], row0)
    with pytest.raises(ValueError):
        cache.bind(torch.zeros(4, 1, dtype=torch.long), 4)  # 4 rows, 3 slots
    assert batch_bucket(3, 64) == 4 and batch_bucket(9, 12) == 12


def test_planner_turns_speculation_down_where_trees_cost_too_much():
    scores = [[0.9, 0.8, 0.5, 0.4]] * 16
    cheap = BatchPlanner(costs=lambda b, n: 1.0 + 0.01 * n)
    assert cheap.plan(16, scores) == 4
    dear = BatchPlanner(costs=lambda b, n: 1.0 + n * b / 16)  # trees cost a lot at batch 16
    assert dear.plan(16, scores) == 0
    assert dear.plan(1, [scores[0]]) == 4  # ... but pay at batch 1
    assert cheap.plan(16, [[]] * 16) == 0  # nothing proposed: a plain step


def test_planner_measures_each_size_before_trusting_it():
    p = BatchPlanner(sizes=(0, 4, 8), skip_first=False)
    scores = [[0.9] * 6]
    seen = []
    for _ in range(3):
        s = p.plan(1, scores)
        seen.append(s)
        p.observe(1, s, {0: 1.0, 4: 1.1, 8: 1.2}[s], [0.9] * s, [True] * s)
    assert seen == [0, 4, 8]
    assert p.plan(1, scores) == 8  # most tokens per second once measured


def test_concurrent_generate_calls_share_rounds(llama_target):
    """Calls from several threads on one generator: their rows share batched rounds (fewer rounds than
    rows x rounds), each row still exactly HF generate() of its prompt alone."""
    import threading

    cfg = SpecSplitConfig(drafter="ngram", max_batch=8)
    results: dict[int, torch.Tensor] = {}
    with SpecSplitGenerator(llama_target, None, config=cfg) as gen:
        gen.generate(*left_padded(PROMPTS[:2]), max_new_tokens=2)  # builds the pool
        start = threading.Barrier(len(PROMPTS))

        def call(i: int) -> None:
            start.wait()
            results[i] = gen.generate(
                torch.tensor([PROMPTS[i]]), max_new_tokens=30, return_dict_in_generate=True
            )

        before = gen._scheduler.rounds
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        shared_rounds = gen._scheduler.rounds - before
    row_rounds = sum(len(r.spec_stats.rounds) for r in results.values())
    for i, p in enumerate(PROMPTS):
        assert _trim(results[i].sequences[0, len(p) :].tolist()) == _alone(llama_target, p, 30)
    assert 0 < shared_rounds < row_rounds


def test_scheduler_streams_rounds_cancels_and_bounds_waiting(llama_target):
    from specsplit.errors import ResourceExhausted
    from specsplit.pipeline.batch import BatchScheduler

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    sched = BatchScheduler(BatchedTarget(runner, slots=2, capacity=128), 2, max_waiting=3, gather_s=0.0)
    reqs = [BatchRequest(p, DecodeParams(max_new_tokens=20)) for p in PROMPTS[:3]]
    tickets = [sched.submit(r) for r in reqs]
    with pytest.raises(ResourceExhausted, match="waiting"):
        sched.submit(BatchRequest(PROMPTS[3], DecodeParams(max_new_tokens=5)))
    with pytest.raises(ValueError, match="positions"):
        sched.submit(BatchRequest(PROMPTS[0], DecodeParams(max_new_tokens=500)))
    rounds = sched.follow(tickets[0])
    first = next(rounds)  # one round: the first two rows joined (two slots), the third waits
    assert len(first[0]) == 1 and sched.live_rows == 2 and sched.waiting_rows == 1
    rounds.close()  # the client went away: no round is running, so its row leaves now
    assert tickets[0].done and sched.live_rows == 1
    toks, _ = sched.wait(tickets[2])  # takes the freed slot
    assert toks == _alone(llama_target, PROMPTS[2], 20)
    assert tickets[0].done and tickets[0].cancelled and len(tickets[0].out) < 20
    assert sched.wait(tickets[1])[0] == _alone(llama_target, PROMPTS[1], 20)
    assert sched.live_rows == 0 and sched.waiting_rows == 0


def test_rows_with_other_sampling_settings_wait_for_their_turn(llama_target):
    from specsplit.pipeline.batch import BatchScheduler, run_rows

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    sched = BatchScheduler(BatchedTarget(runner, slots=4, capacity=128), 4, gather_s=0.0)
    hot = SamplingParams(do_sample=True, temperature=0.7)
    reqs = [
        BatchRequest(PROMPTS[0], DecodeParams(max_new_tokens=10)),
        BatchRequest(
            PROMPTS[1],
            DecodeParams(max_new_tokens=10, sampling=hot, generator=torch.Generator().manual_seed(1)),
        ),
        BatchRequest(PROMPTS[2], DecodeParams(max_new_tokens=10)),
    ]
    out = run_rows(sched, reqs, None)
    assert out[0][0] == _alone(llama_target, PROMPTS[0], 10)
    assert out[2][0] == _alone(llama_target, PROMPTS[2], 10)
    alone = decode_batch(BatchedTarget(runner, 1, 128), [BatchRequest(PROMPTS[1], DecodeParams(
        max_new_tokens=10, sampling=hot, generator=torch.Generator().manual_seed(1)))], 1)  # fmt: skip
    assert out[1][0] == alone[0][0]


def test_planner_skips_proposals_while_plain_steps_win():
    from specsplit.engines.batch_plan import PROBE_EVERY

    p = BatchPlanner(costs=lambda b, n: 1.0 + n)  # trees never pay
    assert p.wants_proposals(16)
    assert p.plan(16, [[0.5, 0.4]] * 16) == 0
    skipped = 0
    while not p.wants_proposals(16):
        skipped += 1
    assert skipped == PROBE_EVERY - 1  # then one round looks at the proposals again


def test_model_drafter_with_a_draft_keeps_its_per_row_drafts(llama_target, llama_draft_random):
    ids, mask = left_padded(PROMPTS[:3])
    with SpecSplitGenerator(llama_target, llama_draft_random, config=SpecSplitConfig(max_batch=8)) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=10, return_dict_in_generate=True)
        assert gen._batched is None
    assert any(r.drafter == "model" for s in out.per_sequence_stats for r in s.rounds)


@pytest.mark.real
def test_batched_generation_example_rows_equal_each_prompt_alone(capsys, monkeypatch):
    """``examples/batched_generation.py`` on SmolLM2 (CPU, float32), three threads sharing rounds: it
    checks every row against the same prompt generated alone."""
    import runpy
    import sys
    from pathlib import Path

    from _real_models import smollm2_dir

    script = Path(__file__).resolve().parents[1] / "examples" / "batched_generation.py"
    argv = [str(script), "--target", smollm2_dir(), "--max-new-tokens", "16", "--threads", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("same as alone") == 6 and "DIFFERS" not in out


def test_position_noise_ring_draws_each_position_once():
    from specsplit.core.sampling import position_noise
    from specsplit.engines.batched import PositionNoise

    ring = PositionNoise(seed=7, vocab=11, device=torch.device("cpu"), depth=5)
    for start, count in ((3, 5), (5, 3), (6, 5), (10, 1)):  # rounds moving forward, overlapping
        got = ring.rows(start, count)
        assert torch.equal(got, position_noise(7, start, count, 11, torch.device("cpu")))
    assert ring.draws == len(set(range(3, 11)))  # positions 3..10, each once
    with pytest.raises(ValueError):
        ring.rows(20, 6)


@pytest.mark.parametrize("bucketed", [False, True], ids=["eager-prompt", "graphed-prompt"])
def test_session_batcher_keeps_room_for_any_round_and_checks_requests(llama_target, bucketed):
    """Client-loop sessions in a pool (new sessions' prompts written eagerly, or by the graphed
    prefill's bucketed shape as on CUDA): desync and bad ids are refused without changing anything, a
    session near its slot's end is refused before it could overflow a round, and an ended session's
    slot goes to the last one (whose next round still continues its text)."""
    from specsplit.core.tree import TokenTree
    from specsplit.engines.batched_sessions import MAX_NODES, SessionBatcher
    from specsplit.errors import CacheDesyncError, InvalidRequest, ResourceExhausted
    from specsplit.messages import VerifyRequest

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    cap = 16 + 1 + MAX_NODES
    sb = SessionBatcher(
        BatchedTarget(runner, slots=2, capacity=cap), runner.vocab_size, 256, 64, gather_s=0.0
    )
    sb.target.bucketed_prefill = bucketed
    empty = TokenTree.empty()
    a = sb.verify(VerifyRequest("a", empty, PROMPTS[0][:8], 0))
    b = sb.verify(VerifyRequest("b", empty, PROMPTS[2][:8], 0))
    assert a.prefix_length == b.prefix_length == 8
    with pytest.raises(CacheDesyncError):
        sb.verify(VerifyRequest("a", empty, [a.next_token_id], 5))
    with pytest.raises(InvalidRequest):
        sb.verify(VerifyRequest("a", empty, [10**6], 8))
    assert sb.takes(VerifyRequest("c", empty, [1], 0)) is False  # both slots in use
    assert sb.end("a") and sb.live_sessions == 1
    # b moved into slot 0; its next token still follows its own text
    nxt = sb.verify(VerifyRequest("b", empty, [b.next_token_id], 8))
    assert [b.next_token_id, nxt.next_token_id] == _alone(llama_target, PROMPTS[2][:8], 2)
    with pytest.raises(ResourceExhausted):
        sb.verify(VerifyRequest("b", empty, [nxt.next_token_id] + [5] * 10, 9))  # would leave too little room


def test_compiled_rounds_trace_whole_and_commit_what_eager_rounds_commit(llama_target, monkeypatch):
    """``compile=True`` sends the one-token rounds (not trees, not prompts) through ``torch.compile``;
    traced with no graph break by the ``aot_eager`` backend (no C++ build on CPU), the rounds of
    a batch whose size shrinks as rows end commit exactly what the eager rounds commit."""
    import functools

    from specsplit.engines import batched

    compiled = []
    real_compile = torch.compile

    calls = []

    def fake_compile(fn, **kw):
        compiled.append(fn)
        traced = functools.partial(real_compile, backend="aot_eager", fullgraph=True)(fn, **kw)

        def counted(*a):
            calls.append(a[0].shape)
            return traced(*a)

        return counted

    torch._dynamo.reset()
    monkeypatch.setattr(batched.torch, "compile", fake_compile)
    ids, mask = left_padded(PROMPTS[:5])
    outs = []
    for compile in (False, True):
        cfg = SpecSplitConfig(drafter="ngram", max_batch=4)
        cfg.target.compile = compile
        with SpecSplitGenerator(llama_target, None, config=cfg) as gen:
            outs.append(gen.generate(ids, attention_mask=mask, max_new_tokens=20))
            assert gen._batched is not None
    assert [fn.__name__ for fn in compiled] == ["_round_forward"]
    assert calls and all(shape[1] == 1 for shape in calls)  # one-token rounds only
    assert torch.equal(outs[0], outs[1])
    torch._dynamo.reset()


def test_chain_drafts_are_each_rows_greedy_continuation(llama_target):
    """A chain draft writes each row's new tokens (one to several, ragged) and drafts ``k`` greedy
    tokens for every row in one call; the next call continues from what the rows committed."""
    from specsplit.engines.batched import ChainRow

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    pool = BatchedTarget(runner, slots=4, capacity=96)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    held = [1, 3, 2]  # new tokens each row brings to its first draft
    pool.prefill(0, [p[:-h] for p, h in zip(prompts, held, strict=True)])
    truth = [_alone(llama_target, p, 12) for p in prompts]
    rows = [ChainRow(len(p) - h, p[-h:]) for p, h in zip(prompts, held, strict=True)]
    assert pool.chain(rows, 5) == [t[:5] for t in truth]
    # Next call: row 0 accepted 2 drafts + the target's token, row 1 all 5 + one, row 2 none + one.
    took = [3, 6, 1]
    rows = [ChainRow(len(p), t[:m]) for p, t, m in zip(prompts, truth, took, strict=True)]
    assert pool.chain(rows, 4) == [t[m : m + 4] for t, m in zip(truth, took, strict=True)]
    # Fewer rows (a smaller batch bucket), one draft token.
    assert pool.chain([ChainRow(len(prompts[0]) + 3, truth[0][3:5])], 1) == [truth[0][5:6]]


@pytest.mark.parametrize("bucketed", [False, True], ids=["eager-prompt", "graphed-prompt"])
def test_draft_batcher_drafts_each_sessions_greedy_chain_and_checks_requests(llama_target, bucketed):
    """Chain-draft sessions in a pool: a new session's long prompt (written by the eager forward, or
    by the graphed prefill's bucketed shape as on CUDA), then rounds that bring ragged new tokens,
    each drafting the model's greedy continuation; desync, bad ids, other tree shapes and empty
    requests refused without changing anything; an ended session's slot goes to the last one."""
    from specsplit.config import TreeConfig
    from specsplit.engines.batched_sessions import MAX_CHAIN, MAX_INGEST, DraftBatcher
    from specsplit.errors import CacheDesyncError, InvalidRequest
    from specsplit.messages import DraftRequest

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    db = DraftBatcher(BatchedTarget(runner, slots=2, capacity=64 + MAX_INGEST + MAX_CHAIN), runner.vocab_size,
                      gather_s=0.0)  # fmt: skip
    db.target.bucketed_prefill = bucketed
    chain4 = TreeConfig(shape="chain", num_draft_tokens=4)
    long_prompt = (PROMPTS[5] * 2)[:20]  # more than MAX_INGEST tokens: written before the shared call
    a = db.draft(DraftRequest("a", long_prompt, 0, chain4))
    b = db.draft(DraftRequest("b", PROMPTS[2], 0, chain4))
    truth_a, truth_b = _alone(llama_target, long_prompt, 10), _alone(llama_target, PROMPTS[2], 10)
    assert a.tree.token_ids.tolist() == truth_a[:4] and a.prefix_length == 20
    assert b.tree.token_ids.tolist() == truth_b[:4] and b.tree.parents.tolist() == [-1, 0, 1, 2]
    # a accepted 2 drafts + the target's token; b accepted all 4 + one, asking for 2 tokens only
    a2 = db.draft(DraftRequest("a", truth_a[:3], 20, chain4))
    b2 = db.draft(DraftRequest("b", truth_b[:5], len(PROMPTS[2]), chain4, max_depth=2))
    assert a2.tree.token_ids.tolist() == truth_a[3:7] and a2.prefix_length == 23
    assert b2.tree.token_ids.tolist() == truth_b[5:7]
    with pytest.raises(CacheDesyncError):
        db.draft(DraftRequest("a", [1], 5, chain4))
    with pytest.raises(InvalidRequest):
        db.draft(DraftRequest("a", [10**6], 23, chain4))
    with pytest.raises(InvalidRequest):
        db.draft(DraftRequest("a", [], 23, chain4))
    with pytest.raises(InvalidRequest):
        db.draft(DraftRequest("a", [1], 23, TreeConfig(shape="dynamic")))
    assert not db.takes(DraftRequest("c", [1], 0, chain4))  # both slots in use
    assert not db.takes(DraftRequest("c", [1], 0, TreeConfig(shape="dynamic")))
    assert db.end("a") and db.live_sessions == 1
    # b moved into slot 0 and continues its text
    b3 = db.draft(DraftRequest("b", truth_b[5:8], len(PROMPTS[2]) + 5, chain4))
    assert b3.tree.token_ids.tolist() == truth_b[8:10] + _alone(llama_target, PROMPTS[2], 12)[10:12]


def test_background_rounds_stream_in_chunks_and_close_ends_what_is_left(llama_target):
    """With its own driving thread (a worker's setting) the scheduler runs rounds while callers only
    wait; ``follow_chunks`` hands each caller the rounds committed since its last chunk (at most one
    chunk per interval), the tokens exact; ``close`` stops the thread and ends rows still waiting."""
    import time

    from specsplit.errors import ResourceExhausted
    from specsplit.pipeline.batch import BatchScheduler

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    sched = BatchScheduler(BatchedTarget(runner, slots=2, capacity=128), 2, gather_s=0.0)
    sched.drive_in_background()
    tickets = [sched.submit(BatchRequest(p, DecodeParams(max_new_tokens=30))) for p in PROMPTS[:2]]
    t0 = time.perf_counter()
    chunks = list(sched.follow_chunks(tickets[0], every_s=0.05))
    took = time.perf_counter() - t0
    rounds = [r for c in chunks for r in c]
    assert [t for toks, _ in rounds for t in toks] == _alone(llama_target, PROMPTS[0], 30)
    # at most one chunk per interval (the first one and the last one come at once)
    assert len(chunks) <= 2 + took / 0.05 and len(chunks) < len(rounds)
    assert sched.wait(tickets[1])[0] == _alone(llama_target, PROMPTS[1], 30)
    # Two rows fill the pool; a third waits when the scheduler closes and ends with an error.
    held = [sched.submit(BatchRequest(p, DecodeParams(max_new_tokens=100))) for p in PROMPTS[2:5]]
    sched.close()
    assert all(t.done for t in held)
    assert any(isinstance(t.error, ResourceExhausted) for t in held)


def _placed_sessions(batcher, first: dict[str, object]) -> dict[str, object]:
    """Place each session with its first request (no waiting), then give the batcher a long wait."""
    batcher.gather_s = 0.0
    out = {key: call() for key, call in first.items()}
    batcher.gather_s = 30.0
    return out


def _concurrently(calls: dict[str, object]) -> tuple[dict[str, object], float]:
    """Run every call in its own thread, each started as the previous one is queued or running."""
    import threading
    import time

    got: dict[str, object] = {}
    threads = [threading.Thread(target=lambda k=k, c=c: got.__setitem__(k, c())) for k, c in calls.items()]
    t0 = time.monotonic()
    for t in threads:
        t.start()
        time.sleep(0.05)  # the first caller is already gathering, holding the driver lock
    for t in threads:
        t.join(60)
    return got, time.monotonic() - t0


def test_running_sessions_join_a_round_that_is_gathering(llama_target):
    """A round's driver gathers with the driver lock held; the next requests of running sessions
    must still reach its queue (they need no placement), so all three sessions share ONE round and
    nobody waits out the (long) gather bound. Verifications and chain drafts alike."""
    from specsplit.config import TreeConfig
    from specsplit.core.tree import TokenTree
    from specsplit.engines.batched_sessions import (
        MAX_CHAIN,
        MAX_INGEST,
        MAX_NODES,
        DraftBatcher,
        SessionBatcher,
    )
    from specsplit.errors import CacheDesyncError
    from specsplit.messages import DraftRequest, VerifyRequest

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    empty = TokenTree.empty()
    keys = ("a", "b", "c")
    prompts = dict(zip(keys, (PROMPTS[0][:8], PROMPTS[2][:8], PROMPTS[5][:8]), strict=True))
    sb = SessionBatcher(BatchedTarget(runner, slots=3, capacity=32 + MAX_NODES), runner.vocab_size, 256, 64)
    first = _placed_sessions(
        sb, {k: (lambda k=k: sb.verify(VerifyRequest(k, empty, prompts[k], 0))) for k in keys}
    )
    rounds = sb.rounds
    with pytest.raises(CacheDesyncError):  # refused before it is queued, nothing changed
        sb.verify(VerifyRequest("a", empty, [first["a"].next_token_id], 7))
    got, took = _concurrently(
        {k: (lambda k=k: sb.verify(VerifyRequest(k, empty, [first[k].next_token_id], 8))) for k in keys}
    )
    assert sb.rounds == rounds + 1 and took < 15.0
    for k in keys:
        assert [first[k].next_token_id, got[k].next_token_id] == _alone(llama_target, prompts[k], 2)

    chain2 = TreeConfig(shape="chain", num_draft_tokens=2)
    db = DraftBatcher(BatchedTarget(runner, slots=3, capacity=32 + MAX_INGEST + MAX_CHAIN), runner.vocab_size)
    drafts = _placed_sessions(
        db, {k: (lambda k=k: db.draft(DraftRequest(k, prompts[k], 0, chain2))) for k in keys}
    )
    rounds = db.rounds
    truth = {k: _alone(llama_target, prompts[k], 5) for k in keys}
    with pytest.raises(CacheDesyncError):
        db.draft(DraftRequest("a", truth["a"][:3], 9, chain2))
    got, took = _concurrently(
        {k: (lambda k=k: db.draft(DraftRequest(k, truth[k][:3], 8, chain2))) for k in keys}
    )
    assert db.rounds == rounds + 1 and took < 15.0
    for k in keys:
        assert drafts[k].tree.token_ids.tolist() == truth[k][:2]
        assert got[k].tree.token_ids.tolist() == truth[k][3:5]


def test_a_round_waits_for_sessions_due_soon_and_not_for_late_ones(llama_target):
    """Past ``gather_s`` a round waits for a session its think time says is due within
    EXPECT_ROUNDS of its own call time (both share one round), never for one due later."""
    import threading
    import time

    from specsplit.core.tree import TokenTree
    from specsplit.engines.batched_sessions import MAX_NODES, SessionBatcher
    from specsplit.messages import VerifyRequest

    runner = ModelRunner(llama_target, None, "cpu", None, "float32")
    empty = TokenTree.empty()
    sb = SessionBatcher(BatchedTarget(runner, slots=2, capacity=32 + MAX_NODES), runner.vocab_size, 256, 64)
    a = _placed_sessions(sb, {"a": lambda: sb.verify(VerifyRequest("a", empty, PROMPTS[0][:8], 0)),
                              "b": lambda: sb.verify(VerifyRequest("b", empty, PROMPTS[2][:8], 0))})  # fmt: skip
    sb.gather_s = 0.0
    sb._run_s = 2.0  # rounds "take" 2 s: a round may wait up to 3 s for sessions due by then
    b = sb._sessions["b"]
    b.replied, b.think = time.monotonic(), 0.3  # b is due in 0.3 s
    rounds = sb.rounds
    later = threading.Timer(0.2, lambda: sb.verify(VerifyRequest("b", empty, [a["b"].next_token_id], 8)))
    later.start()
    a2 = sb.verify(VerifyRequest("a", empty, [a["a"].next_token_id], 8))
    later.join()
    assert sb.rounds == rounds + 1  # a waited for b: one round for both

    b.replied, b.think = time.monotonic(), 60.0  # b is due long after any wait a round may make
    t0 = time.monotonic()
    a3 = sb.verify(VerifyRequest("a", empty, [a2.next_token_id], 9))
    assert a3.next_token_id == _alone(llama_target, PROMPTS[0][:8], 3)[2]
    assert time.monotonic() - t0 < 2.0 and sb.rounds == rounds + 2
