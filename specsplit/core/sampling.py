"""Logits to probabilities, in ONE place for the draft, the target and the pipeline.

The transforms follow Hugging Face's logits warpers in the same order (temperature, top-k, top-p)
so that "the target's sampling distribution" means the same thing here as in ``generate()``.
Sampling uses the exponential-race trick (``argmax(p / E)``, ``E ~ Exp(1)``), which draws from
``p`` without a host sync; its top-k order is a draw of k tokens without replacement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.errors import ConfigError


@dataclass
class SamplingParams:
    """How tokens are chosen; ONE definition used by the draft, the target and the pipeline.

    ``top_k=0`` and ``top_p=1.0`` disable those filters. With ``do_sample=False`` the output is
    the target's greedy decoding and the other fields are ignored.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution.

    Args:
        logits: `[..., vocab]` raw logits (any float dtype).
        params: sampling parameters; with ``do_sample=False`` this is a plain softmax.

    Returns:
        `[..., vocab]` float32 probabilities (rows sum to 1).
    """
    x = logits.float()
    if not params.do_sample:
        return torch.softmax(x, dim=-1)
    if params.temperature != 1.0:
        x = x / params.temperature
    neg = torch.finfo(x.dtype).min
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, neg)
    if params.top_p < 1.0:
        # HF semantics: drop the low tail whose cumulative mass is <= 1 - top_p, keep >= 1 token.
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, neg)
    return torch.softmax(x, dim=-1)


# Candidates beyond top_k that the fast top-k + top-p path keeps for tokens tying the k-th value.
TIE_SLACK = 64


def fast_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logits_to_probs` without sorting the whole vocabulary when top-k and top-p are both
    on: top-p runs over the ``top_k + TIE_SLACK`` best candidates, which hold every token the top-k
    filter keeps unless more than ``TIE_SLACK`` further tokens tie the k-th value exactly.

    Returns:
        ``(probs, overflow)``: ``overflow`` is a `[1]` int64 device flag, 1 when a row's ties may
        reach past the candidates (then only :func:`logits_to_probs` is exact; read it with the
        round's host read and redo), or None when the exact transform ran.
    """
    vocab = logits.shape[-1]
    k = params.top_k
    if not (params.do_sample and k and params.top_p < 1.0 and k + TIE_SLACK < vocab):
        return logits_to_probs(logits, params), None
    x = logits.float()
    if params.temperature != 1.0:
        x = x / params.temperature
    neg = torch.finfo(x.dtype).min
    vals, ids = torch.topk(x, k + TIE_SLACK, dim=-1)  # descending
    kth = vals[..., k - 1 : k]
    vals = vals.masked_fill(vals < kth, neg)  # HF's top-k: ties with the k-th value stay
    # Top-p as in logits_to_probs, ascending; the tokens outside the candidates hold no mass.
    asc = vals.flip(-1)
    drop = torch.softmax(asc, dim=-1).cumsum(dim=-1) <= (1.0 - params.top_p)
    drop[..., -1] = False
    kept = asc.masked_fill(drop, neg).flip(-1)
    probs = torch.zeros_like(x).scatter_(-1, ids, torch.softmax(kept, dim=-1))
    overflow = ((vals[..., -1:] >= kth) & (kth > neg)).any().long().view(1)
    return probs, overflow


def exponential_noise(
    shape: torch.Size | tuple[int, ...], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """`shape` i.i.d. Exp(1) samples (float32), clamped away from 0."""
    e = torch.empty(shape, dtype=torch.float32, device=device).exponential_(1.0, generator=generator)
    return e.clamp_min_(1e-20)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of `[..., vocab]` probabilities; returns `[...]` int64 (no host sync)."""
    return (probs / exponential_noise(probs.shape, probs.device, generator)).argmax(dim=-1)


def sample_without_replacement(
    probs: torch.Tensor, k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw ``k`` tokens per row without replacement, in draw order; `[..., k]` int64.

    Entries drawn beyond a row's support have probability 0; callers detect them through ``probs``.
    """
    keys = probs / exponential_noise(probs.shape, probs.device, generator)
    return torch.topk(keys, k, dim=-1).indices


def truncate_top_k(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``k`` most probable tokens and renormalise.

    Returns:
        ``(ids [..., k] int64, probs [..., k] float32)``: a sparse, exact distribution.
    """
    k = min(k, probs.shape[-1])
    vals, ids = torch.topk(probs, k, dim=-1)
    vals = vals / vals.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return ids, vals


def make_generator(device: torch.device, seed: int | None) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed`` (``None`` → global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


_GOLDEN = 0x9E3779B97F4A7C15
_MIX = 0xBF58476D1CE4E5B9
_MASK = (1 << 63) - 1


def derive_seed(seed: int, position: int) -> int:
    """A seed for the randomness of one absolute position (or one round starting there) of a
    generation whose seed is ``seed``: splitmix64-style mixing, so nearby positions get unrelated
    streams."""
    x = (int(seed) * _GOLDEN + int(position) * _MIX) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * _MIX) & ((1 << 64) - 1)
    x ^= x >> 29
    return x & _MASK


def position_noise(seed: int, start: int, count: int, vocab: int, device: torch.device) -> torch.Tensor:
    """`[count, vocab]` Exp(1) noise for the absolute positions ``start .. start + count - 1``.

    Sampling position ``t`` as ``argmax(p_t / noise[t])`` draws from ``p_t``; because the noise
    depends on the position and the generation's seed only, the token sampled at a position is the
    same whatever tree (or none) a round verified there: seeded sampling gives the same tokens with
    any drafter, any tree and any number of rounds.
    """
    g = torch.Generator(device=device)
    rows = []
    for i in range(count):  # a tree's depth + 1 rows
        g.manual_seed(derive_seed(seed, start + i))
        rows.append(exponential_noise((vocab,), device, g))
    return torch.stack(rows) if rows else torch.empty(0, vocab, device=device)
