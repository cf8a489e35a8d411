"""Who is calling a worker: per-client bearer tokens, the caller of the running call, and the
namespace that keeps each client's sessions its own.

A token file holds either one token (every caller that sends it is the client ``default``) or
one named client a line::

    # name:token
    alice:8f14e45fceea167a5a36dedd4bea2543
    bob:c9f0f895fb98ab9159f51fd0297e236d

A caller's sessions live in its own namespace: the worker keys a session by the wire
``session_id`` plus a tag of the caller's client name and of the secret its
:class:`~specsplit.remote.client.GrpcTransport` sends (``specsplit-client-secret`` metadata, random
per transport). Another client, or another process holding the same token, names a different
session with the same id: it cannot read, advance or end a session it did not create, and it
learns nothing about it (an unknown id is ``NOT_FOUND`` as for any id).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from specsplit.errors import ConfigError, InvalidRequest

SECRET_KEY = "specsplit-client-secret"  # metadata: the caller's session namespace secret
MAX_SESSION_ID_CHARS = 512  # longer session ids are refused (INVALID_ARGUMENT) before any work
_TAG_CHARS = 16
# A session id a worker runs a generation under on behalf of a caller adds "#" + tag to the wire id.
MAX_GENERATE_SESSION_ID_CHARS = MAX_SESSION_ID_CHARS - _TAG_CHARS - 1
ANONYMOUS = ""  # the client name of callers of a worker without tokens
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


@dataclass(frozen=True)
class Caller:
    """The client of the call being served.

    Attributes:
        client: the client's name from the token file (``""`` on a worker without tokens).
        secret: the namespace secret the caller sent (``""``: none).
        peer: the connection (``context.peer()``); tells callers of a worker without tokens
            apart for fair scheduling only.
    """

    client: str = ANONYMOUS
    secret: str = ""
    peer: str = ""

    @property
    def named(self) -> bool:
        return self.client != ANONYMOUS

    @property
    def fairness_key(self) -> str:
        """Whose share of the worker a call counts against: the client, else its connection."""
        return f"client:{self.client}" if self.named else f"peer:{self.peer}"

    def session_key(self, session_id: str) -> str:
        """The engine's key of this caller's session ``session_id`` (the id itself for an
        anonymous caller that sends no secret, as older clients do)."""
        if not self.named and not self.secret:
            return session_id
        digest = hashlib.sha256(f"{self.client}\0{self.secret}".encode()).hexdigest()[:_TAG_CHARS]
        return f"{session_id}#{digest}"


_NOBODY = Caller()
_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("specsplit_caller", default=None)


def current_caller() -> Caller:
    """The caller of the call this thread serves (set by the worker's gate; an anonymous one outside)."""
    return _CALLER.get() or _NOBODY


def set_caller(caller: Caller) -> contextvars.Token[Caller | None]:
    return _CALLER.set(caller)


def reset_caller(token: contextvars.Token[Caller | None]) -> None:
    _CALLER.reset(token)


def check_session_id(session_id: str, limit: int = MAX_SESSION_ID_CHARS) -> None:
    """Refuse a session id longer than ``limit`` characters (the id is not echoed)."""
    if len(session_id) > limit:
        raise InvalidRequest(f"session_id has {len(session_id)} characters; at most {limit} are accepted")


class ClientTokens:
    """The bearer tokens a worker accepts, each naming a client.

    Args:
        tokens: ``{client name: token}``.
    """

    def __init__(self, tokens: dict[str, str]):
        if not tokens:
            raise ConfigError("no client tokens given")
        for name, token in tokens.items():
            if not token or any(c.isspace() for c in token):
                raise ConfigError(f"the token of client {name!r} is empty or holds whitespace")
        self._expected = [(name, f"Bearer {tok}".encode()) for name, tok in tokens.items()]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._expected]

    @classmethod
    def single(cls, token: str) -> ClientTokens:
        """One token shared by every caller (client ``default``)."""
        return cls({"default": token})

    @classmethod
    def from_file(cls, path: str | Path, flag: str = "--auth-token-file") -> ClientTokens:
        """Read a token file: one token, or ``name:token`` lines (``#`` comments and blank lines skipped).

        Raises:
            ConfigError: missing or empty file, malformed or repeated client lines.
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{flag} {path} does not exist")
        lines = [ln.strip() for ln in path.read_text().splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("#")]
        if not lines:
            raise ConfigError(f"{flag} {path} is empty")
        named = [ln.split(":", 1) for ln in lines if ":" in ln and _NAME.match(ln.split(":", 1)[0])]
        if len(named) != len(lines):
            if len(lines) == 1:
                return cls.single(lines[0])
            raise ConfigError(f"{flag} {path}: with several lines, every line must be 'name:token'")
        tokens: dict[str, str] = {}
        for name, token in named:
            if name in tokens:
                raise ConfigError(f"{flag} {path}: client {name!r} appears twice")
            tokens[name] = token.strip()
        return cls(tokens)

    def identify(self, authorization: str) -> str | None:
        """The client whose token ``authorization`` carries (``Bearer <token>``), or None.

        Every token is compared, in constant time each, so the time taken does not tell which
        client's token a guess came close to.
        """
        got = authorization.encode("latin-1", "replace")
        found = None
        for name, expected in self._expected:
            if hmac.compare_digest(got, expected) and found is None:
                found = name
        return found
