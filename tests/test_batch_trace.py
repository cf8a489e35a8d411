"""benchmarks/batch_trace.py: joining a batching worker's steps with each client's own clock (the
trace itself needs a GPU worker to mean anything; this checks the joining on known events)."""

from __future__ import annotations

from conftest import load_benchmark

MS = 1_000_000  # ns


def test_timeline_joins_each_clients_milestones_and_the_workers_steps():
    bt = load_benchmark("batch_trace")
    a, b = bt._key([5, 6, 7]), bt._key([8, 9])
    t0 = 1000 * MS
    clients = [
        {"key": a, "start": t0, "first": t0 + 30 * MS, "end": t0 + 80 * MS, "tokens": 3,
         "prompt_id": "a", "prompt_tokens": 3},
        {"key": b, "start": t0 + 1 * MS, "first": t0 + 50 * MS, "end": t0 + 90 * MS, "tokens": 2,
         "prompt_id": "b", "prompt_tokens": 2},
    ]  # fmt: skip
    events = [
        ["done", t0 - 10 * MS, a],  # an earlier run's row with the same prompt: not this client's
        ["handler", t0 + 2 * MS, a], ["queued", t0 + 3 * MS, a],
        ["prefill", t0 + 4 * MS, t0 + 6 * MS, [a]], ["round", t0 + 6 * MS, t0 + 26 * MS, [a]],
        ["handler", t0 + 7 * MS, b], ["queued", t0 + 8 * MS, b],
        ["prefill", t0 + 27 * MS, t0 + 28 * MS, [b]], ["round", t0 + 28 * MS, t0 + 48 * MS, [a, b]],
        ["done", t0 + 49 * MS, a], ["round", t0 + 50 * MS, t0 + 70 * MS, [b]], ["done", t0 + 71 * MS, b],
    ]  # fmt: skip
    tl = bt.timeline(clients, events)
    ca, cb = tl["clients"]
    assert (ca["handler_ms"], ca["queued_ms"], ca["prefill_start_ms"], ca["prefill_end_ms"]) == (2, 3, 4, 6)
    assert (ca["first_round_end_ms"], ca["client_first_ms"], ca["done_ms"], ca["client_end_ms"]) == (
        26,
        30,
        49,
        80,
    )
    assert ca["rounds"] == 2 and ca["round_ms_mean"] == 20
    assert (cb["prefill_start_ms"], cb["first_round_end_ms"], cb["done_ms"], cb["rounds"]) == (26, 47, 70, 2)
    assert [(s["kind"], s["rows"]) for s in tl["steps"]] == [
        ("prefill", 1), ("round", 1), ("prefill", 1), ("round", 2), ("round", 1)
    ]  # fmt: skip
    assert "| a | 3 | 3 | 2.0 | 3.0 | 4.0 | 6.0 | 26.0 | 30.0 | 49.0 | 80.0 | 2 | 20.00 |" in bt._table(
        {"device": "cpu", "tag": "t", "command": "c", "runs": [{"clients": 2, "repeat": 0, "timeline": tl}]}
    )
