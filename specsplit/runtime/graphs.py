"""Fixed-shape cached forwards over one preallocated workspace cache, replayed from CUDA graphs.

At batch 1 both models are bound by per-kernel launch overhead in eager PyTorch; a forward whose
shapes never change (the verify step over a fixed tree budget, each draft level, the padded ingest
of the accepted tokens) can be captured once in a CUDA graph and replayed for every later round and
session (see benchmarks/NOTES.md, "CUDA graphs and the static workspace"). What makes the shapes
static:

- the KV cache is written at positions given by a device tensor (``index_copy_``) and attention
  reads a fixed bucket of the buffer (the smallest power of two >= the valid length, at least
  :data:`MIN_BUCKET` slots) with the additive mask blocking every slot that is not context or an
  ancestor, so attention work follows the context length rather than the workspace size; one
  graph per (tokens, bucket);
- inputs, positions, mask and write positions live in static buffers that are refilled in place.

A :class:`GraphedRound` captures a whole sequence of such forwards and the device-side selection
between them (a dynamic tree's growth) as ONE graph: every forward's inputs are then written by
device ops (:meth:`StaticForward.fill`) from a device-resident context length.

On CPU (or with capture disabled) the same static path runs eagerly; tests compare it with the
plain eager path.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specsplit.core.pinned import capture_section, empty_pinned
from specsplit.core.tree_attention import ancestor_matrix
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.runtime.runner import ModelRunner, h2d

logger = logging.getLogger(__name__)

MIN_BUCKET = 256  # smallest key length a static forward attends over
# Token counts a prompt's padded first forward is rounded up to (one graph each, captured on first use).
PREFILL_BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def kv_bucket(end: int, capacity: int) -> int:
    """Key slots a static forward ending at slot ``end`` attends over (a power of two, capped)."""
    b = MIN_BUCKET
    while b < end:
        b *= 2
    return min(b, capacity)


def prefill_bucket(q: int) -> int | None:
    """The padded size of a ``q``-token prefill (:data:`PREFILL_BUCKETS`), or None when too long."""
    return next((b for b in PREFILL_BUCKETS if b >= q), None)


@dataclass
class _Buffers:
    ids: torch.Tensor  # [1, q]
    pos: torch.Tensor  # [1, q]
    mask: torch.Tensor  # [1, 1, q, capacity]
    wpos: torch.Tensor  # [q]
    logits: torch.Tensor | None = None  # [q, V] (graph output); [len(keep), V] with keep
    graph: torch.cuda.CUDAGraph | None = None
    keep: torch.Tensor | None = None  # [k] rows whose logits a padded prefill computes


class StaticForward:
    """Static-shape forwards of one model over a workspace cache of ``capacity`` slots.

    Args:
        runner: the engine's model runner (a single-device model).
        capacity: slots in the workspace cache (the longest session it can serve).
        use_graphs: capture CUDA graphs (only on CUDA devices).
    """

    def __init__(self, runner: ModelRunner, capacity: int, use_graphs: bool, compile: bool = False):
        model = runner.require()
        self.runner = runner
        self.capacity = capacity
        self.device = runner.input_device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.cache = runner.new_cache(capacity)
        cfg: Any = getattr(model.config, "text_config", None) or model.config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.cache.allocate(1, kv_heads, head_dim, runner.dtype, self.device)
        self._bufs: dict[tuple[int, int], _Buffers] = {}
        self._prefill_bufs: dict[tuple[int, int, int], _Buffers] = {}
        self._arange = torch.arange(capacity, device=self.device)
        self._pool = None
        if self.use_graphs:
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.graph_pool_handle()
        self._neg = torch.finfo(runner.dtype).min
        self._ctx = torch.zeros((), dtype=torch.long, device=self.device)
        self.captures = 0
        self._step: Any = None
        if compile:
            raise_recompile_limit(64)  # one graph per (tokens, bucket); shapes go dynamic after two
            self._step = torch.compile(self._model_step)

    @property
    def pool(self) -> Any:
        """The graph memory pool every capture over this workspace shares."""
        return self._pool

    def _buffers(self, q: int, kv: int, shared: bool = True) -> _Buffers:
        b = self._bufs.get((q, kv)) if shared else None
        if b is None:
            dev = self.device
            b = _Buffers(
                ids=torch.zeros(1, q, dtype=torch.long, device=dev),
                pos=torch.zeros(1, q, dtype=torch.long, device=dev),
                mask=torch.zeros(1, 1, q, kv, dtype=self.runner.dtype, device=dev),
                wpos=torch.arange(self.capacity - q, self.capacity, device=dev),
            )
            if shared:
                self._bufs[q, kv] = b
        return b

    def _forward(self, b: _Buffers) -> torch.Tensor:
        self.cache.set_write_positions(b.wpos, b.mask.shape[-1])
        try:
            if b.keep is not None:  # a padded prefill: never compiled (a recompile per bucket)
                return self.runner.forward(b.ids, b.pos, b.mask, self.cache, logits_to_keep=b.keep)
            if self._step is not None:
                self.runner.forward_count += 1
                out: torch.Tensor = self._step(b.ids, b.pos, b.mask)
                return out
            return self.runner.forward(b.ids, b.pos, b.mask, self.cache, logits_to_keep=b.ids.shape[1])
        finally:
            self.cache.set_write_positions(None)

    def _model_step(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model call that ``torch.compile`` fuses (static buffers in, logits out)."""
        logits = self.runner.logits(ids, pos, mask, self.cache, ids.shape[1], **self.runner.attention_kwargs)
        return logits[0]

    def _capture(self, b: _Buffers) -> None:
        # Capture on the model's own device (it need not be the current one). CAPTURE_LOCK: no other
        # thread captures or pins host memory meanwhile (specsplit.core.pinned).
        what = f"{b.ids.shape[1]}-token forwards over {b.mask.shape[-1]} key slots"
        with capture_section(what), torch.cuda.device(self.device):
            self._capture_here(b)

    def _capture_here(self, b: _Buffers) -> None:
        # Warm-up writes go to the last q slots, which no session reaches while this runs.
        b.wpos.copy_(self._arange[self.capacity - b.ids.shape[1] :])
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # An explicit capture stream on this device: torch's default capture stream is created
        # once, on whatever device was current then (the draft's GPU, say).
        # thread_local: the overlapped pipeline runs the other engine in another thread meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            b.logits = self._forward(b)
        b.graph = graph
        self.captures += 1

    def fill(
        self, b: _Buffers, ids: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, block: torch.Tensor
    ) -> None:
        """Write one forward's inputs into ``b`` with device ops only (no host value is read, so
        this also runs inside a captured graph).

        Args:
            ids / pos: `[q]` int64 tokens and absolute positions (device).
            ctx: `[]` int64 committed context length (device): every row attends to ``[0, ctx)``.
            block: `[q, nb]` bool, which of the slots ``[ctx, ctx + nb)`` each row attends to; the
                rows are written to slots ``ctx + nb - q .. ctx + nb - 1``.
        """
        q, nb = block.shape
        kv = b.mask.shape[-1]
        rel = self._arange[:kv] - ctx  # [kv] slot relative to the tree's first slot
        in_block = (rel >= 0) & (rel < nb)
        seen = block[:, rel.clamp(0, nb - 1)] & in_block  # [q, kv]
        b.mask[0, 0].copy_(torch.where(seen | (rel < 0), 0.0, self._neg))
        b.ids[0].copy_(ids)
        b.pos[0].copy_(pos)
        torch.add(self._arange[:q], ctx + (nb - q), out=b.wpos)

    def forward_at(
        self, b: _Buffers, ids: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, block: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`fill` then one forward over ``b`` (eager; inside a round's captured graph)."""
        self.fill(b, ids, pos, ctx, block)
        return self._forward(b)

    def new_buffers(self, q: int, kv: int) -> _Buffers:
        """Input buffers of a ``q``-token forward over ``kv`` slots that no other step shares."""
        return self._buffers(q, kv, shared=False)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: int, block: torch.Tensor) -> torch.Tensor:
        """One forward of ``q`` tokens written to slots ``ctx + b - q .. ctx + b - 1``.

        Args:
            ids: `[q]` int64 tokens (device).
            pos: `[q]` int64 absolute positions (device).
            ctx: committed context length (every row attends to slots ``[0, ctx)``).
            block: `[q, b]` bool, which of the slots ``[ctx, ctx + b)`` each row attends to.

        Returns:
            `[q, vocab]` logits; with graphs this is a static buffer, valid until the next call
            of the same size (clone what must outlive it).
        """
        q, nb = block.shape
        end = ctx + nb
        if end > self.capacity:
            raise ValueError(f"static forward needs {end} slots; the workspace holds {self.capacity}")
        b = self._buffers(q, kv_bucket(end, self.capacity))
        if self.use_graphs and b.graph is None:
            self._capture(b)
        self._ctx.fill_(ctx)
        self.fill(b, h2d(ids, self.device), h2d(pos, self.device), self._ctx, h2d(block, self.device))
        return self._replay(b, end)

    def _replay(self, b: _Buffers, end: int) -> torch.Tensor:
        """Run the filled buffers ``b`` (their graph, or eagerly) and leave the cache at ``end``."""
        if b.graph is not None:
            out = replay(b.graph, self.device, self.runner, b.logits)
        else:
            out = self._forward(b)
        self.cache.set_length(end)
        return out

    @torch.inference_mode()
    def run_prefill(
        self, ids: torch.Tensor, ctx: int, parents: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """A many-token forward (a prompt, or a prompt followed by a tree) padded to a bucket.

        Eager PyTorch runs a prompt's forward at a few tens of microseconds of host time per op;
        at batch 1 that, not the GPU, sets its cost. Padded to :func:`prefill_bucket` tokens it
        replays one CUDA graph per bucket instead. Exact: padding rows see only the committed
        tokens and write slots past the valid length (the next forward overwrites them), and
        logits are computed for the kept rows only.

        Args:
            ids: `[q]` int64 tokens (host or device): ``p`` committed tokens (causal), then a
                tree's ``n`` nodes.
            ctx: committed context length (every row attends to slots ``[0, ctx)``).
            parents: `[n]` int64 tree parents (-1: below the last committed token), or None.

        Returns:
            `[n + 1, vocab]` logits of the last committed token and of each tree node (a static
            buffer, as for :meth:`run`); None when no bucket fits (the caller runs eagerly). The
            cache length is left at ``ctx + bucket``: the caller sets the committed length.
        """
        n = 0 if parents is None else int(parents.shape[0])
        q = int(ids.shape[0])
        p = q - n
        size = prefill_bucket(q)
        if p < 1 or size is None or ctx + size > self.capacity:
            return None
        key = (size, kv_bucket(ctx + size, self.capacity), n + 1)
        b = self._prefill_bufs.get(key)
        if b is None:
            b = self._prefill_bufs[key] = self._buffers(size, key[1], shared=False)
            b.keep = torch.zeros(n + 1, dtype=torch.long, device=self.device)
        if self.use_graphs and b.graph is None:
            self._capture(b)
        dev = self.device
        ar = self._arange[:size]
        # Causal over the committed tokens: tree and padding rows see all of them (and a padding
        # row nothing else: finite values in slots nothing reads).
        block = (ar[None, :] <= ar[:, None]) & (ar[None, :] < p)
        pos = ar.clone()
        if parents is not None and n:
            anc = ancestor_matrix(h2d(parents, dev))
            block[p:q, p:q] = anc
            pos[p:q] = anc.sum(-1) + (p - 1)
        self._ctx.fill_(ctx)
        padded = torch.cat([h2d(ids, dev), ar.new_zeros(size - q)])
        torch.add(ar[: n + 1], p - 1, out=b.keep)
        self.fill(b, padded, pos + self._ctx, self._ctx, block)
        return self._replay(b, ctx + size)


def replay(
    graph: torch.cuda.CUDAGraph, device: torch.device, runner: ModelRunner, out: torch.Tensor | None
) -> torch.Tensor:
    """Replay a captured forward on its device, count it as the runner's forward, return its output
    buffer ``out``."""
    with torch.cuda.device(device):
        graph.replay()
    runner.forward_count += 1
    assert out is not None
    return out


class GraphedRound:
    """A device-only computation over static input buffers, captured as ONE CUDA graph.

    ``fn(*inputs)`` must read no device value on the host and keep its shapes fixed for fixed
    input shapes (a whole tree-growth round: several forwards through :meth:`StaticForward.forward_at`
    and the selection between them). Without graphs (CPU, ``use_graphs=False``) it runs eagerly on
    the same buffers. The returned tensors are the graph's own: valid until the next call.

    ``device_inputs``: further inputs that callers pass as device tensors (keyword ``device_args``
    of a call, copied device to device); ``fn`` receives them after ``inputs``.
    """

    def __init__(
        self,
        static: StaticForward,
        fn: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        device_inputs: Sequence[torch.Tensor] = (),
    ):
        self.static = static
        self.fn = fn
        self.device_inputs = [torch.empty_like(x, device=static.device) for x in device_inputs]
        # All-int64 inputs on a GPU live in ONE device buffer with a pinned host twin: a call with
        # host arguments (a tree that came over gRPC) is then one copy, not one per input plus a
        # fill kernel per int, and each pageable copy costs host time before the launch.
        self._stage: torch.Tensor | None = None
        self._stage_np: Any = None
        self._staged: torch.cuda.Event | None = None
        sizes = [x.numel() for x in inputs]
        self._packed: torch.Tensor | None = None
        if static.use_graphs and inputs and all(x.dtype == torch.long for x in inputs):
            packed = torch.empty(sum(sizes), dtype=torch.long, device=static.device)
            self._slices = [
                (a, a + n) for a, n in zip(itertools.accumulate([0, *sizes]), sizes, strict=False)
            ]
            self._packed = packed
            self.inputs = [packed[a:b].view(x.shape) for (a, b), x in zip(self._slices, inputs, strict=True)]
        else:
            self.inputs = [torch.empty_like(x, device=static.device) for x in inputs]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None

    def _stage_host(self, args: Sequence[torch.Tensor | int]) -> bool:
        """Copy host arguments to the inputs in one transfer; False if any argument is on a device."""
        if self._packed is None or any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in args):
            return False
        if self._stage is None:
            # Pinned on first use, not at construction: only callers with host arguments need it, and
            # never while another thread captures a graph (specsplit.core.pinned).
            self._stage = empty_pinned(self._packed.numel(), torch.long)
            self._stage_np = self._stage.numpy()
        elif self._staged is not None:
            self._staged.synchronize()  # the last call's copy has left the pinned buffer (always, by now)
        for (a, b), x in zip(self._slices, args, strict=True):
            self._stage_np[a:b] = x.reshape(-1).numpy() if isinstance(x, torch.Tensor) else x
        self._packed.copy_(self._stage, non_blocking=True)
        if self._staged is None:
            self._staged = torch.cuda.Event()
        self._staged.record(torch.cuda.current_stream(self.static.device))
        return True

    @torch.inference_mode()
    def __call__(self, *args: torch.Tensor | int, device_args: Sequence[torch.Tensor] = ()) -> Any:
        if len(args) != len(self.inputs) or len(device_args) != len(self.device_inputs):
            raise ValueError(
                f"expected {len(self.inputs)} + {len(self.device_inputs)} inputs, got {len(args)} + {len(device_args)}"
            )
        if not self._stage_host(args):
            for buf, x in zip(self.inputs, args, strict=True):
                if isinstance(x, torch.Tensor):
                    buf.copy_(x, non_blocking=True)
                else:
                    buf.fill_(x)
        for buf, x in zip(self.device_inputs, device_args, strict=True):
            buf.copy_(x, non_blocking=True)
        if not self.static.use_graphs:
            return self.fn(*self.inputs, *self.device_inputs)
        if self.graph is None:
            what = f"a whole round, {len(self.inputs)} inputs"
            with capture_section(what), torch.cuda.device(self.static.device):  # see specsplit.core.pinned
                self._capture()
        assert self.graph is not None
        with torch.cuda.device(self.static.device):
            self.graph.replay()
        return self.outputs

    def _capture(self) -> None:
        # Warm-up on the real inputs: it writes exactly the slots the replay is about to write.
        dev = self.static.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(*self.inputs, *self.device_inputs)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.static.pool, stream=stream, capture_error_mode="thread_local"):
            self.outputs = self.fn(*self.inputs, *self.device_inputs)
        self.graph = graph
        self.static.captures += 1


def raise_recompile_limit(n: int) -> None:
    """Let ``torch.compile`` keep at least ``n`` compiled variants of one function (one per shape)."""
    cfg: Any = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


class Workspace:
    """One static workspace per engine, lent to one session at a time (others run eagerly).

    Batch-1 serving holds one live session per engine most of the time; the workspace's captured
    graphs are then reused by every round of every session.
    """

    def __init__(self, runner: ModelRunner, capacity: int, use_graphs: bool, compile: bool = False):
        self._runner = runner
        self._capacity = capacity
        self._use_graphs = use_graphs
        self._compile = compile
        self._static: StaticForward | None = None
        self.owner: str | None = None
        self._warned_owner: str | None = None

    @property
    def static(self) -> StaticForward:
        if self._static is None:
            self._static = StaticForward(self._runner, self._capacity, self._use_graphs, self._compile)
        return self._static

    def acquire(self, session_id: str, needed: int) -> StaticKVCache | None:
        """The workspace cache for ``session_id`` if it is free and large enough, else None."""
        if self.owner is not None:
            if self._warned_owner != self.owner:  # once per holder: a leaked session shows up here
                self._warned_owner = self.owner
                logger.warning(
                    "the CUDA-graph workspace of %s is held by session %r: session %r and any other "
                    "started meanwhile run the eager path (slower) until it ends or expires",
                    self._runner.model_name or "the model",
                    self.owner,
                    session_id,
                )
            return None
        if needed > self._capacity:
            return None
        device_map: Any = getattr(self._runner.model, "hf_device_map", None)
        if device_map and len(set(device_map.values())) > 1:
            return None  # a model spread over devices runs eagerly
        cache = self.static.cache
        cache.set_length(0)
        self.owner = session_id
        return cache

    def release(self, session_id: str) -> None:
        if self.owner == session_id:
            self.owner = None
