"""The weight-read bound (`specsplit.bench.roofline`) and the bench's report of it."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specsplit.bench.roofline import copy_bandwidth, weight_bytes, weight_read_bound
from specsplit.bench.run import _weight_read_bound


def test_weight_bytes_counts_every_parameter_once():
    model = tiny_llama(0)
    assert weight_bytes(model) == sum(p.numel() * 4 for p in model.parameters())  # float32, untied
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one tensor, counted once
    assert weight_bytes(model) == sum(p.numel() * 4 for p in model.parameters())
    assert (
        weight_bytes(model.to(torch.bfloat16)) * 2
        == weight_bytes(tiny_llama(0)) - model.lm_head.weight.numel() * 4
    )


def test_bound_arithmetic():
    model = tiny_llama(0)
    b = weight_read_bound(model, bandwidth=2e9)
    assert b["weight_bytes"] == weight_bytes(model) and b["copy_bandwidth_GBps"] == 2.0
    assert b["bound_ms"] == pytest.approx(weight_bytes(model) / 2e9 * 1e3)
    assert b["bound_tokens_per_s"] == pytest.approx(1e3 / b["bound_ms"])


def test_copy_bandwidth_runs_off_the_gpu():
    assert copy_bandwidth("cpu", nbytes=1 << 20, reps=2) > 0


def test_bench_measures_the_bound_only_on_a_gpu():
    assert _weight_read_bound(tiny_llama(0), "cpu") is None
