"""The round loop (draft, verify, commit, stop) over any Transport."""

from __future__ import annotations

from specsplit.pipeline.loop import DecodeParams, OverlapPolicies, OverlapPolicy, decode, decode_rounds

__all__ = ["DecodeParams", "OverlapPolicies", "OverlapPolicy", "decode", "decode_rounds"]
