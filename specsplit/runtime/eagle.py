"""An EAGLE-style draft head: one decoder layer that drafts a tree from the target's own features.

Medusa's heads (:mod:`specsplit.runtime.heads`) guess every position from ONE hidden state, so the
fourth guess knows nothing of the first three. EAGLE (Li et al., 2024) drafts autoregressively at
the *feature* level instead: a single decoder layer reads the target's last hidden state ``f_p``
(the input of its output layer) and the embedding of the token that row decided, ``e(x_{p+1})``,
and predicts the next feature ``f_{p+1}``, which the target's own output layer turns into a
guess for ``x_{p+2}``::

    z_p = fc([f_p ; e(x_{p+1})])                 # [H]   (2H -> H)
    f^_{p+1} = layer(z_p | keys of positions <= p)  # one pre-norm decoder layer, its own KV cache
    logits = lm_head_S(f^_{p+1})                 # the target's output layer over S ranked tokens

Vocabulary in this module: *features* are the target's post-norm hidden states; *ingesting* a
committed position writes its key/value into the draft head's KV cache from the target's true
feature; *levels* of the tree are grown from the head's own predicted features.

A round, on the device and inside the target's one-graph round (no host work, no extra read):

1. **Ingest** the positions the round committed (the pending token's row and every accepted
   node's row), from the target's features of this very forward (:class:`FeatureTap`): a forward of
   the layer over those rows, writing their keys into the head's cache at their absolute positions.
   The last row's output is the head's guess of the feature after the round's next token.
2. **Grow** ``depth`` levels (EAGLE-2's rule): the ``topk`` best tokens below the next token; each
   later level expands the ``width`` frontier nodes of highest path log-probability, each with its
   ``topk`` best children, in ONE forward of ``width`` rows with tree attention (committed
   positions, the node's ancestors, itself).
3. **Pick** the ``nodes`` candidates of highest path log-probability; a child always scores
   strictly below its parent, so they form a tree, and in creation order parents come first. It
   leaves as `[3 * nodes]` int64 ``tokens, parents, depths``, the same form as the Medusa heads'
   dynamic tree, so every consumer of draft-head guesses (the n-gram rounds, gRPC) takes it as is.

The head scores only ``S`` tokens, the most frequent in the target's own answers (FR-Spec): the
output layer is the largest read of a level. Lossless by construction, like every drafter here:
the head only proposes and the target verifies every node; a token outside the subset is never
guessed, which can only end a round earlier.

The cache belongs to the target's static workspace (one session at a time, :mod:`~specsplit.runtime.
graphs`): every round of that session ingests what it committed, so the cache always holds the
session's committed context; a prompt's round ingests the whole prompt. Sessions on the eager path
get no guesses from this head.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from specsplit.errors import ConfigError
from specsplit.runtime.runner import h2d

logger = logging.getLogger(__name__)

KIND = "eagle"
_TIEBREAK = 1e-4  # as in heads.pick_guess_tree: a path scores strictly below its prefix
# Rows of the one-graph round's ingest are padded up to one of these (one compiled variant each).
INGEST_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256)
# Top-k over the scored subset in two stages of this many tokens each (None: one torch.topk); see
# chunked_topk. The default is what benchmarks/topk_probe.py measured faster on the GPU.
TOPK_CHUNK: int | None = 2048


@dataclass
class EagleConfig:
    """Shapes of an EAGLE draft head and the tree it grows.

    Attributes:
        hidden_size / num_heads / kv_heads / head_dim / intermediate_size / rms_eps / qkv_bias:
            the decoder layer's shapes (the target's, by default).
        vocab_size: the target's vocabulary.
        vocab_subset: tokens the head scores (the most frequent first; the vocabulary when larger).
        topk: children of an expanded node (and candidates below the next token).
        width: frontier nodes expanded per level.
        depth: levels of candidates (the deepest guess, counted below the next token).
    """

    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float = 1e-6
    qkv_bias: bool = True
    vocab_subset: int = 32768
    topk: int = 8
    width: int = 8
    depth: int = 5

    def __post_init__(self) -> None:
        if self.num_heads % self.kv_heads:
            raise ConfigError(f"EAGLE head: {self.num_heads} query heads over {self.kv_heads} KV heads")
        if not (1 <= self.width <= self.topk) or self.depth < 1:
            raise ConfigError(
                f"EAGLE tree needs 1 <= width <= topk and depth >= 1, got topk={self.topk}, "
                f"width={self.width}, depth={self.depth}"
            )

    @property
    def candidates(self) -> int:
        """Candidate nodes a round grows (the most a tree can take)."""
        return self.topk + (self.depth - 1) * self.width * self.topk

    @classmethod
    def for_target(cls, model: Any, **kw: Any) -> EagleConfig:
        """The target's layer shapes (``kw`` overrides: the tree, the subset)."""
        c: Any = getattr(model.config, "text_config", None) or model.config
        heads = int(c.num_attention_heads)
        return cls(
            hidden_size=int(c.hidden_size), num_heads=heads,
            kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            intermediate_size=int(c.intermediate_size), vocab_size=int(c.vocab_size),
            rms_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            qkv_bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")), **kw,
        )  # fmt: skip


class _RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _pack_rows(mods: tuple[torch.nn.Linear, ...], name: str) -> torch.Tensor | None:
    """One tensor of the modules' ``name`` parameters stacked by rows, each module's parameter
    replaced by its slice of it (None where a module has no such parameter)."""
    parts = [getattr(m, name) for m in mods]
    if any(t is None for t in parts):
        assert all(t is None for t in parts), f"some {name}s missing: the packed product would drop the rest"
        return None
    whole = torch.cat([t.detach() for t in parts])
    at = 0
    for m, t in zip(mods, parts, strict=True):
        setattr(m, name, torch.nn.Parameter(whole[at : at + t.shape[0]], requires_grad=t.requires_grad))
        at += t.shape[0]
    return whole


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class EagleLayer(torch.nn.Module):
    """The head's weights: the input projection and one pre-norm decoder layer (Llama/Qwen2 shape),
    with a final norm so its output lives where the target's features do.

    Split in two so a caller can place the new keys before attending: :meth:`qkv` then
    :func:`attend` then :meth:`out`.
    """

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        self.norm_in = _RMSNorm(h, cfg.rms_eps)
        self.q = torch.nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k = torch.nn.Linear(h, cfg.kv_heads * d, bias=cfg.qkv_bias)
        self.v = torch.nn.Linear(h, cfg.kv_heads * d, bias=cfg.qkv_bias)
        self.o = torch.nn.Linear(cfg.num_heads * d, h, bias=False)
        self.norm_mid = _RMSNorm(h, cfg.rms_eps)
        self.gate = torch.nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = torch.nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = torch.nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm_out = _RMSNorm(h, cfg.rms_eps)
        self._qkv_sizes = [cfg.num_heads * d, cfg.kv_heads * d, cfg.kv_heads * d]
        self._packed: tuple[Any, Any, Any] | None = None  # see pack()

    def qkv(
        self, feats: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(residual [B, R, H], q [B, heads, R, D], k, v [B, kv_heads, R, D])`` of rows with
        features ``feats`` and decided-token embeddings ``emb`` (`[B, R, H]`), rotated by ``cos`` /
        ``sin`` (`[B, R, D]`, their positions)."""
        b, r, _ = feats.shape
        c = self.cfg
        x = self.fc(torch.cat([feats, emb], dim=-1))
        h = self.norm_in(x)
        packed = self._packed if not torch.is_grad_enabled() else None
        if packed is not None:  # one product for q, k and v
            q, k, v = F.linear(h, packed[0], packed[1]).split(self._qkv_sizes, dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.reshape(b, r, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(b, r, c.kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(b, r, c.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x, _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def out(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """`[B, R, H]` the predicted features, from the residual ``x`` and the attention output."""
        x = x + self.o(attn)
        h = self.norm_mid(x)
        packed = self._packed if not torch.is_grad_enabled() else None
        if packed is not None:  # one product for gate and up
            gate, up = F.linear(h, packed[2]).chunk(2, dim=-1)
        else:
            gate, up = self.gate(h), self.up(h)
        x = x + self.down(F.silu(gate) * up)
        out: torch.Tensor = self.norm_out(x)
        return out

    def pack(self) -> None:
        """Lay q/k/v (weights and biases) and gate/up out as slices of one tensor each, for
        inference: two products a pass instead of five (each a kernel launch; the small k/v products
        are pure launch latency).

        The modules keep their parameters, now views of the packed tensors: no second copy, and
        weights loaded or changed in place afterwards are what the packed products read. Forwards
        with autograd use the separate modules (each parameter gets its gradient). Call it once the
        layer has its device and dtype: ``.to()`` gives the modules new tensors and undoes it."""
        with torch.no_grad():
            self._packed = (
                _pack_rows((self.q, self.k, self.v), "weight"),
                _pack_rows((self.q, self.k, self.v), "bias"),
                _pack_rows((self.gate, self.up), "weight"),
            )

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # .to() / .half() / .cuda() give the parameters new tensors: the packing no longer holds them
        self._packed = None
        return super()._apply(fn, recurse)

    def warm_start(self, model: Any) -> None:
        """Copy the target's last decoder layer (and final norm) into this one: a start that already
        computes with features of the right scale; ``fc`` starts as "take the feature"."""
        dec = model.get_decoder()
        last = dec.layers[-1]
        att, mlp = last.self_attn, last.mlp
        pairs = [(self.q, att.q_proj), (self.k, att.k_proj), (self.v, att.v_proj), (self.o, att.o_proj),
                 (self.gate, mlp.gate_proj), (self.up, mlp.up_proj), (self.down, mlp.down_proj),
                 (self.norm_in, last.input_layernorm), (self.norm_mid, last.post_attention_layernorm),
                 (self.norm_out, dec.norm)]  # fmt: skip
        with torch.no_grad():
            for mine, theirs in pairs:
                for name, p in mine.named_parameters():
                    src = getattr(theirs, name, None)
                    if isinstance(src, torch.Tensor) and src.shape == p.shape:
                        p.copy_(src.to(p.dtype))
            h = self.cfg.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, :h].copy_(torch.eye(h))
            self.fc.bias.zero_()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with an additive mask, the query groups folded onto their KV head
    (each KV head is read once).

    Args:
        q: `[B, heads, R, D]`; k, v: `[B, kv_heads, L, D]`.
        mask: `[B or 1, R, L]` additive (0 / a large negative).

    Returns:
        `[B, R, heads * D]`.
    """
    b, nh, r, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    g = nh // kvh
    s = torch.matmul(q.reshape(b, kvh, g * r, d), k.transpose(-1, -2)).float() * d**-0.5
    s = s.view(b, kvh, g, r, length) + mask.float()[:, None, None]
    p = s.softmax(-1).to(v.dtype).view(b, kvh, g * r, length)
    o = torch.matmul(p, v).view(b, nh, r, d)
    return o.transpose(1, 2).reshape(b, r, nh * d)


def chunked_topk(x: torch.Tensor, k: int, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-``k`` of ``x`` (`[R, N]`): values best first and their indices, as
    ``x.topk(k)`` gives them, in two stages: the top ``k`` of every run of ``chunk`` columns, then
    the top ``k`` of those. Exact (the best ``k`` of a row are among the best ``k`` of their runs);
    on a GPU two top-k's over short rows can take fewer kernels than one over a long row with few
    rows. Falls back to one ``topk`` when ``chunk`` is None or does not split the rows evenly."""
    r, n = x.shape
    if chunk is None or k > chunk or n % chunk or n // chunk * k >= n:
        vals, idx = x.topk(k, dim=-1)
        return vals, idx
    runs = n // chunk
    part_v, part_i = x.view(r, runs, chunk).topk(k, dim=-1)  # [R, runs, k]
    offsets = torch.arange(0, n, chunk, device=x.device).view(1, runs, 1)
    vals, at = part_v.reshape(r, runs * k).topk(k, dim=-1)
    return vals, (part_i + offsets).reshape(r, runs * k).gather(1, at)


class EagleDrafter:
    """An EAGLE head's state for rounds of one sequence: its KV cache, its output layer over the
    subset, and the two device functions :meth:`ingest` and :meth:`grow`.

    Args:
        layer: the head's weights (in the target's dtype, on its device).
        vocab_ids: `[S]` int64 the tokens the head scores.
        lm_head: `[V, H]` the target's output layer weight (rows ``vocab_ids`` are copied once).
        embed: the target's input embedding module.
        rotary: the target's rotary embedding module (``rotary(x, position_ids) -> (cos, sin)``).
        capacity: positions the cache holds (the target workspace's slots).
        max_ingest: most rows one :meth:`ingest` pads to (scratch slots for its padding rows).
    """

    def __init__(
        self,
        layer: EagleLayer,
        vocab_ids: torch.Tensor,
        lm_head: torch.Tensor,
        embed: torch.nn.Module,
        rotary: torch.nn.Module,
        capacity: int,
        max_ingest: int,
    ):
        cfg = layer.cfg
        w = layer.fc.weight
        dev, dt = w.device, w.dtype
        layer.pack()
        self.layer, self.cfg, self.embed, self.rotary = layer, cfg, embed, rotary
        self.topk_chunk = TOPK_CHUNK
        self.capacity = capacity
        self.vocab_ids = vocab_ids.to(dev)
        # Cache slots: committed positions [0, capacity), then an ingest's padding rows, then the tree's.
        self.pad_base = capacity
        self.tree_base = capacity + max_ingest
        total = self.tree_base + (cfg.depth - 1) * cfg.width
        with torch.inference_mode(False):  # plain tensors: written in place inside inference mode
            self.lm = lm_head.detach().index_select(0, self.vocab_ids).to(dt).contiguous()  # [S, H]
            self.k = torch.zeros(1, cfg.kv_heads, total, cfg.head_dim, dtype=dt, device=dev)
            self.v = torch.zeros_like(self.k)
            self.slots = torch.arange(total, device=dev)
            self._width = torch.arange(cfg.width, device=dev)
        self.neg = torch.finfo(dt).min

    @property
    def device(self) -> torch.device:
        return self.k.device

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x, pos.view(1, -1))
        return cos, sin

    def _top(self, y: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best subset tokens of each row of features ``y`` (`[R, H]`): float32
        log-probabilities `[R, k]`, best first, and their subset indices. Top-k runs on the logits
        (log-softmax keeps each row's order) and only the k picks are normalised."""
        logits = F.linear(y, self.lm).float()  # [R, S]
        vals, idx = chunked_topk(logits, k, self.topk_chunk)
        return vals - logits.logsumexp(-1, keepdim=True), idx

    def ingest(
        self, feats: torch.Tensor, tokens: torch.Tensor, ctx: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        """Write committed positions ``ctx .. ctx + count - 1`` into the cache; device ops only.

        Every row's key and value go to the cache, but only the last real row's output is needed,
        so attention and the rest of the layer run for that row alone.

        Args:
            feats: `[M, H]` the target's features at those positions (rows past ``count``: padding).
            tokens: `[M]` int64 the token each row decided (the one at the next position).
            ctx: `[]` int64 the first row's position (the cache holds every position before it).
            count: `[]` int64 rows that are real (at least 1); padding rows write scratch slots.

        Returns:
            `[H]` the head's predicted feature after the last real row.
        """
        last = (count - 1).clamp_min(0).view(1)
        x, q, pos = self._write(feats, tokens, ctx, count)
        out = self._attend_out(x.index_select(1, last), q.index_select(2, last), pos.index_select(0, last))
        return out[0]

    def ingest_rows(
        self, feats: torch.Tensor, tokens: torch.Tensor, ctx: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`ingest`, returning every row's predicted feature (`[M, H]`)."""
        x, q, pos = self._write(feats, tokens, ctx, count)
        return self._attend_out(x, q, pos)

    def write(
        self, feats: torch.Tensor, tokens: torch.Tensor, ctx: torch.Tensor, count: torch.Tensor
    ) -> None:
        """:meth:`ingest`'s cache writes alone (a round that grows no tree); device ops only."""
        self._write(feats, tokens, ctx, count)

    def _write(
        self, feats: torch.Tensor, tokens: torch.Tensor, ctx: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An ingest's keys and values into the cache; ``(residual, rotated queries, positions)``."""
        m = feats.shape[0]
        ar = self.slots[:m]
        pos = ctx + ar  # [M]
        emb = self.embed(tokens).to(feats.dtype)
        cos, sin = self._rope(feats, pos)
        x, q, k, v = self.layer.qkv(feats[None], emb[None], cos, sin)
        where = torch.where(ar < count, pos, self.pad_base + ar)
        self.k.index_copy_(2, where, k)
        self.v.index_copy_(2, where, v)
        return x, q, pos

    def _attend_out(self, x: torch.Tensor, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """`[R, H]` ingested rows' outputs: each row at ``pos`` sees every committed position up to
        itself (this ingest's earlier rows included)."""
        seen = (self.slots[None, :] <= pos[:, None]) & (self.slots[None, :] < self.pad_base)
        mask = torch.where(seen, 0.0, self.neg).to(x.dtype)[None]  # [1, R, L]
        out: torch.Tensor = self.layer.out(x, attend(q, self.k, self.v, mask))[0]
        return out

    def level(
        self, hid: torch.Tensor, tok: torch.Tensor, anc: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One level's forward of tree rows; device ops only.

        Args:
            hid: `[W, H]` each row's input feature (its parent row's prediction).
            tok: `[W]` int64 each row's token (the node being expanded).
            anc: `[W, L]` bool the cache slots each row sees besides its own (committed positions,
                its ancestors' slots).
            slot: `[W]` int64 the scratch slots the rows' keys go to.
            pos: `[]` int64 the rows' position (one level sits at one depth).

        Returns:
            ``(predicted features [W, H], what each row saw [W, L] with its own slot)``.
        """
        w = hid.shape[0]
        emb = self.embed(tok).to(hid.dtype)
        cos, sin = self._rope(hid, pos.expand(w))
        x, q, k, v = self.layer.qkv(hid[None], emb[None], cos, sin)
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        seen = anc | (self.slots[None, :] == slot[:, None])  # [W, L]
        mask = torch.where(seen, 0.0, self.neg).to(hid.dtype)[None]
        y: torch.Tensor = self.layer.out(x, attend(q, self.k, self.v, mask))[0]
        return y, seen

    def grow(self, h: torch.Tensor, valid: torch.Tensor, nodes: int) -> torch.Tensor:
        """The round's guess tree below the next token; device ops only.

        Args:
            h: `[H]` the head's feature after the next token (:meth:`ingest`'s result).
            valid: `[]` int64 committed positions in the cache (the next token sits at ``valid``).
            nodes: nodes of the tree (at most :attr:`EagleConfig.candidates`).

        Returns:
            `[3 * nodes]` int64: tokens, parents (-1: below the next token) and depths, parents first.
        """
        c = self.cfg
        kk, w = c.topk, c.width
        dev = h.device
        vals, idx = self._top(h[None], kk)  # [1, K]
        vals, tok = vals[0], self.vocab_ids.index_select(0, idx[0])
        toks, scores, parents, depths = (
            [tok],
            [vals],
            [torch.full((kk,), -1, device=dev)],
            [torch.ones(kk, device=dev)],
        )
        f_tok, f_score = tok[:w], vals[:w]
        f_idx = torch.arange(w, device=dev)
        f_hid = h.expand(w, h.shape[0])
        committed = (self.slots < valid)[None]  # [1, L]
        f_anc = committed.expand(w, -1)  # [W, L] what each frontier node's row may see
        base = kk
        for level in range(1, c.depth):
            slot = self._width + (self.tree_base + (level - 1) * w)  # [W] this level's scratch slots
            y, seen = self.level(f_hid, f_tok, f_anc, slot, valid + level - 1)
            cv, ci = self._top(y, kk)  # [W, K]
            c_tok = self.vocab_ids.index_select(0, ci.reshape(-1))  # [W * K]
            c_score = (f_score[:, None] + cv).reshape(-1)
            toks.append(c_tok)
            scores.append(c_score)
            parents.append(f_idx.repeat_interleave(kk))
            depths.append(torch.full((w * kk,), level + 1.0, device=dev))
            if level < c.depth - 1:
                f_score, pick = c_score.topk(w)
                row = torch.div(pick, kk, rounding_mode="floor")
                f_tok, f_idx = c_tok.index_select(0, pick), base + pick
                f_hid, f_anc = y.index_select(0, row), seen.index_select(0, row)
            base += w * kk
        return pick_tree(torch.cat(toks), torch.cat(scores), torch.cat(parents), torch.cat(depths), nodes)


def pick_tree(
    tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, nodes: int
) -> torch.Tensor:
    """The ``nodes`` candidates of highest path score, in candidate order, as `[3 * nodes]` int64
    tokens, parents (re-indexed to the kept nodes; -1: a root) and depths.

    Candidates come parents first and a child scores at most its parent (log-probabilities only
    fall); the depth tie-break makes that strict, so the kept set is closed under parents."""
    pick = (scores - _TIEBREAK * depths).topk(nodes).indices.sort().values
    at = torch.full_like(parents, -1).index_copy(0, pick, torch.arange(nodes, device=pick.device))
    par = parents.index_select(0, pick)
    par = torch.where(par >= 0, at.index_select(0, par.clamp_min(0)), par)
    return torch.cat([tokens.index_select(0, pick), par, depths.index_select(0, pick).long()])


class FeatureTap(torch.nn.Module):
    """The target's final norm, which also keeps its output (the features) of every row.

    Unlike :class:`~specsplit.runtime.heads.HiddenTap` (the output layer's input, kept rows only),
    this sees every position of a forward, a prompt's too, which the head's cache needs. Forwards
    of more rows than ``capacity``, or of several sequences, are not kept.
    """

    rows: torch.Tensor

    def __init__(self, inner: torch.nn.Module, capacity: int, hidden: int, dtype: torch.dtype, device: Any):
        super().__init__()
        self.inner = inner
        with torch.inference_mode(False):
            rows = torch.zeros(capacity, hidden, dtype=dtype, device=device)
        self.register_buffer("rows", rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, q, H]
        out: torch.Tensor = self.inner(x)
        if out.shape[0] == 1 and out.shape[1] <= self.rows.shape[0]:
            self.rows[: out.shape[1]].copy_(out[0])
        return out


def install_feature_tap(model: Any, capacity: int) -> FeatureTap:
    """Wrap ``model``'s final norm in a :class:`FeatureTap` (once; returns the existing one)."""
    dec = model.get_decoder()
    norm = getattr(dec, "norm", None)
    if isinstance(norm, FeatureTap):
        if norm.rows.shape[0] < capacity:
            raise ConfigError(f"the feature tap holds {norm.rows.shape[0]} rows, {capacity} are needed")
        return norm
    if not isinstance(norm, torch.nn.Module):
        raise ConfigError(f"an EAGLE head needs the target's final norm; {type(dec).__name__} has none")
    w = model.get_output_embeddings().weight
    tap = FeatureTap(norm, capacity, int(w.shape[1]), w.dtype, w.device)
    dec.norm = tap
    return tap


# ---------------------------------------------------------------------- files
def save_eagle(layer: EagleLayer, vocab_ids: torch.Tensor, info: Any, out_dir: str | Path) -> Path:
    """Write the head (bf16) and ``info`` (a :class:`~specsplit.runtime.heads.HeadsInfo` of kind
    ``"eagle"``) into ``out_dir``."""
    from safetensors.torch import save_file

    from specsplit.runtime.heads import INFO_FILE, WEIGHTS_FILE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu", torch.bfloat16).contiguous() for n, p in layer.named_parameters()}
    tensors["vocab_ids"] = vocab_ids.detach().to("cpu", torch.long).contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    info.kind, info.eagle = KIND, asdict(replace(layer.cfg, vocab_subset=int(vocab_ids.numel())))
    (out / INFO_FILE).write_text(json.dumps(asdict(info), indent=1) + "\n")
    return out


def load_eagle(
    path: str | Path, info: Any, device: torch.device | str, dtype: torch.dtype
) -> tuple[EagleLayer, torch.Tensor]:
    """The head of an EAGLE heads directory (``info`` already read from it) on ``device``.

    Raises:
        ConfigError: the weights do not match the description.
    """
    from safetensors.torch import load_file

    from specsplit.runtime.heads import WEIGHTS_FILE

    try:
        cfg = EagleConfig(**info.eagle)
    except TypeError as e:
        raise ConfigError(f"EAGLE head in {path}: its description is not a layer's ({e})") from None
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    vocab = tensors.pop("vocab_ids", None)
    layer = EagleLayer(cfg)
    try:
        layer.load_state_dict(tensors)
    except RuntimeError as e:
        raise ConfigError(f"EAGLE head in {path} does not match its description ({e})") from None
    if vocab is None or vocab.dim() != 1 or not 1 <= vocab.numel() <= cfg.vocab_size:
        raise ConfigError(f"EAGLE head in {path} carries no valid vocab_ids")
    if int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size:
        raise ConfigError(f"EAGLE head in {path}: vocab_ids outside the vocabulary")
    layer.requires_grad_(False)
    return layer.to(device=device, dtype=dtype).eval(), vocab


def ingest_bucket(rows: int) -> int:
    """Rows a one-graph round's ingest is padded to (:data:`INGEST_BUCKETS`, or ``rows`` beyond)."""
    return next((b for b in INGEST_BUCKETS if b >= rows), rows)


class TargetEagle:
    """A target's EAGLE head, ready for rounds: the guesser behind ``TargetConfig.draft_heads``
    when the directory holds an EAGLE head (the same calls as
    :class:`~specsplit.runtime.heads.TargetHeads`).

    Args:
        model: the target (its final norm is wrapped in a :class:`FeatureTap`).
        path / info: the heads directory and its description.
        nodes: tree nodes the guesses take.
        capacity: positions of the target's static workspace (the head's cache).
        max_depth: deepest tree a verification takes (a round ingests up to ``max_depth + 1`` rows).
        compile: fuse the round's head computation with ``torch.compile`` (with the target's own).

    Raises:
        ConfigError: the head does not fit this target.
    """

    needs_static = True  # the cache follows the static workspace's session
    keeps_state = True  # every committed position must reach the head's cache, guesses or not

    def __init__(
        self, model: Any, path: str | Path, info: Any, nodes: int, capacity: int, max_depth: int,
        compile: bool = False,
    ):  # fmt: skip
        out = model.get_output_embeddings()
        w = cast(torch.Tensor, out.weight)
        layer, vocab = load_eagle(path, info, w.device, w.dtype)
        cfg = layer.cfg
        if cfg.hidden_size != w.shape[1] or cfg.vocab_size != w.shape[0]:
            raise ConfigError(
                f"EAGLE head in {path} was trained for hidden size {cfg.hidden_size} and vocabulary "
                f"{cfg.vocab_size}; this target has {w.shape[1]} and {w.shape[0]}"
            )
        self.info, self.cfg = info, cfg
        self.num_nodes = min(nodes, cfg.candidates)
        self.max_ingest = ingest_bucket(max_depth + 1)
        self.tap = install_feature_tap(model, capacity)
        self.drafter = EagleDrafter(
            layer, vocab, w, model.get_input_embeddings(), model.get_decoder().rotary_emb, capacity,
            self.max_ingest,
        )  # fmt: skip
        self._round_fn: Any = self._round
        self._ingest_fn: Any = self._ingest
        self.compiled = compile
        if compile:
            self._round_fn = torch.compile(self._round, dynamic=False)
            self._ingest_fn = torch.compile(self._ingest, dynamic=False)
        logger.info(
            "EAGLE draft head from %s: %d guess nodes a round (top-%d, %d wide, %d deep), %d scored tokens",
            path, self.num_nodes, cfg.topk, cfg.width, cfg.depth, vocab.numel(),
        )  # fmt: skip

    def _round(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> torch.Tensor:
        feats = self.tap.rows.index_select(0, rows)
        h = self.drafter.ingest(feats, decided, ctx, count)
        return self.drafter.grow(h, ctx + count, self.num_nodes)

    def _ingest(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> None:
        feats = self.tap.rows.index_select(0, rows)
        self.drafter.write(feats, decided, ctx, count)

    def _padded(self, rows: torch.Tensor, decided: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = rows.shape[0]
        # Every round pads to the same rows, so a compiled head has one variant, compiled in the
        # first round that asks for guesses (a variant per depth would compile mid-generation).
        size = self.max_ingest if self.compiled else ingest_bucket(m)
        if size > m:
            rows = torch.cat([rows, rows.new_zeros(size - m)])
            decided = torch.cat([decided, decided.new_zeros(size - m)])
        return rows, decided

    def round_guesses(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> torch.Tensor:
        """A one-graph round's guesses (device ops only): ``rows`` `[M]` the tap rows of the
        committed positions (the pending token's row, then each accepted node's), ``decided``
        `[M]` the token each decided, ``count`` `[]` how many are real, ``ctx`` `[]` the pending
        token's position."""
        rows, decided = self._padded(rows, decided)
        out: torch.Tensor = self._round_fn(rows, decided, count, ctx)
        return out

    def round_ingest(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> None:
        """A one-graph round that asks for no guesses: the committed positions' keys and values
        into the head's cache (what :meth:`round_guesses` writes), without growing a tree."""
        rows, decided = self._padded(rows, decided)
        self._ingest_fn(rows, decided, count, ctx)

    def eager_guesses(
        self, pending: list[int], tree_nodes: int, nodes: list[int], tokens: list[int], next_token: int,
        length: int, static: bool, grow: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        """An eager round's guesses (device tensor; the caller reads it): the round's forward held
        ``pending`` then a tree of ``tree_nodes`` (the tap's rows in that order), from position
        ``length``; it accepted ``nodes`` (``tokens``) and decided ``next_token``. None where this
        head cannot follow the session (not the static workspace's, or a forward the tap did not keep),
        and without ``grow`` (the committed positions only reach the head's cache)."""
        p = len(pending)
        rows = list(range(p)) + [p + i for i in nodes]
        kept = p + tree_nodes <= self.tap.rows.shape[0]
        if not static or not p or not kept or length + len(rows) > self.drafter.capacity:
            return None
        dev = self.drafter.device
        decided = pending[1:] + tokens + [next_token]
        ids = h2d(torch.tensor(rows + decided + [length, len(rows)], dtype=torch.long), dev)
        m = len(rows)
        if not grow:
            self._ingest(ids[:m], ids[m : 2 * m], ids[2 * m + 1], ids[2 * m])
            return None
        out: torch.Tensor = self._round(ids[:m], ids[m : 2 * m], ids[2 * m + 1], ids[2 * m])
        return out

    def nodes(self, guesses: list[int]) -> tuple[list[int], list[int], list[int]]:
        """The tree's ``(tokens, parents, depths)`` from one round's guesses read to the host."""
        n = self.num_nodes
        return guesses[:n], guesses[n : 2 * n], guesses[2 * n : 3 * n]
