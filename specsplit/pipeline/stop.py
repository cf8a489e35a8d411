"""Stop conditions, checked on each round's committed tokens: EOS ids, stop strings, HF stopping
criteria (never overshooting)."""

from __future__ import annotations

import torch

from specsplit.pipeline.params import DecodeParams


class StopChecker:
    """Cuts a round's new tokens after the first EOS id or stop string."""

    def __init__(self, params: DecodeParams, prompt: list[int] | None = None):
        self.criteria = params.stopping_criteria
        self.context = list(params.criteria_prefix) + list(prompt or [])  # what the criteria see first
        self.eos = params.eos_token_ids
        self.stops = params.stop_strings
        self.tok = params.tokenizer
        if self.stops and self.tok is None:
            raise ValueError("stop_strings need a tokenizer (pass tokenizer= to generate)")
        self.window = (max((len(s) for s in self.stops), default=0) + 8) if self.stops else 0

    def cut(
        self, generated: list[int], new: list[int], scores: torch.Tensor | None = None
    ) -> tuple[list[int], bool]:
        """Truncate ``new`` after the first stop condition; ``(kept, stopped)``.

        ``scores``: `[len(new), vocab]` processed scores of the new tokens, handed to stopping
        criteria (None when not collected)."""
        for i, t in enumerate(new):  # at most tree depth + 1 host ints
            if t in self.eos:
                new, stopped = new[: i + 1], True
                break
        else:
            stopped = False
        new, stopped = self._strings(generated, new, stopped)
        if not self.criteria:
            return new, stopped
        return self._criteria(generated, new, stopped, scores)

    def _criteria(
        self, generated: list[int], new: list[int], stopped: bool, scores: torch.Tensor | None
    ) -> tuple[list[int], bool]:
        """HF stopping criteria, called as ``generate()`` calls them: after each token, on the
        whole sequence (left padding and prompt included)."""
        seq = self.context + generated
        for i, t in enumerate(new):  # only with user criteria: a Python call per committed token
            seq.append(t)
            ids = torch.tensor([seq], dtype=torch.long)
            row = scores[i : i + 1] if scores is not None else None
            if any(bool(torch.as_tensor(c(ids, row)).any()) for c in self.criteria):
                return new[: i + 1], True
        return new, stopped

    def _strings(self, generated: list[int], new: list[int], stopped: bool) -> tuple[list[int], bool]:
        if not self.stops:
            return new, stopped
        tail = generated[-self.window :]
        for i in range(len(new)):  # only with stop strings: a text check per committed token
            text = self.tok.decode(tail + new[: i + 1], skip_special_tokens=False)
            if any(text.endswith(s) for s in self.stops):
                return new[: i + 1], True
        return new, stopped
