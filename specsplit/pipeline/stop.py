"""Stop conditions, checked on each round's committed tokens: EOS ids, stop strings (never overshooting)."""

from __future__ import annotations

from specsplit.pipeline.params import DecodeParams


class StopChecker:
    """Cuts a round's new tokens after the first EOS id or stop string."""

    def __init__(self, params: DecodeParams):
        self.eos = params.eos_token_ids
        self.stops = params.stop_strings
        self.tok = params.tokenizer
        if self.stops and self.tok is None:
            raise ValueError("stop_strings need a tokenizer (pass tokenizer= to generate)")
        self.window = (max((len(s) for s in self.stops), default=0) + 8) if self.stops else 0

    def cut(self, generated: list[int], new: list[int]) -> tuple[list[int], bool]:
        """Truncate ``new`` after the first stop condition; ``(kept, stopped)``."""
        for i, t in enumerate(new):  # at most tree depth + 1 host ints
            if t in self.eos:
                return self._strings(generated, new[: i + 1], True)
        return self._strings(generated, new, False)

    def _strings(self, generated: list[int], new: list[int], stopped: bool) -> tuple[list[int], bool]:
        if not self.stops:
            return new, stopped
        tail = generated[-self.window :]
        for i in range(len(new)):  # only with stop strings: a text check per committed token
            text = self.tok.decode(tail + new[: i + 1], skip_special_tokens=False)
            if any(text.endswith(s) for s in self.stops):
                return new[: i + 1], True
        return new, stopped
