"""A draft model's output layer restricted to a ranked subset of the vocabulary (FR-Spec style).

A draft step that reads its weights from memory pays for the output layer in proportion to the
vocabulary: Qwen2.5-0.5B's is 136M of its 494M parameters, read on every step. Most tokens a draft
proposes come from a small, frequent part of the vocabulary, so the draft may score only the
``size`` best-ranked tokens. Every other token gets a very low logit (:data:`FILL`), so the draft
never proposes it unless a logits processor masks the whole subset.

This is lossless by construction: the draft only proposes, and verification compares the target's
distribution with the draft's ``q`` exactly as the draft computed it (tokens outside the subset have
``q = 0``; greedy verification does not read ``q`` at all). What it costs is acceptance: a token
the target would pick that is outside the subset cannot be drafted, so that round ends there.

The ranking says which tokens come first:

- By default the token id. Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen2) number their tokens
  in merge order, and a BPE learns its most frequent pairs first, so low ids are the tokens its
  training text used most: a data-free proxy for a frequency ranking.
- :func:`rank_from_texts` ranks by how often each token occurs in the user's own texts (the
  workload's prompts and answers); :func:`save_ranking` / :func:`load_ranking` keep it in a JSON file
  (``DraftConfig.vocab_ranking``). Tokens the texts never use follow in id order.

The model's end-of-sequence, beginning-of-sequence and padding ids are always kept.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from specsplit.errors import ConfigError

logger = logging.getLogger(__name__)

FILL = -1.0e4  # logit of a token outside the subset: finite, so a fully masked row still softmaxes


def special_ids(model: Any) -> list[int]:
    """End/beginning-of-sequence and padding ids of a model's config and generation config."""
    out: list[int] = []
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            v = getattr(cfg, name, None) if cfg is not None else None
            for t in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(t, int) and t >= 0 and t not in out:
                    out.append(t)
    return out


def subset_ids(
    vocab_size: int, size: int, ranking: Sequence[int] | None, always: Iterable[int] = ()
) -> torch.Tensor:
    """The ``size`` tokens a restricted output layer scores, ascending.

    Args:
        vocab_size: rows of the output layer.
        size: tokens kept (``always`` included).
        ranking: token ids, best first (ids beyond the vocabulary or repeated are ignored); the
            tokens it does not name follow in id order. ``None``: id order.
        always: ids kept whatever their rank.

    Raises:
        ConfigError: ``size`` below 1.
    """
    if size < 1:
        raise ConfigError(f"draft vocab_subset must be >= 1, got {size}")
    keep: dict[int, None] = dict.fromkeys(t for t in always if 0 <= t < vocab_size)
    want = max(min(size, vocab_size), len(keep))
    for t in chain(ranking or (), range(vocab_size)):  # the ranking, then whatever it left out, by id
        if len(keep) >= want:
            break
        if 0 <= t < vocab_size:
            keep.setdefault(t)
    ids = sorted(keep)
    return torch.tensor(ids, dtype=torch.long)


class SubsetHead(torch.nn.Module):
    """An output layer that scores only ``ids`` and returns full-vocabulary logits.

    Args:
        head: the model's output layer (``nn.Linear`` or a packed one: anything with ``weight``).
        ids: the tokens scored, `[n]` int64 (see :func:`subset_ids`).
        pack: pack the subset's weight for the CPU's matmul (:mod:`specsplit.runtime.packed`).
        int8: keep the subset's weight as int8 (:mod:`specsplit.runtime.int8`), as the head was.
    """

    ids: torch.Tensor

    def __init__(self, head: Any, ids: torch.Tensor, pack: bool = False, int8: bool = False):
        super().__init__()
        weight = head.weight.detach()
        self.vocab_size = int(weight.shape[0])
        ids = ids.to(weight.device)
        bias = getattr(head, "bias", None)
        linear = torch.nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device=weight.device,
                                 dtype=weight.dtype)  # fmt: skip
        with torch.no_grad():
            linear.weight.copy_(weight.index_select(0, ids))
            if bias is not None:
                linear.bias.copy_(bias.detach().index_select(0, ids))
        linear.requires_grad_(False)
        if int8:
            from specsplit.runtime.int8 import Int8Linear

            self.linear: torch.nn.Module = Int8Linear(linear)
        elif pack:
            from specsplit.runtime.packed import PackedLinear

            self.linear = PackedLinear(linear)
        else:
            self.linear = linear
        self.register_buffer("ids", ids, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.linear(hidden)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), FILL)
        return out.index_copy_(-1, self.ids, sub)

    def extra_repr(self) -> str:
        return f"scores {self.ids.numel()} of {self.vocab_size} tokens"


def rank_from_texts(tokenizer: Any, texts: Iterable[str]) -> list[int]:
    """Token ids ranked by how often ``tokenizer`` produces them over ``texts`` (ties: lower id first)."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def save_ranking(path: str | Path, ranked: Sequence[int], source: str = "") -> None:
    """Write a ranking as JSON (``{"ranked_ids": [...], "source": ...}``)."""
    Path(path).write_text(json.dumps({"source": source, "ranked_ids": [int(t) for t in ranked]}))


def load_ranking(path: str | Path) -> list[int]:
    """Read a ranking: JSON with ``ranked_ids``, or a bare JSON list of ids.

    Raises:
        ConfigError: the file is missing or holds no list of integer ids.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the draft vocabulary ranking {path}: {e}") from e
    ids = data.get("ranked_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ConfigError(
            f"{path}: a draft vocabulary ranking is a JSON list of token ids (or {{'ranked_ids': [...]}})"
        )
    return ids
