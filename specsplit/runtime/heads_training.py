"""Training draft heads (:mod:`specsplit.runtime.heads`) for one target, from the target alone.

No dataset is needed, which matters offline: the target writes its own training data.

1. **Questions.** Each chat starts as the target's chat template up to a user turn, seeded with an
   opening word of a kind of request (``Write``, ``Translate``, ``Summarize``...), and the target
   samples the rest of the user's message (the Magpie recipe for instruction-tuned models).
2. **Answers.** The target answers each question greedily, in batches. Greedy answers are exactly
   what the heads must predict when they draft for greedy decoding (self-distillation).
3. **Heads.** With the target frozen, its last hidden states over each answer (and, for
   token-conditioned heads, the embedding of the token each row decided) train head ``k`` to
   predict the token ``k + 1`` places ahead (cross-entropy, head ``k`` weighted ``0.8 ** (k-1)`` as in
   Medusa). Held-out chats measure each head's rank accuracies, saved with the heads
   (:class:`~specsplit.runtime.heads.HeadsInfo`) to build the guess tree.

Everything runs on the target's device; a GPU does the default sizes in minutes, a CPU only tiny
ones (tests use tiny random models).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from specsplit.runtime.heads import DraftHeads, HeadsInfo, choice_paths, head_logits

logger = logging.getLogger(__name__)

# Opening words of user requests: the question sampler starts from one of these, so the questions
# spread over kinds of requests instead of following the model's single most likely opening.
OPENINGS = (
    "Write", "Explain", "Translate", "Summarize", "What", "How", "Why", "Can you", "Fix", "Refactor",
    "Implement", "Describe", "Compare", "Give", "List", "Solve", "Calculate", "Rewrite", "Add", "Convert",
    "Create", "Tell me", "Is", "Help me", "Please", "Find", "Generate", "Review", "Design", "I",
)  # fmt: skip


@dataclass
class HeadsTrainingOptions:
    """What :func:`train_heads` does.

    Attributes:
        num_heads: heads trained (tokens guessed after the target's next one).
        conversations: chats the target writes (questions and greedy answers).
        question_tokens / answer_tokens: most tokens of a sampled question / a greedy answer.
        generate_batch: chats generated together.
        epochs / lr / tokens_per_step: the optimiser's passes over the answers, AdamW's peak
            learning rate (linear warm-up over 5% of steps, cosine decay), tokens a step.
        holdout: share of the chats kept out of training to measure rank accuracies.
        ranks: ranks measured per head (the widest a guess tree branches).
        seed: seeds sampling, shuffling and the held-out split.
        token_input: token-conditioned heads (:class:`~specsplit.runtime.heads.DraftHeads`).
        cache_features_gb: keep the target's features of the training batches, up to this many GiB,
            instead of recomputing them every epoch (:class:`FeatureCache`; 0: never).
    """

    num_heads: int = 4
    conversations: int = 16384
    question_tokens: int = 64
    answer_tokens: int = 256
    generate_batch: int = 256
    epochs: int = 3
    lr: float = 1e-3
    tokens_per_step: int = 16384
    holdout: float = 0.05
    ranks: int = 10
    seed: int = 0
    token_input: bool = False
    cache_features_gb: float = 24.0


@dataclass
class Chat:
    """One training sequence: ``ids`` (prompt then answer) and where the answer starts.

    ``source``: ``"chat"`` (the target's own greedy answer) or ``"text"`` (a passage of some text
    wrapped as an answer, :func:`text_chats`: its tokens are not the target's choices, so only a
    trainer that labels with the target's own predictions uses it, and it is never held out).
    """

    ids: list[int]
    answer_start: int
    source: str = "chat"


@dataclass
class TrainingReport:
    """What training measured (also saved in the heads' ``trained_on``)."""

    chats: int = 0
    answer_tokens: int = 0
    generate_s: float = 0.0
    train_s: float = 0.0
    steps: int = 0
    final_loss: list[float] = field(default_factory=list)
    rank_accuracy: list[list[float]] = field(default_factory=list)
    accepted_per_round: float = 0.0  # held-out: guessed tokens a 32-node choice tree would accept


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return [int(i) for i in ids]


def question_prefixes(tokenizer: Any, n: int, seed: int) -> list[tuple[list[int], str]]:
    """``n`` question starts: the chat template's tokens up to a user message, then an opening word
    (``(token ids, the opening word)``)."""
    marker = "\u2063QUESTION\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    head = tokenizer(text[: text.index(marker)], add_special_tokens=False).input_ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = rng.choice(OPENINGS)
        out.append((list(head) + tokenizer(word, add_special_tokens=False).input_ids, word))
    return out


@torch.inference_mode()
def generate_batched(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    sample: bool,
    batch: int,
    seed: int,
) -> list[list[int]]:
    """Each prompt's continuation (cut after its first end-of-sequence token), left-padded batches
    through Hugging Face ``generate()``; sampled at temperature 1 or greedy."""
    dev = model.get_input_embeddings().weight.device
    out: list[list[int]] = []
    eos = set(eos_ids)
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        torch.manual_seed(seed + start)
        kw: dict[str, Any] = {"do_sample": sample}
        if sample:
            kw.update(temperature=1.0, top_p=0.95, top_k=0)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        gen = model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids) or None, pad_token_id=pad_id, repetition_penalty=None, **kw,
        )  # fmt: skip
        for row in gen[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            out.append(row[:cut])
        logger.info("generated %d of %d", min(start + batch, len(prompts)), len(prompts))
    return out


def synthesize_chats(model: Any, tokenizer: Any, opts: HeadsTrainingOptions) -> list[Chat]:
    """The target's own chats: sampled questions, greedy answers (module docstring)."""
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    starts = question_prefixes(tokenizer, opts.conversations, opts.seed)
    tails = generate_batched(
        model,
        [ids for ids, _ in starts],
        opts.question_tokens,
        eos,
        pad,
        True,
        opts.generate_batch,
        opts.seed,
    )
    questions = []
    for (_, word), tail in zip(starts, tails, strict=True):
        question = (
            word + tokenizer.decode([t for t in tail if t not in eos], skip_special_tokens=True)
        ).strip()
        if question != word:
            questions.append(question)
    prompts = [_chat_ids(tokenizer, q) for q in questions]
    answers = generate_batched(
        model, prompts, opts.answer_tokens, eos, pad, False, opts.generate_batch, opts.seed
    )
    return [Chat(list(p) + a, len(p)) for p, a in zip(prompts, answers, strict=True) if len(a) > 1]


# Files a text corpus takes, and the fence each answer opens with.
TEXT_SUFFIXES = {".py": "python", ".md": "markdown", ".rst": "rst", ".txt": "", ".json": "json"}


def text_chats(
    tokenizer: Any, paths: Sequence[str], max_tokens: int, chunk_tokens: int = 256, seed: int = 0
) -> list[Chat]:
    """Passages of the files under ``paths`` (directories are searched for :data:`TEXT_SUFFIXES`),
    each wrapped as the answer of a chat that asks for its file, up to ``max_tokens`` answer tokens
    in all, files in a seeded random order. Data for a trainer that labels with the target's own
    choices (its forward over the passage gives them), without generation; text the target reads is
    not text it writes, though: in place of more of its own chats it lowered held-out acceptance
    (benchmarks/RESULTS.md, "Passages of code instead of more chats")."""
    from pathlib import Path

    files: list[Path] = []
    for p in paths:
        root = Path(p)
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files += sorted(f for f in root.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
    random.Random(seed).shuffle(files)
    out: list[Chat] = []
    total = 0
    for f in files:
        if total >= max_tokens:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer(text, add_special_tokens=False).input_ids
        prompt = _chat_ids(tokenizer, f"Show me the file {f.name}.")
        fence = tokenizer(f"```{TEXT_SUFFIXES[f.suffix]}\n", add_special_tokens=False).input_ids
        for start in range(0, len(ids), chunk_tokens):
            piece = ids[start : start + chunk_tokens]
            if len(piece) < 16 or total >= max_tokens:
                break
            out.append(Chat(prompt + fence + piece, len(prompt), source="text"))
            total += len(fence) + len(piece)
    logger.info("text corpus: %d passages, %d tokens from %d files", len(out), total, len(files))
    return out


def _chat_ids(tokenizer: Any, question: str) -> list[int]:
    """The token ids of a chat holding ``question``, up to the assistant's turn."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    if hasattr(ids, "keys"):  # a BatchEncoding where the tokenizer returns dicts
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _batches(chats: list[Chat], tokens_per_step: int, rng: random.Random) -> list[list[Chat]]:
    """Chats grouped by length into batches of about ``tokens_per_step`` padded tokens, shuffled."""
    order = sorted(chats, key=lambda c: len(c.ids))
    out: list[list[Chat]] = []
    cur: list[Chat] = []
    for c in order:
        if cur and len(c.ids) * (len(cur) + 1) > tokens_per_step:
            out.append(cur)
            cur = []
        cur.append(c)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _hidden(model: Any, batch: list[Chat]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [B, T, H], ids [B, T], usable [B, T])``: the target's last hidden states (its
    output layer's input), and which rows decide an answer token (row ``t`` decides ``x_{t+1}``)."""
    dev = model.get_input_embeddings().weight.device
    width = max(len(c.ids) for c in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    usable = torch.zeros(len(batch), width, dtype=torch.bool)
    for i, c in enumerate(batch):
        ids[i, : len(c.ids)] = torch.tensor(c.ids)
        mask[i, : len(c.ids)] = 1
        usable[i, c.answer_start - 1 : len(c.ids) - 1] = True
    ids, mask, usable = ids.to(dev), mask.to(dev), usable.to(dev)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    return hidden, ids, usable


class FeatureCache:
    """What ``make`` computes from the target for each training batch (its features, :func:`_hidden`),
    computed once and kept while it fits in ``budget_gb``: the batches hold the same chats every epoch
    (only their order changes), so later epochs skip the target's forwards. Keyed by the batch's chats."""

    def __init__(self, make: Callable[[list[Chat]], tuple[torch.Tensor, ...]], budget_gb: float):
        self.make = make
        self.left = int(budget_gb * 2**30)
        self.kept: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    def get(self, batch: list[Chat]) -> tuple[torch.Tensor, ...]:
        key = tuple(id(c) for c in batch)
        hit = self.kept.get(key)
        if hit is not None:
            return hit
        out = self.make(batch)
        size = sum(t.numel() * t.element_size() for t in out)
        if size <= self.left:
            self.kept[key] = out
            self.left -= size
        return out


def _rows(k: int, ids: torch.Tensor, usable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows where head ``k`` (1-based) has a label, as ``(batch index, position, label)``: row ``t``
    decides ``x_{t+1}`` and head ``k`` guesses ``x_{t+1+k}``, which must be an answer token too."""
    t = ids.shape[1]
    ok = usable[:, : t - k] & usable[:, k:]  # row t usable and row t + k usable: x_{t+1+k} is an answer token
    b, p = ok.nonzero(as_tuple=True)
    return b, p, ids[b, p + 1 + k]


def train_heads(
    model: Any, chats: list[Chat], opts: HeadsTrainingOptions, base_model: str = ""
) -> tuple[DraftHeads, HeadsInfo, TrainingReport]:
    """Train ``opts.num_heads`` draft heads on ``chats`` with the target ``model`` frozen.

    Returns:
        ``(heads, info, report)``: float32 heads on the model's device, their description (with
        the held-out rank accuracies), and what training measured.
    """
    if len(chats) < 2:
        raise ValueError(f"training draft heads needs at least 2 chats, got {len(chats)}")
    dev = model.get_input_embeddings().weight.device
    lm_head = model.get_output_embeddings().weight.detach()  # [V, H]
    hidden_size = int(lm_head.shape[1])
    rng = random.Random(opts.seed)
    chats = list(chats)
    rng.shuffle(chats)
    n_held = max(1, int(len(chats) * opts.holdout))
    held, train = chats[:n_held], chats[n_held:]
    torch.manual_seed(opts.seed)
    embed = model.get_input_embeddings()
    heads = DraftHeads(opts.num_heads, hidden_size, opts.token_input).to(dev)
    optim = torch.optim.AdamW(heads.parameters(), lr=opts.lr, weight_decay=0.0)
    steps_per_epoch = len(_batches(train, opts.tokens_per_step, random.Random(0)))
    total = max(1, steps_per_epoch * opts.epochs)
    warm = max(1, total // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    report = TrainingReport(chats=len(chats), answer_tokens=sum(len(c.ids) - c.answer_start for c in chats))
    t0 = time.perf_counter()
    losses = [0.0] * opts.num_heads
    step = 0
    cache = FeatureCache(lambda b: _hidden(model, b), opts.cache_features_gb)
    for epoch in range(opts.epochs):
        for batch in _batches(train, opts.tokens_per_step, rng):
            hidden, ids, usable = cache.get(batch)
            for k in range(1, opts.num_heads + 1):
                b, p, labels = _rows(k, ids, usable)
                if labels.numel() == 0:
                    continue
                e = embed(ids[b, p + 1]).float() if opts.token_input else None
                z = heads.block(k - 1, hidden[b, p].float(), e)
                logits = F.linear(z.to(lm_head.dtype), lm_head)
                loss = F.cross_entropy(logits.float(), labels)
                (loss * 0.8 ** (k - 1)).backward()
                losses[k - 1] = float(loss.detach())
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 or step == total:
                logger.info(
                    "epoch %d step %d/%d loss %s",
                    epoch + 1,
                    step,
                    total,
                    " ".join(f"{v:.3f}" for v in losses),
                )
    report.steps, report.final_loss = step, losses
    report.train_s = time.perf_counter() - t0
    heads.eval()
    acc, accepted = evaluate_heads(model, heads, held, opts.ranks, opts.tokens_per_step)
    report.rank_accuracy, report.accepted_per_round = acc, accepted
    info = HeadsInfo(
        num_heads=opts.num_heads,
        hidden_size=hidden_size,
        vocab_size=int(lm_head.shape[0]),
        base_model=base_model,
        rank_accuracy=acc,
        token_input=opts.token_input,
    )
    return heads, info, report


@torch.no_grad()
def evaluate_heads(
    model: Any,
    heads: DraftHeads,
    chats: list[Chat],
    ranks: int,
    tokens_per_step: int = 16384,
    budget: int = 32,
) -> tuple[list[list[float]], float]:
    """Held-out rank accuracies `[K][ranks]`, and the guessed tokens a ``budget``-node choice tree
    (:func:`~specsplit.runtime.heads.choice_paths` of those accuracies) accepts per round, on
    average over the rows where every head has a label."""
    lm_head = model.get_output_embeddings().weight.detach()
    embed = model.get_input_embeddings()

    def decided(ids: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
        return embed(ids[b, p + 1]) if heads.token_input else None  # the rows' decided tokens

    k_heads = heads.num_heads
    hits = torch.zeros(k_heads, ranks, dtype=torch.float64)
    counts = torch.zeros(k_heads, dtype=torch.float64)
    rank_rows: list[torch.Tensor] = []  # [M, K] label rank per head (ranks: not in the top)
    for batch in _batches(chats, tokens_per_step, random.Random(0)):
        hidden, ids, usable = _hidden(model, batch)
        b, p, _ = _rows(k_heads, ids, usable)  # rows where every head has a label
        for k in range(1, k_heads + 1):
            bk, pk, labels = _rows(k, ids, usable)
            if labels.numel() == 0:
                continue
            top = head_logits(heads, lm_head, hidden[bk, pk], decided(ids, bk, pk))[k - 1]
            top = top.topk(ranks, dim=-1).indices
            match = top == labels[:, None]
            hits[k - 1] += match.sum(0).double().cpu()
            counts[k - 1] += labels.numel()
        if b.numel():
            top = (
                head_logits(heads, lm_head, hidden[b, p], decided(ids, b, p)).topk(ranks, dim=-1).indices
            )  # [K, M, R]
            labels = torch.stack([ids[b, p + 1 + k] for k in range(1, k_heads + 1)])  # [K, M]
            match = top == labels[..., None]
            rank = torch.where(match.any(-1), match.float().argmax(-1), torch.full_like(labels, ranks))
            rank_rows.append(rank.T.cpu())
    acc = (hits / counts.clamp_min(1)[:, None]).tolist()
    if not rank_rows:
        return acc, 0.0
    paths = set(choice_paths(acc, budget))
    ranked = torch.cat(rank_rows).tolist()
    total = 0
    for row in ranked:
        d = 0
        while d < k_heads and tuple(row[: d + 1]) in paths:
            d += 1
        total += d
    return acc, total / len(ranked)
