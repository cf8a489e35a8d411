"""Local mode: both engines in this process, on one device or several."""

from __future__ import annotations

from specsplit.local.transport import LocalTransport

__all__ = ["LocalTransport"]
