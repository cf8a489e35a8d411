"""Per-round telemetry: time spans, tau, per-position acceptance, JSON export."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RoundStats:
    """One draft+verify round as the orchestrator saw it."""

    accepted: int  # drafted tokens accepted
    committed: int  # tokens committed this round (accepted + next, after stop conditions)
    drafted_depth: int  # longest drafted path (0 = target-only step)
    tree_nodes: int
    draft_s: float  # wall time of the draft call
    verify_s: float  # wall time of the verify call
    host_s: float  # orchestrator bookkeeping (stop checks; a streamer's time falls between rounds)
    # call time not spent on the workers' side (in-process: the engines; over gRPC: the handlers,
    # whose time includes the device sync that serialising a result waits for)
    transport_s: float = 0.0
    draft_model_s: float = 0.0
    verify_model_s: float = 0.0
    overlap_draft_s: float = 0.0  # overlapped mode: the speculative draft beside verification
    spec_hit: bool | None = None  # overlapped mode: did this round's speculation hold (None: none ran)
    drafter: str = ""  # what drafted this round: "model", "ngram", "hybrid" or "none" (a plain target step)


@dataclass
class SpecStats:
    """Statistics of one generated sequence (or, merged, of several)."""

    rounds: list[RoundStats] = field(default_factory=list)
    wall_time_s: float = 0.0
    prompt_tokens: int = 0
    recoveries: int = 0  # desync / lost-session recoveries
    draft_fallback: bool = False  # the draft became unreachable and decoding went on target-only
    spec_rounds: int = 0  # overlapped mode: rounds that drafted the next round speculatively
    spec_hits: int = 0  # ... whose speculation held (the next tree was ready)
    stopped: bool = False  # a stop condition (EOS id, stop string, stopping criteria) ended it

    @property
    def new_tokens(self) -> int:
        return sum(r.committed for r in self.rounds)

    @property
    def tau(self) -> float:
        """Mean tokens per round (accepted + 1)."""
        return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(r.drafted_depth for r in self.rounds)
        return sum(r.accepted for r in self.rounds) / drafted if drafted else 0.0

    def accepted_counts(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    def acceptance_histogram(self) -> dict[int, int]:
        """``{accepted tokens: rounds}``."""
        hist: dict[int, int] = {}
        for r in self.rounds:
            hist[r.accepted] = hist.get(r.accepted, 0) + 1
        return dict(sorted(hist.items()))

    def per_position_acceptance(self) -> list[float]:
        """Entry ``i``: fraction of rounds drafting ``>= i+1`` tokens that accepted ``>= i+1``."""
        depth = max((r.drafted_depth for r in self.rounds), default=0)
        out = []
        for i in range(1, depth + 1):
            eligible = [r for r in self.rounds if r.drafted_depth >= i]
            out.append(sum(r.accepted >= i for r in eligible) / len(eligible) if eligible else 0.0)
        return out

    @classmethod
    def merge(cls, parts: list[SpecStats]) -> SpecStats:
        out = cls()
        for p in parts:
            out.rounds.extend(p.rounds)
            out.wall_time_s += p.wall_time_s
            out.prompt_tokens += p.prompt_tokens
            out.recoveries += p.recoveries
            out.draft_fallback |= p.draft_fallback
            out.spec_rounds += p.spec_rounds
            out.spec_hits += p.spec_hits
        return out

    def summary(self) -> dict[str, Any]:
        n = len(self.rounds) or 1
        return {
            "new_tokens": self.new_tokens,
            "rounds": len(self.rounds),
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance(),
            "acceptance_histogram": self.acceptance_histogram(),
            "wall_time_s": self.wall_time_s,
            "tokens_per_s": self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0,
            "mean_draft_s": sum(r.draft_s for r in self.rounds) / n,
            "mean_verify_s": sum(r.verify_s for r in self.rounds) / n,
            "mean_host_s": sum(r.host_s for r in self.rounds) / n,
            "mean_transport_s": sum(r.transport_s for r in self.rounds) / n,
            "recoveries": self.recoveries,
            "draft_fallback": self.draft_fallback,
            "spec_rounds": self.spec_rounds,
            "overlap_hit_rate": self.spec_hits / self.spec_rounds if self.spec_rounds else None,
            "rounds_by_drafter": self.rounds_by_drafter(),
        }

    def rounds_by_drafter(self) -> dict[str, int]:
        """How many rounds each drafter drafted (``"none"``: plain target steps)."""
        out: dict[str, int] = {}
        for r in self.rounds:
            key = r.drafter or ("model" if r.drafted_depth else "none")
            out[key] = out.get(key, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "rounds": [asdict(r) for r in self.rounds]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)
