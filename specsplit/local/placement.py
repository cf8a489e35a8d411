"""Device placement helpers for local mode (accelerate device maps for the target)."""

from __future__ import annotations

import torch


def available_devices() -> list[str]:
    """``["cuda:0", "cuda:1", ...]`` or ``["cpu"]``."""
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def default_placement() -> tuple[str, str]:
    """``(draft_device, target_device)``: separate GPUs when there are two or more."""
    devs = available_devices()
    if len(devs) >= 2:
        return devs[0], devs[1]
    return devs[0], devs[0]
