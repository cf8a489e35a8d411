"""The round loop (draft, verify, commit, stop) over any Transport, and the overlapped pipeline."""

from __future__ import annotations

from specsplit.pipeline.loop import decode, decode_rounds
from specsplit.pipeline.overlap import OverlapPolicies, OverlapPolicy
from specsplit.pipeline.params import DecodeOutputs, DecodeParams

__all__ = ["DecodeOutputs", "DecodeParams", "OverlapPolicies", "OverlapPolicy", "decode", "decode_rounds"]
