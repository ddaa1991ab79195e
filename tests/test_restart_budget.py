"""`dualpace up`'s restart decisions: the budget's backoff and window, and one
supervision pass over fake children (which restarts, which is left alone, when up gives up)."""

from __future__ import annotations

import argparse
import threading

import pytest

from dualpace_cli.restart_budget import RestartBudget
from dualpace_cli.supervise import pinned_argv, supervise_once
from dualpace_cli.up import Child, Console


def test_backoff_doubles_then_caps_and_the_budget_runs_out():
    budget = RestartBudget(max_restarts=5, window_s=60, initial_backoff_s=0.5, max_backoff_s=3.0)
    assert [budget.on_exit(t) for t in (0, 1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert budget.on_exit(5) is None  # the sixth exit within 60 s
    assert budget.num_recent == 5


def test_restarts_older_than_the_window_no_longer_count():
    budget = RestartBudget(max_restarts=2, window_s=10, initial_backoff_s=1.0, max_backoff_s=8.0)
    assert budget.on_exit(0) == 1.0
    assert budget.on_exit(5) == 2.0
    assert budget.on_exit(9) is None
    assert budget.on_exit(10.5) == 2.0  # the exit at 0 left the window; the one at 5 still counts
    assert budget.on_exit(16) == 2.0  # now only the one at 10.5 counts


def test_zero_restarts_means_give_up_at_once():
    assert RestartBudget(max_restarts=0).on_exit(0) is None


@pytest.mark.parametrize("kwargs", [{"max_restarts": -1}, {"window_s": 0},
                                    {"initial_backoff_s": 5, "max_backoff_s": 1}])
def test_bad_budgets_are_refused(kwargs):
    with pytest.raises(ValueError):
        RestartBudget(**kwargs)


def test_pinned_argv_keeps_the_addresses_the_daemon_got():
    child = Child("router", "router", ["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                                       "--gpu", "127.0.0.1:5"], RestartBudget())
    child.address, child.http_address = "127.0.0.1:4001", "127.0.0.1:4002"
    assert pinned_argv(child) == ["serve", "--listen", "127.0.0.1:4001", "--http-listen", "127.0.0.1:4002",
                                  "--gpu", "127.0.0.1:5"]


class FakeProcess:
    def __init__(self, pid: int, returncode: int | None = None) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int | None:
        return self.returncode


class FakeUp:
    def __init__(self, *children: Child) -> None:
        self.children = list(children)
        self.console = Console()
        self.launched: list[str] = []
        self.args = argparse.Namespace()

    def launch(self, child: Child) -> None:
        self.launched.append(child.module)
        child.process = FakeProcess(100 + len(self.launched))


def fake_child(module: str, returncode: int | None, max_restarts: int = 2) -> Child:
    child = Child(module.split("_")[0], module, ["--listen", "127.0.0.1:0"],
                  RestartBudget(max_restarts=max_restarts, window_s=60, initial_backoff_s=1, max_backoff_s=4))
    child.process, child.address = FakeProcess(1, returncode), "127.0.0.1:7000"
    child.relay = threading.Thread(target=lambda: None)
    child.relay.start()
    return child


def test_an_exited_child_is_relaunched_after_its_backoff_and_the_others_are_left_alone(capsys):
    dead, alive = fake_child("cpu_service", -9), fake_child("gpu_service", None)
    up = FakeUp(dead, alive)
    assert supervise_once(up, 10.0) is None
    assert "cpu_service exited unexpectedly with status -9; restarting it on 127.0.0.1:7000 in 1 s" \
        in capsys.readouterr().err
    assert supervise_once(up, 10.5) is None and up.launched == []  # the backoff is not over
    assert supervise_once(up, 11.0) is None and up.launched == ["cpu_service"]
    assert dead.argv == ["--listen", "127.0.0.1:7000"] and dead.restarting
    dead.listening.set()
    assert supervise_once(up, 11.1) is None
    assert "cpu_service on 127.0.0.1:7000 (pid 101) restarted (1 of 2 within 60 s)" in capsys.readouterr().out
    assert not dead.restarting and alive.process.pid == 1


def test_up_gives_up_once_the_budget_is_spent():
    child = fake_child("router", 1, max_restarts=1)
    up = FakeUp(child)
    assert supervise_once(up, 0.0) is None
    assert supervise_once(up, 1.0) is None and up.launched == ["router"]
    child.process.returncode = 1  # exits again before listening
    assert supervise_once(up, 2.0) is child
