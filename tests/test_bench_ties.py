"""Near-tie analysis of greedy mismatches (``specsplit.bench.ties``) on a tiny random Llama in bf16."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specsplit.bench.cli import _rerender
from specsplit.bench.models import tiny_models
from specsplit.bench.run import BenchOptions, run_bench
from specsplit.bench.ties import TiePair, analyze_mismatches, bench_tie_analysis, fp32_copy, to_markdown

J = 6  # the first differing new token in the constructed pairs


@torch.inference_mode()
def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.inference_mode()
def _last_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.fixture(scope="module")
def setup() -> SimpleNamespace:
    """A bf16 target whose token ``b`` is tuned to near-tie the top token ``a`` at one context.

    Row ``b`` of the LM head becomes row ``a`` with one element moved by one bf16 ulp, so the two
    logits differ by about ``ulp * h_k`` (~1e-3) wherever they are compared: exactly representable
    in bf16, so the float32 copy (upcast) sees the same weights.
    """
    base = tiny_models()[0].to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (20,), generator=g).tolist()
    ref = _greedy(base, prompt, 12)
    ctx = prompt + ref[:J]
    logits = _last_logits(fp32_copy(base), ctx)
    order = logits.argsort(descending=True).tolist()
    a, low = order[0], order[-1]
    assert a == ref[J]
    b = order[5]  # a mid-ranked token, made the runner-up by the edit below
    tied = copy.deepcopy(base)
    with torch.no_grad():
        w = tied.get_output_embeddings().weight
        h = tied.model(torch.tensor([ctx])).last_hidden_state[0, -1].float()
        k = int(h.abs().argmax())
        row = w[a].clone()
        # one ulp toward a lower logit for b: b is then just below a
        toward = torch.tensor(-1e9 if h[k] > 0 else 1e9, dtype=torch.bfloat16)
        row[k] = torch.nextafter(row[k], toward)
        w[b] = row
    return SimpleNamespace(base=base, tied=tied, prompt=prompt, ref=ref, a=a, b=b, low=low)


def _other(ref: list[int], tok: int) -> list[int]:
    return ref[:J] + [tok] + ref[J + 1 :]


def test_constructed_near_tie_is_classified_near_tie(setup: SimpleNamespace) -> None:
    s = setup
    res = analyze_mismatches(s.tied, [TiePair(s.prompt, s.ref, _other(s.ref, s.b), "dec", "p0")])
    assert res["dtype"] == "bfloat16"
    assert res["noise"]["positions"] == len(s.ref) and res["noise"]["gap_noise"]["p99"] > 0
    assert res["threshold"] == pytest.approx(3.0 * res["noise"]["gap_noise"]["p99"])
    (row,) = res["rows"]
    assert (row["position"], row["reference_token"], row["other_token"]) == (J, s.a, s.b)
    assert 0 < row["gap_fp32"] < 0.01  # a genuine (one-ulp) tie, fp32 prefers the reference token
    assert row["fp32_prefers"] == "reference"
    assert row["rank_other"] <= 2 and row["rank_reference"] <= 2
    assert abs(row["gap_fp32"]) <= res["threshold"]
    assert row["near_tie"] is True, row
    assert res["summary"]["dec"] == {
        "compared": 1,
        "mismatches": 1,
        "near_ties": 1,
        "not_near_ties": 0,
        "max_abs_gap_fp32": pytest.approx(abs(row["gap_fp32"])),
        "max_abs_prob_diff_fp32": pytest.approx(abs(row["prob_diff_fp32"])),
    }
    assert res["totals"]["all_near_ties"] is True
    # an explicit float32 copy gives the same answer as the one made (and freed) internally
    again = analyze_mismatches(
        s.tied, [TiePair(s.prompt, s.ref, _other(s.ref, s.b), "dec", "p0")], fp32_model=fp32_copy(s.tied)
    )
    assert again["rows"][0]["gap_fp32"] == pytest.approx(row["gap_fp32"])


def test_gap_beyond_threshold_is_not_a_near_tie(setup: SimpleNamespace) -> None:
    """The same top-2 pair with a zero threshold: a nonzero fp32 gap fails the gap test."""
    s = setup
    res = analyze_mismatches(s.tied, [(s.prompt, s.ref, _other(s.ref, s.b), "dec", "p0")], factor=0.0)
    (row,) = res["rows"]
    assert row["near_tie"] is False and "threshold" in row["reason"]
    assert res["totals"] == {
        "compared": 1,
        "mismatches": 1,
        "near_ties": 0,
        "not_near_ties": 1,
        "all_near_ties": False,
    }


def test_low_ranked_token_is_not_a_near_tie(setup: SimpleNamespace) -> None:
    s = setup
    pairs = [
        TiePair(s.prompt, s.ref, _other(s.ref, s.low), "bad", "p0"),
        TiePair(s.prompt, s.ref, _other(s.ref, s.b), "good", "p0"),
    ]
    res = analyze_mismatches(s.tied, pairs)
    rows = {r["decoder"]: r for r in res["rows"]}
    bad = rows["bad"]
    assert bad["near_tie"] is False
    assert bad["rank_other"] > 2 and "top-2" in bad["reason"]
    assert bad["gap_fp32"] > 10 * res["threshold"] and bad["prob_diff_fp32"] > 0
    assert bad["fp32_prefers"] == "reference"
    assert rows["good"]["near_tie"] is True
    assert res["summary"]["bad"]["not_near_ties"] == 1 and res["summary"]["good"]["near_ties"] == 1
    assert res["totals"]["all_near_ties"] is False
    md = to_markdown(res)
    assert "**1 are NOT near-ties**" in md and "| `bad` |" in md and "| `good` |" in md


def test_identical_outputs_give_no_rows(setup: SimpleNamespace) -> None:
    s = setup
    res = analyze_mismatches(s.base, [TiePair(s.prompt, s.ref, list(s.ref), "same", "p0")])
    assert res["rows"] == []
    assert res["summary"]["same"]["compared"] == 1 and res["summary"]["same"]["mismatches"] == 0
    assert res["totals"]["all_near_ties"] is True
    assert res["noise"]["positions"] == len(s.ref)  # equal outputs still measure the noise
    assert "0 of 1 outputs differ" in to_markdown(res)


def test_json_and_markdown(setup: SimpleNamespace) -> None:
    s = setup
    pairs = [
        TiePair(s.prompt, s.ref, _other(s.ref, s.b), "near", "p0"),
        TiePair(s.prompt, s.ref, _other(s.ref, s.low), "far", "p0"),
        TiePair(s.prompt, s.ref, s.ref[:J], "short", "p0"),  # a prefix: a length difference
        TiePair(s.prompt, s.ref, list(s.ref), "same", "p0"),
    ]
    tok = SimpleNamespace(decode=lambda ids: f"w{ids[0]}")
    res = analyze_mismatches(s.tied, pairs, tokenizer=tok, noise_positions=4)
    assert res["noise"]["positions"] == 4
    back = json.loads(json.dumps(res, allow_nan=False))
    assert back == res
    short = next(r for r in res["rows"] if r["decoder"] == "short")
    assert short["other_token"] is None and short["near_tie"] is False and "length" in short["reason"]
    assert next(r for r in res["rows"] if r["decoder"] == "near")["other_text"] == f"w{s.b}"
    md = to_markdown(res)
    assert "## Mismatches vs `hf-target`: near-tie analysis" in md
    assert "| decoder | compared | mismatches | near-ties |" in md
    for name in ("near", "far", "short", "same"):
        assert f"| `{name}` |" in md
    assert "3 of 4 outputs differ" in md and "**2 are NOT near-ties**" in md
    assert "(end)" in md and f"`'w{s.b}'`" in md
    assert to_markdown(None) == ""
    assert "failed: boom" in to_markdown({"reference": "hf-target", "error": "boom"})


def test_float32_target_only_exact_ties_pass(setup: SimpleNamespace) -> None:
    """A float32 target is its own reference: the noise is 0, so any gap is not a near-tie."""
    s = setup
    f32 = fp32_copy(s.tied)
    res = analyze_mismatches(f32, [TiePair(s.prompt, s.ref, _other(s.ref, s.b), "dec", "p0")])
    assert res["dtype"] == "float32" and res["threshold"] == 0.0
    assert res["rows"][0]["near_tie"] is False


def test_bench_hook_auto_enable(setup: SimpleNamespace) -> None:
    s = setup
    prompts = [SimpleNamespace(id="p0", input_ids=s.prompt)]
    same = {("hf-target", "p0"): list(s.ref), ("x", "p0"): list(s.ref)}
    diff = {("hf-target", "p0"): list(s.ref), ("x", "p0"): _other(s.ref, s.b)}
    bf16 = SimpleNamespace(target=s.tied, tokenizer=None, dtype="bfloat16")
    fp32 = SimpleNamespace(target=fp32_copy(s.tied), tokenizer=None, dtype="float32")
    assert bench_tie_analysis(bf16, prompts, same, "hf-target") is None  # nothing differs
    assert bench_tie_analysis(fp32, prompts, diff, "hf-target") is None  # float32: off by default
    assert bench_tie_analysis(bf16, prompts, diff, "hf-target", enabled=False) is None
    on = bench_tie_analysis(bf16, prompts, diff, "hf-target")
    assert on is not None and on["totals"]["near_ties"] == 1 and on["summary"]["x"]["compared"] == 1
    forced = bench_tie_analysis(fp32, prompts, same, "hf-target", enabled=True)
    assert forced is not None and forced["totals"]["mismatches"] == 0
    broken = SimpleNamespace(target=torch.nn.Linear(2, 2), tokenizer=None, dtype="bfloat16")
    err = bench_tie_analysis(broken, prompts, diff, "hf-target")
    assert err is not None and "error" in err


@pytest.mark.filterwarnings("ignore:No artists with labels")
def test_bench_run_writes_tie_analysis(tmp_path: Path) -> None:
    opts = BenchOptions(
        suite="smoke",
        decoders=("hf-target", "specsplit-target-only"),
        repeats=1,
        max_new_tokens=6,
        out=tmp_path,
        tie_analysis=True,
        threads=1,
    )
    result = run_bench(opts)
    ties = result["tie_analysis"]
    assert ties["totals"] == {
        "compared": 2,
        "mismatches": 0,
        "near_ties": 0,
        "not_near_ties": 0,
        "all_near_ties": True,
    }
    md = Path(result["files"]["md"])
    assert "near-tie analysis" in md.read_text()
    saved = json.loads(Path(result["files"]["json"]).read_text())
    assert saved["tie_analysis"] == ties
    md.unlink()
    assert _rerender(Path(result["files"]["json"])) == 0
    assert "near-tie analysis" in md.read_text()
    off = run_bench(BenchOptions(suite="smoke", decoders=("hf-target",), repeats=1, max_new_tokens=4,
                                 out=tmp_path, tag="off", threads=1))  # fmt: skip
    assert "tie_analysis" not in off  # float32 smoke run, auto: skipped
