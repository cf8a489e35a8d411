"""GPU checks (skipped without CUDA): greedy exactness with the draft and target on different
devices, and with the target spread by an accelerate device map. Marked ``large``."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, EngineTuning, PipelineTuning, TargetConfig

pytestmark = [
    pytest.mark.large,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[5, 17, 33, 81, 9, 100], [7, 7, 12], [44, 3, 19, 250, 61, 62, 63, 64, 9]]


def _devices() -> tuple[str, str]:
    n = torch.cuda.device_count()
    return ("cuda:0", "cuda:1") if n >= 2 else ("cuda:0", "cuda:0")


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_two_device_greedy_exactness(llama_target, llama_draft_random, shape):
    import copy

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev)
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape=shape), draft=DraftConfig(device=ddev, dtype="float32"),
        target=TargetConfig(device=tdev, dtype="float32"),
    )  # fmt: skip
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids.to(tdev), max_new_tokens=40, do_sample=False).cpu()
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        out = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("kind", ["auto", "split"])
def test_device_map_target(tmp_path, llama_target, kind):
    from transformers import AutoModelForCausalLM

    llama_target.save_pretrained(tmp_path / "t")
    last = torch.cuda.device_count() - 1
    device_map = "auto" if kind == "auto" else {
        "model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
        "model.layers.1": last, "model.norm": last, "lm_head": last,
    }  # fmt: skip
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "t", device_map=device_map, dtype=torch.float32)
    ddev, _ = _devices()
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).to(ddev)
    ids = torch.tensor([PROMPTS[2]])
    ref = llama_target.generate(ids, max_new_tokens=30, do_sample=False)
    cfg = SpecSplitConfig(tree=TreeConfig(shape="static"), draft=DraftConfig(device=ddev))
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        out = gen.generate(ids, max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.acceptance_rate > 0.9  # draft == target


@pytest.mark.parametrize("kernel", ["auto", "math"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused-projections"])
@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_cuda_graph_path_exact(llama_target, llama_draft_random, shape, fuse, kernel):
    """Captured graphs replay the same computation as eager HF decoding (float32), also with the
    q/k/v and gate/up projections fused and with the folded matmul attention at every length."""
    import copy

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev)
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape=shape),
        draft=DraftConfig(
            device=ddev,
            dtype="float32",
            cuda_graphs=True,
            fuse_projections=fuse,
            tuning=EngineTuning(graph_capacity=512, attention_kernel=kernel),
        ),
        target=TargetConfig(
            device=tdev,
            dtype="float32",
            cuda_graphs=True,
            fuse_projections=fuse,
            tuning=EngineTuning(graph_capacity=512, attention_kernel=kernel, graph_rounds=True),
        ),
    )
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids.to(tdev), max_new_tokens=60, do_sample=False).cpu()  # before fusing
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        for _ in range(3):
            out = gen.generate(ids, max_new_tokens=60, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
        assert gen.target_engine._workspace.static.captures >= 1
        assert gen.draft_engine._workspace.static.captures >= 1
        if shape == "dynamic":  # the whole tree round is one captured graph
            assert gen.draft_engine._rounds
            assert all(r.graph is not None for r in gen.draft_engine._rounds.values())
        # the target's greedy round (mask, forward, acceptance, KV commit) is one captured graph
        assert gen.target_engine._rounds
        assert all(r.graph is not None for r in gen.target_engine._rounds.values())


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled"])
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_restricted_draft_vocabulary_on_cuda_graphs_exact(llama_target, llama_draft_random, shape, compile):
    """A draft whose output layer scores half the vocabulary, on the graph path with fused
    projections (its whole tree round one graph), also compiled: HF's greedy tokens, and every
    drafted token from the subset."""
    import copy

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev)
    tuning = EngineTuning(graph_capacity=512, graph_rounds=True)
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape=shape),
        draft=DraftConfig(device=ddev, dtype="float32", cuda_graphs=True, fuse_projections=True,
                          tuning=tuning, vocab_subset=128, compile=compile),
        target=TargetConfig(device=tdev, dtype="float32", cuda_graphs=True, tuning=tuning),
    )  # fmt: skip
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids.to(tdev), max_new_tokens=60, do_sample=False).cpu()
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        drafted: list[int] = []
        grow = gen.draft_engine.generate

        def recording(req):
            res = grow(req)
            drafted.extend(res.tree.token_ids.tolist())
            return res

        gen.draft_engine.generate = recording  # type: ignore[method-assign]
        for _ in range(2):
            out = gen.generate(ids, max_new_tokens=60, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
        assert drafted and max(drafted) < 128  # the subset (the special ids 0-2 lie in it)
        head = gen.draft_engine.runner.head
        assert head is not None and head.ids.device.type == "cuda"
        assert gen.draft_engine._workspace.static.captures >= 1


@pytest.mark.parametrize(
    ("shape", "compile"),
    [("chain", False), ("dynamic", False), ("dynamic", True)],
    ids=["chain", "dynamic-overlap", "dynamic-overlap-compiled-steps"],
)
def test_prefill_graphs_exact(llama_target, llama_draft_random, shape, compile):
    """Padded prompt forwards replay one CUDA graph per bucket (``prefill_graphs``) and decoding
    stays equal to HF greedy decoding (float32), across prompt lengths of three buckets, also when
    the round steps are compiled (the prefill graphs are not) and under the overlapped pipeline."""
    import copy

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev)
    common = dict(
        dtype="float32",
        cuda_graphs=True,
        compile=compile,
        tuning=EngineTuning(graph_capacity=1024, prefill_graphs=True),
    )
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape=shape),
        overlap=shape == "dynamic",  # captures in the verify thread while the draft speculates
        draft=DraftConfig(device=ddev, **common),  # type: ignore[arg-type]
        target=TargetConfig(device=tdev, **common),  # type: ignore[arg-type]
    )
    gen_ = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (1, n), generator=gen_) for n in (20, 100, 300, 90)]
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        for ids in prompts:
            ref = target.generate(ids.to(tdev), max_new_tokens=40, do_sample=False).cpu()
            assert torch.equal(gen.generate(ids, max_new_tokens=40), ref)
        for engine in (gen.target_engine, gen.draft_engine):
            captured = {k for k, b in engine._workspace.static._prefill_bufs.items() if b.graph is not None}
            assert {k[0] for k in captured} >= {128, 384}  # prompts 100 and 90 share one graph


def test_captures_in_two_threads_at_once(llama_target, llama_draft_random):
    """The overlapped pipeline can capture in both threads at once (a prompt's bucket in the verify
    thread, a new KV bucket of the speculative draft in the other). A capture's set-up (a device
    sync, freeing cached blocks) in one thread invalidates a capture in progress in the other, so
    captures hold ``specsplit.core.pinned.CAPTURE_LOCK``: each bucket is captured once and its padded
    forward equals the same forward without graphs."""
    import copy
    import threading

    from specsplit.runtime.graphs import PREFILL_BUCKETS, StaticForward
    from specsplit.runtime.runner import ModelRunner

    buckets = PREFILL_BUCKETS[:6]
    ids = torch.randint(3, 256, (buckets[-1],), generator=torch.Generator().manual_seed(3))
    models = [copy.deepcopy(m).to("cuda:0") for m in (llama_target, llama_draft_random)]
    runners = [ModelRunner(m, None, None, None, "auto") for m in models]
    want = [
        [StaticForward(r, 1024, use_graphs=False).run_prefill(ids[:n], 0).clone() for n in buckets]
        for r in runners
    ]
    statics = [StaticForward(r, 1024, use_graphs=True) for r in runners]
    got: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def prefills(k: int) -> None:
        try:
            for n in buckets:  # a new bucket each time: a capture each time
                got[k].append(statics[k].run_prefill(ids[:n], 0).clone())
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=prefills, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in (0, 1):
        assert statics[k].captures == len(buckets)
        for g, w in zip(got[k], want[k], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rounds", [True, False], ids=["round-graph", "forward-graph"])
def test_target_only_cuda_graphs_exact(llama_target, rounds):
    """Target-only decoding (no draft: an empty tree every round) replays its greedy round from one
    graph by default, and equals HF greedy decoding either way."""
    import copy

    _, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    cfg = SpecSplitConfig(
        target=TargetConfig(
            device=tdev,
            dtype="float32",
            cuda_graphs=True,
            tuning=EngineTuning(graph_capacity=512, graph_rounds=rounds),
        )
    )
    ids = torch.tensor([PROMPTS[2]])
    ref = target.generate(ids.to(tdev), max_new_tokens=40, do_sample=False).cpu()
    with SpecSplitGenerator(target, None, config=cfg) as gen:
        for _ in range(2):
            out = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
        graphs = [r.graph for r in gen.target_engine._rounds.values()]
        assert (bool(graphs) and all(g is not None for g in graphs)) if rounds else not graphs


@pytest.mark.parametrize("vocab", [None, 128], ids=["full-vocab", "draft-vocab-128"])
@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
@pytest.mark.parametrize("graphs", [False, True, "target-rounds"])
def test_no_hidden_host_syncs_in_a_round(
    llama_target, llama_draft_random, shape, graphs, vocab, outcome_reads
):
    """Inside a round the only device-to-host read is the verification outcome (one copy), also with
    a draft whose output layer scores a subset of the vocabulary."""
    import copy

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev)
    reads = outcome_reads
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape=shape),
        draft=DraftConfig(
            device=ddev, cuda_graphs=bool(graphs), tuning=EngineTuning(graph_capacity=512), vocab_subset=vocab
        ),
        target=TargetConfig(
            device=tdev,
            cuda_graphs=bool(graphs),
            tuning=EngineTuning(graph_capacity=512, graph_rounds=graphs == "target-rounds"),
        ),
    )
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        gen.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20)  # prefill, captures
        from specsplit.pipeline import DecodeParams, decode

        params = DecodeParams(max_new_tokens=24, tree=cfg.tree)
        prompt = PROMPTS[0] + [11, 12, 13]
        torch.cuda.synchronize()
        reads["n"] = 0
        # first round prefills (host work allowed); check the steady-state rounds
        try:
            out, stats = decode(gen.transport, prompt, params, on_tokens=_arm_sync_check_after_first_round())
        finally:  # a failure must not leave the check armed for the tests after this one
            torch.cuda.set_sync_debug_mode(0)
    assert reads["n"] == len(stats.rounds)


def _arm_sync_check_after_first_round():
    def on_tokens(_tokens):
        torch.cuda.set_sync_debug_mode("error")

    return on_tokens


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_overlap_two_devices_equals_sequential(llama_target, shape, graphs):
    """Overlapped pipeline with the draft and target on different GPUs (threads, two devices,
    CUDA graphs captured while the other engine runs): same tokens as sequential mode."""
    import copy

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = noisy_copy(llama_target, 0.001, seed=3).to(ddev)
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids.to(tdev), max_new_tokens=48, do_sample=False).cpu()
    outs = {}
    for overlap in (False, True):
        for sample in (False, True):
            cfg = SpecSplitConfig(tree=TreeConfig(shape=shape), overlap=overlap, draft=DraftConfig(device=ddev, dtype="float32", cuda_graphs=graphs), target=TargetConfig(device=tdev, dtype="float32", cuda_graphs=graphs), tuning=PipelineTuning(overlap_policy="always"))  # fmt: skip
            kw = {"do_sample": True, "temperature": 0.8, "top_k": 20} if sample else {}
            with SpecSplitGenerator(target, draft, config=cfg) as gen:
                outs[overlap, sample] = gen.generate(
                    ids, max_new_tokens=48, return_dict_in_generate=True,
                    generator=torch.Generator().manual_seed(5), **kw,
                )  # fmt: skip
    assert torch.equal(outs[False, False].sequences, ref)
    assert torch.equal(outs[True, False].sequences, ref)
    assert torch.equal(outs[True, True].sequences, outs[False, True].sequences)
    assert outs[True, False].spec_stats.spec_hits > 0


@pytest.mark.parametrize("loop", ["client", "target"])
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_grpc_workers_cuda_graphs_exact(llama_target, llama_draft_random, shape, loop):
    """Over gRPC the target receives host trees; its round graph takes them in one packed copy
    from pinned memory (``GraphedRound``). Same tokens as HF greedy, round after round."""
    import copy

    from specsplit.engines.draft import DraftEngine
    from specsplit.engines.target import TargetEngine
    from specsplit.remote import serve_draft, serve_target

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev)
    d_engine = DraftEngine(
        draft,
        DraftConfig(device=ddev, dtype="float32", cuda_graphs=True, tuning=EngineTuning(graph_capacity=512)),
    )
    t_engine = TargetEngine(
        target,
        TargetConfig(device=tdev, dtype="float32", cuda_graphs=True, tuning=EngineTuning(graph_capacity=512)),
    )
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids.to(tdev), max_new_tokens=48, do_sample=False).cpu()
    with serve_draft(d_engine) as d_srv, serve_target(t_engine, draft_address=d_srv.address) as t_srv:
        cfg = SpecSplitConfig(
            transport="grpc", target_address=t_srv.address, draft_address=d_srv.address,
            tree=TreeConfig(shape=shape), grpc_loop=loop,
        )  # fmt: skip
        with SpecSplitGenerator(None, None, config=cfg) as gen:
            for _ in range(2):
                out = gen.generate(ids, max_new_tokens=48, return_dict_in_generate=True)
                assert torch.equal(out.sequences, ref)
    rounds = list(t_engine._rounds.values())
    assert rounds and all(r.graph is not None for r in rounds)
    assert any(r._stage is not None for r in rounds)  # the host trees went through the packed copy


def test_engine_masked_attention_is_memory_efficient_not_cudnn(llama_target):
    """The engines' masked SDPA (a prefill with the first tree) runs PyTorch's memory-efficient kernel
    by name, never cuDNN's (a plan build per new prompt length and thread), and equals SDPA math."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from specsplit.core.tree import TokenTree
    from specsplit.core.tree_attention import build_verify_attention
    from specsplit.engines.target import TargetEngine
    from specsplit.messages import VerifyRequest
    from specsplit.runtime import attention as attn

    g = torch.Generator(device="cuda:0").manual_seed(0)
    q = torch.randn(1, 4, 45, 16, device="cuda:0", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, 45 + 30, 16, device="cuda:0", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    mask, _ = build_verify_attention(torch.arange(-1, 44, device="cuda:0"), 30, 0, torch.bfloat16)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    got = attn.masked_sdpa(q, kr, vr, mask, None)
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

    model = copy.deepcopy(llama_target).to("cuda:0", torch.bfloat16)
    eng = TargetEngine(model, TargetConfig(device="cuda:0", dtype="bfloat16"))
    prompt = [int(t) for t in torch.randint(3, 200, (37,), generator=torch.Generator().manual_seed(1))]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.verify(VerifyRequest("s", TokenTree.empty(), prompt, 0))
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_efficient_attention" in names
    assert "aten::_scaled_dot_product_cudnn_attention" not in names


@pytest.mark.parametrize("ipc", [True, False])
def test_grpc_target_loop_tree_slots_exact(model_dirs, ipc):
    """The target loop with its draft worker in another process on this host: greedy trees come from
    the draft worker's GPU memory (CUDA IPC tree slots, the verification queued behind the draft's
    GPU work) and the tokens equal HF greedy, generation after generation; ``tree_slots=False``:
    every tree travels in the reply, same tokens."""
    from remote_support import load_saved

    from specsplit.engines.target import TargetEngine
    from specsplit.remote import serve_target
    from specsplit.remote.launch import WorkerProcess

    ddev, tdev = _devices()
    target_dir, draft_dir = model_dirs
    target = load_saved(target_dir).to(tdev)
    t_engine = TargetEngine(
        target,
        TargetConfig(device=tdev, dtype="float32", cuda_graphs=True, tuning=EngineTuning(graph_capacity=512)),
    )
    refs = [target.generate(torch.tensor([p], device=tdev), max_new_tokens=40, do_sample=False).cpu()
            for p in PROMPTS]  # fmt: skip
    tree = TreeConfig(shape="dynamic", budget=16, max_depth=4, topk=4, width=4)
    with WorkerProcess("draft", str(draft_dir), device=ddev, dtype="float32", args=["--cuda-graphs"],
                       ready_timeout_s=300) as d:  # fmt: skip
        with serve_target(t_engine, draft_address=d.address, tree_slots=ipc) as t_srv:
            cfg = SpecSplitConfig(
                transport="grpc", target_address=t_srv.address, tree=tree, grpc_loop="target"
            )
            with SpecSplitGenerator(None, None, config=cfg) as gen:
                for _ in range(2):
                    for p, ref in zip(PROMPTS, refs, strict=True):
                        out = gen.generate(torch.tensor([p]), max_new_tokens=40, return_dict_in_generate=True)
                        assert torch.equal(out.sequences, ref)
                        assert out.spec_stats.tau > 1
            loop = t_srv.on_stop[0].__self__  # the servicer's TargetLoopTransport
            if ipc:
                assert loop._slots is not None, "".join(d._log[-20:])
                assert loop._slots.reads >= 2 * len(PROMPTS) * 3
            else:
                assert loop._slots is None


def test_tree_slot_sanitize_on_cuda_equals_cpu():
    """The sanitiser on CUDA equals CPU and reads nothing back to the host."""
    from specsplit.remote.tree_slots import sanitize

    g = torch.Generator().manual_seed(3)
    raw = torch.randint(-3, 40, (3, 24), generator=g)
    want = sanitize(raw, 32, torch.arange(24))
    raw_d, rows_d = raw.cuda(), torch.arange(24, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # it runs while the draft's GPU work is queued: no host sync
    try:
        got = sanitize(raw_d, 32, rows_d)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("mode", ["ngram", "auto", "lookahead", "lookahead-auto"])
def test_ngram_trees_on_cuda_graphs_exact(llama_target, llama_draft_random, mode):
    """n-gram trees padded to a few sizes (and lookahead trees: n-grams plus a Jacobi window, of an
    explicit width or of the default ``lookahead="auto"``, which a graph-replaying target turns on),
    verified by one-graph greedy rounds on a GPU: HF greedy's tokens; under sampling, target-only
    sampling's tokens for the same seed (position-keyed draws)."""
    import copy

    from specsplit.config import DEFAULT_LOOKAHEAD, NgramConfig, PipelineTuning

    lookahead = mode.startswith("lookahead")
    width = {"lookahead": 4, "lookahead-auto": "auto"}.get(mode, 0)
    mode = "ngram" if lookahead else mode
    ngram = NgramConfig(lookahead=width, lookahead_policy="always")

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev) if mode == "auto" else None
    cfg = SpecSplitConfig(
        drafter=mode,
        tree=TreeConfig(shape="dynamic", topk=2, width=2, budget=8, max_depth=3),
        draft=DraftConfig(
            device=ddev, dtype="float32", cuda_graphs=True, tuning=EngineTuning(graph_capacity=512)
        ),
        target=TargetConfig(
            device=tdev, dtype="float32", cuda_graphs=True, tuning=EngineTuning(graph_capacity=512)
        ),
        tuning=PipelineTuning(ngram=ngram),
    )
    ids = torch.tensor([[5, 17, 33, 81, 9, 100, 5, 17, 33, 81]])
    ref = llama_target.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
    kw = dict(max_new_tokens=32, do_sample=True, temperature=0.8, top_p=0.95)
    plain_cfg = SpecSplitConfig(target=TargetConfig(device=tdev, dtype="float32"))
    with SpecSplitGenerator(copy.deepcopy(llama_target).to(tdev), None, config=plain_cfg) as plain:
        sampled_ref = plain.generate(ids, generator=torch.Generator().manual_seed(9), **kw)
    drafted = 0
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        assert gen._ngram.lookahead_width() == (DEFAULT_LOOKAHEAD if width == "auto" else width)
        for _ in range(2):
            out = gen.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
            drafted += out.spec_stats.rounds_by_drafter().get("lookahead" if lookahead else "ngram", 0)
        assert drafted > 0
        assert torch.equal(gen.generate(ids, generator=torch.Generator().manual_seed(9), **kw), sampled_ref)
        sizes = {key[0] for key in gen.target_engine._rounds}
    assert sizes <= {0, 2, 4, 8, 16, 32}


@pytest.mark.parametrize("mode", ["ngram", "model"])
def test_logits_processors_on_cuda_graph_targets(llama_target, llama_draft_random, mode):
    """HF logits processors on a CUDA-graph target (history buffer, tree contexts, scores on the
    device): greedy output equals HF ``generate()`` with the same options, sampling equals plain
    decoding's seeded tokens, and ``output_scores`` come back on the device."""
    import copy

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev) if mode == "model" else None
    graphs = EngineTuning(graph_capacity=512)
    cfg = SpecSplitConfig(
        drafter=mode,
        tree=TreeConfig(shape="dynamic", topk=2, width=2, budget=8, max_depth=3),
        draft=DraftConfig(device=ddev, dtype="float32", cuda_graphs=True, tuning=graphs),
        target=TargetConfig(device=tdev, dtype="float32", cuda_graphs=True, tuning=graphs),
    )
    ids = torch.tensor([[5, 17, 33, 81, 9, 100, 5, 17, 33, 81]])
    opts = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, suppress_tokens=[7, 8])
    ref = llama_target.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=0, **opts)
    kw = dict(max_new_tokens=32, do_sample=True, temperature=0.8, top_k=40, repetition_penalty=1.2)
    plain_cfg = SpecSplitConfig(target=TargetConfig(device=tdev, dtype="float32"))
    with SpecSplitGenerator(copy.deepcopy(llama_target).to(tdev), None, config=plain_cfg) as plain:
        sampled_ref = plain.generate(ids, generator=torch.Generator().manual_seed(4), **kw)
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        for _ in range(2):
            out = gen.generate(
                ids, max_new_tokens=48, return_dict_in_generate=True, output_scores=True, **opts
            )
            assert torch.equal(out.sequences, ref)
        assert out.scores is not None and out.scores[0].device.type == "cuda" and len(out.scores) == 48
        if mode == "ngram":
            assert torch.equal(
                gen.generate(ids, generator=torch.Generator().manual_seed(4), **kw), sampled_ref
            )


def test_greedy_rounds_with_a_penalty_replay_as_one_captured_graph(llama_target):
    """A greedy round whose processors are a repetition penalty and capture-safe ones replays as
    ONE captured graph (forward, processors, acceptance, KV commit): HF's output, with graphs."""
    import copy

    _, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    cfg = SpecSplitConfig(
        drafter="ngram",
        target=TargetConfig(
            device=tdev, dtype="float32", cuda_graphs=True, tuning=EngineTuning(graph_capacity=512)
        ),
    )
    ids = torch.tensor([[5, 17, 33, 81, 9, 100, 5, 17, 33, 81]])
    opts = dict(repetition_penalty=1.05, suppress_tokens=[7, 8])
    ref = llama_target.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=0, **opts)
    with SpecSplitGenerator(target, None, config=cfg) as gen:
        for _ in range(2):
            out = gen.generate(ids, max_new_tokens=48, return_dict_in_generate=True, **opts)
            assert torch.equal(out.sequences, ref)
        graphs = [rnd for key, rnd in gen.target_engine._rounds.items() if key[-1] is not None]
    assert graphs and all(rnd.graph is not None for rnd in graphs)
    assert sum(out.spec_stats.accepted_counts()) > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_no_hidden_host_syncs_with_a_repetition_penalty(
    llama_target, llama_draft_random, graphs, outcome_reads
):
    """The processor pass (token history, every row's token set, the penalty), on the target and
    on the draft's levels, adds no host read to a round: still only the verification outcome."""
    import copy

    from specsplit.messages import LogitsProcessing
    from specsplit.pipeline import DecodeParams, decode

    ddev, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    draft = copy.deepcopy(llama_draft_random).to(ddev)
    tuning = EngineTuning(graph_capacity=512)
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape="dynamic"),
        draft=DraftConfig(device=ddev, cuda_graphs=graphs, tuning=tuning),
        target=TargetConfig(device=tdev, cuda_graphs=graphs, tuning=tuning),
    )
    prompt = PROMPTS[0] + [11, 12, 13]
    spec = LogitsProcessing({"repetition_penalty": 1.3, "max_length": 200}, len(prompt))
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        gen.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20, repetition_penalty=1.3)  # captures
        params = DecodeParams(max_new_tokens=24, tree=cfg.tree, processing=spec, draft_processing=spec)
        torch.cuda.synchronize()
        outcome_reads["n"] = 0
        try:
            out, stats = decode(gen.transport, prompt, params, on_tokens=_arm_sync_check_after_first_round())
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert outcome_reads["n"] == len(stats.rounds)


@pytest.mark.parametrize("do_sample", [False, True])
def test_batched_rounds_on_cuda_graphs_exact(llama_target, do_sample):
    """Batched rounds replayed from graphs (one per batch bucket, tree size and KV bucket) commit what
    the eager batched rounds and the sequential rows commit; rows leaving shrink the batch bucket."""
    import copy

    target = copy.deepcopy(llama_target).to("cuda:0")
    prompts = PROMPTS + [[1, 2, 3, 1, 2, 3, 1, 2, 3], [90], [11, 12, 13, 11, 12, 13, 11]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    kw = dict(max_new_tokens=40, do_sample=do_sample, temperature=0.9, top_p=0.9)
    outs = []
    for graphs, max_batch in ((True, 4), (False, 4), (True, 0)):
        cfg = SpecSplitConfig(
            drafter="ngram", max_batch=max_batch, target=TargetConfig(cuda_graphs=graphs, dtype="float32")
        )
        with SpecSplitGenerator(target, None, config=cfg) as gen:
            outs.append(
                gen.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(3), **kw)
            )
            if graphs and max_batch:
                assert gen._batched is not None and gen._batched.captures >= 2
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])
    if not do_sample:
        for b, p in enumerate(prompts):
            ref = llama_target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[
                0, len(p) :
            ].tolist()
            row = outs[0][b, width:].tolist()
            assert row[: len(ref)] == ref


def test_compiled_batched_rounds_equal_hf_alone(llama_target):
    """Batched rounds fused by torch.compile and replayed from graphs (a batch that shrinks as rows
    end: several batch buckets, one dynamic compile) give every greedy row HF generate() alone."""
    import copy

    from specsplit.bench.batch import left_padded

    torch._dynamo.reset()
    target = copy.deepcopy(llama_target).to("cuda:0")
    prompts = PROMPTS + [[1, 2, 3, 1, 2, 3, 1, 2, 3], [90], [11, 12, 13, 11, 12, 13, 11]]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    cfg = SpecSplitConfig(
        drafter="ngram", max_batch=8, target=TargetConfig(cuda_graphs=True, compile=True, dtype="float32")
    )
    with SpecSplitGenerator(target, None, config=cfg) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        assert gen._batched is not None and gen._batched.captures >= 2 and gen._batched._step is not None
    for b, p in enumerate(prompts):
        ref = llama_target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[
            0, len(p) :
        ].tolist()
        assert out[b, width:].tolist()[: len(ref)] == ref


def test_batched_chain_drafts_on_cuda_graphs_equal_hf_greedy(llama_target):
    """Chain drafts replayed from graphs (ragged new tokens, two batch buckets) draft each row's
    greedy continuation, as HF generate() alone gives it."""
    import copy

    from specsplit.engines.batched import BatchedTarget, ChainRow
    from specsplit.runtime.runner import ModelRunner

    target = copy.deepcopy(llama_target).to("cuda:0")
    pool = BatchedTarget(ModelRunner(target, None, "cuda:0", None, "float32"), slots=4, capacity=256)
    prompts = [PROMPTS[0], PROMPTS[2], [1, 2, 3, 1, 2, 3]]
    truth = [
        llama_target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    held = [1, 3, 2]
    pool.prefill(0, [p[:-h] for p, h in zip(prompts, held, strict=True)])
    rows = [ChainRow(len(p) - h, p[-h:]) for p, h in zip(prompts, held, strict=True)]
    for _ in range(2):  # the second call replays the captured graph
        assert pool.chain(rows, 5) == [t[:5] for t in truth]
    took = [3, 6, 1]
    rows = [ChainRow(len(p), t[:m]) for p, t, m in zip(prompts, truth, took, strict=True)]
    assert pool.chain(rows, 4) == [t[m : m + 4] for t, m in zip(truth, took, strict=True)]
    assert pool.chain(rows[:1], 4) == [truth[0][3:7]]  # batch bucket 1
    assert pool.captures >= 3


def test_batched_prefill_from_graphs_writes_what_eager_groups_write(llama_target):
    """Joining rows' prompts written from graphs of bucketed shapes (padding rows in the spare slot)
    leave every slot with the KV the eager groups write, beside live rows they must not touch; the
    second call of a shape replays its graph."""
    import copy

    from specsplit.engines.batched import BatchedTarget
    from specsplit.runtime.runner import ModelRunner

    target = copy.deepcopy(llama_target).to("cuda:0")
    runner = ModelRunner(target, None, "cuda:0", None, "float32")
    graphed = BatchedTarget(runner, slots=8, capacity=128)
    eager = BatchedTarget(runner, slots=8, capacity=128, use_graphs=False)
    live = [[5, 6, 7, 8, 9, 10, 11]]
    joining = sorted(([p[:-1] for p in PROMPTS] + [[], [3] * 40]), key=len)[:7]
    for pool in (graphed, eager):
        pool.prefill(0, live)
        pool.prefill(1, joining)
    assert graphed.captures >= 1
    for b, p in enumerate(live + joining):
        torch.testing.assert_close(
            graphed.cache.kv[:, :, b, :, : len(p)], eager.cache.kv[:, :, b, :, : len(p)], rtol=1e-5, atol=1e-5
        )
    before = graphed.captures
    graphed.cache.kv[:, :, 1:8].zero_()
    graphed.prefill(1, joining)  # the same shapes: replays only
    assert graphed.captures == before
    for b, p in enumerate(joining, start=1):
        torch.testing.assert_close(
            graphed.cache.kv[:, :, b, :, : len(p)], eager.cache.kv[:, :, b, :, : len(p)], rtol=1e-5, atol=1e-5
        )


def test_batched_prefill_shapes_captured_up_front_serve_any_group(llama_target):
    """A worker captures every prompt-forward shape at start: groups of any composition then only
    replay, and write what the eager groups write."""
    import copy

    from specsplit.engines.batched import PREFILL_TOKENS, BatchedTarget
    from specsplit.runtime.runner import ModelRunner

    target = copy.deepcopy(llama_target).to("cuda:0")
    runner = ModelRunner(target, None, "cuda:0", None, "float32")
    pool = BatchedTarget(runner, slots=8, capacity=96)
    eager = BatchedTarget(runner, slots=8, capacity=96, use_graphs=False)
    n = pool.capture_prefills()
    # widths 16, 32, 64, 96 (the capacity) x rows 1..8
    assert n == 4 * 4 and all(r * w <= PREFILL_TOKENS for r, w in pool._prefills)
    assert eager.capture_prefills() == 0
    prompts = [list(range(5, 5 + k)) for k in (3, 17, 40, 90, 1)]
    for p in (pool, eager):
        p.prefill(0, prompts[:2])
        p.prefill(2, prompts[2:])
    assert pool.captures == n
    for b, p in enumerate(prompts):
        torch.testing.assert_close(
            pool.cache.kv[:, :, b, :, : len(p)], eager.cache.kv[:, :, b, :, : len(p)], rtol=1e-5, atol=1e-5
        )
    # Rounds too: every greedy shape captured up front, then rounds only replay and commit what
    # the eager pool commits.
    from specsplit.core.sampling import SamplingParams
    from specsplit.engines.batched import RowTree

    rounds = pool.capture_rounds((0, 4))
    assert rounds == len(pool.round_shapes((0, 4))) > 0
    trees = [RowTree(len(p), 7, [8, 9], [-1, 0], [1, 2]) for p in prompts]
    for batch in (trees, trees[:3], trees[:1]):
        got = pool.round(batch, SamplingParams(), 4)
        want = eager.round(batch, SamplingParams(), 4)
        assert [(o.tokens, o.next_token) for o in got] == [(o.tokens, o.next_token) for o in want]
    assert pool.captures == n + rounds


def test_batched_capture_warms_up_on_the_staged_inputs(llama_target, monkeypatch):
    """A capture's warm-up (on a side stream) reads the inputs just staged, even while the current
    stream is still busy: it must wait for the snapshot it restores them from."""
    import copy

    from specsplit.engines.batched import BatchedTarget, ChainRow
    from specsplit.runtime.runner import ModelRunner

    target = copy.deepcopy(llama_target).to("cuda:0")
    pool = BatchedTarget(ModelRunner(target, None, "cuda:0", None, "float32"), slots=4, capacity=256)
    prompts = [PROMPTS[0], PROMPTS[2]]
    truth = [
        llama_target.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    pool.prefill(0, [p[:-2] for p in prompts])
    seen: list[torch.Tensor] = []
    body = pool._chain_body

    def spy(ch, k):  # what each run of the body reads, on the stream it runs on
        if not torch.cuda.is_current_stream_capturing():
            seen.append(ch.stage.clone())
        return body(ch, k)

    monkeypatch.setattr(pool, "_chain_body", spy)
    wait = torch.cuda.Stream.wait_stream

    def busy_after(self, other):  # the current stream stays busy right after any wait is recorded
        wait(self, other)
        torch.cuda._sleep(100_000_000)

    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", busy_after)
    out = pool.chain([ChainRow(len(p) - 2, p[-2:]) for p in prompts], 5)
    torch.cuda.synchronize()
    staged = next(iter(pool._chains.values())).host.to("cuda:0")
    assert len(seen) == 2 and all(torch.equal(s, staged) for s in seen)
    assert out == truth


def test_batched_greedy_round_reads_the_host_once(llama_target, monkeypatch):
    """A greedy batched round on the graph path makes no device-to-host read but its outcome's."""
    import copy

    from specsplit.core.sampling import SamplingParams
    from specsplit.engines import batched
    from specsplit.engines.batched import BatchedTarget, RowTree
    from specsplit.runtime.runner import ModelRunner

    reads = {"n": 0}
    orig = batched.read_outcome

    def allowed(t):
        reads["n"] += 1
        torch.cuda.set_sync_debug_mode(0)
        try:
            return orig(t)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(batched, "read_outcome", allowed)
    target = copy.deepcopy(llama_target).to("cuda:0")
    pool = BatchedTarget(ModelRunner(target, None, "cuda:0", None, "float32"), slots=4, capacity=256)
    prompts = [PROMPTS[0], PROMPTS[2], [1, 2, 3, 1, 2, 3]]
    pool.prefill(0, [p[:-1] for p in prompts])
    rows = [RowTree(len(p) - 1, p[-1], [p[0], p[1]], [-1, 0], [1, 2]) for p in prompts]
    pool.round(rows, SamplingParams(), 2)  # captures the shape
    rows = [RowTree(r.length + 1, 5, [6, 7], [-1, 0], [1, 2]) for r in rows]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.round(rows, SamplingParams(), 2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reads["n"] == 2


@pytest.mark.parametrize("policy", ["always", "adaptive"])
@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled"])
@pytest.mark.parametrize("window", [0, 4], ids=["heads", "heads-lookahead"])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_draft_heads_on_cuda_graphs_exact(
    llama_target, tmp_path, compile, window, kind, policy, outcome_reads
):
    """A target with draft heads (Medusa's, or an EAGLE head growing its tree inside the round) on
    one-graph rounds (plain and compiled; beside a lookahead window or not): HF greedy's tokens, the
    heads' guesses in the rounds, and still one device read a steady-state round (the guesses ride
    on the outcome's copy). ``adaptive``: guesses priced above anything they add, so most rounds
    grow none (an EAGLE head's ingest-only rounds, a graph of their own) between probes."""
    import copy

    from specsplit.config import NgramConfig
    from specsplit.pipeline import DecodeParams, decode
    from specsplit.runtime.heads import DraftHeads, HeadsInfo, save_heads

    torch.manual_seed(0)
    w = llama_target.get_output_embeddings().weight
    if kind == "eagle":
        from specsplit.runtime.eagle import EagleConfig, EagleLayer, save_eagle

        layer = EagleLayer(EagleConfig.for_target(llama_target, topk=4, width=3, depth=4))
        layer.warm_start(llama_target)
        info = HeadsInfo(4, w.shape[1], w.shape[0])
        path = save_eagle(layer, torch.arange(0, w.shape[0], 2), info, tmp_path / "eagle")
    else:
        heads = DraftHeads(3, w.shape[1], token_input=True)  # the token gathered in the graph
        with torch.no_grad():
            heads.weight.normal_(0, 0.05)
            heads.token_weight.normal_(0, 0.05)
        acc = [[0.5 / (r + 1) / (k + 1) for r in range(4)] for k in range(3)]
        info = HeadsInfo(3, w.shape[1], w.shape[0], rank_accuracy=acc, token_input=True)
        path = save_heads(heads, info, tmp_path / "heads")
    _, tdev = _devices()
    target = copy.deepcopy(llama_target).to(tdev)
    cost = 1e9 if policy == "adaptive" else None
    ngram = NgramConfig(
        lookahead=window, lookahead_policy="always", guess_policy=policy, guess_cost_tokens=cost
    )
    cfg = SpecSplitConfig(
        drafter="ngram",
        target=TargetConfig(
            device=tdev, dtype="float32", cuda_graphs=True, compile=compile, draft_heads=str(path),
            draft_heads_nodes=8, tuning=EngineTuning(graph_capacity=512),
        ),
        tuning=PipelineTuning(ngram=ngram),
    )  # fmt: skip
    ids = torch.tensor([[5, 17, 33, 81, 9, 100, 5, 17, 33, 81]])
    ref = llama_target.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=0)
    with SpecSplitGenerator(target, None, config=cfg) as gen:
        for _ in range(2):
            out = gen.generate(ids, max_new_tokens=48, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
            assert out.spec_stats.rounds_by_drafter().get("heads", 0) > 0
        params = DecodeParams(max_new_tokens=24, drafter="ngram", ngram=gen._ngram)
        torch.cuda.synchronize()
        outcome_reads["n"] = 0
        try:
            _, stats = decode(
                gen.transport, ids[0].tolist(), params, on_tokens=_arm_sync_check_after_first_round()
            )
        finally:  # a failure must not leave the check armed for the tests after this one
            torch.cuda.set_sync_debug_mode(0)
    assert outcome_reads["n"] == len(stats.rounds)
