"""benchmarks/grpc_round_trace.py: joining the two workers' spans into a round's segments (the trace
itself needs real workers on a GPU to mean anything; ``test_gpu.py`` runs its hooks' code paths)."""

from __future__ import annotations

import pytest
from conftest import load_benchmark

US = 1000  # ns


def _trace():
    return load_benchmark("grpc_round_trace")


def _prompt(base: int, rounds: int) -> tuple[list, list, int]:
    """Spans of one prompt's rounds, with known gaps (microseconds)."""
    t, d = [], []
    ds = base
    ve = base
    for _ in range(rounds):
        cs = ds + 50 * US
        hs = cs + 700 * US
        he = hs + 16700 * US
        d += [
            ("d.handler", hs, he),
            ("d.req_decode", hs + 10 * US, hs + 50 * US),
            ("d.engine", hs + 60 * US, hs + 1560 * US),
            ("d.encode", hs + 1600 * US, hs + 16600 * US),
        ]
        ce = he + 500 * US
        de = ce + 230 * US
        vs = de + 40 * US
        ve = vs + 5500 * US
        t += [
            ("t.draft", ds, de),
            ("t.call", cs, ce),
            ("t.tree_decode", ce + 10 * US, ce + 210 * US),
            ("t.verify", vs, ve),
            ("t.validate", vs + 5 * US, vs + 305 * US),
            ("t.round", vs + 400 * US, vs + 5400 * US),
            ("t.sync", vs + 700 * US, vs + 5300 * US),
        ]
        ds = ve + 400 * US
    return t, d, ve


def test_analyze_joins_both_workers_spans():
    tr = _trace()
    t1, d1, end1 = _prompt(10**9, 4)
    t2, d2, end2 = _prompt(end1 + 100_000 * US, 4)  # the next prompt starts 100 ms later
    target = {"spans": t1 + t2, "gpu_ms": [("t.gpu", 5.0)] * 8}
    draft = {"spans": d1 + d2, "gpu_ms": [("d.gpu", 16.0)] * 8}
    res = tr.analyze(target, draft, 0, end2 + 1)
    assert res["rounds"] == 6 and res["skipped"] == 2  # each prompt's last round has no next draft call
    med = res["median_ms"]
    expect = {
        "round": 24.12,
        "call -> draft handler starts": 0.7,
        "d: decode the request": 0.05,
        "d: engine (host: checks, ingest, grow launches)": 1.5,
        "d: encode the tree (waits for the GPU)": 15.0,
        "draft handler returns -> call returns": 0.5,
        "t: decode the tree": 0.2,
        "t: rest of the draft call": 0.03,
        "t: loop between draft and verify (+ the last round's update, deferred)": 0.04,
        "t: validate the tree": 0.3,
        "t: verify before the round graph": 0.1,
        "t: round graph launch (host)": 0.3,
        "t: wait for the GPU + read the result": 4.6,
        "t: verify after the read": 0.2,
        "t: loop glue to the next draft call (+ the update, not deferred)": 0.4,
    }
    for k, v in expect.items():
        assert med[k] == pytest.approx(v, abs=1e-9), k
    # the segments tile the round exactly
    parts = sum(v for k, v in res["mean_ms"].items() if k != "round")
    assert parts == pytest.approx(res["mean_ms"]["round"], abs=1e-6)
    assert res["gpu_span_ms"] == {"t.gpu": 5.0, "d.gpu": 16.0}


def test_per_prompt_splits_the_wall_time():
    tr = _trace()
    t1, _, end1 = _prompt(10**9, 4)
    t2, _, end2 = _prompt(end1 + 100_000 * US, 4)
    spans = tr._spans_by_name({"spans": t1 + t2}, 0, end2 + 1)
    rows = [
        {"start_ns": 10**9 - 1000 * US, "end_ns": end1 + 2000 * US},
        {"start_ns": end1 + 100_000 * US - 1000 * US, "end_ns": end2 + 2000 * US},
    ]
    out = tr.per_prompt(rows, spans["t.draft"], spans["t.verify"])
    assert out["steady round"]["n"] == 4 and out["steady round"]["median"] == pytest.approx(24.12)
    assert out["setup: client call to first draft call"]["median"] == pytest.approx(1.0)
    assert out["first round (prefill)"]["median"] == pytest.approx(24.12)
    assert out["first round: draft call"]["median"] == pytest.approx(18.18)  # 50 + 700 + 16700 + 500 + 230 us
    assert out["first round: verify call"]["median"] == pytest.approx(5.5)
    assert out["last round"]["median"] == pytest.approx(23.72)
    assert out["teardown: last verify to client return"]["median"] == pytest.approx(2.0)
    wall = (end1 + 2000 * US - (10**9 - 1000 * US)) * 1e-6
    assert out["outside the steady rounds"]["median"] == pytest.approx(wall - 2 * 24.12)


def test_recorder_wraps_and_keeps_results_and_errors(tmp_path):
    tr = _trace()
    rec = tr._Recorder(str(tmp_path / "trace.json"))

    class Thing:
        def ok(self, x):
            return x + 1

        def bad(self):
            raise ValueError("boom")

    rec.wrap(Thing, "ok", "ok")
    rec.wrap(Thing, "bad", "bad")
    assert Thing().ok(1) == 2
    with pytest.raises(ValueError, match="boom"):
        Thing().bad()
    assert [n for n, _, _ in rec.spans] == ["ok", "bad"]
    assert all(e >= s for _, s, e in rec.spans)
    rec.dump()
    assert (tmp_path / "trace.json").read_text().startswith('{"spans"')
