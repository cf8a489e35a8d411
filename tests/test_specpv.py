"""SpecPV partial verification: config, retrieval, policy, fallback, and the same behaviour over gRPC.

Contexts here are a few hundred tokens with small blocks, so every policy branch (seed, partial,
interval, overflow, fallback) runs on tiny random models in seconds.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import noisy_copy
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specsplit import (
    ConfigError,
    DraftEngine,
    LocalTransport,
    SpecSplitConfig,
    TargetEngine,
    TokenTree,
    TreeConfig,
)
from specsplit.config import DraftConfig, SpecPVConfig, TargetConfig
from specsplit.core.specpv_view import plan_layout, score_blocks, select_blocks
from specsplit.core.tree_attention import ancestor_matrix, bool_mask_to_float
from specsplit.engines.partial_kv import BlockSummaries, PartialSession
from specsplit.messages import VerifyRequest, VerifyResult
from specsplit.pipeline import DecodeParams, decode
from specsplit.runtime.attention import ATTENTION_NAME
from specsplit.runtime.kv_cache import StaticKVCache

VOCAB = 256
CTX = 240  # prompt length: well above the thresholds used below
NEW = 24
STATIC = TreeConfig(shape="static")
CHAIN = TreeConfig(shape="chain", num_draft_tokens=4)


def _config(family: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return LlamaConfig(**common) if family == "llama" else Qwen2Config(**common, tie_word_embeddings=False)


def _pair(family: str, noise: float = 0.02) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny target and a draft = target + noise (partial acceptance, branching trees)."""
    cls = LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM
    torch.manual_seed(3)
    target = cls(_config(family)).eval()
    draft = noisy_copy(target, noise, seed=4)
    with torch.no_grad():
        for m in (target, draft):
            m.get_output_embeddings().weight.mul_(8.0)  # peaked: no numerical near-ties
    return target, draft


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny forwards: one intra-op thread is faster on a shared 2-core box (and deterministic)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def llama_pair():
    return _pair("llama")


@pytest.fixture(scope="module")
def qwen_pair():
    return _pair("qwen")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(4, VOCAB, (CTX,), generator=g).tolist()


def _pv(**kw) -> SpecPVConfig:
    base = dict(enabled=True, block_size=8, n_sink_blocks=1, n_window_blocks=2, partial_threshold=64)
    base.update(kw)
    return SpecPVConfig(**base)


FULL_VIEW = dict(n_retrieval_blocks=64)  # >= every candidate block: the view is the whole context


class _Recording(LocalTransport):
    """LocalTransport that records each verify result and runs a hook after it."""

    def __init__(self, draft, target, hook=None):
        super().__init__(draft, target)
        self.results: list[VerifyResult] = []
        self.hook = hook

    def verify(self, request: VerifyRequest) -> VerifyResult:
        res = super().verify(request)
        self.results.append(res)
        if self.hook is not None:
            self.hook(self, request.session_id, res)
        return res


def _run(target, draft, prompt, pv: SpecPVConfig | None, tree=STATIC, hook=None, new=NEW, sampling=None):
    te = TargetEngine(target, TargetConfig(specpv=pv or SpecPVConfig()))
    tr = _Recording(DraftEngine(draft), te, hook)
    params = DecodeParams(new, tree=tree)
    if sampling is not None:
        params.sampling, params.generator = sampling, torch.Generator().manual_seed(11)
    out, stats = decode(tr, prompt, params, session_id="s")
    tr.close()
    return out, stats, te, tr


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(block_size=0), "block_size"),
        (dict(n_retrieval_blocks=-1), "n_retrieval_blocks"),
        (dict(full_refresh_interval=0), "full_refresh_interval"),
        (dict(retrieval_reduce="median"), "retrieval_reduce"),
        (dict(retrieval_refresh_interval=-1), "retrieval_refresh_interval"),
        (dict(partial_threshold=2.5), "partial_threshold"),
        (dict(rectify_margin=-0.5), "rectify_margin"),
        (dict(rectify_margin=float("inf")), "rectify_margin"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        SpecPVConfig(**kw)


def test_buffer_checked_against_tree_budget_and_env():
    big = TreeConfig(shape="dynamic", budget=64, max_depth=8)
    with pytest.raises(ConfigError, match=r"n_spec_tokens_buf=40 .* >= 74"):
        SpecSplitConfig(
            tree=big, target=TargetConfig(specpv=SpecPVConfig(enabled=True, n_spec_tokens_buf=40))
        )
    SpecSplitConfig(tree=big, target=TargetConfig(specpv=SpecPVConfig(enabled=True, n_spec_tokens_buf=74)))
    SpecSplitConfig(tree=big, target=TargetConfig(specpv=SpecPVConfig(n_spec_tokens_buf=40)))  # off: no check
    with pytest.raises(ConfigError, match="unknown keys in target.specpv"):
        TargetConfig(specpv={"enabled": True, "budget": 9})
    env = {"SPECSPLIT_TARGET_SPECPV_ENABLED": "1", "SPECSPLIT_TARGET_SPECPV_PARTIAL_THRESHOLD": "8192"}
    cfg = SpecSplitConfig.from_env(environ=env)
    assert cfg.target.specpv.enabled and cfg.target.specpv.partial_threshold == 8192
    cfg = SpecSplitConfig.from_env(environ={"SPECSPLIT_TARGET_SPECPV": '{"enabled": true, "block_size": 32}'})
    assert cfg.target.specpv == SpecPVConfig(enabled=True, block_size=32)
    assert SpecSplitConfig.from_dict(cfg.to_dict()).target.specpv == cfg.target.specpv


# ---------------------------------------------------------------------- retrieval
def _planted_cache(kv_heads=2, blocks=32, bs=4, d=8, planted=((5, 11), (7, 20))):
    g = torch.Generator().manual_seed(0)
    keys = 0.1 * torch.randn(1, kv_heads, blocks * bs, d, generator=g)
    qdir = torch.randn(kv_heads, d, generator=g)
    for h, bl in enumerate(planted):
        for b in bl:
            keys[0, h, b * bs : (b + 1) * bs] = 3.0 * qdir[h] + 0.05 * torch.randn(bs, d, generator=g)
    cache = StaticKVCache(1, blocks * bs + 16)
    cache.append(0, keys, -keys)  # values: anything distinguishable
    # queries: [1, heads = kv_heads * 2, nq = 3, d], each head of group h along qdir[h]
    q = qdir.repeat_interleave(2, dim=0)[None, :, None, :] + 0.1 * torch.randn(
        1, 2 * kv_heads, 3, d, generator=g
    )
    return cache, keys, q


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_planted_blocks_are_retrieved(reduce):
    cache, keys, q = _planted_cache()
    summ = BlockSummaries(block_size=4, first_block=2)
    assert summ.update(cache) == 30 and summ.update(cache) == 0  # incremental: nothing new
    scores = score_blocks(q, summ.kmax[0][:, :, 2:32], summ.kmin[0][:, :, 2:32], reduce)  # [1, 2, 30]
    assert scores.shape == (1, 2, 30)
    chosen = select_blocks(scores, 2, first_block=2)
    assert chosen.tolist() == [[[5, 11], [7, 20]]]  # per KV head, in position order


def test_rebuilt_view_holds_sink_planted_blocks_and_window():
    cache, keys, q = _planted_cache()
    cfg = SpecPVConfig(enabled=True, block_size=4, n_sink_blocks=2, n_retrieval_blocks=2, n_window_blocks=3)
    pvs = PartialSession(cfg)
    layout = pvs.rebuild(cache, {0: q})
    full = 128
    assert (layout.sink, layout.retrieved_blocks, layout.window_start) == (8, 2, full - 12)
    assert layout.view_len == 8 + 8 + 12 and pvs.view.seq_len == layout.view_len
    vk = pvs.view.layers[0].keys
    assert torch.equal(vk[:, :, :8], keys[:, :, :8])
    for h, (a, b) in enumerate(((5, 11), (7, 20))):
        want = torch.cat([keys[0, h, a * 4 : a * 4 + 4], keys[0, h, b * 4 : b * 4 + 4]])
        assert torch.equal(vk[0, h, 8:16], want)
    assert torch.equal(vk[:, :, 16:28], keys[:, :, full - 12 : full])
    assert torch.equal(pvs.view.layers[0].values[:, :, :28], -vk[:, :, :28])
    # rollback inside the backlog only trims the buffer; below the full cache it drops the view
    pvs.backlog = [1, 2, 3]
    pvs.view.set_length(layout.view_len + 3)
    pvs.rollback(cache, full + 1)
    assert pvs.backlog == [1] and pvs.view.seq_len == layout.view_len + 1
    pvs.rollback(cache, 100)
    assert not pvs.ready and pvs.backlog == [] and cache.seq_len == 100 and pvs.summaries.n_blocks == 25


def test_layout_without_candidates_is_the_whole_context():
    layout, n_cand = plan_layout(_pv(n_retrieval_blocks=3), 40)  # sink 8, blocks 1-2, window from 24
    assert n_cand == 2 and layout.retrieved_blocks == 2 and layout.window_start == 24
    assert layout.view_len == 40
    layout, n_cand = plan_layout(_pv(n_retrieval_blocks=3), 45)  # the window starts at a block boundary
    assert n_cand == 2 and layout.window_start == 24 and layout.view_len == 45


def test_reselect_regathers_only_the_retrieved_blocks():
    """Retrieval refresh between full verifications: new queries -> new blocks; the rest stays."""
    g = torch.Generator().manual_seed(1)
    bs, d, blocks = 4, 8, 32
    keys = 0.1 * torch.randn(1, 2, blocks * bs, d, generator=g)
    da, db = torch.linalg.qr(torch.randn(d, 2, generator=g)).Q.T  # two orthonormal directions
    for planted, direction in (((5, 11), da), ((14, 23), db)):
        for b in planted:
            keys[0, :, b * bs : (b + 1) * bs] = 3.0 * direction + 0.05 * torch.randn(bs, d, generator=g)
    cache = StaticKVCache(1, blocks * bs + 16)
    cache.append(0, keys, -keys)

    def queries(direction):  # [1, 4 heads (2 per KV head), 3 queries, d]
        return direction[None, None, None, :] + 0.1 * torch.randn(1, 4, 3, d, generator=g)

    cfg = SpecPVConfig(
        enabled=True,
        block_size=bs,
        n_sink_blocks=2,
        n_retrieval_blocks=2,
        n_window_blocks=3,
        retrieval_refresh_interval=1,
    )
    pvs = PartialSession(cfg)
    layout = pvs.rebuild(cache, {0: queries(da)})
    assert pvs.selected[0].tolist() == [[[5, 11], [5, 11]]]
    view = pvs.view.layers[0]
    # two buffered tokens (accepted under partial verification) must survive the re-selection
    view.keys[:, :, layout.view_len : layout.view_len + 2] = 7.0
    pvs.backlog = [1, 2]
    pvs.view.set_length(layout.view_len + 2)
    before_k, before_v = view.keys.clone(), view.values.clone()
    assert pvs.reselect(cache, {0: queries(db)})
    assert pvs.selected[0].tolist() == [[[14, 23], [14, 23]]]
    lo, hi = layout.sink, layout.sink + 2 * bs
    want = torch.cat([keys[:, :, 14 * bs : 15 * bs], keys[:, :, 23 * bs : 24 * bs]], dim=2)
    assert torch.equal(view.keys[:, :, lo:hi], want) and torch.equal(view.values[:, :, lo:hi], -want)
    assert torch.equal(view.keys[:, :, :lo], before_k[:, :, :lo])  # sink
    assert torch.equal(view.keys[:, :, hi:], before_k[:, :, hi:])  # window + buffer
    assert torch.equal(view.values[:, :, hi:], before_v[:, :, hi:])
    assert pvs.view.seq_len == layout.view_len + 2 and pvs.backlog == [1, 2]
    with pytest.raises(RuntimeError, match="no recorded queries"):
        pvs.reselect(cache, {})
    # nothing to re-select when every candidate fits
    pvs2 = PartialSession(SpecPVConfig(enabled=True, block_size=bs, n_sink_blocks=2, n_retrieval_blocks=64))
    pvs2.rebuild(cache, None)
    assert pvs2.selected == [] and not pvs2.reselect(cache, {0: queries(db)})


# ---------------------------------------------------------------------- engine behaviour
def test_off_or_below_threshold_is_identical(llama_pair, prompt):
    target, draft = llama_pair
    ref, ref_stats, plain, _ = _run(target, draft, prompt, None)
    assert plain.specpv_stats is None
    out, stats, te, tr = _run(target, draft, prompt, _pv(partial_threshold=10_000))
    assert out == ref
    assert [r.accepted for r in stats.rounds] == [r.accepted for r in ref_stats.rounds]
    assert te.forward_count == plain.forward_count == len(ref_stats.rounds)
    assert te.specpv_stats.partial_steps == 0 and te.specpv_stats.refreshes == 0
    assert te.specpv_stats.full_reasons == {"below_threshold": len(stats.rounds)}
    assert {r.stats.verify_mode for r in tr.results} == {"full"}


@pytest.mark.parametrize("family, tree", [("llama", STATIC), ("qwen", CHAIN)])
def test_view_covering_context_equals_full_verification(request, family, tree, prompt):
    target, draft = request.getfixturevalue(f"{family}_pair")
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, CTX:].tolist()
    plain, plain_stats, _, _ = _run(target, draft, prompt, None, tree=tree)
    assert plain == ref
    out, stats, te, _ = _run(target, draft, prompt, _pv(full_refresh_interval=3, **FULL_VIEW), tree=tree)
    assert target.config._attn_implementation == ATTENTION_NAME
    s = te.specpv_stats
    assert s.partial_steps > 0 and s.refreshes >= 2 and s.fallbacks == 0
    assert out == ref
    assert [r.accepted for r in stats.rounds] == [r.accepted for r in plain_stats.rounds]


def test_partial_step_attends_to_the_view_at_true_positions(llama_pair, prompt):
    target, _ = llama_pair
    te = TargetEngine(target, TargetConfig(specpv=_pv(n_retrieval_blocks=0)))  # view: sink + window
    r = te.verify(VerifyRequest("s", TokenTree.empty(), prompt, 0))  # full step, seeds the view
    layout = te.get_or_create_session("s")[0].pv.layout
    assert (layout.sink, layout.retrieved_blocks, layout.window_start) == (8, 0, 224)
    tree = TokenTree(
        token_ids=torch.tensor([9, 40, 77, 3, 120]),
        parents=torch.tensor([-1, -1, 0, 2, 1]),
        depths=torch.tensor([1, 1, 2, 3, 2]),
        log_probs=torch.zeros(5),
    )
    captured = {}
    orig = te._specpv.policy.forward

    def spy(*args):
        captured["step"] = orig(*args)
        return captured["step"]

    te._specpv.policy.forward = spy
    te.verify(VerifyRequest("s", tree, [r.next_token_id], CTX))
    step = captured["step"]
    assert step.partial and step.logits.shape == (6, VOCAB)
    # Reference: ONE plain forward over prompt + pending + tree whose mask hides what the view lacks.
    n_ctx, q = CTX, 6
    allowed = torch.zeros(n_ctx + q, n_ctx + q, dtype=torch.bool)
    allowed[:n_ctx, :n_ctx] = torch.ones(n_ctx, n_ctx, dtype=torch.bool).tril()
    allowed[n_ctx:, : layout.sink] = True
    allowed[n_ctx:, layout.window_start : n_ctx] = True
    allowed[n_ctx:, n_ctx] = True  # pending token
    allowed[n_ctx + 1 :, n_ctx + 1 :] = ancestor_matrix(tree.parents)
    pos = torch.cat([torch.arange(n_ctx + 1), n_ctx + tree.depths])[None]
    ids = torch.tensor([prompt + [r.next_token_id] + tree.token_ids.tolist()])
    with torch.no_grad():
        mask = bool_mask_to_float(allowed[None, None], torch.float32)
        ref = target(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0, n_ctx:]
    torch.testing.assert_close(step.logits, ref, rtol=1e-4, atol=1e-4)
    te.shutdown()


def test_recorded_queries_are_post_rope_at_true_positions(llama_pair, prompt):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    target, _ = llama_pair
    te = TargetEngine(target, TargetConfig(specpv=_pv(**FULL_VIEW)))
    seen = {}
    orig = te._specpv.policy.commit

    def spy(state, step, nodes, tokens):
        seen["q"] = step.recorder.queries
        return orig(state, step, nodes, tokens)

    te._specpv.policy.commit = spy
    te.verify(VerifyRequest("s", TokenTree.empty(), prompt, 0))  # seed: records the last row
    q = seen["q"]
    assert sorted(q) == [0, 1] and q[0].shape == (1, 4, 1, 16)
    with torch.no_grad():  # layer 0's query of the last prompt token, by hand
        ids = torch.tensor([prompt])
        h = target.model.layers[0].input_layernorm(target.model.embed_tokens(ids))
        attn = target.model.layers[0].self_attn
        qs = attn.q_proj(h).view(1, CTX, -1, 16).transpose(1, 2)
        pos = torch.arange(CTX)[None]
        cos, sin = target.model.rotary_emb(h, pos)
        qs, _ = apply_rotary_pos_emb(qs, qs, cos, sin)
    torch.testing.assert_close(q[0], qs[:, :, -1:], rtol=1e-4, atol=1e-5)
    te.shutdown()


def test_refresh_interval_and_buffer_accounting(llama_pair, prompt):
    target, _ = llama_pair
    checks, layouts = [], []

    def hook(tr, sid, res):
        state, _ = tr.target_engine.get_or_create_session(sid)
        pvs = state.pv
        layouts.append(pvs.layout)
        assert state.seq_len == res.prefix_length == state.cache.seq_len + len(pvs.backlog)
        if pvs.ready:
            assert state.cache.seq_len == pvs.layout.full_len
            assert pvs.view.seq_len == pvs.layout.view_len + len(pvs.backlog) <= pvs.view.capacity
        checks.append((res.stats.verify_mode, pvs.steps_since_refresh, len(pvs.backlog)))

    # draft == target and an exact view: every chain is accepted (4 + 1 tokens per round)
    pv = _pv(full_refresh_interval=3, n_spec_tokens_buf=64, **FULL_VIEW)
    out, stats, te, tr = _run(target, target, prompt, pv, tree=CHAIN, hook=hook, new=60)
    modes = [m for m, _, _ in checks]
    assert modes[:9] == [
        "full",
        "partial",
        "partial",
        "partial",
        "full",
        "partial",
        "partial",
        "partial",
        "full",
    ]
    assert all(b == 0 for m, _, b in checks if m == "full")  # a full step recomputes the backlog
    assert [b for m, _, b in checks[1:4]] == [5, 10, 15]
    s = te.specpv_stats
    assert s.full_reasons.get("overflow", 0) == 0 and s.full_reasons["seed"] == 1
    assert s.recomputed_tokens == 15 * s.full_reasons["interval"]
    assert s.retrieved_blocks == layouts[-1].retrieved_blocks > 20 and s.partial_steps == modes.count(
        "partial"
    )
    assert s.refreshes == modes.count("full") == 3

    # a 16-slot buffer holds three rounds (backlog 15 + 5 fed > 16): the full step comes early
    checks.clear()
    pv = _pv(full_refresh_interval=100, n_spec_tokens_buf=16, **FULL_VIEW)
    out2, _, te, _ = _run(target, target, prompt, pv, tree=CHAIN, hook=hook, new=60)
    assert out2 == out and [m for m, _, _ in checks] == modes
    assert te.specpv_stats.full_reasons == {"seed": 1, "overflow": 2}
    assert max(b for _, _, b in checks) == 15


def _check_view(state) -> None:
    """The partial view is sink + retrieved blocks + window of the full cache, then the buffer whose
    layer-0 keys (embedding + RoPE only) are the exact keys of the backlog at its true positions."""
    pvs, cache = state.pv, state.cache
    lay, bs = pvs.layout, pvs.cfg.block_size
    k = lay.retrieved_blocks
    lo, hi = lay.sink, lay.sink + k * bs
    assert cache.seq_len == lay.full_len and pvs.view.seq_len == lay.view_len + len(pvs.backlog)
    for i, (fl, vl) in enumerate(zip(cache.layers, pvs.view.layers, strict=True)):
        for full, view in ((fl.keys, vl.keys), (fl.values, vl.values)):
            assert torch.equal(view[:, :, :lo], full[:, :, :lo])
            if pvs.selected:
                blocks = pvs.selected[i]
                assert (blocks[..., 1:] > blocks[..., :-1]).all()  # position order, no duplicates
                assert blocks.min() >= pvs.cfg.n_sink_blocks and blocks.max() < lay.window_start // bs
                idx = (blocks[..., None] * bs + torch.arange(bs)).flatten(-2)
                want = full.gather(2, idx[..., None].expand(-1, -1, -1, full.shape[-1]))
            else:
                want = full[:, :, lo:hi]
            assert torch.equal(view[:, :, lo:hi], want)
            assert torch.equal(view[:, :, hi : lay.view_len], full[:, :, lay.window_start : lay.full_len])


@pytest.mark.parametrize("tree, every", [(CHAIN, 1), (STATIC, 1), (STATIC, 2), (STATIC, 0)])
def test_retrieval_refresh_between_full_verifications(llama_pair, prompt, tree, every):
    target, draft = llama_pair
    seen = []

    def hook(tr, sid, res):
        state, _ = tr.target_engine.get_or_create_session(sid)
        if state.pv is not None and state.pv.ready:
            _check_view(state)
            seen.append((res.stats.verify_mode, [b.clone() for b in state.pv.selected]))

    pv = _pv(n_retrieval_blocks=4, full_refresh_interval=4, retrieval_refresh_interval=every)
    out, stats, te, _ = _run(target, draft, prompt, pv, tree=tree, hook=hook, new=40)
    s = te.specpv_stats
    assert s.partial_steps > 4 and s.fallbacks == 0 and len(out) == 40
    # partial step j (1-based since the last full one) re-selects when j % every == 0
    want = 0
    since = 0
    for mode, _ in seen:
        since = since + 1 if mode == "partial" else 0
        want += bool(every) and mode == "partial" and since % every == 0
    assert s.reselections == want
    if every:  # the selection does move between full verifications
        moved = [
            any(not torch.equal(a, b) for a, b in zip(prev[1], cur[1], strict=True))
            for prev, cur in zip(seen, seen[1:], strict=False)
            if cur[0] == "partial"
        ]
        assert any(moved)


@pytest.mark.parametrize("window", [0, 3])
def test_retrieval_query_window_scores_with_recent_committed_rows(llama_pair, prompt, monkeypatch, window):
    """retrieval_query_window: each re-selection is scored with the last `window` committed rows
    since the view was built (this step's rows last); 0: this step's pending + accepted rows only."""
    target, draft = llama_pair
    calls = []
    orig = PartialSession.reselect

    def spy(self, cache, queries):
        calls.append((self.steps_since_refresh, {i: q.clone() for i, q in queries.items()}))
        return orig(self, cache, queries)

    monkeypatch.setattr(PartialSession, "reselect", spy)
    pv = _pv(
        n_retrieval_blocks=4,
        full_refresh_interval=4,
        retrieval_refresh_interval=1,
        retrieval_query_window=window,
    )
    out, _, te, _ = _run(target, draft, prompt, pv, tree=CHAIN, new=40)
    assert te.specpv_stats.fallbacks == 0 and len(calls) == te.specpv_stats.reselections > 4
    max_own = 1 + CHAIN.num_draft_tokens  # pending + the accepted chain
    capped = False
    for (since_prev, prev), (since, cur) in zip(calls, calls[1:], strict=False):
        rows = cur[0].shape[2]
        assert all(q.shape[2] == rows for q in cur.values())
        if not window or since == 1:  # fresh view (history reset by the full verification)
            assert 1 <= rows <= max_own
            continue
        assert since == since_prev + 1 and rows <= window
        capped |= rows == window
        # the previous call's rows (its trailing ones) lead this call's; this step's own rows follow
        n_prev = prev[0].shape[2]
        ok = [
            own
            for own in range(1, max_own + 1)
            if rows == min(window, n_prev + own)
            and all(
                torch.equal(cur[i][:, :, : rows - own], prev[i][:, :, n_prev - (rows - own) :]) for i in cur
            )
        ]
        assert ok, (since, rows, n_prev)
    assert capped or not window


def test_min_margin_below_reads_only_the_deciding_rows():
    """Rows that decided a committed token: row 0 and each accepted node's row; others are ignored."""
    from specsplit.core.verification import verify_greedy

    tree = TokenTree(  # 0 -> 1 -> 2 (chain) and a sibling 3 of node 0
        torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 1, -1]), torch.tensor([1, 2, 3, 1]), torch.zeros(4)
    )
    logits = torch.zeros(5, 10)
    logits[0, 5], logits[1, 6], logits[2, 3], logits[3, 1], logits[4, 2] = 9.0, 9.0, 9.0, 9.0, 9.0
    out = verify_greedy(logits, tree, 3, 2)  # accepts nodes 0, 1 (tokens 5, 6); node 2 (7) rejected
    assert out.to_host(tree.token_ids) == ([0, 1], [5, 6], 3)
    assert out.min_margin_below(logits, 1.0).tolist() == [0]
    logits[4, 3] = 8.5  # a near-tie on node 3's row (not on the path): ignored
    assert out.min_margin_below(logits, 1.0).tolist() == [0]
    logits[2, 4] = 8.5  # a near-tie on node 1's row, which chose the next token
    assert out.min_margin_below(logits, 1.0).tolist() == [1]
    assert out.min_margin_below(logits, 0.4).tolist() == [0]
    nodes, toks, nxt = out.to_host(tree.token_ids, extra=torch.tensor([7, 1]))
    assert (nodes, toks, nxt, out.extra_host) == ([0, 1], [5, 6], 3, [7, 1])


@pytest.mark.parametrize("tree", [CHAIN, STATIC])
def test_rectify_margin_verifies_near_ties_in_full(llama_pair, prompt, tree):
    """A margin no logit gap reaches rectifies every partial step: the output is full verification's,
    and each discarded step is counted; a zero margin changes nothing."""
    target, draft = llama_pair
    ref, ref_stats, _, _ = _run(target, draft, prompt, None, tree=tree)
    small = dict(n_retrieval_blocks=1, full_refresh_interval=4)  # a lossy view
    out, stats, te, tr = _run(target, draft, prompt, _pv(**small, rectify_margin=1e6), tree=tree)
    s = te.specpv_stats
    assert out == ref
    assert s.partial_steps == 0 and s.rectifications > 0 and s.full_reasons.get("rectify") == s.rectifications
    assert {r.stats.verify_mode for r in tr.results} == {"full"}
    assert te.forward_count == len(stats.rounds) + s.rectifications  # one discarded forward per rectification
    lossy, _, te0, _ = _run(target, draft, prompt, _pv(**small), tree=tree)
    assert te0.specpv_stats.rectifications == 0 and te0.specpv_stats.partial_steps > 0


def test_rectification_reads_the_device_once_more_only_when_it_fires(llama_pair, prompt, outcome_reads):
    """The near-tie flag rides on the round's one host read; only a rectified round reads again."""
    target, draft = llama_pair
    small = dict(n_retrieval_blocks=1, full_refresh_interval=4)
    _, stats, te, _ = _run(target, draft, prompt, _pv(**small, rectify_margin=1e6), tree=CHAIN)
    rect = te.specpv_stats.rectifications
    assert rect > 0 and outcome_reads["n"] == len(stats.rounds) + rect
    outcome_reads["n"] = 0
    _, stats, te, _ = _run(target, draft, prompt, _pv(**small, rectify_margin=1e-9), tree=CHAIN)
    assert te.specpv_stats.partial_steps > 0 and te.specpv_stats.rectifications == 0
    assert outcome_reads["n"] == len(stats.rounds)


def test_invariant_failure_falls_back_logged_once(llama_pair, prompt, caplog):
    target, draft = llama_pair
    ref, _, _, _ = _run(target, draft, prompt, None, new=40)
    broken = []

    def corrupt(tr, sid, res):  # knock the buffer out of step with the backlog, twice
        state, _ = tr.target_engine.get_or_create_session(sid)
        if res.stats.verify_mode == "partial" and len(broken) < 2:
            state.pv.view.set_length(state.pv.view.seq_len + 1)
            broken.append(len(tr.results))

    with caplog.at_level(logging.WARNING, logger="specsplit.engines.specpv"):
        out, _, te, _ = _run(
            target, draft, prompt, _pv(full_refresh_interval=50, **FULL_VIEW), hook=corrupt, new=40
        )
    assert out == ref
    assert len(broken) == 2 and te.specpv_stats.fallbacks == 2
    assert te.specpv_stats.full_reasons["fallback"] == 2
    warnings = [r for r in caplog.records if "partial verification failed" in r.getMessage()]
    assert len(warnings) == 1


def test_unhookable_model_verifies_in_full(llama_pair, prompt, monkeypatch):
    from specsplit.engines import specpv

    monkeypatch.setattr(specpv, "install_attention", lambda model: False)
    target, draft = llama_pair
    ref, ref_stats, _, _ = _run(target, draft, prompt, None)
    out, stats, te, _ = _run(target, draft, prompt, _pv(**FULL_VIEW))
    assert out == ref and te.specpv_stats.partial_steps == 0
    assert te.specpv_stats.full_reasons == {"unhooked": len(stats.rounds)}


def test_lost_session_and_sampling_under_specpv(llama_pair, prompt):
    target, draft = llama_pair
    ref, _, _, _ = _run(target, draft, prompt, None)

    def drop(tr, sid, res):  # the worker loses the session mid-backlog; the pipeline resends
        if len(tr.results) == 4:
            assert tr.target_engine.end_session(sid)

    out, stats, te, _ = _run(target, draft, prompt, _pv(**FULL_VIEW), hook=drop)
    assert out == ref and stats.recoveries == 1 and te.specpv_stats.full_reasons["seed"] == 2
    from specsplit import SamplingParams

    sp = SamplingParams(do_sample=True, temperature=0.9)
    a, _, te, _ = _run(target, draft, prompt, _pv(n_retrieval_blocks=4), sampling=sp)
    b, _, _, _ = _run(target, draft, prompt, _pv(n_retrieval_blocks=4), sampling=sp)
    assert a == b and len(a) == NEW and te.specpv_stats.partial_steps > 0


# ---------------------------------------------------------------------- gRPC
def test_same_behaviour_through_grpc(llama_pair, prompt):
    pytest.importorskip("grpc")
    remote = pytest.importorskip("specsplit.remote")
    target, draft = llama_pair
    pv = _pv(n_retrieval_blocks=4, full_refresh_interval=3)
    local_out, local_stats, local_te, _ = _run(target, draft, prompt, pv)
    te = TargetEngine(target, TargetConfig(specpv=pv))
    de = DraftEngine(draft)
    with remote.serve_target(te, port=0) as ts, remote.serve_draft(de, port=0) as ds:
        tr = remote.GrpcTransport(ts.address, ds.address, timeout_s=60.0)
        try:
            out, stats = decode(tr, prompt, DecodeParams(NEW, tree=STATIC), session_id="s")
        finally:
            tr.close()
    assert out == local_out
    assert [r.accepted for r in stats.rounds] == [r.accepted for r in local_stats.rounds]
    a, b = te.specpv_stats, local_te.specpv_stats
    assert a.partial_steps == b.partial_steps > 0 and a.full_reasons == b.full_reasons


# ---------------------------------------------------------------------- GPU
@pytest.mark.large
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("every", [0, 1])
def test_no_hidden_host_syncs_in_specpv_rounds(prompt, outcome_reads, every):
    """After the prefill round, partial steps AND refreshing full steps read the device only once."""
    target, draft = (m.to("cuda:0") for m in _pair("llama"))
    reads = outcome_reads
    te = TargetEngine(
        target,
        TargetConfig(
            device="cuda:0",
            specpv=_pv(n_retrieval_blocks=4, full_refresh_interval=3, retrieval_refresh_interval=every),
        ),
    )
    tr = LocalTransport(DraftEngine(draft, DraftConfig(device="cuda:0")), te)
    torch.cuda.synchronize()
    try:
        out, stats = decode(
            tr,
            prompt,
            DecodeParams(40, tree=STATIC),
            on_tokens=lambda _: torch.cuda.set_sync_debug_mode("error"),
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
        tr.close()
    assert reads["n"] == len(stats.rounds) and len(out) == 40
    s = te.specpv_stats
    assert s.partial_steps > 0 and s.full_reasons.get("interval", 0) > 0 and s.fallbacks == 0
    assert s.reselections == (s.partial_steps if every else 0)
