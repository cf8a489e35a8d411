"""Session store shared by both engines: per-session locks, LRU bound, TTL expiry, KV budget.

The store only tracks objects; freeing a session drops the last reference to its KV cache, and
an optional ``on_evict`` callback lets an engine return buffers to a pool. :class:`KVBudget`
accounts the KV slots each session may hold against a byte budget (a worker's memory limit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specsplit.errors import ResourceExhausted, SessionNotFound

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    state: T
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)


class SessionStore(Generic[T]):
    """Thread-safe ``session_id -> state`` map with LRU eviction and TTL purging.

    Args:
        max_sessions: live sessions kept; creating one more evicts the least recently used.
        ttl_s: sessions idle longer than this are removed by :meth:`purge_stale` (and by the
            background thread started with :meth:`start_purger`).
        on_evict: called with ``(session_id, state)`` whenever a session leaves the store.
        evict_idle_s: a full store evicts its least recently used session only when that session
            has been idle this long; otherwise a new session is refused (``ResourceExhausted``), so
            a burst of new sessions cannot push out the ones in use. 0: always evict (in-process use).
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        on_evict: Callable[[str, T], None] | None = None,
        name: str = "sessions",
        evict_idle_s: float = 0.0,
    ):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.evict_idle_s = evict_idle_s
        self._on_evict = on_evict
        self._name = name
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._entries

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def get(self, session_id: str) -> T:
        """The state of a live session (refreshes its LRU position and idle timer)."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                raise SessionNotFound(f"session {session_id!r} not found (ended, evicted or expired)")
            entry.last_used = time.monotonic()
            self._entries.move_to_end(session_id)
            return entry.state

    def get_or_create(self, session_id: str, factory: Callable[[], T]) -> tuple[T, bool]:
        """``(state, existed)``; a new session may evict the least recently used one.

        Raises:
            ResourceExhausted: the store is full and its least recently used session was used
                within ``evict_idle_s`` (nothing changed).
        """
        evicted: list[tuple[str, _Entry[T]]] = []
        with self._lock:
            entry = self._entries.get(session_id)
            now = time.monotonic()
            if entry is not None:
                entry.last_used = now
                self._entries.move_to_end(session_id)
                return entry.state, True
            if len(self._entries) >= self.max_sessions and self.evict_idle_s > 0:
                oldest = next(iter(self._entries.values()))
                if now - oldest.last_used < self.evict_idle_s:
                    raise ResourceExhausted(
                        f"{self._name}: all {self.max_sessions} sessions are in use; retry later"
                    )
            while len(self._entries) >= self.max_sessions:
                evicted.append(self._entries.popitem(last=False))
            state = factory()
            self._entries[session_id] = _Entry(state)
        for sid, old in evicted:
            logger.info("%s: evicted least recently used session %r", self._name, sid)
            self._evicted(sid, old)
        return state, False

    def put(self, session_id: str, state: T) -> None:
        """Replace (or insert) a session's state."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                self._entries[session_id] = _Entry(state)
            else:
                entry.state = state
                entry.last_used = time.monotonic()
            self._entries.move_to_end(session_id)

    @contextmanager
    def locked(self, session_id: str) -> Iterator[None]:
        """Hold the per-session lock (serialises requests of one session, not of different ones).

        Raises:
            SessionNotFound: the session left the store (ended, evicted, expired) before or while
                this request waited for its lock: its state may already be handed on.
        """
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None:
            raise SessionNotFound(f"session {session_id!r} not found (ended, evicted or expired)")
        with entry.lock:
            with self._lock:
                gone = self._entries.get(session_id) is not entry
            if gone:
                raise SessionNotFound(f"session {session_id!r} ended while this request waited for it")
            yield

    def pop(self, session_id: str) -> bool:
        """Remove a session; True if it existed."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
        if entry is None:
            return False
        self._evicted(session_id, entry)
        return True

    def clear(self) -> int:
        with self._lock:
            items = list(self._entries.items())
            self._entries.clear()
        for sid, e in items:
            self._evicted(sid, e)
        return len(items)

    def purge_stale(self, ttl_s: float | None = None) -> int:
        """Remove sessions idle for more than ``ttl_s`` (default: the store's TTL)."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        now = time.monotonic()
        with self._lock:
            stale = [(sid, e) for sid, e in self._entries.items() if now - e.last_used > ttl]
            for sid, _ in stale:
                del self._entries[sid]
        for sid, e in stale:
            logger.info("%s: session %r expired after %.0fs idle", self._name, sid, ttl)
            self._evicted(sid, e)
        return len(stale)

    def _evicted(self, sid: str, entry: _Entry[T]) -> None:
        """Hand a removed session's state to ``on_evict`` once no request of it is running.

        Ending a session while one of its requests is still running (a caller that gave up on a
        slow call ends it meanwhile) waits for that request: the hook may lend the state's
        resources (an engine's graph workspace) to another session, which must not happen while
        this one still uses them.
        """
        if self._on_evict is not None:
            with entry.lock:
                try:
                    self._on_evict(sid, entry.state)
                except Exception:  # an eviction hook must never break the caller
                    logger.exception("%s: on_evict failed for %r", self._name, sid)

    # ------------------------------------------------------------------ background purge
    def start_purger(self, interval_s: float | None = None) -> None:
        """Start a daemon thread that purges expired sessions every ``interval_s``."""
        if self._thread is not None:
            return
        interval = interval_s if interval_s is not None else max(0.05, min(self.ttl_s / 4, 60.0))
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(interval):
                self.purge_stale()

        self._thread = threading.Thread(target=run, name=f"{self._name}-purger", daemon=True)
        self._thread.start()

    def stop_purger(self) -> None:
        """Stop the purge thread and wait for it (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class KVBudget:
    """Bytes of KV cache the sessions of one engine may hold together.

    A session reserves the slots it may grow to before its cache is allocated or grown; a
    reservation that would pass the budget is refused (``ResourceExhausted``) and changes
    nothing, so a new session never pushes out memory that running ones hold. Reservations only
    grow while the session lives and are returned when it leaves the store.

    Args:
        budget_bytes: the most bytes all reservations may add up to.
        bytes_per_token: KV bytes of one slot (every layer's key and value).
    """

    def __init__(self, budget_bytes: int, bytes_per_token: int):
        if budget_bytes < 0 or bytes_per_token < 1:
            raise ValueError(f"bad KV budget ({budget_bytes} bytes, {bytes_per_token} bytes per token)")
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._tokens: dict[str, int] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used * self.bytes_per_token

    def reserved(self, session_id: str) -> int:
        """Slots reserved for a session (0 when none)."""
        with self._lock:
            return self._tokens.get(session_id, 0)

    def reserve(self, session_id: str, tokens: int, force: bool = False) -> None:
        """Make sure ``session_id`` may hold ``tokens`` slots.

        Args:
            force: record the slots even past the budget (memory already allocated).

        Raises:
            ResourceExhausted: the budget has no room for the extra slots (nothing changed).
        """
        with self._lock:
            have = self._tokens.get(session_id, 0)
            extra = tokens - have
            if extra <= 0:
                return
            if not force and (self._used + extra) * self.bytes_per_token > self.budget_bytes:
                free = max(0, self.budget_bytes - self._used * self.bytes_per_token)
                raise ResourceExhausted(
                    f"the worker's KV memory budget is used up ({free // 1024} KiB free, "
                    f"{extra * self.bytes_per_token // 1024} KiB needed); retry later or shorten the context"
                )
            self._tokens[session_id] = tokens
            self._used += extra

    def release(self, session_id: str) -> None:
        with self._lock:
            self._used -= self._tokens.pop(session_id, 0)
