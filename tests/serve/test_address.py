"""parse_listen and is_loopback."""

from __future__ import annotations

import pytest

from dualpace.errors import InvalidArgument
from dualpace.serve.address import ListenAddress, is_loopback, parse_listen


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:50051", "127.0.0.1", 50051),
        ("127.0.0.1:0", "127.0.0.1", 0),
        ("[::1]:8080", "::1", 8080),
        ("localhost:65535", "localhost", 65535),
        (" 0.0.0.0:1 ", "0.0.0.0", 1),
        ("gpu-host.example:7000", "gpu-host.example", 7000),
    ],
)
def test_parses_valid_addresses(text: str, host: str, port: int) -> None:
    assert parse_listen(text) == ListenAddress(host, port)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("127.0.0.1", "no port"),
        ("127.0.0.1:", "port ''"),
        (":50051", "no host"),
        ("127.0.0.1:http", "not a number"),
        ("127.0.0.1:70000", "outside [0, 65535]"),
        ("127.0.0.1:-1", "not a number"),
        ("::1:50051", "needs brackets"),
        ("[::1:50051", "closing ']'"),
        ("[::1]50051", "no port"),
        ("[zz]:1", "not an IPv6 address"),
        ("300.1.1.1:5", "not a valid IPv4"),
        ("bad_host!:5", "neither an IP address"),
    ],
)
def test_rejects_malformed_addresses_naming_the_field(text: str, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_listen(text, field="--listen")
    assert info.value.field == "--listen"
    assert str(info.value).startswith("--listen: ")
    assert fragment in str(info.value)


def test_targets_bracket_ipv6_and_connect_to_loopback() -> None:
    assert parse_listen("[::1]:0").target(port=123) == "[::1]:123"
    assert parse_listen("0.0.0.0:5").connect_target() == "127.0.0.1:5"
    assert parse_listen("localhost:5").connect_target() == "127.0.0.1:5"
    assert parse_listen("[::]:5").connect_target() == "[::1]:5"
    assert str(parse_listen("127.0.0.1:9")) == "127.0.0.1:9"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("::", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_unix_socket_addresses_where_allowed() -> None:
    address = parse_listen("unix:/run/dualpace/gpu.sock", allow_unix=True)
    assert address.is_unix and address.unix_path == "/run/dualpace/gpu.sock"
    assert address.target() == address.connect_target() == "unix:/run/dualpace/gpu.sock"
    assert parse_listen("unix:///run/x.sock", allow_unix=True).unix_path == "/run/x.sock"
    assert not parse_listen("127.0.0.1:1").is_unix


@pytest.mark.parametrize(("text", "allow_unix", "fragment"), [
    ("unix:/run/x.sock", False, "not supported here"),
    ("unix:relative.sock", True, "absolute path"),
    ("unix:/" + "d" * 120, True, "longer than a Unix socket allows"),
])
def test_unix_socket_refusals_name_the_field(text: str, allow_unix: bool, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        parse_listen(text, "--listen", allow_unix=allow_unix)
    assert raised.value.field == "--listen" and fragment in raised.value.problem
