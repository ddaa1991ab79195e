"""Which engines this engine may push a request's KV to (`--peer ADDR`, repeatable).

A `MigrateOut` sends the request's KV, its prompt and output, and this daemon's bearer
token to `target_address` (a `CopyPrefix` sends cached KV and its tokens the same way);
anyone who can call either could otherwise point it at any host. So the target must be a listed peer, or the call is refused with
PERMISSION_DENIED before anything is paused or sent (the request keeps running here).

    --peer 127.0.0.1:50062        one engine's address, as the router names it
    --peer unix:/run/dualpace/cpu.sock
    --peer 127.0.0.1:*            any port of that host: for launchers whose peers take a
                                  free port at bind (tests, benches, `dualpace up --engine-listen tcp`)

No --peer: every target is refused (the error names --peer). Addresses are compared
after normalisation, without DNS: `localhost` is 127.0.0.1, IP literals in their
canonical form (IPv6 compressed, brackets dropped), host names lower case without a
trailing dot, `unix:///p` and `unix:/p` the same path (normalised, not resolved).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass

from dualpace.errors import InvalidArgument, PermissionDenied
from dualpace.serve.address import UNIX_PREFIX, parse_listen

ANY_PORT = "*"


@dataclass(frozen=True)
class PeerAddress:
    """A normalised engine address; port None means any port (only in a --peer entry)."""

    host: str = ""
    port: int | None = None
    unix_path: str | None = None

    def matches(self, target: PeerAddress) -> bool:
        if self.unix_path is not None or target.unix_path is not None:
            return self.unix_path == target.unix_path
        return self.host == target.host and (self.port is None or self.port == target.port)

    def __str__(self) -> str:
        if self.unix_path is not None:
            return UNIX_PREFIX + self.unix_path
        port = ANY_PORT if self.port is None else str(self.port)
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"


def normalise_address(text: str, field: str, allow_any_port: bool = False) -> PeerAddress:
    """HOST:PORT or unix:PATH as a PeerAddress; InvalidArgument(field, ...) when malformed."""
    text = text.strip()
    any_port = allow_any_port and text.endswith(":" + ANY_PORT) and not text.startswith(UNIX_PREFIX)
    parsed = parse_listen(text[: -len(ANY_PORT)] + "0" if any_port else text, field, allow_unix=True)
    if parsed.unix_path is not None:
        return PeerAddress(unix_path=os.path.normpath(parsed.unix_path))
    if parsed.port == 0 and not any_port:
        raise InvalidArgument(field, f"{text!r}: port 0 is no engine's address; give its real port"
                                     + (f" or {ANY_PORT}" if allow_any_port else ""))
    return PeerAddress(_normalise_host(parsed.host), None if any_port else parsed.port)


def _normalise_host(host: str) -> str:
    host = host.lower().rstrip(".")
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host  # a host name: compared as written (no DNS lookups)


class PeerList:
    """The --peer entries; `check(target)` before a migration sends anything."""

    def __init__(self, peers: Iterable[str] = ()):
        self.peers = tuple(normalise_address(peer, "--peer", allow_any_port=True) for peer in peers)

    def check(self, target_address: str) -> None:
        """Raise PermissionDenied unless `target_address` is a listed peer (InvalidArgument if malformed)."""
        target = normalise_address(target_address, "target_address")
        if any(peer.matches(target) for peer in self.peers):
            return
        if not self.peers:
            raise PermissionDenied(
                f"target_address: {target_address!r} refused: this engine has no --peer, so it migrates to no "
                "engine; start it with --peer ADDR for each engine it may send requests to")
        listed = ", ".join(str(peer) for peer in self.peers)
        raise PermissionDenied(f"target_address: {target_address!r} is not a --peer of this engine (peers: {listed})")

    def __str__(self) -> str:
        return ", ".join(str(peer) for peer in self.peers) or "none"
