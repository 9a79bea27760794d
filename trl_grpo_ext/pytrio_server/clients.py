"""Who is calling: the server's API keys, the client each one identifies, and what a client may see.

Every key is one client. A client owns the sessions, runs and checkpoints it creates; another client's objects are
answered as if they did not exist (404, never 403: no existence leaks) and listings hold one's own only. An admin key
sees, and may act on, every client's objects.

A client is known by its owner id, a domain-separated hash prefix of its key (the key itself is never stored), so the
same key finds its checkpoints again after a server restart. A server started without a key generates one per start;
its client is `LOCAL_OWNER`, so the recipe's in-process server (a fresh key each run) still resumes the previous
run's checkpoints. Checkpoint records written before owners existed belong to the server's only client key, or to
`LOCAL_OWNER` (admins only) when it has several.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

LOCAL_OWNER = "local"


@dataclass(frozen=True)
class Caller:
    """An authenticated client: its owner id, and whether it holds an admin key."""

    owner: str
    admin: bool = False

    def may_see(self, owner: str) -> bool:
        return self.admin or owner == self.owner


INTERNAL = Caller(LOCAL_OWNER, admin=True)  # the server's own lookups (event workers, retention): no owner check


def owner_id(key: str) -> str:
    return "client-" + hashlib.sha256(b"trl-grpo-ext-pytrio-owner\0" + key.encode()).hexdigest()[:16]


class KeyRing:
    """The server's keys and the `Caller` each identifies; `identify` compares in constant time."""

    def __init__(self, client_keys: list[str], admin_keys: list[str] = (), generated: bool = False):
        clients = list(dict.fromkeys(client_keys))
        admins = [k for k in dict.fromkeys(admin_keys) if k not in clients]
        if not clients:
            raise ValueError("a local PyTRIO server needs at least one client API key")
        self.primary = clients[0]  # what `LocalPyTrioServer.api_key` reports (and the in-process client uses)
        callers = {k: Caller(LOCAL_OWNER if generated else owner_id(k)) for k in clients}
        callers.update({k: Caller(owner_id(k), admin=True) for k in admins})
        # digests of equal length: compare_digest's time does not depend on where a wrong key differs
        self._entries = [(_digest(k), caller) for k, caller in callers.items()]
        # ownerless (pre-isolation) checkpoint records belong to the only client, if there is one
        self.legacy_owner = callers[self.primary].owner if len(clients) == 1 else LOCAL_OWNER

    @classmethod
    def generate(cls) -> KeyRing:
        return cls(["trio-local-" + secrets.token_urlsafe(18)], generated=True)

    def identify(self, key: str | None) -> Caller | None:
        """The client `key` identifies, or None. Every configured key is compared, with no early exit."""
        if not key:
            return None
        digest, found = _digest(key), None
        for known, caller in self._entries:
            if secrets.compare_digest(digest, known):
                found = caller
        return found

    def __len__(self) -> int:
        return len(self._entries)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
