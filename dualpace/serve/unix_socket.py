"""Binding a gRPC server to a Unix domain socket (`--listen unix:PATH`).

A socket file is reachable only from this machine, and only by users its permissions let in:
0600 here, so the daemon's own user alone (the other DualPace daemons run as the same user)
and no token is needed to keep other local users out. The socket is created under a umask
that already gives 0600, so it is never reachable with wider permissions, even for a moment.

A socket file left behind by a daemon that was killed (SIGKILL, a crash) is removed before
binding, as it would block the bind; one that a live server still answers on is not: that is
"address in use", refused like a busy TCP port.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from dualpace.errors import InvalidArgument

SOCKET_MODE = 0o600


def prepare_path(path: str, field: str) -> None:
    """Ready `path` for binding: its folder must exist; a stale socket file is removed."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise InvalidArgument(field, f"unix:{path}: the folder {folder} does not exist")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise InvalidArgument(field, f"unix:{path} exists and is not a socket; not replacing it")
    if _answers(path):
        raise InvalidArgument(field, f"cannot bind unix:{path}: a server is listening there")
    os.unlink(path)  # left by a daemon that did not exit cleanly


def bind_private(bind: Callable[[], int], path: str) -> int:
    """Run `bind` (which creates the socket file) under a umask giving SOCKET_MODE, then make sure."""
    with _umask(0o777 & ~SOCKET_MODE):
        port = bind()
    if os.path.exists(path):
        os.chmod(path, SOCKET_MODE)
    return port


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


@contextmanager
def _umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)
