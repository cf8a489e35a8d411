"""Training an EAGLE draft head (:mod:`specsplit.runtime.eagle`) for one target, from its own chats.

The chats are the ones draft heads train on (:func:`~specsplit.runtime.heads_training.synthesize_chats`:
sampled questions, the target's greedy answers), so the head learns exactly what it must guess when
drafting for greedy decoding. With the target frozen, its features ``f`` (post-norm hidden states)
over each chat are the inputs and the regression targets.

**Training-time unrolling.** At a round the head's first level reads true features, but every later
level reads the head's own predictions. Trained on true features only, it would meet inputs it never
saw. So each step unrolls ``unroll`` levels over the whole sequence at once: level ``s`` at position
``p`` reads the head's level ``s - 1`` prediction made at ``p - 1`` and the true token ``x_{p+1}`` (the
path a round accepts is the target's own), and attends exactly what a depth-``s`` tree node attends
at inference: the true keys of positions ``<= p - s + 1`` and its ancestors' keys at
``p - s + 2 .. p`` (:func:`unroll_mask`). Each level's loss is a smooth-L1 regression of the next feature
plus the cross-entropy of the token after it through the target's output layer over the head's
scored tokens (EAGLE's two losses), level ``s`` weighted ``decay ** (s - 1)``.

The scored tokens are the ``vocab_subset`` most frequent in the training answers (FR-Spec), plus
the model's special tokens. Held-out chats then measure accuracy by depth and, with the inference
code itself (:class:`~specsplit.runtime.eagle.EagleDrafter`), the guesses a round's tree accepts.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from specsplit.runtime.eagle import EagleConfig, EagleDrafter, EagleLayer, attend
from specsplit.runtime.heads import HeadsInfo
from specsplit.runtime.heads_training import Chat, FeatureCache, _batches, _hidden
from specsplit.runtime.vocab_subset import special_ids, subset_ids

logger = logging.getLogger(__name__)


@dataclass
class EagleTrainingOptions:
    """What :func:`train_eagle` does (the chats come from
    :class:`~specsplit.runtime.heads_training.HeadsTrainingOptions`).

    Attributes:
        unroll: levels unrolled a step (training-time test).
        epochs / lr / tokens_per_step: passes over the chats, AdamW's peak learning rate (linear
            warm-up over 5% of the steps, cosine decay), padded tokens a step.
        feature_weight / token_weight: weights of the feature regression and the token loss.
        decay: a level's loss weight relative to the level above it.
        vocab_subset / topk / width / depth: the head's scored tokens and tree
            (:class:`~specsplit.runtime.eagle.EagleConfig`).
        holdout: share of the chats kept out to measure the head.
        eval_positions / eval_nodes: positions of held-out answers where a round's tree is grown,
            and its size, for the accepted-guesses measure.
        warm_start: start from the target's last decoder layer (:meth:`EagleLayer.warm_start`)
            instead of a random layer; measured worse (benchmarks/NOTES.md, "An EAGLE head").
        cache_features_gb: keep the target's features of the training batches on the device, up to
            this many GiB, instead of recomputing them every epoch (0: never; on a GPU they cost a
            fraction of its memory, on a CPU they would cost host memory the forwards can spare).
        train_seconds: a time budget for the optimiser's steps (0: none); the planned steps shrink to
            what fits, measured after each epoch (:class:`_Schedule`).
        seed: seeds shuffling, the split and initialisation.
    """

    unroll: int = 4
    epochs: int = 4
    lr: float = 1e-3
    tokens_per_step: int = 8192
    feature_weight: float = 1.0
    token_weight: float = 1.0
    decay: float = 0.8
    vocab_subset: int = 32768
    topk: int = 8
    width: int = 8
    depth: int = 5
    holdout: float = 0.05
    eval_positions: int = 2000
    eval_nodes: int = 32
    warm_start: bool = False
    cache_features_gb: float = 24.0
    train_seconds: float = 0.0
    seed: int = 0


@dataclass
class EagleReport:
    """What training measured (also saved in the head's ``trained_on``)."""

    chats: int = 0
    answer_tokens: int = 0
    text_passages: int = 0  # passages of a text corpus trained on beside the chats
    text_tokens: int = 0
    generate_s: float = 0.0
    train_s: float = 0.0
    steps: int = 0
    final_loss: list[float] = field(default_factory=list)
    accuracy_by_depth: list[float] = field(default_factory=list)  # held-out top-1, unrolled
    accepted_per_round: float = 0.0  # held-out: guesses a round's tree accepts (eval_nodes nodes)
    subset_coverage: float = 0.0  # held-out answer tokens inside the scored subset


class _Schedule:
    """Linear warm-up over 5% of the steps, then cosine decay; with a time budget, the planned steps
    are re-fitted after each epoch to what the last epoch's pace fits in it (the decay then ends in
    time). The last epoch's pace, not the average: the first epoch also computes and caches the
    target's features, so its steps are slower than the later ones, and a later epoch may give back
    steps the first one took away (never more than planned)."""

    def __init__(self, total: int, budget_s: float):
        self.total, self.planned, self.budget_s = total, total, budget_s
        self.warm = max(1, total // 20)
        self._mark = (0, 0.0)  # (steps, seconds) at the end of the last epoch

    def lr_at(self, step: int) -> float:
        if step < self.warm:
            return (step + 1) / self.warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - self.warm) / max(1, self.total - self.warm))))

    def after_epoch(self, step: int, elapsed_s: float) -> None:
        if self.budget_s <= 0 or step == 0:
            return
        last_step, last_s = self._mark
        self._mark = (step, elapsed_s)
        if step == last_step:
            return
        pace = (elapsed_s - last_s) / (step - last_step)
        fits = max(step, min(self.planned, step + int((self.budget_s - elapsed_s) / pace)))
        if fits != self.total:
            logger.info("time budget: %d of the planned %d steps fit in %.0f s", fits, self.planned,
                        self.budget_s)  # fmt: skip
            self.total = fits


def _autocast(dev: torch.device) -> Any:
    """bf16 products for a float32 head on a GPU; nothing on a CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()


def rank_vocabulary(chats: list[Chat]) -> list[int]:
    """Answer tokens by frequency (ties: lower id first)."""
    counts: Counter[int] = Counter()
    for c in chats:
        counts.update(c.ids[c.answer_start :])
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def unroll_mask(length: int, level: int, device: torch.device | str) -> torch.Tensor:
    """`[T, level * T]` bool: which keys level ``level`` (1-based) at position ``p`` attends, the keys
    laid out level by level: level 1's (true features) at positions ``<= p - level + 1``, and level
    ``t``'s (2 <= t <= level) at position ``p - level + t`` alone (its ancestors, then itself)."""
    p = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    blocks = [j <= p - level + 1] + [j == p - level + t for t in range(2, level + 1)]
    return torch.cat(blocks, dim=1)


def unrolled_levels(
    layer: EagleLayer,
    feats: torch.Tensor,
    emb_next: torch.Tensor,
    rotary: torch.nn.Module,
    levels: int,
) -> list[torch.Tensor]:
    """Each level's predicted features `[B, T, H]` over a batch (teacher-forced tokens).

    Args:
        layer: the head.
        feats: `[B, T, H]` the target's features.
        emb_next: `[B, T, H]` the embedding of the token after each position (``e(x_{p+1})``).
        rotary: the target's rotary embedding.
        levels: levels unrolled.
    """
    b, t, _ = feats.shape
    pos = torch.arange(t, device=feats.device)[None].expand(b, t)
    cos, sin = rotary(feats, pos)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    x_in = feats
    neg = torch.finfo(torch.float32).min
    for level in range(1, levels + 1):
        x, q, k, v = layer.qkv(x_in, emb_next, cos, sin)
        keys.append(k)
        values.append(v)
        mask = torch.where(unroll_mask(t, level, feats.device), 0.0, neg)[None]
        y = layer.out(x, attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask))
        outs.append(y)
        x_in = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)  # level + 1 at p reads p - 1
    return outs


def _batch_tensors(model: Any, batch: list[Chat]) -> tuple[torch.Tensor, ...]:
    """``(features [B, T, H], ids [B, T], lengths [B], answer starts [B], choices [B, T])`` of a batch:
    ``choices[b, t]`` is the target's own (greedy) token after position ``t``, the label of every
    guess (on the target's greedy chats it is the next token)."""
    feats, ids, _ = _hidden(model, batch)
    dev = ids.device
    lens = torch.tensor([len(c.ids) for c in batch], device=dev)
    starts = torch.tensor([c.answer_start for c in batch], device=dev)
    lm = model.get_output_embeddings().weight
    flat = feats.reshape(-1, feats.shape[-1])
    with torch.no_grad():  # in slices: a [rows, vocab] product at once would take gigabytes
        choices = torch.cat(
            [F.linear(flat[i : i + 2048], lm).argmax(-1) for i in range(0, flat.shape[0], 2048)]
        )
    return feats, ids, lens, starts, choices.view(ids.shape)


def _level_rows(level: int, lens: torch.Tensor, starts: torch.Tensor, t: int) -> torch.Tensor:
    """`[B, T]` bool: positions where level ``level`` has a whole chain (it starts at
    ``p - level + 1 >= 0``) and its label ``x_{p+2}`` is an answer token."""
    p = torch.arange(t, device=lens.device)[None]
    return (p >= level - 1) & (p + 2 < lens[:, None]) & (p + 2 >= starts[:, None])


def _emb_next(model: Any, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the last column is never a chain's token
    with torch.no_grad():
        return model.get_input_embeddings()(nxt).to(dtype)


def train_eagle(
    model: Any, chats: list[Chat], opts: EagleTrainingOptions, base_model: str = ""
) -> tuple[EagleLayer, torch.Tensor, HeadsInfo, EagleReport]:
    """Train an EAGLE head on ``chats`` with the target ``model`` frozen.

    Returns:
        ``(layer, vocab_ids, info, report)``: the float32 head on the model's device, the tokens it
        scores, its description (accuracy by depth in ``rank_accuracy``) and what training measured.
    """
    if sum(c.source != "text" for c in chats) < 2:
        raise ValueError(f"training an EAGLE head needs at least 2 of the target's chats, got {len(chats)}")
    dev = model.get_input_embeddings().weight.device
    lm_head = model.get_output_embeddings().weight.detach()  # [V, H]
    rotary = model.get_decoder().rotary_emb
    rng = random.Random(opts.seed)
    texts = [c for c in chats if c.source == "text"]
    chats = [c for c in chats if c.source != "text"]
    rng.shuffle(chats)
    n_held = max(1, int(len(chats) * opts.holdout))
    held, train = chats[:n_held], chats[n_held:] + texts  # held out: the target's own answers only
    vocab = int(lm_head.shape[0])
    vocab_ids = subset_ids(vocab, opts.vocab_subset, rank_vocabulary(train), special_ids(model)).to(dev)
    cfg = EagleConfig.for_target(
        model, vocab_subset=int(vocab_ids.numel()), topk=opts.topk, width=opts.width, depth=opts.depth
    )
    torch.manual_seed(opts.seed)
    layer = EagleLayer(cfg).to(dev)
    if opts.warm_start:
        layer.warm_start(model)
    lm_sub = lm_head.index_select(0, vocab_ids)  # [S, H], the model's dtype
    index_of = torch.full((vocab,), -100, dtype=torch.long, device=dev)
    index_of[vocab_ids] = torch.arange(vocab_ids.numel(), device=dev)
    optim = torch.optim.AdamW(layer.parameters(), lr=opts.lr, weight_decay=0.0)
    batches = _batches(train, opts.tokens_per_step, random.Random(0))  # fixed groups, reshuffled each epoch
    plan = _Schedule(max(1, len(batches) * opts.epochs), opts.train_seconds)
    cache = FeatureCache(lambda b: _batch_tensors(model, b), opts.cache_features_gb)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, plan.lr_at)
    report = EagleReport(chats=len(chats), answer_tokens=sum(len(c.ids) - c.answer_start for c in chats),
                         text_passages=len(texts), text_tokens=sum(len(c.ids) - c.answer_start for c in texts))  # fmt: skip
    t0 = time.perf_counter()
    losses: list[torch.Tensor] = [torch.zeros(())] * opts.unroll
    step = 0
    for epoch in range(opts.epochs):
        if step >= plan.total:
            break
        order = list(range(len(batches)))
        rng.shuffle(order)
        for b_i in order[: plan.total - step]:
            feats, ids, lens, starts, choices = cache.get(batches[b_i])
            t = ids.shape[1]
            with _autocast(dev):
                outs = unrolled_levels(layer, feats.float(), _emb_next(model, ids, torch.float32), rotary,
                                       opts.unroll)  # fmt: skip
                loss = feats.new_zeros((), dtype=torch.float32)
                for level, y in enumerate(outs, start=1):
                    b, p = _level_rows(level, lens, starts, t).nonzero(as_tuple=True)
                    if b.numel() == 0:
                        continue
                    yv = y[b, p]
                    reg = F.smooth_l1_loss(yv.float(), feats[b, p + 1].float())
                    logits = F.linear(yv.to(lm_sub.dtype), lm_sub).float()
                    ce = F.cross_entropy(logits, index_of[choices[b, p + 1]], ignore_index=-100)
                    part = opts.feature_weight * reg + opts.token_weight * ce
                    loss = loss + opts.decay ** (level - 1) * part
                    losses[level - 1] = ce.detach()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.5)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 or step == plan.total:
                logger.info("epoch %d step %d/%d token loss by level %s", epoch + 1, step, plan.total,
                            " ".join(f"{float(v):.3f}" for v in losses))  # fmt: skip
        plan.after_epoch(step, time.perf_counter() - t0)
    report.steps, report.final_loss = step, [float(v) for v in losses]
    report.train_s = time.perf_counter() - t0
    layer.eval()
    report.accuracy_by_depth = evaluate_depths(model, layer, lm_sub, index_of, held, opts)
    report.accepted_per_round, report.subset_coverage = evaluate_rounds(model, layer, vocab_ids, held, opts)
    info = HeadsInfo(
        num_heads=cfg.depth, hidden_size=cfg.hidden_size, vocab_size=vocab, base_model=base_model,
        rank_accuracy=[[a] for a in report.accuracy_by_depth],
    )  # fmt: skip
    return layer, vocab_ids, info, report


@torch.no_grad()
def evaluate_depths(
    model: Any,
    layer: EagleLayer,
    lm_sub: torch.Tensor,
    index_of: torch.Tensor,
    chats: list[Chat],
    opts: EagleTrainingOptions,
) -> list[float]:
    """Held-out top-1 accuracy of each unrolled level (its chain's earlier tokens right)."""
    hits = [0] * opts.unroll
    counts = [0] * opts.unroll
    rotary = model.get_decoder().rotary_emb
    for batch in _batches(chats, opts.tokens_per_step, random.Random(0)):
        feats, ids, lens, starts, choices = _batch_tensors(model, batch)
        with _autocast(feats.device):
            outs = unrolled_levels(layer, feats.float(), _emb_next(model, ids, torch.float32), rotary,
                                   opts.unroll)  # fmt: skip
        for level, y in enumerate(outs, start=1):
            b, p = _level_rows(level, lens, starts, ids.shape[1]).nonzero(as_tuple=True)
            guess = F.linear(y[b, p].to(lm_sub.dtype), lm_sub).argmax(-1)
            hits[level - 1] += int((guess == index_of[choices[b, p + 1]]).sum())
            counts[level - 1] += int(b.numel())
    return [h / max(1, c) for h, c in zip(hits, counts, strict=True)]


def accepted_in_tree(packed: list[int], nodes: int, truth: list[int]) -> int:
    """Guesses of a packed tree (tokens, parents, depths) that the true continuation ``truth``
    accepts: the longest root path whose every node is the token that followed."""
    tokens, parents = packed[:nodes], packed[nodes : 2 * nodes]
    at, depth = -1, 0
    while depth < len(truth):
        nxt = next((i for i in range(nodes) if parents[i] == at and tokens[i] == truth[depth]), None)
        if nxt is None:
            break
        at, depth = nxt, depth + 1
    return depth


def evaluate_rounds(
    model: Any, layer: EagleLayer, vocab_ids: torch.Tensor, chats: list[Chat], opts: EagleTrainingOptions
) -> tuple[float, float]:
    """``(guesses a round's tree accepts, share of answer tokens the head can score)`` on held-out
    chats, at ``opts.eval_positions`` sampled answer positions (:func:`accepted_at`)."""
    spots = [(i, n) for i, c in enumerate(chats) for n in range(c.answer_start, len(c.ids) - 1)]
    random.Random(opts.seed).shuffle(spots)
    by_chat: dict[int, list[int]] = {}
    for i, n in sorted(spots[: opts.eval_positions]):
        by_chat.setdefault(i, []).append(n)
    nodes = min(opts.eval_nodes, layer.cfg.candidates)
    mean = accepted_at(model, layer, vocab_ids, chats, by_chat, [nodes])[nodes]
    scored = set(vocab_ids.tolist())
    answers = [t for c in chats for t in c.ids[c.answer_start :]]
    return mean, sum(1 for t in answers if t in scored) / max(1, len(answers))


@torch.no_grad()
def accepted_at(
    model: Any,
    layer: EagleLayer,
    vocab_ids: torch.Tensor,
    chats: list[Chat],
    spots: dict[int, list[int]],
    nodes: list[int],
) -> dict[int, float]:
    """Guesses a round's tree of each size in ``nodes`` accepts, on average over the positions
    ``spots[i]`` of chat ``i`` (where the round's next token sits), with the inference code: each
    chat's true features are ingested once, then a tree is grown below each position as a round would
    and walked along the tokens that followed."""
    dtype = model.get_output_embeddings().weight.dtype
    dev = vocab_ids.device
    longest = max(len(chats[i].ids) for i in spots)
    head = EagleDrafter(copy.deepcopy(layer).to(dtype), vocab_ids, model.get_output_embeddings().weight,
                        model.get_input_embeddings(), model.get_decoder().rotary_emb, longest, longest)  # fmt: skip
    sizes = [min(n, layer.cfg.candidates) for n in nodes]
    total = dict.fromkeys(sizes, 0)
    count = 0
    zero = torch.zeros((), dtype=torch.long, device=dev)
    for i, positions in spots.items():
        c = chats[i]
        feats, _, _ = _hidden(model, [c])
        t = len(c.ids)
        ids1 = torch.tensor(c.ids, device=dev)
        rows = head.ingest_rows(feats[0, : t - 1].to(dtype), ids1[1:], zero, torch.tensor(t - 1, device=dev))
        for n in positions:  # the next token x_n; the head's feature after it came from row n - 1
            for size in sizes:
                packed = head.grow(rows[n - 1], torch.tensor(n, device=dev), size).tolist()
                total[size] += accepted_in_tree(packed, size, c.ids[n + 1 :])
            count += 1
    return {n: total[min(n, layer.cfg.candidates)] / max(1, count) for n in nodes}
