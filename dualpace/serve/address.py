"""Listen addresses: parse `--listen HOST:PORT` and tell loopback hosts apart.

Accepted forms: an IPv4 literal (`127.0.0.1:50051`), a bracketed IPv6 literal
(`[::1]:50051`) or a host name (`localhost:50051`). Port 0 asks the kernel for
a free port when the server binds. Where the caller allows it (the daemons' gRPC
`--listen`), also `unix:PATH`: a Unix domain socket, which only processes on this
machine can reach and whose file permissions (0600: the daemon's user alone) decide who
may connect (dualpace.serve.server). Anything else raises InvalidArgument naming
the field, so a daemon's CLI prints one clear line.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from dualpace.errors import InvalidArgument

_HOSTNAME_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_PORT_DIGITS = re.compile(r"^[0-9]{1,5}$")
_MAX_PORT = 65535
UNIX_PREFIX = "unix:"
MAX_UNIX_PATH_BYTES = 107  # sun_path holds 108 bytes with its terminating NUL (Linux)


@dataclass(frozen=True)
class ListenAddress:
    """A parsed HOST:PORT; `host` never carries IPv6 brackets."""

    host: str
    port: int
    unix_path: str | None = None  # set for unix:PATH (then host is "" and port 0)

    @property
    def is_ipv6(self) -> bool:
        """True for an IPv6 literal host."""
        return ":" in self.host

    @property
    def is_unix(self) -> bool:
        return self.unix_path is not None

    def target(self, port: int | None = None) -> str:
        """`host:port` as gRPC expects it (IPv6 in brackets), or `unix:PATH`; `port` overrides self.port."""
        if self.unix_path is not None:
            return UNIX_PREFIX + self.unix_path
        return format_host_port(self.host, self.port if port is None else port)

    def connect_target(self, port: int | None = None) -> str:
        """Where a client on this machine reaches the server: wildcards become loopback.

        `localhost` becomes 127.0.0.1 so the printed address is an IP literal
        that every client resolves the same way. A Unix socket is reached at its path.
        """
        if self.unix_path is not None:
            return self.target()
        host = self.host
        if host == "0.0.0.0" or host.lower().rstrip(".") == "localhost":
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return format_host_port(host, self.port if port is None else port)

    def __str__(self) -> str:
        return self.target()


def format_host_port(host: str, port: int) -> str:
    """Joins host and port, bracketing an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_listen(text: str, field: str = "--listen", allow_unix: bool = False) -> ListenAddress:
    """Parses HOST:PORT (or unix:PATH when allow_unix); raises InvalidArgument(field, ...) when it is malformed."""
    text = text.strip()
    if not text:
        raise InvalidArgument(field, "is empty; expected HOST:PORT such as 127.0.0.1:50051")
    if text.startswith(UNIX_PREFIX):
        if not allow_unix:
            raise InvalidArgument(field, f"{text!r}: a Unix socket is not supported here; expected HOST:PORT")
        return ListenAddress(host="", port=0, unix_path=_check_unix_path(text[len(UNIX_PREFIX):], text, field))
    host, port_text = _split_host_port(text, field)
    return ListenAddress(host=_check_host(host, text, field), port=_parse_port(port_text, text, field))


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals (127.0.0.0/8, ::1); no DNS lookups."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_unix_path(path: str, text: str, field: str) -> str:
    if path.startswith("//"):  # unix:///abs/path, as gRPC also writes it
        path = path[2:]
    if not path.startswith("/"):
        raise InvalidArgument(field, f"{text!r}: give an absolute path, e.g. unix:/run/dualpace/gpu.sock "
                                     "(the other daemons connect to the same path)")
    if len(path.encode()) > MAX_UNIX_PATH_BYTES:
        raise InvalidArgument(field, f"{text!r}: the path is longer than a Unix socket allows "
                                     f"({MAX_UNIX_PATH_BYTES} bytes)")
    return path


def _split_host_port(text: str, field: str) -> tuple[str, str]:
    """Splits `host:port` or `[v6]:port` into its two texts."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise InvalidArgument(field, f"{text!r} opens '[' without a closing ']'; expected [IPV6]:PORT")
        rest = text[close + 1 :]
        if not rest.startswith(":"):
            raise InvalidArgument(field, f"{text!r} has no port; expected [IPV6]:PORT such as [::1]:50051")
        host = text[1:close]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidArgument(field, f"{host!r} inside brackets is not an IPv6 address") from None
        return host, rest[1:]
    if text.count(":") > 1:
        raise InvalidArgument(field, f"{text!r}: an IPv6 address needs brackets, e.g. [::1]:50051")
    if ":" not in text:
        raise InvalidArgument(field, f"{text!r} has no port; expected HOST:PORT such as 127.0.0.1:50051")
    host, port_text = text.split(":")
    return host, port_text


def _check_host(host: str, text: str, field: str) -> str:
    """Returns the host if it is an IP literal or a valid host name."""
    if not host:
        raise InvalidArgument(field, f"{text!r} has no host; expected HOST:PORT such as 127.0.0.1:50051")
    if ":" in host:
        return host  # an IPv6 literal, already checked inside the brackets
    try:
        ipaddress.IPv4Address(host)
        return host
    except ValueError:
        pass
    if all(part.isdigit() for part in host.split(".")):
        raise InvalidArgument(field, f"{host!r} is not a valid IPv4 address")
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOSTNAME_LABEL.match(label) for label in labels):
        raise InvalidArgument(field, f"{host!r} is neither an IP address nor a valid host name")
    return host


def _parse_port(port_text: str, text: str, field: str) -> int:
    """Returns the port as an int in [0, 65535]."""
    if not _PORT_DIGITS.match(port_text):
        raise InvalidArgument(field, f"{text!r}: port {port_text!r} is not a number in [0, {_MAX_PORT}]")
    port = int(port_text)
    if port > _MAX_PORT:
        raise InvalidArgument(field, f"{text!r}: port {port} is outside [0, {_MAX_PORT}]")
    return port


def data_socket_host(listen: str) -> str:
    """Where a daemon's KV data socket listens: its gRPC listen host (never a wider one), and
    127.0.0.1 for a unix: or localhost daemon (dualpace.engine.transfer.kv_tcp_import)."""
    address = parse_listen(listen, allow_unix=True)
    if address.is_unix or address.host.lower().rstrip(".") == "localhost":
        return "127.0.0.1"
    return address.host


def data_socket_peer_host(target_address: str) -> str:
    """Where a sender reaches a target's KV data socket: the host of its gRPC address (127.0.0.1 for
    a unix: address)."""
    address = parse_listen(target_address, "target_address", allow_unix=True)
    return "127.0.0.1" if address.is_unix else address.host
