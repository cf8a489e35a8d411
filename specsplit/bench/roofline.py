"""The weight-read bound of a decode step (DESIGN.md, "Performance model").

At batch 1 every decode step reads each weight of the model once; a step cannot be faster than the
model's weight bytes over the device's memory bandwidth. ``specsplit bench`` reports its target-only
decoders against that bound, with the bandwidth measured on the run's own device by a large
device-to-device copy (what a well-behaved kernel can stream, not the data sheet's peak).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, tied or shared tensors counted once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def copy_bandwidth(device: torch.device | str, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes read + written per second by a ``nbytes`` device-to-device copy, repeated ``reps`` times
    after three warm-up copies (CUDA events on a GPU, wall time elsewhere). Frees its buffers."""
    dev = torch.device(device)
    a = torch.empty(nbytes // 2, dtype=torch.float16, device=dev).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(dev):
            start.record()
            for _ in range(reps):
                b.copy_(a)
            end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            b.copy_(a)
        seconds = time.perf_counter() - t0
    moved = 2 * a.numel() * a.element_size() * reps
    del a, b
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return moved / seconds


def weight_read_bound(model: torch.nn.Module, bandwidth: float) -> dict[str, Any]:
    """The bound of one decode step of ``model`` at ``bandwidth`` bytes/s, as the bench records it."""
    nbytes = weight_bytes(model)
    seconds = nbytes / bandwidth
    return {
        "weight_bytes": nbytes,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "bound_ms": seconds * 1e3,
        "bound_tokens_per_s": 1.0 / seconds,
    }
