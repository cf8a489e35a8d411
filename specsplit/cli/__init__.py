"""The ``specsplit`` command line: ``generate``, ``serve``, ``models``, ``bench``."""

from __future__ import annotations

from specsplit.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
