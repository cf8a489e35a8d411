"""`specsplit bench`: the smoke suite end to end, the prompt set, and the aggregation arithmetic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from specsplit.bench.decoders import DEFAULT_DECODERS, FRSPEC_VOCAB, BuildOptions
from specsplit.bench.report import RunRecord, first_difference, rounds_to_counts, summarize
from specsplit.bench.run import CATEGORIES, DEFAULT_PROMPTS, SCHEMA, load_prompts
from specsplit.cli import main
from specsplit.config import (
    DEFAULT_LOOKAHEAD,
    DEFAULT_LOOKAHEAD_LEVELS,
    DEFAULT_LOOKAHEAD_NODES,
    EngineTuning,
)

NOT_DRAFTING = {"hf-target", "hf-assisted-default", "hf-prompt-lookup", "specsplit-target-only"}
SPECULATIVE = tuple(d for d in DEFAULT_DECODERS if d not in NOT_DRAFTING)
_METRICS = {
    "prompts": int,
    "new_tokens_per_prompt": float,
    "tokens_per_s": dict,
    "speedup_vs_hf_target": dict,
    "speedup_vs_hf_assisted": dict,
    "rounds": int,
    "tau": float,
    "per_position_acceptance": list,
    "exact_match_rate": float,
    "mismatched_prompts": list,
}


def _grpc_available() -> bool:
    try:
        import specsplit.remote  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--suite", "smoke", "--device", "cpu", "--out", str(out)]) == 0
    files = list(out.glob("*-smoke.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text()), out


def test_smoke_json_schema(smoke: tuple[dict, Path]) -> None:
    result, _ = smoke
    assert result["schema"] == SCHEMA
    for key in ("created_utc", "command", "machine", "config", "decoder_labels", "notes", "summary", "runs"):
        assert key in result, key
    assert result["command"].startswith("specsplit bench --suite smoke --device cpu")
    machine = result["machine"]
    assert machine["slug"].startswith("cpu-") and machine["slug"].endswith("core")
    for key in ("torch", "transformers", "python", "cpu", "cpu_cores", "torch_threads"):
        assert machine[key], key
    cfg = result["config"]
    assert (cfg["suite"], cfg["max_new_tokens"], cfg["repeats"], cfg["num_prompts"]) == ("smoke", 16, 2, 2)
    expected = [d for d in DEFAULT_DECODERS if d != "specsplit-grpc" or _grpc_available()]
    assert cfg["decoders"] == expected
    if not _grpc_available():
        assert "specsplit-grpc" in cfg["skipped"]
    assert set(result["summary"]) == set(expected)
    for name in expected:
        entry = result["summary"][name]
        assert set(entry["by_category"]) == {"chat", "code"}
        for scope in (entry["overall"], *entry["by_category"].values()):
            for key, typ in _METRICS.items():
                assert isinstance(scope[key], typ), (name, key, scope[key])
            assert (
                scope["tokens_per_s"]["min"]
                <= scope["tokens_per_s"]["median"]
                <= scope["tokens_per_s"]["max"]
            )
            assert scope["tokens_per_s"]["median"] > 0
    assert len(result["runs"]) == len(expected) * 2 * 2  # decoders x prompts x repeats
    for run in result["runs"]:
        assert run["time_s"] > 0 and run["new_tokens"] > 0


def test_smoke_every_decoder_matches_hf_generate(smoke: tuple[dict, Path]) -> None:
    """Float32 tiny models with peaked distributions: every decoder reproduces (a) token for token."""
    result, _ = smoke
    for name, entry in result["summary"].items():
        assert entry["overall"]["exact_match_rate"] == 1.0, (name, entry["overall"]["mismatched_prompts"])
        assert entry["overall"]["mismatched_prompts"] == []
    assert all(run["matches_baseline"] is True for run in result["runs"])


def test_smoke_speculative_decoders_draft_and_accept(smoke: tuple[dict, Path]) -> None:
    """The draft is the target plus a little noise: drafts are partly accepted, by both libraries."""
    result, _ = smoke
    summary = result["summary"]
    for name in SPECULATIVE:
        if name not in summary:
            continue
        m = summary[name]["overall"]
        assert m["tau"] > 1.2, (name, m["tau"])
        assert 0.0 < m["acceptance_rate"] < 1.0, (name, m["acceptance_rate"])
        assert m["per_position_acceptance"], name
    k = result["config"]["num_draft_tokens"]
    for name in ("hf-assisted", "specsplit-chain"):  # same draft, same K, same greedy rule: same rounds
        assert len(summary[name]["overall"]["per_position_acceptance"]) == k
    assert summary["hf-assisted"]["overall"]["tau"] == pytest.approx(
        summary["specsplit-chain"]["overall"]["tau"]
    )
    assert summary["hf-target"]["overall"]["tau"] == 1.0
    split = summary["specsplit-chain"]["overall"]["time_split_ms_per_round"]
    assert set(split) == {"draft", "verify", "transport", "host", "overlap_draft"} and split["verify"] > 0
    assert split["overlap_draft"] == 0.0 and summary["specsplit-chain"]["overall"]["overlap_hit_rate"] is None
    ovl = summary["specsplit-overlap-chain"]["overall"]
    assert ovl["time_split_ms_per_round"]["overlap_draft"] > 0 and 0.0 <= ovl["overlap_hit_rate"] <= 1.0
    assert 0 < ovl["overlap_spec_rounds"] <= ovl["rounds"]  # the policy's probes at least
    line = f"a speculative next-round draft ran in {ovl['overlap_spec_rounds']:.0f} of {ovl['rounds']} rounds"
    assert line in Path(result["files"]["md"]).read_text()
    assert summary["hf-target"]["overall"]["time_split_ms_per_round"] is None
    assert summary["hf-target"]["overall"]["speedup_vs_hf_target"]["median"] == pytest.approx(1.0)


def test_report_names_the_weight_read_bound(smoke: tuple[dict, Path]) -> None:
    """On a GPU the run records the target's weight-read bound; the report states it and each
    target-only decoder's share of it (faked here: CPU runs record none)."""
    import copy

    from specsplit.bench.report import to_markdown

    smoke_result = smoke[0]
    assert smoke_result["config"]["weight_read_bound"] is None
    result = copy.deepcopy(smoke_result)
    tps = result["summary"]["specsplit-target-only"]["overall"]["tokens_per_s"]["median"]
    result["config"]["weight_read_bound"] = {
        "weight_bytes": 3.55e9, "copy_bandwidth_GBps": 4283.0, "bound_ms": 0.829, "bound_tokens_per_s": 4 * tps
    }  # fmt: skip
    md = to_markdown(result)
    assert "Weight-read bound of the target: 3.55 GB at the 4283 GB/s" in md
    assert "`specsplit-target-only` runs at 25% of it" in md
    assert "Weight-read bound" not in to_markdown(smoke_result)  # CPU runs: no bound, no line


def test_smoke_writes_table_and_plot(smoke: tuple[dict, Path]) -> None:
    result, out = smoke
    md = Path(result["files"]["md"])
    assert md.parent == out and md.is_file()
    text = md.read_text()
    assert "| decoder | tokens/s |" in text
    for name in result["config"]["decoders"]:
        assert f"| `{name}` |" in text
    if importlib.util.find_spec("matplotlib") is not None:
        png = Path(result["files"]["png"])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "png" not in result["files"]


def test_prompt_set_covers_every_known_category() -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 8 * len(CATEGORIES)
    assert len({p.id for p in prompts}) == len(prompts)
    for cat in CATEGORIES:
        group = [p for p in prompts if p.category == cat]
        assert len(group) >= 8, cat
    for p in prompts:
        assert p.messages[-1]["role"] == "user"
        if p.category == "chat":  # multi-turn: earlier turns given as messages
            assert any(m["role"] == "assistant" for m in p.messages), p.id
        if p.category in ("summarization", "qa"):  # the passage is part of the prompt
            assert len(p.messages[-1]["content"]) > 400, p.id
        if p.category == "code-editing":  # the code to edit is part of the prompt: 15-40 lines of Python
            assert p.id.startswith("code-editing-"), p.id
            code = p.messages[-1]["content"].split("```python\n", 1)[1].split("\n```", 1)[0]
            compile(code, p.id, "exec")
            assert 15 <= len(code.splitlines()) <= 40, p.id
    quick = load_prompts(DEFAULT_PROMPTS, per_category=1)
    assert [p.category for p in quick] == list(CATEGORIES)


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"id": "a", "category": "", "messages": [{"role": "user", "content": "x"}]}', "category"),
        ('{"id": "a", "category": "a|b", "messages": [{"role": "user", "content": "x"}]}', "category"),
        ('{"id": "a", "category": 7, "messages": [{"role": "user", "content": "x"}]}', "category"),
        ('{"id": "a", "category": "code", "messages": [{"role": "robot", "content": "x"}]}', "roles"),
        (
            '{"id": "a", "category": "code", "messages": [{"role": "assistant", "content": "x"}]}',
            "last message",
        ),
        ('{"id": "a", "category": "code"}', "needs id"),
    ],
)
def test_load_prompts_rejects_malformed_entries(tmp_path: Path, line: str, match: str) -> None:
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        load_prompts(tmp_path)


def test_load_prompts_accepts_any_category_known_ones_first(tmp_path: Path) -> None:
    """Users bench their own workloads: any category name loads, after the known ones, sorted."""
    lines = [
        {"id": f"{cat}-{i}", "category": cat, "messages": [{"role": "user", "content": "x"}]}
        for cat in ("zeta-logs", "math", "chat", "alpha-sql", "code-editing")
        for i in (2, 1)
    ]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    prompts = load_prompts(tmp_path)
    order = ["chat", "code-editing", "math", "alpha-sql", "zeta-logs"]
    assert [p.id for p in prompts] == [f"{c}-{i}" for c in order for i in (1, 2)]
    assert [p.category for p in load_prompts(tmp_path, per_category=1)] == order


def test_unknown_category_is_run_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A category outside :data:`CATEGORIES` gets its column in the Markdown tables and its bars in
    the plot, after the known ones."""
    import specsplit.bench.run as bench_run
    from specsplit.bench.run import BenchOptions, BenchPrompt, run_bench

    def prompts() -> list[BenchPrompt]:
        ids = ([5, 9, 13, 17, 21, 25], [7, 11, 19, 23, 29, 31, 37])
        return [
            BenchPrompt("w-1", "my-workload", input_ids=ids[0]),
            BenchPrompt("c-1", "chat", input_ids=ids[1]),
        ]

    monkeypatch.setattr(bench_run, "smoke_prompts", prompts)
    ticks: list[str] = []
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.figure

        save = matplotlib.figure.Figure.savefig

        def spy(fig: matplotlib.figure.Figure, *a: object, **kw: object) -> None:
            ticks.extend(t.get_text() for t in fig.axes[0].get_xticklabels())
            save(fig, *a, **kw)

        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    opts = BenchOptions(suite="smoke", decoders=("hf-target", "specsplit-chain"), repeats=1, max_new_tokens=6,
                        out=tmp_path, threads=1)  # fmt: skip
    result = run_bench(opts)
    assert result["config"]["categories"] == ["chat", "my-workload"]
    for name in ("hf-target", "specsplit-chain"):
        assert set(result["summary"][name]["by_category"]) == {"chat", "my-workload"}
    md = Path(result["files"]["md"]).read_text()
    assert "| decoder | chat | my-workload |" in md and "(chat, my-workload)" in md
    if ticks:
        assert ticks == ["chat", "my-workload", "all"]


def test_profile_prompts_profiles_each_specsplit_decoder_after_the_timing(tmp_path: Path) -> None:
    """``profile_prompts``: each SpecSplit decoder generates the chosen prompts once more under the
    profiler; the pooled rounds are the timed run's rounds of those prompts (greedy, float32, so the
    same generation), the HF baseline has no profile, and the report gains the section."""
    from specsplit.bench.run import BenchOptions, _markdown, run_bench

    opts = BenchOptions(suite="smoke", decoders=("hf-target", "specsplit-target-only", "specsplit-chain"),
                        repeats=1, max_new_tokens=8, out=tmp_path, threads=1, profile_prompts=2)  # fmt: skip
    result = run_bench(opts)
    profiles = result["profiles"]
    assert set(profiles) == {"specsplit-target-only", "specsplit-chain"}
    assert result["config"]["profile_prompts"] == 2
    for name, p in profiles.items():
        assert p["prompts"] == ["random-01", "random-02"]  # one per category
        timed = sum(r["rounds"] for r in result["runs"] if r["decoder"] == name)
        assert p["rounds"] == timed > 0, name
        assert p["wall_ms"] > 0 and p["kernels_ms"] == {}  # no GPU here
    md = Path(result["files"]["md"]).read_text()
    assert "## Profiled rounds" in md and "| `specsplit-chain` | random-01, random-02 |" in md
    assert "## Profiled rounds" not in _markdown({**result, "profiles": None})


def test_profile_prompts_spread_over_the_categories() -> None:
    from specsplit.bench.run import BenchPrompt, spread_prompts

    ps = [BenchPrompt(f"{c}-{i}", c) for c in ("code", "chat", "math") for i in (1, 2)]
    assert [p.id for p in spread_prompts(ps, 4)] == ["chat-1", "code-1", "math-1", "chat-2"]
    assert [p.id for p in spread_prompts(ps, 10)] == [
        "chat-1", "code-1", "math-1", "chat-2", "code-2", "math-2"
    ]  # fmt: skip
    assert spread_prompts(ps, 0) == []


def test_profile_prompts_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--suite", "smoke", "--device", "cpu", "--profile-prompts", "-1"]) == 2
    assert "--profile-prompts must be >= 0" in capsys.readouterr().err
    assert (
        main(["bench", "--suite", "smoke", "--device", "cpu", "--batch-size", "2", "--profile-prompts", "1"])
        != 0
    )


def test_load_prompts_rejects_duplicate_ids(tmp_path: Path) -> None:
    line = '{"id": "a", "category": "code", "messages": [{"role": "user", "content": "x"}]}\n'
    (tmp_path / "p.jsonl").write_text(line * 2)
    with pytest.raises(ValueError, match="duplicate"):
        load_prompts(tmp_path)


def test_rounds_to_counts_and_first_difference() -> None:
    drafted, accepted, elig, acc = rounds_to_counts([(4, 4), (4, 1), (2, 0), (0, 0)])
    assert (drafted, accepted) == (10, 5)
    assert elig == [3, 3, 2, 2] and acc == [2, 1, 1, 1]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def _rec(decoder: str, repeat: int, tokens: int, time_s: float, **kw: object) -> RunRecord:
    return RunRecord(decoder, "p1", "code", repeat, 10, tokens, time_s, **kw)  # type: ignore[arg-type]


def test_summarize_pairs_speedups_per_repeat() -> None:
    records = [
        _rec("hf-target", 0, 10, 1.0, rounds=10, matches_baseline=True),
        _rec("hf-target", 1, 10, 2.0, rounds=10, matches_baseline=True),
        _rec("hf-target", 2, 10, 1.0, rounds=10, matches_baseline=True),
        _rec("hf-assisted", 0, 10, 0.5, rounds=4, drafted=16, accepted=6, pos_eligible=[4], pos_accepted=[3]),
        _rec("hf-assisted", 1, 10, 1.0, rounds=4, drafted=16, accepted=6, pos_eligible=[4], pos_accepted=[3]),
        _rec(
            "hf-assisted", 2, 10, 0.25, rounds=4, drafted=16, accepted=6, pos_eligible=[4], pos_accepted=[3]
        ),
    ]
    records[3].matches_baseline = False
    s = summarize(records, ["hf-target", "hf-assisted"], ["code"], "hf-target", "hf-assisted")
    m = s["hf-assisted"]["overall"]
    assert m["tokens_per_s"] == {"median": 20.0, "min": 10.0, "max": 40.0}
    # paired ratios per repeat: 20/10, 10/5, 40/10
    assert m["speedup_vs_hf_target"] == {"median": 2.0, "min": 2.0, "max": 4.0}
    assert m["tau"] == pytest.approx((18 + 12) / 12)
    assert m["acceptance_rate"] == pytest.approx(18 / 48)
    assert m["per_position_acceptance"] == [0.75]
    assert m["exact_match_rate"] == 0.0 and m["mismatched_prompts"] == ["p1"]  # judged on the first repeat
    assert s["hf-target"]["overall"]["exact_match_rate"] == 1.0
    assert s["hf-target"]["by_category"]["code"]["speedup_vs_hf_assisted"]["median"] == 0.5


def test_smoke_with_cuda_graphs_flag_stays_exact(tmp_path: Path) -> None:
    """``--cuda-graphs`` switches the engines to their static-shape path (eager on CPU): same tokens."""
    decoders = "hf-target,specsplit-target-only,specsplit-chain,specsplit-static"
    argv = ["bench", "--suite", "smoke", "--device", "cpu", "--cuda-graphs", "--repeats", "1"]
    assert main([*argv, "--decoders", decoders, "--tag", "graphs", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-smoke-graphs.json")
    result = json.loads(path.read_text())
    assert result["config"]["cuda_graphs"] is True and "--cuda-graphs" in result["command"]
    assert result["config"]["decoders"] == decoders.split(",")
    for name, entry in result["summary"].items():
        assert entry["overall"]["exact_match_rate"] == 1.0, name
    assert result["summary"]["specsplit-chain"]["overall"]["tau"] > 1.2


def test_prefill_graphs_flag_reaches_every_specsplit_engine(tmp_path: Path) -> None:
    """``--prefill-graphs`` (the default) reaches local engines and in-process gRPC workers, is
    recorded, keeps the tokens, and leaves decoders without CUDA graphs alone (it is part of the graph
    path); ``--no-prefill-graphs`` turns it off except in the ``-prefill`` twins (the A/B)."""
    from specsplit.bench.decoders import build_decoders, load_models

    m = load_models(tiny=True, device="cpu")
    decs, _ = build_decoders(m, ["specsplit-dynamic", "specsplit-chain"], BuildOptions(cuda_graphs=True))
    try:
        assert all(
            d.config.draft.tuning.prefill_graphs and d.config.target.tuning.prefill_graphs for d in decs
        )
        assert not any("eager prompt" in d.label for d in decs)
    finally:
        for d in decs:
            d.close()
    decs, _ = build_decoders(m, ["specsplit-dynamic"], BuildOptions(cuda_graphs=False))
    try:
        assert not decs[0].config.target.tuning.prefill_graphs and not decs[0].config.target.cuda_graphs
    finally:
        decs[0].close()
    # The -prefill decoders: the A/B side by side in one run, whatever the flag says.
    ab = [
        "specsplit-target-only",
        "specsplit-dynamic",
        "specsplit-target-only-prefill",
        "specsplit-dynamic-prefill",
    ]
    no_prefill = EngineTuning(prefill_graphs=False)
    decs, skipped = build_decoders(m, ab, BuildOptions(cuda_graphs=True, tuning=no_prefill))
    try:
        assert [d.name for d in decs] == ab and not skipped
        on = {
            d.name: (d.config.draft.tuning.prefill_graphs, d.config.target.tuning.prefill_graphs)
            for d in decs
        }
        assert on == {ab[0]: (False, False), ab[1]: (False, False), ab[2]: (True, True), ab[3]: (True, True)}
        assert [("eager prompt forwards" in d.label) for d in decs] == [True, True, False, False]
        assert decs[3].config.tree == decs[1].config.tree
    finally:
        for d in decs:
            d.close()
    decs, skipped = build_decoders(m, ["specsplit-dynamic-prefill"], BuildOptions(cuda_graphs=False))
    assert not decs and "--cuda-graphs" in skipped["specsplit-dynamic-prefill"]
    argv = ["bench", "--suite", "smoke", "--device", "cpu", "--cuda-graphs", "--repeats", "1"]
    decoders = "hf-target,specsplit-target-only,specsplit-dynamic,specsplit-grpc-targetloop-dynamic"
    assert main([*argv, "--decoders", decoders, "--tag", "prefill", "--out", str(tmp_path)]) == 0
    decoders = "hf-target,specsplit-dynamic,specsplit-dynamic-prefill"
    argv_ab = [*argv, "--no-prefill-graphs", "--decoders", decoders, "--tag", "prefill-ab"]
    assert main([*argv_ab, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-smoke-prefill-ab.json")
    ab = json.loads(path.read_text())
    assert ab["config"]["prefill_graphs"] is False and "--no-prefill-graphs" in ab["command"]
    assert "prefill_graphs" in ab["decoder_labels"][decoders.split(",")[-1]]
    for name, entry in ab["summary"].items():
        assert entry["overall"]["exact_match_rate"] == 1.0, name
    (path,) = tmp_path.glob("*-smoke-prefill.json")
    result = json.loads(path.read_text())
    assert result["config"]["prefill_graphs"] is True and "prefill-graphs" not in result["command"]
    for name, entry in result["summary"].items():
        assert entry["overall"]["exact_match_rate"] == 1.0, name
    # Same code both ways: the gRPC workers' padded prefills give the local rounds and acceptance.
    local, remote = (
        result["summary"][d]["overall"] for d in ("specsplit-dynamic", "specsplit-grpc-targetloop-dynamic")
    )
    assert local["rounds"] == remote["rounds"] and local["tau"] == remote["tau"]
    assert local["per_position_acceptance"] == remote["per_position_acceptance"]


def test_graph_rounds_reaches_draft_and_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--graph-rounds`` (the default) and ``--no-graph-rounds`` reach every SpecSplit engine, draft and
    target, local, in-process gRPC workers and the ``specsplit serve`` options of worker processes;
    the ``-levels`` row keeps its draft off either way. Same tokens, and recorded."""
    import specsplit.engines.draft
    import specsplit.engines.target
    from specsplit.bench.decoders import DECODERS, _plan, _worker_args, build_decoders, load_models
    from specsplit.cli.common import check_engine_flags
    from specsplit.cli.main import build_parser

    m = load_models(tiny=True, device="cpu")
    names = ["specsplit-target-only", "specsplit-dynamic", "specsplit-dynamic-levels-compiled"]
    for on in (True, False):
        opts = BuildOptions(cuda_graphs=True, tuning=EngineTuning(graph_rounds=on))
        decs, _ = build_decoders(m, names, opts)
        try:
            rounds = {
                d.name: (d.config.draft.tuning.graph_rounds, d.config.target.tuning.graph_rounds)
                for d in decs
            }
            assert rounds == {names[0]: (on, on), names[1]: (on, on), names[2]: (False, on)}
        finally:
            for d in decs:
                d.close()
        spec = DECODERS["specsplit-grpc-targetloop-dynamic"]
        plan = _plan(m, spec, opts, sync=False)
        flag = "--graph-rounds" if on else "--no-graph-rounds"
        for role, tuning in (("draft", plan.draft_tuning), ("target", plan.target_tuning)):
            args = _worker_args(m, plan, tuning)
            assert flag in args, role
            served = build_parser().parse_args(["serve", role, "--model", "x", *args])  # `serve` takes them
            check_engine_flags(served)
            assert served.graph_rounds is on and served.prefill_graphs is True, role
    seen: list[tuple[str, bool]] = []
    for module, cls in ((specsplit.engines.draft, "DraftEngine"), (specsplit.engines.target, "TargetEngine")):
        engine = getattr(module, cls)

        class Spy(engine):  # type: ignore[misc, valid-type]
            def __init__(self, model: object, config: object, *a: object, _cls: str = cls, **kw: object):
                seen.append((_cls, config.tuning.graph_rounds))  # type: ignore[attr-defined]
                super().__init__(model, config, *a, **kw)

        monkeypatch.setattr(module, cls, Spy)
    argv = ["bench", "--suite", "smoke", "--device", "cpu", "--cuda-graphs", "--no-graph-rounds"]
    decoders = "hf-target,specsplit-dynamic,specsplit-grpc-targetloop-dynamic"
    argv += ["--repeats", "1", "--grpc-workers", "thread", "--decoders", decoders]
    assert main([*argv, "--tag", "rounds", "--out", str(tmp_path)]) == 0
    assert sorted(set(seen)) == [("DraftEngine", False), ("TargetEngine", False)]  # the gRPC workers' engines
    (path,) = tmp_path.glob("*-smoke-rounds.json")
    result = json.loads(path.read_text())
    cfg = result["config"]
    assert cfg["graph_rounds"] is False and cfg["target_graph_rounds"] is False
    assert cfg["engine_tuning"]["graph_rounds"] is False
    assert "--no-graph-rounds" in result["command"] and "target-graph-rounds" not in result["command"]
    for name, entry in result["summary"].items():
        assert entry["overall"]["exact_match_rate"] == 1.0, name


def test_compiled_decoders_are_optional_and_configured(capsys: pytest.CaptureFixture[str]) -> None:
    """The ``-compiled`` decoders run only when named, with graphs + torch.compile on both engines."""
    from specsplit.bench.decoders import OPTIONAL_DECODERS, build_decoders, load_models

    assert not set(OPTIONAL_DECODERS) & set(DEFAULT_DECODERS)  # never in a default run (compiling is slow)
    m = load_models(tiny=True, device="cpu")
    opts = BuildOptions(tuning=EngineTuning(prefill_graphs=False))
    decs, skipped = build_decoders(m, ["specsplit-dynamic", *OPTIONAL_DECODERS], opts)
    try:
        plain_prefill = {"specsplit-target-only-prefill", "specsplit-dynamic-prefill"}  # need --cuda-graphs
        heads = {  # need --draft-heads / --eagle-heads
            n for n in OPTIONAL_DECODERS if n.startswith(("specsplit-heads", "specsplit-eagle"))
        }
        built = [n for n in OPTIONAL_DECODERS if n not in plain_prefill | heads]
        assert [d.name for d in decs] == ["specsplit-dynamic", *built] and set(
            skipped
        ) == plain_prefill | heads
        assert "torch.compile" not in decs[0].label and not decs[0].shape_warmup
        for d in decs[1:]:
            if not d.name.endswith(
                "-compiled"
            ):  # plain A/B pairs and drafters: graphs only with --cuda-graphs
                assert d.name.removesuffix("-unary").removesuffix("-noipc").removesuffix("-frspec") in (
                    "specsplit-grpc-dynamic",
                    "specsplit-grpc-targetloop-dynamic",
                    "specsplit-ngram",
                    "specsplit-suffix",
                    "specsplit-hybrid",
                    "specsplit-auto",
                    "specsplit-auto-chain",
                    "specsplit-chain",
                    "specsplit-dynamic",
                    "specsplit-lookahead",
                )
                assert "torch.compile" not in d.label and not d.shape_warmup
                # the restricted draft vocabulary's A/B: only the -frspec decoders' drafts get one
                assert (d.config.draft.vocab_subset == FRSPEC_VOCAB) == d.name.endswith("-frspec")
                assert d.config.grpc_loop == ("target" if "-targetloop-" in d.name else "client")
                assert d.config.tuning.grpc_streams == (not d.name.endswith("-unary"))  # the streams' A/B
                assert ("unary calls" in d.label) == d.name.endswith("-unary")
                assert ("no tree slots" in d.label) == d.name.endswith("-noipc")  # the tree slots' A/B
                continue
            assert d.shape_warmup  # a graph per KV bucket: warmed up on every prompt
            assert "fused by torch.compile" in d.label, d.label
            if d.config.transport == "grpc":  # the workers hold the engine configs
                assert d.name.startswith("specsplit-grpc-") and d.config.tree.shape == "dynamic"
                assert d.config.overlap == ("-overlap-" in d.name)
                assert d.config.grpc_loop == ("target" if "-targetloop-" in d.name else "client")
                continue
            assert d.config.draft.compile and d.config.target.compile
            assert d.config.draft.cuda_graphs and d.config.target.cuda_graphs
        assert not decs[0].config.draft.compile and not decs[0].config.target.cuda_graphs
        by_name = {d.name: d for d in decs}
        assert not by_name["specsplit-dynamic-levels-compiled"].config.draft.tuning.graph_rounds  # the A/B
        assert by_name["specsplit-dynamic-compiled"].config.draft.tuning.graph_rounds
        assert by_name["specsplit-overlap-dynamic-compiled"].config.overlap
        for name, d in by_name.items():  # the prefill A/B: padded prompts only in the -prefill twins
            assert d.config.transport == "grpc" or d.config.target.tuning.prefill_graphs == (
                "-prefill" in name
            ), name
        split = by_name["specsplit-split-dynamic-compiled"]
        assert not split.config.overlap and "sequential, draft on cpu" in split.label
    finally:
        for d in decs:
            d.close()
    assert (
        main(["bench", "--suite", "smoke", "--device", "cpu", "--decoders", "specsplit-dynamic-fused"]) == 2
    )
    err = capsys.readouterr().err
    assert "unknown decoders" in err and "specsplit-dynamic-compiled" in err


def test_grpc_decoder_runs_a_dynamic_tree_exactly() -> None:
    """The gRPC decoders take any tree shape (``specsplit-grpc-dynamic`` runs the dynamic tree over
    loopback workers) and stay exact; here eager, workers in-process. A spec outside the table (the
    overlapped row without torch.compile) builds the same way."""
    import dataclasses

    import torch

    from specsplit.bench.decoders import DECODERS, build_decoder, load_models

    m = load_models(tiny=True, device="cpu")
    opts = BuildOptions(dynamic_tree=(2, 2, 6, 3), grpc_workers="thread")
    dec = build_decoder(m, DECODERS["specsplit-grpc-dynamic"], opts)
    assert not isinstance(dec, str), dec
    try:
        assert dec.name == "specsplit-grpc-dynamic" and "dynamic tree (top-2, width 2, budget 6" in dec.label
        assert "both workers in-process" in dec.label
        ids = torch.tensor([[3, 14, 15, 92, 65]])
        ref = m.target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 5:].tolist()
        out = dec.run(ids, 12)
        assert out.tokens == ref[: len(out.tokens)] and len(out.tokens) >= 1
        assert max(d for d, _ in out.rounds) == 3  # dynamic rounds of depth 3, not a chain of K
    finally:
        dec.close()
    m.use_overlap_device("cpu")  # the overlapped variant: its own draft copy, speculation on
    label = "SpecSplit {tree} over gRPC, overlapped pipeline (draft worker on {draft_device}, target worker on {device})"
    spec = dataclasses.replace(
        DECODERS["specsplit-grpc-overlap-dynamic-compiled"], name="x", label=label, compile=False
    )
    dec = build_decoder(m, spec, opts)
    assert not isinstance(dec, str), dec
    try:
        assert "overlapped pipeline (draft worker on cpu" in dec.label and dec.config.overlap
        assert not dec.shape_warmup and "torch.compile" not in dec.label
        out = dec.run(ids, 12)
        assert out.tokens == ref[: len(out.tokens)] and len(out.tokens) >= 1
        assert out.split_s is not None and out.split_s["spec_rounds"] >= 1  # it did speculate
    finally:
        dec.close()
    # the rounds run by the target worker (it calls the draft worker itself): same tokens and rounds
    dec = build_decoder(m, DECODERS["specsplit-grpc-targetloop-dynamic"], opts)
    assert not isinstance(dec, str), dec
    try:
        assert dec.config.grpc_loop == "target" and not dec.config.overlap
        out = dec.run(ids, 12)
        assert out.tokens == ref[: len(out.tokens)] and len(out.tokens) >= 1
        assert max(d for d, _ in out.rounds) == 3
    finally:
        dec.close()


def test_warmup_covers_every_prompt_for_shape_capturing_decoders() -> None:
    """A decoder that captures a graph per KV bucket is warmed up on every prompt (full length), so
    no capture or compile lands in a timed call; the others get one short warm-up."""
    import torch

    from specsplit.bench.decoders import DecodeOutput, Decoder
    from specsplit.bench.run import BenchPrompt, _measure

    calls: dict[str, list[tuple[int, int]]] = {"graphs": [], "eager": []}

    def make(name: str) -> Decoder:
        def run(ids: torch.Tensor, max_new: int) -> DecodeOutput:
            calls[name].append((ids.shape[1], max_new))
            return DecodeOutput([1] * max_new, [], {})

        return Decoder(name, name, run, shape_warmup=name == "graphs")

    prompts = [BenchPrompt(id=f"p{i}", category="qa", messages=[], input_ids=list(range(n)))
               for i, n in enumerate((40, 300, 900))]  # fmt: skip
    _measure([make("graphs"), make("eager")], prompts, repeats=1, max_new=8, devices=["cpu"])
    assert calls["graphs"][:3] == [(40, 8), (300, 8), (900, 8)]  # warm-up: every prompt, full length
    assert calls["eager"][0] == (16, 6)  # one short warm-up
    assert len(calls["graphs"]) == 6 and len(calls["eager"]) == 4  # + the timed repeat


@pytest.mark.large  # Inductor compiles C++ kernels on CPU: minutes on 2 cores
def test_smoke_compiled_decoders_stay_exact(tmp_path: Path) -> None:
    decoders = "hf-target,specsplit-target-only-compiled,specsplit-dynamic-compiled"
    argv = ["bench", "--suite", "smoke", "--device", "cpu", "--repeats", "1", "--decoders", decoders]
    assert main([*argv, "--tag", "compiled", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-smoke-compiled.json")
    result = json.loads(path.read_text())
    for name, entry in result["summary"].items():
        assert entry["overall"]["exact_match_rate"] == 1.0, name
    assert result["summary"]["specsplit-dynamic-compiled"]["overall"]["tau"] > 1.2


def test_dynamic_tree_option_sets_the_dynamic_decoders(capsys: pytest.CaptureFixture[str]) -> None:
    from specsplit.bench.decoders import build_decoders, load_models

    m = load_models(tiny=True, device="cpu")
    decs, _ = build_decoders(
        m, ["specsplit-chain", "specsplit-dynamic"], BuildOptions(k=3, dynamic_tree=(2, 3, 9, 5))
    )
    try:
        chain, dyn = decs
        t = dyn.config.tree
        assert (t.shape, t.topk, t.width, t.budget, t.max_depth) == ("dynamic", 2, 3, 9, 5)
        assert "top-2, width 3, budget 9, depth 5" in dyn.label
        assert (chain.config.tree.shape, chain.config.tree.num_draft_tokens) == ("chain", 3)
    finally:
        for d in decs:
            d.close()
    assert main(["bench", "--suite", "smoke", "--dynamic-tree", "2,3"]) != 0
    assert "TOPK,WIDTH,BUDGET,DEPTH" in capsys.readouterr().err


def test_fuse_projections_runs_fused_copies_for_specsplit_only(tmp_path: Path) -> None:
    """``--fuse-projections``: SpecSplit decoders (local and in-process gRPC workers) run fused copies of
    the models, the HF decoders the untouched originals; tokens stay exact and the flag is recorded."""
    import torch

    from specsplit.bench.decoders import build_decoders, load_models

    def fused(model: torch.nn.Module) -> int:
        return sum(getattr(mod, "_specsplit_fused", False) for mod in model.modules())

    m = load_models(tiny=True, device="cpu")
    assert m.specsplit_target is m.target and m.specsplit_draft is m.draft
    assert m.use_fused_projections() == 8  # 2 layers x (attention + MLP) x 2 models
    assert m.use_fused_projections() == 0  # once
    assert fused(m.target) == fused(m.draft) == 0  # the baseline keeps transformers' own layers
    assert fused(m.specsplit_target) == fused(m.specsplit_draft) == 4
    calls = {"target": 0, "draft": 0}
    for role, model in (("target", m.specsplit_target), ("draft", m.specsplit_draft)):
        mlp = model.model.layers[0].mlp
        inner = mlp.forward

        def counted(*a: object, _inner=inner, _role=role, **kw: object) -> torch.Tensor:
            calls[_role] += 1
            return _inner(*a, **kw)

        mlp.forward = counted
    names = ["hf-target", "specsplit-dynamic", "specsplit-grpc-targetloop-dynamic"]
    decs, skipped = build_decoders(m, names, BuildOptions(cuda_graphs=True, grpc_workers="thread"))
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    try:
        assert [d.name for d in decs] == names and not skipped
        assert ["fused q/k/v" in d.label for d in decs] == [False, True, True]
        ref = decs[0].run(ids, 12).tokens
        assert calls == {"target": 0, "draft": 0}  # HF generate() ran the unfused original
        for d in decs[1:]:
            before = dict(calls)
            assert d.run(ids, 12).tokens == ref, d.name
            assert calls["target"] > before["target"] and calls["draft"] > before["draft"], d.name
    finally:
        for d in decs:
            d.close()
    argv = ["bench", "--suite", "smoke", "--device", "cpu", "--cuda-graphs", "--repeats", "1"]
    decoders = "hf-target,specsplit-target-only,specsplit-dynamic"
    argv += ["--fuse-projections", "--decoders", decoders, "--tag", "fused", "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("*-smoke-fused.json")
    result = json.loads(path.read_text())
    assert result["config"]["fuse_projections"] is True and "--fuse-projections" in result["command"]
    for name, entry in result["summary"].items():
        assert entry["overall"]["exact_match_rate"] == 1.0, name


# Every decoder name scripts and committed results use, in run order: the table must keep them all.
_DEFAULT_NAMES = (
    "hf-target", "hf-assisted", "hf-assisted-default", "hf-prompt-lookup", "specsplit-target-only",
    "specsplit-chain", "specsplit-static", "specsplit-dynamic", "specsplit-overlap-chain",
    "specsplit-overlap-dynamic", "specsplit-grpc",
)  # fmt: skip
_OPTIONAL_NAMES = (
    "specsplit-target-only-compiled", "specsplit-dynamic-compiled", "specsplit-dynamic-levels-compiled",
    "specsplit-overlap-dynamic-compiled", "specsplit-split-dynamic-compiled", "specsplit-grpc-dynamic-compiled",
    "specsplit-grpc-overlap-dynamic-compiled", "specsplit-grpc-targetloop-dynamic-compiled",
    "specsplit-grpc-targetloop-overlap-dynamic-compiled", "specsplit-grpc-dynamic",
    "specsplit-grpc-targetloop-dynamic", "specsplit-grpc-dynamic-unary", "specsplit-grpc-targetloop-dynamic-unary",
    "specsplit-grpc-targetloop-dynamic-noipc", "specsplit-target-only-prefill", "specsplit-dynamic-prefill",
    "specsplit-target-only-prefill-compiled", "specsplit-dynamic-prefill-compiled",
    "specsplit-ngram", "specsplit-ngram-compiled", "specsplit-suffix", "specsplit-suffix-compiled",
    "specsplit-hybrid", "specsplit-hybrid-compiled", "specsplit-auto", "specsplit-auto-compiled",
    "specsplit-lookahead", "specsplit-lookahead-compiled", "specsplit-lookahead-always-compiled",
    "specsplit-heads", "specsplit-heads-always-compiled", "specsplit-heads-lookahead-always-compiled",
    "specsplit-eagle-always", "specsplit-eagle-always-compiled", "specsplit-eagle-lookahead-always-compiled",
    "specsplit-eagle-always-adaptive-compiled", "specsplit-eagle-lookahead-always-adaptive-compiled",
    "specsplit-auto-lookahead-compiled", "specsplit-auto-chain", "specsplit-auto-chain-compiled",
    "specsplit-auto-chain-lookahead-compiled", "specsplit-auto-chain-lookahead-always-compiled",
    "specsplit-chain-frspec", "specsplit-dynamic-frspec", "specsplit-auto-frspec", "specsplit-dynamic-frspec-compiled",
)  # fmt: skip


def test_decoder_table_covers_every_name_and_its_labels_match_its_fields() -> None:
    """One row per decoder name, defaults first; a row's label says what its fields set."""
    from specsplit.bench.decoder_specs import _TABLE, DECODERS, OPTIONAL_DECODERS

    assert len(DECODERS) == len(_TABLE)  # no name twice
    assert tuple(DECODERS) == _DEFAULT_NAMES + _OPTIONAL_NAMES
    assert DEFAULT_DECODERS == _DEFAULT_NAMES and OPTIONAL_DECODERS == _OPTIONAL_NAMES
    for name, spec in DECODERS.items():
        assert spec.name == name
        assert spec.drafter == next(
            (d for d in ("ngram", "suffix", "hybrid", "auto") if f"-{d}" in name),
            "ngram" if "-lookahead" in name or "-heads" in name or "-eagle" in name else "model",
        )
        assert (spec.kind == "hf") == name.startswith("hf-")
        if spec.kind == "hf":
            continue
        label = spec.label
        assert ("over gRPC" in label) == spec.grpc == name.startswith("specsplit-grpc"), name
        assert (
            ("run by the target worker" in label)
            == (spec.transport == "grpc-target")
            == ("-targetloop" in name)
        )
        assert ("overlapped pipeline" in label) == spec.overlap == ("-overlap-" in name), name
        assert (spec.draft_placement == "overlap-device") == ("-overlap-" in name or "-split-" in name), name
        assert ("fused by torch.compile" in label) == spec.compile == name.endswith("-compiled"), name
        assert ("(prefill_graphs)" in label) == bool(spec.prefill_graphs) == ("-prefill" in name), name
        assert (
            ("one graph per tree level" in label) == (spec.draft_graph_rounds is False) == ("-levels" in name)
        )
        assert ("unary calls" in label) == (spec.grpc_streams is False) == name.endswith("-unary"), name
        assert ("no tree slots" in label) == (not spec.tree_ipc) == name.endswith("-noipc"), name
        assert ("without a draft" in label) == spec.target_only == ("target-only" in name), name
        assert ("(FR-Spec)" in label) == spec.draft_vocab == ("-frspec" in name), name
        assert ("lookahead window" in label) == bool(spec.lookahead) == ("-lookahead" in name), name
        always = "always" in (spec.lookahead, spec.heads)
        assert ("in every n-gram round" in label) == always == ("-always" in name), name
        assert ("draft heads" in label) == (bool(spec.heads) and not spec.eagle) == ("-heads" in name), name
        assert ("EAGLE head" in label) == spec.eagle == ("-eagle" in name), name
        assert ("grown where it pays" in label) == (spec.guesses == "adaptive") == ("-adaptive" in name), name
        model_tree = (
            "dynamic" if spec.drafter in ("hybrid", "auto") else "chain"
        )  # drafters: the dynamic tree
        named = next((t for t in ("static", "dynamic", "chain") if t in name), model_tree)
        assert spec.tree == named, name


def test_spec_fields_drive_the_built_config() -> None:
    """Every local SpecSplit row builds the config its fields say, over the run's flags; e.g.
    ``specsplit-dynamic-levels-compiled``: CUDA graphs and torch.compile on, the draft's graph rounds off."""
    from specsplit.bench.decoders import DECODERS, build_decoders, load_models

    m = load_models(tiny=True, device="cpu")
    m.use_overlap_device("cpu")
    local = [n for n, s in DECODERS.items() if s.kind == "specsplit" and not s.grpc]
    decs, skipped = build_decoders(m, local, BuildOptions(k=3))
    try:
        heads = {n for n in local if n.startswith(("specsplit-heads", "specsplit-eagle"))}  # need heads
        assert set(skipped) == {"specsplit-target-only-prefill", "specsplit-dynamic-prefill"} | heads
        for d in decs:
            spec, cfg = DECODERS[d.name], d.config
            assert cfg.draft.compile == cfg.target.compile == spec.compile, d.name
            assert cfg.draft.cuda_graphs == cfg.target.cuda_graphs == spec.compile, d.name
            assert d.shape_warmup == spec.compile, d.name
            assert cfg.overlap == spec.overlap and cfg.tree.shape == spec.tree, d.name
            assert cfg.target.tuning.graph_rounds, d.name
            assert cfg.draft.tuning.graph_rounds == (spec.draft_graph_rounds is not False), d.name
            assert cfg.target.tuning.prefill_graphs == spec.compile, d.name  # on with graphs (the default)
            ngram = cfg.tuning.ngram  # the run's lookahead window (--lookahead) on the -lookahead rows only
            window = (ngram.lookahead, ngram.lookahead_levels, ngram.lookahead_nodes)
            default = (DEFAULT_LOOKAHEAD, DEFAULT_LOOKAHEAD_LEVELS, DEFAULT_LOOKAHEAD_NODES)
            assert window == (default if spec.lookahead else (0, *default[1:])), d.name
            assert not spec.lookahead or ngram.lookahead_policy == spec.lookahead, d.name
        levels = next(d for d in decs if d.name == "specsplit-dynamic-levels-compiled").config
        assert levels.draft.compile and levels.draft.cuda_graphs and not levels.draft.tuning.graph_rounds
        assert levels.target.tuning.graph_rounds
    finally:
        for d in decs:
            d.close()


def test_decoder_spec_validates_its_fields_and_the_drafter_reaches_the_config() -> None:
    """Misspelt fields fail when the table is built; a new drafter is one row: the spec's ``drafter``
    reaches ``SpecSplitConfig.drafter`` (local decoders; over gRPC it is refused with a clear error)."""
    import dataclasses

    import torch

    from specsplit.bench.decoders import DECODERS, DecoderSpec, build_decoder, load_models

    with pytest.raises(ValueError, match="transport"):
        DecoderSpec("x", "x", transport="grpc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drafter"):
        DecoderSpec("x", "x", drafter="markov")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hf_mode"):
        DecoderSpec("hf-x", "x", kind="hf")
    m = load_models(tiny=True, device="cpu")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 14, 15, 92]])
    ref: list[int] | None = None
    for drafter, uses_model in (("ngram", False), ("suffix", False), ("hybrid", True), ("auto", True)):
        spec = DecoderSpec(
            f"specsplit-{drafter}", f"SpecSplit local, {drafter} drafter, {{tree}}", drafter=drafter
        )
        assert spec.uses_draft_model == uses_model and spec.needs_draft == (drafter == "hybrid")
        dec = build_decoder(m, spec, BuildOptions())
        assert not isinstance(dec, str), dec
        try:
            assert dec.config.drafter == drafter and f"{drafter} drafter, chain of K=4" in dec.label
            ref = (
                ref
                or m.target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 10:].tolist()
            )
            out = dec.run(ids, 12)
            assert out.tokens == ref[: len(out.tokens)] and len(out.tokens) >= 1, drafter
        finally:
            dec.close()
    grpc_ngram = dataclasses.replace(
        DECODERS["specsplit-grpc-dynamic"], name="specsplit-grpc-ngram", drafter="ngram"
    )
    with pytest.raises(ValueError, match="drafter 'ngram' over gRPC is not built yet"):
        build_decoder(m, grpc_ngram, BuildOptions(grpc_workers="thread"))


def test_command_line_spells_the_shared_flag_names() -> None:
    """The recorded command uses the names every command shares and parses back to the same run."""
    import shlex

    from specsplit.bench.cli import _command_line, _options
    from specsplit.cli.main import build_parser

    argv = ["bench", "--suite", "smoke", "--cuda-graphs", "--no-graph-rounds", "--no-prefill-graphs",
            "--no-fold-gqa", "--attention-kernel", "math", "--q-top-k", "8", "--no-grpc-streams",
            "--overlap-policy", "always", "--sync-timing", "--fuse-projections"]  # fmt: skip
    args = build_parser().parse_args(argv)
    line = _command_line(args, "cpu")
    for flag in argv[3:]:
        assert flag in shlex.split(line), flag
    again = build_parser().parse_args(shlex.split(line)[1:])
    assert vars(again) == vars(args) | {"device": "cpu", "dtype": "auto"}
    opts = _options(args, "cpu")
    assert (opts.tuning.graph_rounds, opts.tuning.prefill_graphs, opts.tuning.fold_gqa) == (
        False,
        False,
        False,
    )
    assert (opts.tuning.attention_kernel, opts.tuning.q_top_k) == ("math", 8)
    assert (opts.pipeline.grpc_streams, opts.pipeline.overlap_policy, opts.pipeline.sync_timing) == (
        False,
        "always",
        True,
    )
    default = _options(build_parser().parse_args(["bench"]), "cpu")
    assert default.tuning == EngineTuning() and default.build_options().tuning == EngineTuning()
    assert "graph-rounds" not in _command_line(build_parser().parse_args(["bench"]), "cpu")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--no-target-graph-rounds"])  # renamed: --no-graph-rounds


def test_batch_and_client_benches_write_their_reports(tmp_path: Path) -> None:
    """``--batch-size`` and ``--concurrent-clients`` on the tiny models: every decoder at every size,
    rows checked against batch 1, clients of batching workers (a draft worker too for the client
    loop), JSON + table written."""
    out = tmp_path / "r"
    base = [
        "bench",
        "--suite",
        "smoke",
        "--device",
        "cpu",
        "--max-new-tokens",
        "6",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    assert main([*base, "--batch-size", "1,2"]) == 0
    batch = json.loads(next(out.glob("batch-*.json")).read_text())
    assert batch["config"]["mode"] == "batch"
    got = {(c["decoder"], c["batch"]) for c in batch["cells"]}
    assert got == {(d, b) for d in ("hf-batch", "specsplit-plain", "specsplit-ngram") for b in (1, 2)}
    assert all(c["tok_s"] > 0 for c in batch["cells"])
    clients = ["--concurrent-clients", "1,3", "--grpc-workers", "thread",
               "--decoders", "grpc-plain,grpc-ngram,grpc-model-clientloop,grpc-model-targetloop"]  # fmt: skip
    assert main([*base, *clients]) == 0
    res = json.loads(next(out.glob("clients-*.json")).read_text())
    assert res["config"]["mode"] == "concurrent-clients"
    cells = {(c["decoder"], c["batch"]): c for c in res["cells"]}
    assert set(cells) == {
        (d, n)
        for d in ("grpc-plain", "grpc-ngram", "grpc-model-clientloop", "grpc-model-targetloop")
        for n in (1, 3)
    }
    assert all(c["tokens"] > 0 and c["client_tok_s_min"] > 0 for c in cells.values())
    for c in cells.values():  # the same prompts one at a time: their time alone over this run's wall
        alone_s = sum(r["tokens"] / (r["tok_s"] / r["vs_alone"]) for r in c["clients"])
        assert c["x_alone"] == pytest.approx(alone_s / c["wall_s"], rel=1e-6)
    # each client against its own prompt decoded alone
    assert all(0 < c["client_vs_alone_min"] <= c["client_vs_alone_p50"] <= c["client_vs_alone_max"]
               for c in cells.values())  # fmt: skip
    for c in cells.values():  # one record per client, naming its prompt; the extremes come from them
        assert len(c["clients"]) == c["batch"] and all(r["prompt_id"] for r in c["clients"])
        assert min(r["vs_alone"] for r in c["clients"]) == c["client_vs_alone_min"]
        assert min(r["tok_s"] for r in c["clients"]) == c["client_tok_s_min"]
        # the first new tokens arrive within the generation, the slowest first one is the max
        assert all(0 < r["first_token_ms"] <= 1e3 * r["tokens"] / r["tok_s"] for r in c["clients"])
        assert max(r["first_token_ms"] for r in c["clients"]) == c["first_token_ms_max"]
    report = next(out.glob("clients-*.md")).read_text()
    assert report.count("grpc-model-clientloop") >= 2 and "- 3 clients, grpc-plain: " in report
    three = cells[("grpc-plain", 3)]
    row = next(line for line in report.splitlines() if line.startswith("| 3 | grpc-plain |"))
    assert f"| {three['x_alone']:.2f} |" in row
    assert f"| {three['client_tok_s_max'] / three['client_tok_s_min']:.2f} (" in row


def test_client_processes_generate_what_client_threads_generate(tmp_path: Path) -> None:
    """``--client-processes``: each client a spawned process with its own generator, started together
    by a barrier; greedy clients make the same tokens as client threads do, and close() ends them."""
    from specsplit import SpecSplitConfig
    from specsplit.bench.batch import BatchBenchOptions, _ClientProcesses, _ClientThreads, _ClientWorkers
    from specsplit.bench.models import load_models
    from specsplit.bench.run import smoke_prompts

    m = load_models(True, "cpu", None, None, None, "auto", with_draft=False)
    opts = BatchBenchOptions(clients=(2,), tiny=True, workers="thread", client_processes=True)
    workers = _ClientWorkers(m, opts, 2, 256)
    rows = smoke_prompts()[:2]
    cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", target_address=workers.addresses[0],
                          drafter="ngram", timeout_s=120.0)  # fmt: skip
    try:
        threads = _ClientThreads(2, cfg, m.tokenizer)
        try:
            _, by_threads = threads.once(rows, m, 8)
        finally:
            threads.close()
        procs = _ClientProcesses(2, cfg)
        try:
            wall, by_processes = procs.once(rows, m, 8)
            _, again = procs.once(rows, m, 8)
        finally:
            procs.close()
    finally:
        workers.close()
    assert [c.tokens for c in by_processes] == [c.tokens for c in by_threads] == [c.tokens for c in again]
    assert all(c.tokens > 0 and 0 < c.first_s <= c.seconds <= wall for c in by_processes) and wall < 120
    assert not any(p.is_alive() for p in procs.procs)


def test_client_and_batch_benches_load_the_draft_named_by_draft(monkeypatch) -> None:
    """``--draft`` reaches the concurrent-client bench's model loading (a non-default ``--target``
    needs it: the draft worker's decoders load both models)."""
    from specsplit.bench import batch

    seen = {}

    class Loaded(Exception):
        pass

    def fake_load(tiny, device, draft_device, target_name, draft_name, dtype_name="auto", with_draft=True):
        seen.update(target=target_name, draft=draft_name, with_draft=with_draft)
        raise Loaded

    monkeypatch.setattr(batch, "load_models", fake_load)
    with pytest.raises(Loaded):
        main(["bench", "--concurrent-clients", "2", "--target", "/models/t", "--draft", "/models/d",
              "--decoders", "grpc-model-targetloop", "--device", "cpu"])  # fmt: skip
    assert seen == {"target": "/models/t", "draft": "/models/d", "with_draft": True}


def test_plot_bars_are_ratios_to_our_target_only_decode_in_a_run_without_hf() -> None:
    """A GPU run of SpecSplit decoders alone plots tokens/s over its target-only decoder (its bars were
    empty before); a run with HF ``generate()`` keeps the speedups over HF."""
    from specsplit.bench.report import speedup_bars

    summary = {
        "specsplit-target-only-compiled": {
            "overall": {"tokens_per_s": {"median": 400.0}},
            "by_category": {"chat": {"tokens_per_s": {"median": 500.0}}},
        },
        "specsplit-ngram-compiled": {
            "overall": {"tokens_per_s": {"median": 600.0}},
            "by_category": {"chat": {"tokens_per_s": {"median": 550.0}}},
        },
    }
    decs, cats = list(summary), ["chat", "code", "all"]
    label, bars = speedup_bars(summary, decs, cats)
    assert "specsplit-target-only-compiled" in label
    assert bars["specsplit-target-only-compiled"] == [1.0, 0.0, 1.0]
    assert bars["specsplit-ngram-compiled"] == pytest.approx([1.1, 0.0, 1.5])
    with_hf = {k: {s: {**v, "speedup_vs_hf_target": {"median": 2.0}} for s, v in d.items() if s == "overall"}
               | {"by_category": {}} for k, d in summary.items()}  # fmt: skip
    with_hf["hf-target"] = {"overall": {}, "by_category": {}}
    label, bars = speedup_bars(with_hf, decs, ["all"])
    assert "HF generate()" in label and bars["specsplit-ngram-compiled"] == [2.0]


def test_heads_decoders_run_the_targets_draft_heads_on_a_copy(tmp_path) -> None:
    """``--draft-heads``: the -heads decoders' target runs the heads (on a copy of the model, so the
    other decoders' target keeps its own output layer) and commits target-only's tokens."""
    import torch

    from specsplit.bench.decoders import build_decoders, load_models
    from specsplit.runtime.heads import DraftHeads, HeadsInfo, HiddenTap, save_heads

    m = load_models(tiny=True, device="cpu")
    w = m.specsplit_target.get_output_embeddings().weight
    acc = [[0.4, 0.2], [0.3, 0.1]]
    path = save_heads(
        DraftHeads(2, w.shape[1]), HeadsInfo(2, w.shape[1], w.shape[0], rank_accuracy=acc), tmp_path
    )
    opts = BuildOptions(draft_heads=str(path), heads_nodes=4)
    decs, skipped = build_decoders(m, ["specsplit-target-only", "specsplit-heads"], opts)
    try:
        assert not skipped and [d.name for d in decs] == ["specsplit-target-only", "specsplit-heads"]
        assert decs[1].config.target.draft_heads == str(path) and decs[1].config.target.draft_heads_nodes == 4
        assert decs[1].config.tuning.ngram.lookahead == 0  # guesses without a window
        ids = torch.tensor([[5, 17, 33, 81, 9, 100, 5, 17]])
        ref, got = decs[0].run(ids, 24), decs[1].run(ids, 24)
        assert got.tokens == ref.tokens
        assert not isinstance(m.specsplit_target.get_output_embeddings(), HiddenTap)
    finally:
        for d in decs:
            d.close()


def test_eagle_decoders_run_an_eagle_head_on_their_own_copy(tmp_path) -> None:
    """``--eagle-heads``: the -eagle decoders' target runs the EAGLE head on its own copy of the model
    (beside the -heads decoders' copy), its guesses land in the rounds, and the tokens are
    target-only's; without the flag they are skipped."""
    import torch

    from specsplit.bench.decoders import build_decoders, load_models
    from specsplit.runtime.eagle import EagleConfig, EagleLayer, FeatureTap, save_eagle
    from specsplit.runtime.heads import HeadsInfo

    m = load_models(tiny=True, device="cpu")
    model = m.specsplit_target
    w = model.get_output_embeddings().weight
    layer = EagleLayer(EagleConfig.for_target(model, topk=4, width=2, depth=3))
    layer.warm_start(model)
    path = save_eagle(layer, torch.arange(w.shape[0]), HeadsInfo(3, w.shape[1], w.shape[0]), tmp_path)
    names = ["specsplit-target-only", "specsplit-eagle-always-compiled"]
    assert build_decoders(m, names, BuildOptions())[1] == {
        "specsplit-eagle-always-compiled": "no EAGLE head (--eagle-heads DIR, trained with `specsplit heads "
        "train --kind eagle`)"
    }
    decs, skipped = build_decoders(m, ["specsplit-target-only", "specsplit-eagle-always-compiled"],
                                   BuildOptions(eagle_heads=str(path), heads_nodes=6))  # fmt: skip
    try:
        assert not skipped and decs[1].config.target.draft_heads == str(path)
        assert "EAGLE head's tree (6 nodes)" in decs[1].label
        ids = torch.tensor([[5, 17, 33, 81, 9, 100, 5, 17]])
        ref, got = decs[0].run(ids, 24), decs[1].run(ids, 24)
        assert got.tokens == ref.tokens
        assert isinstance(m.heads_target(eagle=True).get_decoder().norm, FeatureTap)
        assert not isinstance(model.get_decoder().norm, FeatureTap)
        assert m.heads_target(eagle=True) is not m.heads_target()
    finally:
        for d in decs:
            d.close()


def test_the_adaptive_eagle_decoders_grow_guesses_where_they_pay() -> None:
    from specsplit.bench.decoders import DECODERS, _ngram_settings

    opts = BuildOptions(k=3)
    for name in (
        "specsplit-eagle-always-adaptive-compiled",
        "specsplit-eagle-lookahead-always-adaptive-compiled",
    ):
        assert _ngram_settings(opts, DECODERS[name]).guess_policy == "adaptive", name
    assert (
        _ngram_settings(opts, DECODERS["specsplit-eagle-lookahead-always-compiled"]).guess_policy == "always"
    )
