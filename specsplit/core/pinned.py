"""CUDA graph captures kept apart across threads, and pinned host staging kept out of them.

The overlapped pipeline runs a speculative draft in one thread while the verification runs in
another, and either may capture a graph (the target a prompt's bucket in the first round, the draft
a new KV bucket). A capture's set-up in one thread (``torch.cuda.graph`` synchronises the device
and frees cached blocks first) invalidates a capture in progress in the other, even in
``thread_local`` capture mode, and the failed capture leaves the CUDA context unusable
(``tests/test_gpu.py::test_captures_in_two_threads_at_once`` fails without this lock). So every
capture, with its warm-up, holds :data:`CAPTURE_LOCK`.

Pinned host allocations (``cudaHostAlloc``, when the caching host allocator has no free block of the
size) take the same lock as a precaution: a pinned allocation may invalidate a capture in another
thread as well (seen once, not reproduced in isolation). Uncontended it costs a lock acquisition per
staging copy, and a thread that pins while the other captures waits for that capture (first uses
only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

CAPTURE_LOCK = threading.RLock()
_SERVING = threading.Event()


def mark_serving() -> None:
    """This process now serves calls (a worker that has started): from here on a graph capture is
    logged as a warning, since while it runs every other thread's GPU work in the process waits
    (this lock, the device synchronisation a capture starts with, the host time it takes)."""
    _SERVING.set()


@contextmanager
def capture_section(what: str) -> Iterator[None]:
    """Hold :data:`CAPTURE_LOCK` for one capture of ``what``, logging how long it held it."""
    with CAPTURE_LOCK:
        t0 = time.perf_counter()
        yield
        ms = 1e3 * (time.perf_counter() - t0)
    if _SERVING.is_set():
        logger.warning("captured a CUDA graph while serving (%s): %.0f ms, other work in this "
                       "process waited meanwhile", what, ms)  # fmt: skip
    else:
        logger.info("captured a CUDA graph (%s) in %.0f ms", what, ms)


def pin(t: torch.Tensor) -> torch.Tensor:
    """``t.pin_memory()``, never while another thread captures a CUDA graph."""
    with CAPTURE_LOCK:
        return t.pin_memory()


def empty_pinned(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked `[n]` host buffer, never allocated while another thread captures a CUDA graph."""
    with CAPTURE_LOCK:
        return torch.empty(n, dtype=dtype, pin_memory=True)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy ``t`` to ``device`` without a hidden host sync.

    A copy from pageable host memory waits for the device queue; staging through pinned memory
    lets the host keep launching work while the GPU is busy.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev, non_blocking=True)
    return pin(t).to(dev, non_blocking=True)
