"""Helpers for the remote-mode tests: tiny models on disk and worker subprocesses started via the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
READY_TIMEOUT_S = 120.0  # model load on a busy 2-core box


def tiny_pair(noise: float = 0.005) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A seeded tiny target and a draft that is the target plus a little noise (partial acceptance)."""
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    draft = LlamaForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
        for m in (target, draft):  # peaked distributions: fewer numerical near-ties
            m.get_output_embeddings().weight.mul_(8.0)
    return target, draft


def save_pair(root: Path) -> tuple[Path, Path]:
    """Write the tiny pair to ``root/target`` and ``root/draft`` (safetensors, float32)."""
    target, draft = tiny_pair()
    paths = root / "target", root / "draft"
    for model, path in zip((target, draft), paths, strict=True):
        model.save_pretrained(path)
    return paths


def load_saved(path: Path) -> torch.nn.Module:
    """Load a saved tiny model exactly as a worker does (through ``specsplit.models``)."""
    from specsplit.models import load_model

    return load_model(str(path), dtype=torch.float32, device="cpu")


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch with one intra-op thread (as the workers do), restoring the setting afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Worker:
    """A ``specsplit serve`` subprocess; ``port`` is read from its ``READY <port>`` line."""

    def __init__(self, role: str, model: Path, args: Sequence[str] = (), port: int = 0):
        self.role = role
        self.model = model
        self.args = list(args)
        self.requested_port = port
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.log: list[str] = []

    def start(self) -> Worker:
        cmd = [sys.executable, "-m", "specsplit.cli", "serve", self.role, "--model", str(self.model),
               "--port", str(self.requested_port), "--host", "127.0.0.1", "--device", "cpu",
               "--dtype", "float32", *self.args]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # One intra-op thread, like the test process during these tests (see `single_thread`):
        # identical float reductions on both sides, and no OpenMP spinning on a busy 2-core box.
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        # Drain stderr continuously so a chatty worker never blocks on a full pipe.
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()
        return self

    def _drain(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.log.append(line)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Worker:
        assert self.proc is not None and self.proc.stdout is not None
        result: list[str] = []

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            result.append(self.proc.stdout.readline())

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        line = result[0] if result else ""
        if not line.startswith("READY "):
            self.kill()
            raise RuntimeError(f"{self.role} worker did not start: {line!r}\n{''.join(self.log[-30:])}")
        self.port = int(line.split()[1])
        self.requested_port = self.port  # a restart reuses the port
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_kib(self) -> int:
        """Resident set size of the worker (``VmRSS`` from /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("VmRSS not found")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful shutdown); returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def start_all(workers: Sequence[Worker]) -> list[Worker]:
    """Start several workers in parallel and wait until each is ready (kills all on failure)."""
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.wait_ready()
    except Exception:
        for w in workers:
            w.kill()
        raise
    return list(workers)


def wait_until(pred: object, timeout: float = 10.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return bool(pred())  # type: ignore[operator]
