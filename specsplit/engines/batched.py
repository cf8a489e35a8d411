"""Batched verification: one target forward for the trees of many sequences.

:class:`BatchedTarget` keeps up to ``slots`` sequences in one
:class:`~specsplit.runtime.batched_kv.BatchedKVCache` and runs a round for all of them at once: each
row feeds its pending token (the last committed one, whose KV is not written yet) and its own tree,
padded to the round's common node count; one forward with a per-row additive mask (the row's
context, then its pending token and the ancestors of each node), per-row positions and per-row
write slots; greedy or lossless sampled acceptance for every row at once (ragged: each row accepts
its own path); the accepted KV of each row moved behind its pending token; ONE host read of every
row's outcome.

The same pool over a draft model drafts greedy chains for many sessions at once (:meth:`BatchedTarget.chain`:
a draft worker's client-loop sessions, :class:`~specsplit.engines.batched_sessions.DraftBatcher`).

On CUDA a round's static part (inputs written from one staging copy, mask, forward, and for greedy
rounds the argmax, acceptance and KV move) is captured once per (batch bucket, tree size, KV bucket)
as one CUDA graph, so every row of every batch size is on the graph path. Batches are padded to a
power of two: padding rows sit in free slots, attend only to themselves and are never read.

Sampling draws by position (:func:`~specsplit.core.sampling.position_noise` with each row's own
seed), so a row commits exactly the tokens its single-row generation with the same seed commits.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specsplit.core.pinned import capture_section, empty_pinned
from specsplit.core.sampling import SamplingParams, logits_to_probs, position_noise
from specsplit.errors import ResourceExhausted
from specsplit.runtime.attention import FOLD_KWARG
from specsplit.runtime.batched_kv import BatchedKVCache
from specsplit.runtime.graphs import kv_bucket, raise_recompile_limit, replay
from specsplit.runtime.runner import ModelRunner

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFILL_TOKENS = 8192  # most prompt tokens one batched prefill forward takes (rows are grouped)
PREFILL_SLACK = 1.25  # a prefill group's padded size over its real tokens, at most (eager forwards)
# Graphed prefills (CUDA): a group's rows and width are padded to buckets, one graph per bucket pair.
# An eager forward's host work (thousands of operator calls) costs as much as a decode round of a
# whole batch many times over; a replayed one costs its kernels only, so grouping weighs padded
# tokens against a replay's fixed cost, counted here as this many padded tokens.
PREFILL_GRAPH_MIN_WIDTH = 16
PREFILL_GRAPH_GROUP_TOKENS = 256


def batch_bucket(b: int, slots: int) -> int:
    """The padded batch size of ``b`` rows (a power of two, at most ``slots``)."""
    return min(next((x for x in BATCH_BUCKETS if x >= b), b), slots)


@dataclass
class RowTree:
    """One row's round: what its slot holds, its pending token and its tree (host lists, BFS order,
    ``parents[i] < i``, -1 = child of the pending token)."""

    length: int
    pending: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    seed: int | None = None  # verification seed (sampling)
    noise: PositionNoise | None = None  # the row's noise drawn so far (seeded sampling), kept by the caller


class PositionNoise:
    """A seeded row's position-keyed sampling noise (:func:`~specsplit.core.sampling.position_noise`),
    each position drawn once: a round needs positions ``length + 1 .. length + 1 + depth`` and the
    next round's overlap them, so only the positions past the last round's are drawn again.

    Args:
        seed: the row's verification seed.
        vocab: noise width.
        device: where the noise lives.
        depth: most positions one round reads (the largest tree's depth + 1); the ring's rows.
    """

    def __init__(self, seed: int, vocab: int, device: torch.device, depth: int):
        self.seed, self.depth = seed, depth
        self.ring = torch.empty(depth, vocab, dtype=torch.float32, device=device)
        self._held = [-1] * depth  # the position each ring row holds
        self.draws = 0

    def rows(self, start: int, count: int) -> torch.Tensor:
        """`[count, vocab]` noise of positions ``start .. start + count - 1`` (``count <= depth``)."""
        if count > self.depth:
            raise ValueError(f"{count} positions a round; the ring holds {self.depth}")
        for pos in range(start, start + count):
            k = pos % self.depth
            if self._held[k] != pos:
                self.ring[k] = position_noise(self.seed, pos, 1, self.ring.shape[1], self.ring.device)[0]
                self._held[k] = pos
                self.draws += 1
        idx = [(start + i) % self.depth for i in range(count)]
        return self.ring[idx]


@dataclass
class RowOutcome:
    """What a row committed: accepted node indices and tokens, then the target's own token."""

    nodes: list[int]
    tokens: list[int]
    next_token: int


@dataclass
class ChainRow:
    """One row of a chain draft: what its slot holds and the committed tokens it does not hold yet
    (at least one; the last one is fed first and the chain continues from it)."""

    length: int
    tokens: list[int]


@dataclass
class _Chain:
    """Static buffers (and graph) of one (batch bucket, ingest width, chain length, KV bucket) draft."""

    stage: torch.Tensor  # [B, 2 + W] int64: length, token count, tokens
    host: torch.Tensor  # [B, 2 + W] pinned twin of ``stage``
    ingest: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # ids, pos, wpos [B, W], mask
    level: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # ids, pos, wpos [B, 1], mask
    out: torch.Tensor | None = None  # [B, K] drafted tokens
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class _Prefill:
    """Static buffers (and graph) of one (row bucket, width bucket) graphed prefill."""

    stage: torch.Tensor  # [R, 2 + W] int64: slot, length, tokens
    host: torch.Tensor  # [R, 2 + W] pinned twin of ``stage``
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


@dataclass
class _Round:
    """Static buffers (and graph) of one (batch bucket, nodes, KV bucket) round shape."""

    stage: torch.Tensor  # [B, W] int64 inputs, written from one pinned host copy
    host: torch.Tensor  # [B, W] pinned twin of ``stage``
    mask: torch.Tensor  # [B, 1, Q, R]
    ids: torch.Tensor  # [B, Q]
    pos: torch.Tensor  # [B, Q]
    wpos: torch.Tensor  # [B, Q]
    greedy: bool
    out: torch.Tensor | None = None  # greedy: [B, 2 + 2N] packed outcome; sampled: logits [B, Q, V]
    graph: torch.cuda.CUDAGraph | None = None


class BatchedTarget:
    """Many sequences' rounds in one target forward (see the module docstring).

    Args:
        runner: the target's model runner (a single-device model).
        slots: sequences held at once (the largest batch).
        capacity: tokens per sequence (prompt + new tokens + the largest tree).
        use_graphs: capture CUDA graphs (CUDA only).
        compile: fuse the one-token forwards (plain rounds, chain-draft levels) with
            ``torch.compile`` before capture; tree rounds and prompt forwards are not compiled.
            The first round compiles; after the second shape the compiled forward takes any batch
            and KV size (dynamic shapes), so later shapes only capture.
    """

    def __init__(
        self, runner: ModelRunner, slots: int, capacity: int, use_graphs: bool = True, compile: bool = False
    ):
        model = runner.require()
        devices: dict[str, Any] = getattr(model, "hf_device_map", None) or {}
        if len(set(devices.values())) > 1:
            raise ResourceExhausted("batched rounds need the target on one device (no device map)")
        self.runner = runner
        self.device = runner.input_device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        # Prompts are written in groups of bucketed shapes, replayed from graphs on CUDA (eager
        # forwards elsewhere: on a CPU padding costs real compute). Their padding rows write to one
        # spare slot past the pool's.
        self.bucketed_prefill = self.use_graphs
        self.cache = BatchedKVCache.for_model(model, runner.dtype, self.device, slots + 1, capacity)
        self.slots, self.capacity = slots, capacity
        self._rounds: dict[tuple[int, int, int, bool], _Round] = {}
        self._prefills: dict[tuple[int, int], _Prefill] = {}
        self._chains: dict[tuple[int, int, int, int], _Chain] = {}
        self._ar = torch.arange(capacity, device=self.device)
        self._neg = torch.finfo(runner.dtype).min
        self._pool: Any = None
        if self.use_graphs:
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.lock = threading.Lock()  # one round at a time on this pool
        # On CUDA the rounds' attention folds each KV head's query group into its rows and attends
        # through two matmuls (specsplit.runtime.attention): every row's K/V is read once, where
        # the SDPA path would first copy it to every query head of every row.
        self.attention_kwargs = dict(runner.attention_kwargs)
        if self.attention_kwargs and self.device.type == "cuda":
            self.attention_kwargs[FOLD_KWARG] = "math"
        self._step: Any = None
        if compile:
            raise_recompile_limit(64)
            self._step = torch.compile(self._round_forward)

    def noise_for(self, seed: int | None, depth: int) -> PositionNoise | None:
        """A row's noise ring for rounds of trees up to ``depth - 1`` nodes (None unseeded)."""
        if seed is None:
            return None
        return PositionNoise(seed, self.runner.vocab_size, self.runner.output_device, depth)

    def fits(self, slots: int, capacity: int) -> bool:
        return slots <= self.slots and capacity <= self.capacity

    # ------------------------------------------------------------------ prompts
    @torch.inference_mode()
    def prefill(self, first_slot: int, prompts: list[list[int]]) -> None:
        """Write the KV of ``prompts`` (one per slot from ``first_slot``) in batched forwards of at
        most :data:`PREFILL_TOKENS` padded tokens. Rows shorter than the longest write past their
        length (slots their next forward overwrites) and attend only to their own tokens. On CUDA
        with graphs the groups replay graphs of bucketed shapes (:meth:`_graph_groups`)."""
        if first_slot < 0 or first_slot + len(prompts) > self.slots:
            raise ValueError(f"rows {first_slot}..{first_slot + len(prompts)} past {self.slots} slots")
        if self.bucketed_prefill:
            for lo, hi, rows, width in self._graph_groups([len(p) for p in prompts]):
                if rows * width > PREFILL_TOKENS or width > self.capacity:  # eager (or refused there)
                    self._prefill_group(first_slot + lo, prompts[lo:hi], len(prompts[lo]))
                else:
                    self._prefill_graphed(first_slot + lo, prompts[lo:hi], rows, width)
            return
        i = 0
        while i < len(prompts):
            j, longest, total = i + 1, len(prompts[i]), len(prompts[i])
            while j < len(prompts):
                wider = max(longest, len(prompts[j]))
                rows = j + 1 - i
                # A group pads every row to its longest: keep it within the token budget and the
                # padding within a quarter of the real tokens (callers sort rows by length).
                if wider * rows > PREFILL_TOKENS or wider * rows > PREFILL_SLACK * (total + len(prompts[j])):
                    break
                longest, total, j = wider, total + len(prompts[j]), j + 1
            self._prefill_group(first_slot + i, prompts[i:j], longest)
            i = j

    def _graph_groups(self, lengths: list[int]) -> list[tuple[int, int, int, int]]:
        """Consecutive groups of rows for graphed prefills, ``(first, end, row bucket, width
        bucket)`` each: the split that minimises padded tokens plus
        :data:`PREFILL_GRAPH_GROUP_TOKENS` a group (dynamic programming over the rows in order;
        callers sort them by length). A group holds at most :data:`PREFILL_TOKENS` padded tokens;
        a longer row is a group of its own (its width then exceeds that, and it runs eagerly)."""
        n = len(lengths)
        best = [0.0] + [float("inf")] * n
        start = [0] * (n + 1)
        for j in range(1, n + 1):
            longest = 0
            for i in range(j - 1, -1, -1):
                longest = max(longest, lengths[i])
                rows, width = self._prefill_shape(j - i, longest)
                if rows * width > PREFILL_TOKENS and j - i > 1:
                    break
                cost = best[i] + PREFILL_GRAPH_GROUP_TOKENS + rows * width
                if cost < best[j]:
                    best[j], start[j] = cost, i
        groups = []
        j = n
        while j > 0:
            i = start[j]
            groups.append((i, j, *self._prefill_shape(j - i, max(lengths[i:j]))))
            j = i
        return [g for g in reversed(groups) if max(lengths[g[0] : g[1]]) > 0]

    @torch.inference_mode()
    def capture_prefills(self, max_rows: int | None = None) -> int:
        """Capture every graphed prefill shape this pool can use (rows and width buckets within
        :data:`PREFILL_TOKENS`; groups of at most ``max_rows`` rows) now, while no row is live:
        which shapes a server meets depends on how its clients' calls happen to arrive together,
        and a shape met first while serving stops every row's rounds for its capture. Pools that
        write one new session's prompt at a time (:meth:`extend`) need ``max_rows=1``. Returns
        the graphs captured (0 without graphs)."""
        if not self.bucketed_prefill or not self.use_graphs:
            return 0
        before = self.captures
        for rows, width in self.prefill_shapes():
            if max_rows is None or rows <= max_rows:
                self._prefill_graphed(0, [], rows, width)
        return self.captures - before

    @torch.inference_mode()
    def capture_rounds(self, sizes: tuple[int, ...]) -> int:
        """Capture every greedy round shape of this pool (:meth:`round_shapes`) now, while no row
        is live (the warm-ups write into free slots only). Rows joining and leaving walk a server
        through batch buckets and KV buckets in whatever order its clients happen to arrive and
        finish, and each shape met first while serving stops every row for its capture. Returns
        the graphs captured (0 without graphs)."""
        if not self.use_graphs:
            return 0
        before = self.captures
        greedy = SamplingParams()
        for bp, n, kv in self.round_shapes(sizes):
            rnd = self._round_buffers(bp, n, kv, True)
            if rnd.graph is None:
                self._stage(rnd, [], n)  # padding rows only
                what = f"round ({bp} rows x {n} nodes over {kv} key slots)"
                rnd.graph, rnd.out = self._capture(
                    rnd.stage, functools.partial(self._body, rnd, n, greedy), what
                )
        return self.captures - before

    def round_shapes(self, sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """Every ``(batch bucket, nodes, KV bucket)`` a round of this pool verifying trees of
        ``sizes`` nodes can take (:meth:`round` pads to these)."""
        buckets = sorted({batch_bucket(b, self.slots) for b in range(1, self.slots + 1)})
        kvs = sorted({kv_bucket(e, self.capacity) for e in _powers(1, self.capacity)})
        return [(bp, n, kv) for bp in buckets for n in sorted(set(sizes)) for kv in kvs if 1 + n <= kv]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every ``(rows, width)`` a bucketed prefill of this pool can take (within
        :data:`PREFILL_TOKENS`; widths up to the slots' capacity)."""
        cap = self.capacity
        widths = sorted(
            {self._prefill_shape(1, min(w, cap))[1] for w in _powers(PREFILL_GRAPH_MIN_WIDTH, cap)}
        )
        return [(r, w) for w in widths for r in _powers(1, self.slots) if r * w <= PREFILL_TOKENS]

    def _prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """A graphed prefill's padded shape: rows to a power of two, width to a power of two (at
        least :data:`PREFILL_GRAPH_MIN_WIDTH`, at most the slots' capacity)."""
        width = max(longest, PREFILL_GRAPH_MIN_WIDTH)
        # A prompt longer than a slot keeps its own width: prefill() sends it to the eager path,
        # which refuses it (ResourceExhausted).
        return 1 << (rows - 1).bit_length(), min(1 << (width - 1).bit_length(), max(self.capacity, longest))

    def _prefill_graphed(self, first: int, prompts: list[list[int]], rows: int, width: int) -> None:
        """One group's prompts written from a graph of its padded shape: row ``r`` into slot
        ``first + r``; padding rows write to the spare slot and attend to themselves."""
        pre = self._prefills.get((rows, width))
        if pre is None:
            pre = self._prefills[(rows, width)] = _Prefill(*self._staging(rows, 2 + width))
        staged = pre.host.numpy()
        staged[:] = 0
        staged[:, 0] = self.slots  # the spare slot
        staged[:, 1] = 1
        for r, p in enumerate(prompts):
            staged[r, 0], staged[r, 1] = first + r, len(p)
            staged[r, 2 : 2 + len(p)] = p
        pre.stage.copy_(pre.host, non_blocking=True)
        if not self.use_graphs:  # the same shapes run eagerly (tests on a CPU)
            self._prefill_body(pre.stage)
            return
        if pre.graph is None:
            what = f"prefill ({rows} rows x {width} tokens)"
            pre.graph, pre.out = self._capture(pre.stage, lambda: self._prefill_body(pre.stage), what)
        replay(pre.graph, self.device, self.runner, pre.out)

    def _prefill_body(self, st: torch.Tensor) -> torch.Tensor:
        """Device ops only (one graph): ids, positions and a causal mask within each row's length
        from the staged buffer, then the forward writing every row's slot."""
        width = st.shape[1] - 2
        ids, lens = st[:, 2:], st[:, 1:2]
        ar = self._ar[:width]
        pos = ar[None].expand_as(ids)
        seen = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < lens[:, :, None])  # [R, q, kv]
        seen = seen | torch.eye(width, dtype=torch.bool, device=self.device)[None]  # padding: themselves
        mask = torch.where(seen, 0.0, self._neg).to(self.runner.dtype)[:, None]
        self.cache.bind_fresh(pos, st[:, 0])
        try:
            logits = self._model_call(ids, pos, mask, 1)
        finally:
            self.cache.bind(None)
        return logits[:, -1, :1].clone()  # the logits are not needed; a small output keeps the graph's

    @torch.inference_mode()
    def extend(self, slot: int, start: int, tokens: list[int]) -> None:
        """Write the KV of ``tokens`` at positions ``start ..`` of ``slot`` (its first ``start``
        positions are context): a session's committed tokens beyond what its slot holds. A new
        session's prompt (``start`` 0) takes the graphed prefill on CUDA, as a joining row's does."""
        if start == 0 and self.bucketed_prefill:
            self.prefill(slot, [tokens])
            return
        self._prefill_group(slot, [tokens], len(tokens), start)

    def _prefill_group(self, first: int, prompts: list[list[int]], width: int, start: int = 0) -> None:
        if width == 0:
            return
        if start + width > self.capacity:
            raise ResourceExhausted(f"{start + width} positions do not fit a slot of {self.capacity}")
        k, dev = len(prompts), self.device
        ids = torch.zeros(k, width, dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        for r, p in enumerate(prompts):
            if p:
                ids[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        ar = torch.arange(width)
        causal = ar[None, :] <= ar[:, None]  # [q, kv]
        seen = causal[None] & (ar[None, None, :] < lens[:, None, None])  # [k, q, kv]
        seen |= torch.eye(width, dtype=torch.bool)[None]  # padding rows: themselves (finite, unread)
        context = torch.ones(k, width, start, dtype=torch.bool)  # what the slot held before
        mask = torch.where(torch.cat([context, seen], dim=-1), 0.0, self._neg).to(self.runner.dtype)[:, None]
        pos = ar[None].expand(k, width) + start
        wpos = pos.to(dev)
        self.cache.bind(wpos, start + width, first)
        try:
            self._model_call(ids.to(dev), pos.to(dev), mask.to(dev), 1)
        finally:
            self.cache.bind(None)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Hand slot ``src``'s first ``length`` positions to slot ``dst`` (a row leaving the batch
        gives its slot to the last row, so live rows stay packed at the front)."""
        self.cache.move_slot(src, dst, length)

    # ------------------------------------------------------------------ rounds
    @torch.inference_mode()
    def round(self, rows: list[RowTree], sampling: SamplingParams, nodes: int) -> list[RowOutcome]:
        """One round for ``rows`` (slots ``0 .. len(rows) - 1``), every tree padded to ``nodes``.

        Each row's cache then holds its committed length + 1 (the pending token) + its accepted
        nodes; the caller tracks the lengths."""
        b = len(rows)
        if not 0 < b <= self.slots:
            raise ValueError(f"a round takes 1..{self.slots} rows, got {b}")
        n = max([nodes] + [len(r.tokens) for r in rows])
        q = 1 + n
        end = max(r.length for r in rows) + q
        if end > self.capacity:
            raise ResourceExhausted(f"a round needs {end} positions; a slot holds {self.capacity}")
        bp = batch_bucket(b, self.slots)
        greedy = not sampling.do_sample
        rnd = self._round_buffers(bp, n, kv_bucket(end, self.capacity), greedy)
        self._stage(rnd, rows, n)
        if self.use_graphs and rnd.graph is None:
            what = f"round ({bp} rows x {n} nodes over {rnd.mask.shape[-1]} key slots)"
            rnd.graph, rnd.out = self._capture(rnd.stage, lambda: self._body(rnd, n, sampling), what)
        if rnd.graph is not None:
            out = replay(rnd.graph, self.device, self.runner, rnd.out)
        else:
            out = self._body(rnd, n, sampling)
        if not greedy:
            out = self._decide_sampled(rnd, out, rows, sampling, n)
        packed = read_outcome(out[:b])  # the round's one host read
        return [_outcome(row, n) for row in packed]

    def _round_buffers(self, bp: int, n: int, kv: int, greedy: bool) -> _Round:
        key = (bp, n, kv, greedy)
        rnd = self._rounds.get(key)
        if rnd is None:
            q, dev = 1 + n, self.device
            width = _width(q, n)
            stage, host = self._staging(bp, width)
            rnd = self._rounds[key] = _Round(
                stage=stage,
                host=host,
                mask=torch.zeros(bp, 1, q, kv, dtype=self.runner.dtype, device=dev),
                ids=torch.zeros(bp, q, dtype=torch.long, device=dev),
                pos=torch.zeros(bp, q, dtype=torch.long, device=dev),
                wpos=torch.zeros(bp, q, dtype=torch.long, device=dev),
                greedy=greedy,
            )
        return rnd

    def _stage(self, rnd: _Round, rows: list[RowTree], n: int) -> None:
        """Every row's inputs into the pinned buffer (numpy), then one copy to the device."""
        host = rnd.host.numpy()
        q = 1 + n
        bp = host.shape[0]
        host[:] = 0
        a0 = 1 + 2 * q
        p0 = a0 + q * q
        anc = host[:, a0:p0].reshape(bp, q, q)
        anc[:, np.arange(q), np.arange(q)] = 1  # padding rows and nodes see themselves
        host[:, 1 + q : a0] = 1  # padding nodes: depth 1
        host[:, p0 + n : p0 + 2 * n] = -1  # padding nodes never match
        b = len(rows)
        host[:b, 0] = [r.length for r in rows]
        host[:b, 1] = [r.pending for r in rows]
        host[:b, 1 + q] = 0
        anc[:b, :, 0] = 1  # every row of a real sequence sees its pending token
        parents = np.full((b, n), -1, dtype=np.int64)  # node parents, -1 for roots and padding
        for i, r in enumerate(rows):  # a row's lists into its slices (no per-node work)
            k = len(r.tokens)
            if k:
                host[i, 2 : 2 + k] = r.tokens
                host[i, 2 + q : 2 + q + k] = r.depths
                parents[i, :k] = r.parents
                host[i, p0 : p0 + k] = parents[i, :k] + 1
                host[i, p0 + n : p0 + n + k] = r.tokens
        rows_ix = np.arange(b)
        for j in range(n):  # node j of every row sees what its parent sees among the nodes before it
            p = parents[:, j]
            has = p >= 0
            if has.any():
                anc[rows_ix[has], 1 + j, 1 : 1 + j] = anc[rows_ix[has], 1 + p[has], 1 : 1 + j]
        rnd.stage.copy_(rnd.host, non_blocking=True)

    def _body(self, rnd: _Round, n: int, sampling: SamplingParams) -> torch.Tensor:
        """Device ops only (captured as the round's graph): inputs from the staged buffer, mask,
        forward; greedy rounds also decide, accept and move the KV (a packed outcome); sampled
        rounds return the logits."""
        logits = self._fill_forward(rnd, n)
        if not rnd.greedy:
            return logits
        return self._accept(rnd, logits.argmax(dim=-1), n)

    def _fill_forward(self, rnd: _Round, n: int) -> torch.Tensor:
        st = rnd.stage
        bp, q, kv = rnd.ids.shape[0], 1 + n, rnd.mask.shape[-1]
        a0 = 1 + 2 * q
        lens = st[:, :1]  # [B, 1]
        anc = st[:, a0 : a0 + q * q].view(bp, q, q) > 0
        rnd.ids.copy_(st[:, 1 : 1 + q])
        torch.add(st[:, 1 + q : a0], lens, out=rnd.pos)
        torch.add(self._ar[:q][None], lens, out=rnd.wpos)
        rel = self._ar[:kv][None] - lens  # [B, kv] position relative to the pending token's slot
        in_block = (rel >= 0) & (rel < q)
        seen = anc.gather(2, rel.clamp(0, q - 1)[:, None, :].expand(bp, q, kv)) & in_block[:, None, :]
        seen |= (rel < 0)[:, None, :]
        rnd.mask[:, 0].copy_(torch.where(seen, 0.0, self._neg))
        return self._forward_at(rnd.ids, rnd.pos, rnd.wpos, rnd.mask)

    def _forward_at(
        self, ids: torch.Tensor, pos: torch.Tensor, wpos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """A forward of the first ``B`` slots writing at ``wpos`` (compiled when asked)."""
        self.cache.bind(wpos, mask.shape[-1], 0)
        try:
            self.runner.forward_count += 1
            # Only one-token rounds are compiled: every tree size is a shape the attention's
            # branches specialise on, and compiling each took minutes on a GPU host.
            step = self._step if self._step is not None and ids.shape[1] == 1 else self._round_forward
            out: torch.Tensor = step(ids, pos, mask)
            return out
        finally:
            self.cache.bind(None)

    def _round_forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A round's model call (what ``torch.compile`` fuses): static buffers in, every row's logits out."""
        return self._logits(ids, pos, mask, ids.shape[1])

    def _model_call(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, keep: int
    ) -> torch.Tensor:
        self.runner.forward_count += 1
        return self._logits(ids, pos, mask, keep)

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
        return self.runner.logits(ids, pos, mask, self.cache, keep, **self.attention_kwargs)

    def _accept(self, rnd: _Round, choice: torch.Tensor, n: int) -> torch.Tensor:
        """Per row: the longest path of nodes whose token equals its parent row's ``choice``, the
        choice after it, and the KV of that path moved behind the pending token. Returns `[B, 2 +
        2N]` int64: accepted count, next token, path (node indices, -1 padded), path tokens."""
        bp = choice.shape[0]
        dev = choice.device
        if n == 0:
            zero = torch.zeros(bp, 1, dtype=torch.long, device=dev)
            return torch.cat([zero, choice[:, :1]], dim=1)
        st = rnd.stage
        p0 = 1 + 2 * (1 + n) + (1 + n) ** 2
        par_row = st[:, p0 : p0 + n]  # [B, N] parent's row (0: the pending token)
        match_tok = st[:, p0 + n : p0 + 2 * n]  # [B, N] token, -1 for padding
        match = match_tok == choice.gather(1, par_row)
        idx = torch.arange(n, device=dev)[None].expand(bp, n)
        cand = torch.where(match, idx, n)
        first = torch.full((bp, 1 + n), n, dtype=torch.long, device=dev)
        first = first.scatter_reduce(1, par_row, cand, reduce="amin")  # first accepted child per row
        row = torch.zeros(bp, 1, dtype=torch.long, device=dev)
        count = torch.zeros(bp, 1, dtype=torch.long, device=dev)
        steps = []
        for _ in range(n):
            child = first.gather(1, row)
            ok = child < n
            steps.append(torch.where(ok, child, -1))
            count += ok.long()
            row = torch.where(ok, child + 1, row)
        path = torch.cat(steps, dim=1)  # [B, N]
        toks = torch.where(path >= 0, rnd.ids.gather(1, path.clamp_min(0) + 1), -1)
        nxt = choice.gather(1, row)
        # KV: accepted node at depth d moves to the slot right after the pending token + d.
        base = st[:, :1] + 1
        dst = base + idx
        src = torch.where(path >= 0, base + path.clamp_min(0), dst)
        self.cache.keep_paths(src, dst)
        return torch.cat([count, nxt, path, toks], dim=1)

    def _decide_sampled(
        self, rnd: _Round, logits: torch.Tensor, rows: list[RowTree], sampling: SamplingParams, n: int
    ) -> torch.Tensor:
        """Sampled rounds: each row's choice is ``argmax(p / noise)`` with the noise of its own seed
        and absolute positions; then the same acceptance as greedy rounds."""
        bp, q, vocab = logits.shape
        probs = logits_to_probs(logits, sampling)  # [B, Q, V] float32
        depth = rnd.stage[:, 1 + q : 1 + 2 * q]  # [B, Q] (padding rows: zeros and ones)
        noise = torch.ones(bp, n + 1, vocab, dtype=torch.float32, device=logits.device)
        for i, r in enumerate(rows):
            if r.seed is None:
                noise[i].exponential_(1.0).clamp_min_(1e-20)
            elif r.noise is not None:
                noise[i] = r.noise.rows(r.length + 1, n + 1)
            else:
                noise[i] = position_noise(r.seed, r.length + 1, n + 1, vocab, logits.device)
        per_row = noise.gather(1, depth[..., None].clamp_max(n).expand(bp, q, vocab))
        choice = (probs / per_row).argmax(dim=-1)
        return self._accept(rnd, choice, n)

    def _capture(
        self, stage: torch.Tensor, body: Callable[[], torch.Tensor], what: str
    ) -> tuple[Any, torch.Tensor]:
        """Capture ``body`` (device ops reading ``stage``) as one graph; ``(graph, its output)``.
        Warm-up runs write only positions past each row's committed length: a staged round never
        moves committed KV."""
        with capture_section(f"batched {what}"), torch.cuda.device(self.device):
            # The snapshot is taken on the current stream BEFORE the side stream's wait is
            # recorded: the warm-up must not read it before the clone has run (it would stage
            # whatever the fresh block held, and index with it).
            snapshot = stage.clone()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    stage.copy_(snapshot)
                    body()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            stage.copy_(snapshot)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                out = body()
            self.captures += 1
            return graph, out

    # ------------------------------------------------------------------ chain drafts
    @torch.inference_mode()
    def chain(self, rows: list[ChainRow], k: int) -> list[list[int]]:
        """Greedy chain drafts for ``rows`` (slots ``0 .. len(rows) - 1``): each row's new tokens
        written behind its committed length in one forward (whose last real row gives the first
        draft token), then ``k - 1`` one-token forwards for every row at once; ONE host read.

        Each row's slot then holds its committed length + its new tokens; the drafted tokens' KV
        (written past it) is overwritten by the next call. Returns `k` tokens per row."""
        b = len(rows)
        if not 0 < b <= self.slots or k < 1:
            raise ValueError(f"a chain draft takes 1..{self.slots} rows and k >= 1, got {b} rows, k={k}")
        width = max(len(r.tokens) for r in rows)
        if min(len(r.tokens) for r in rows) < 1:
            raise ValueError("every chain row needs at least one new token")
        width = 1 << (width - 1).bit_length()  # padded to a power of two: few graph shapes
        end = max(r.length for r in rows) + width + k
        if end > self.capacity:
            raise ResourceExhausted(f"a chain draft needs {end} positions; a slot holds {self.capacity}")
        bp = batch_bucket(b, self.slots)
        ch = self._chain_buffers(bp, width, k, kv_bucket(end, self.capacity))
        host = ch.host.numpy()
        host[:] = 0
        host[:, 1] = 1  # padding rows: one token at position 0 of a free slot
        for i, r in enumerate(rows):
            host[i, 0], host[i, 1] = r.length, len(r.tokens)
            host[i, 2 : 2 + len(r.tokens)] = r.tokens
        ch.stage.copy_(ch.host, non_blocking=True)
        if self.use_graphs and ch.graph is None:
            ch.graph, ch.out = self._capture(
                ch.stage,
                lambda: self._chain_body(ch, k),
                f"chain draft ({bp} rows x {width} new tokens, k={k}, over {ch.ingest[3].shape[-1]} key slots)",
            )
        if ch.graph is not None:
            out = replay(ch.graph, self.device, self.runner, ch.out)
        else:
            out = self._chain_body(ch, k)
        return read_outcome(out[:b])

    def _staging(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A `[rows, width]` int64 device buffer and its host twin (pinned on CUDA) for one copy."""
        host = (
            empty_pinned(rows * width, torch.long)
            if self.device.type == "cuda"
            else torch.empty(rows * width, dtype=torch.long)
        )
        return torch.zeros(rows, width, dtype=torch.long, device=self.device), host.view(rows, width)

    def _chain_buffers(self, bp: int, width: int, k: int, kv: int) -> _Chain:
        key = (bp, width, k, kv)
        ch = self._chains.get(key)
        if ch is None:
            dev, dt = self.device, self.runner.dtype

            def inputs(q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                z = [torch.zeros(bp, q, dtype=torch.long, device=dev) for _ in range(3)]
                return z[0], z[1], z[2], torch.zeros(bp, 1, q, kv, dtype=dt, device=dev)

            stage, host = self._staging(bp, 2 + width)
            ch = self._chains[key] = _Chain(
                stage=stage,
                host=host,
                ingest=inputs(width),
                level=inputs(1),
            )
        return ch

    def _chain_body(self, ch: _Chain, k: int) -> torch.Tensor:
        """Device ops only (one graph): the ingest forward, then ``k - 1`` levels, argmax each."""
        st = ch.stage
        width = st.shape[1] - 2
        lens, count = st[:, :1], st[:, 1:2]
        ids, pos, wpos, mask = ch.ingest
        kv = mask.shape[-1]
        rel = self._ar[:kv][None] - lens  # [B, kv] slot relative to the first new token's
        ids.copy_(st[:, 2:])
        torch.add(self._ar[:width][None], lens, out=pos)
        wpos.copy_(pos)
        mask[:, 0].copy_(torch.where(rel[:, None, :] <= self._ar[:width][None, :, None], 0.0, self._neg))
        logits = self._forward_at(ids, pos, wpos, mask)  # [B, W, V]
        last = logits.gather(1, (count - 1)[:, :, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        tok = last.argmax(dim=-1, keepdim=True)  # [B, 1]
        drafted = [tok]
        ids, pos, wpos, mask = ch.level
        for i in range(1, k):  # token i of the chain sits right after the new tokens + i - 1 drafts
            ids.copy_(tok)
            torch.add(lens, count + (i - 1), out=pos)
            wpos.copy_(pos)
            mask[:, 0, 0].copy_(torch.where(rel <= count + (i - 1), 0.0, self._neg))
            tok = self._forward_at(ids, pos, wpos, mask)[:, -1].argmax(dim=-1, keepdim=True)
            drafted.append(tok)
        return torch.cat(drafted, dim=1)


class RoundDriver:
    """Rounds shared by many waiting callers without a thread of their own: whoever waits while no
    round runs runs the next one for everybody (``lock``); the others wait on ``cv``, which the
    callers' bookkeeping shares."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cv = threading.Condition()

    def turn(self, ready: Callable[[], bool], step: Callable[[], None]) -> None:
        """Run ``step`` once unless another caller is running one (or ``ready()`` already holds);
        otherwise wait, bounded, until ``ready()`` or until no round runs."""
        if self.lock.acquire(blocking=False):
            try:
                if not ready():
                    step()
            finally:
                self.lock.release()
                with self.cv:
                    self.cv.notify_all()
        else:
            with self.cv:
                self.cv.wait_for(lambda: ready() or not self.lock.locked(), 0.05)


def _powers(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` up to the first one that reaches ``hi``."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


def read_outcome(packed: torch.Tensor) -> list[list[int]]:
    """The one device-to-host read of a round: every row's packed outcome."""
    rows: list[list[int]] = packed.tolist()
    return rows


def _width(q: int, n: int) -> int:
    """Staged int64 values per row: length, Q tokens, Q depths, the Q x Q visibility block, N parent
    rows and N match tokens."""
    return 1 + 2 * q + q * q + 2 * n


def _outcome(packed: list[int], n: int) -> RowOutcome:
    m, nxt = packed[0], packed[1]
    return RowOutcome(packed[2 : 2 + m], packed[2 + n : 2 + n + m], nxt)
