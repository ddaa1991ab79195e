"""`dualpace up`'s supervision, one poll at a time: a daemon that exited by itself is logged and
relaunched on the address it had (so the router's load watch and cpu_service's --gpu-service
reconnect to it unchanged), after the backoff its RestartBudget grants; the other daemons are
not touched. Nothing here blocks, so one slow restart does not hide another daemon's exit."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Protocol

from dualpace_cli.restart_budget import RestartBudget


@dataclass
class Child:
    """One daemon: its process, the address it printed, and the thread relaying its output."""

    name: str  # output prefix: gpu, cpu, router
    module: str  # gpu_service, cpu_service, router: how messages name it
    argv: list[str]
    budget: RestartBudget
    process: subprocess.Popen | None = None
    address: str | None = None
    listening: threading.Event = field(default_factory=threading.Event)
    http_address: str | None = None  # the router's "router http listening on ADDR" line
    http_listening: threading.Event = field(default_factory=threading.Event)
    relay: threading.Thread | None = None
    exit_handled: bool = False  # its unexpected exit is logged and a restart (or giving up) decided
    restart_at_s: float | None = None  # monotonic time of the pending restart
    restarting: bool = False  # relaunched, not listening yet


class LineWriter(Protocol):
    def line(self, text: str, stream=None) -> None: ...


class Supervisor(Protocol):
    """What supervision needs of `dualpace up` (dualpace_cli.up.Up)."""

    children: list[Child]
    console: LineWriter

    def launch(self, child: Child) -> None: ...


PINNED_FLAGS = {"--listen": "address", "--http-listen": "http_address"}  # flag -> the Child field it pins


def pinned_argv(child: Child) -> list[str]:
    """The child's argv with each listen flag set to the address it actually got (a port of 0
    becomes the port it was given), so the relaunched daemon comes back where it was."""
    argv = list(child.argv)
    for index, flag in enumerate(argv[:-1]):
        address = getattr(child, PINNED_FLAGS.get(flag, ""), None)
        if address:
            argv[index + 1] = address
    return argv


def supervise_once(up: Supervisor, now_s: float) -> Child | None:
    """One look at every child; returns a child whose restart budget is spent (up gives up)."""
    for child in up.children:
        if child.restart_at_s is not None:
            if now_s >= child.restart_at_s:
                relaunch(up, child)
            continue
        if child.process.poll() is None:
            if child.restarting and child.listening.is_set():
                child.restarting = False
                up.console.line(f"dualpace up: {child.module} on {child.address} (pid {child.process.pid}) "
                                f"restarted ({child.budget.num_recent} of {child.budget.max_restarts} "
                                f"within {child.budget.window_s:g} s)")
            continue
        if child.exit_handled:
            continue
        child.exit_handled = True
        child.restarting = False
        delay_s = child.budget.on_exit(now_s)
        if delay_s is None:
            return child
        up.console.line(f"dualpace up: {child.module} exited unexpectedly with status "
                        f"{child.process.returncode}; restarting it on {child.address} in {delay_s:g} s "
                        f"(restart {child.budget.num_recent} of {child.budget.max_restarts} "
                        f"within {child.budget.window_s:g} s; the others keep running)", sys.stderr)
        child.restart_at_s = now_s + delay_s
    return None


def relaunch(up: Supervisor, child: Child) -> None:
    child.relay.join(timeout=2.0)  # the old process's last lines first
    child.argv = pinned_argv(child)
    child.restart_at_s = None
    child.exit_handled = False
    child.restarting = True
    up.launch(child)
