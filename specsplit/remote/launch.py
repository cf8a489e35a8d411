"""Start ``specsplit serve`` workers as local subprocesses (benchmarks, examples, tests).

A worker prints exactly one line ``READY <port>`` on stdout once it accepts calls;
:class:`WorkerProcess` waits for it and knows the address. Used as a context manager it stops the
worker (SIGTERM, then SIGKILL after ``grace`` seconds) on exit::

    with WorkerProcess("target", "qwen2.5-coder-1.5b", device="cuda:0") as t, \\
         WorkerProcess("draft", "qwen2.5-coder-0.5b", device="cuda:0") as d:
        cfg = SpecSplitConfig(transport="grpc", target_address=t.address, draft_address=d.address)
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Sequence

from specsplit.errors import TransportError

logger = logging.getLogger(__name__)
_SEVERE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b")  # log levels, not Python's "UserWarning"
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")  # a log record's first line (its timestamp)


class WorkerProcess:
    """One ``specsplit serve <role>`` subprocess on 127.0.0.1.

    Args:
        role: ``"draft"`` or ``"target"``.
        model: alias, local directory or HF id the worker loads.
        device: torch device of the worker (``None``: its default).
        dtype: ``auto`` / ``float32`` / ``float16`` / ``bfloat16``.
        args: extra ``specsplit serve`` options (e.g. ``["--cuda-graphs"]``).
        port: TCP port (0: the worker picks a free one).
        ready_timeout_s: how long model loading may take before the start counts as failed.
    """

    def __init__(
        self,
        role: str,
        model: str,
        *,
        device: str | None = None,
        dtype: str = "auto",
        args: Sequence[str] = (),
        port: int = 0,
        ready_timeout_s: float = 600.0,
    ):
        if role not in ("draft", "target"):
            raise ValueError(f"role must be 'draft' or 'target', got {role!r}")
        self.role, self.model, self.device, self.dtype = role, model, device, dtype
        self.args, self.port, self.ready_timeout_s = list(args), port, ready_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self._log: list[str] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The worker's command line (``python -m specsplit.cli serve ...``); subclasses may wrap it."""
        cmd = [sys.executable, "-m", "specsplit.cli", "serve", self.role, "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype, *self.args]  # fmt: skip
        if self.device:
            cmd += ["--device", self.device]
        return cmd

    def start(self) -> WorkerProcess:
        """Spawn the worker and wait for ``READY``; raises TransportError if it does not come."""
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
        )
        threading.Thread(target=self._drain, daemon=True).start()  # a full stderr pipe would block it
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(self.ready_timeout_s)
        first = line[0] if line else ""
        if not first.startswith("READY "):
            tail = "".join(self._log[-20:])
            self.stop(grace=1.0)
            raise TransportError(f"{self.role} worker ({self.model}) did not start: {first!r}\n{tail}")
        self.port = int(first.split()[1])
        logger.info("%s worker for %s ready at %s", self.role, self.model, self.address)
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        forwarding = False
        for text in self.proc.stderr:
            self._log.append(text)
            del self._log[:-200]
            # The worker's own warnings and errors reach this process's log, with the lines that
            # continue them (an error's traceback) up to the next record.
            if _RECORD.match(text):
                forwarding = bool(_SEVERE.search(text))
            elif not forwarding:
                forwarding = bool(_SEVERE.search(text))
            if forwarding:
                logger.warning("%s worker: %s", self.role, text.rstrip())

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM (the worker drains in-flight calls), then SIGKILL after ``grace`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> WorkerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
