"""`dualpace-router placement`: the router's view of the engines, their requests and recent migrations.

    dualpace-router placement --router 127.0.0.1:50051            # tables, once
    dualpace-router placement --router 127.0.0.1:50051 --watch    # refreshed every --interval-s until Ctrl-C
    dualpace-router placement --router 127.0.0.1:50051 --json     # one JSON object (one per line with --watch)

Exit status: 0, or 2 with a one-line error when the router cannot be reached or answers with an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime

import grpc

from dualpace.wire.router_messages import placements_to_dict
from dualpace.wire.v1 import router_pb2, router_pb2_grpc

PROG = "dualpace-router placement"
CALL_TIMEOUT_S = 5.0
MAX_MIGRATIONS_SHOWN = 10
# Piped or redirected, the tables keep their natural width instead of a terminal's (rich's
# default there is 80 columns, which cut the headers to "ki…", "heal…").
UNCROPPED_WIDTH = 10_000


class PlacementError(Exception):
    """The router could not be asked: one line for the user."""


def fetch(stub: router_pb2_grpc.RouterStub, address: str) -> dict:
    try:
        reply = stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        code = exc.code().name if exc.code() is not None else "UNKNOWN"
        raise PlacementError(f"router {address}: {code}: {exc.details()}") from None
    return placements_to_dict(reply)


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value > 0 else "-"


def render(placements: dict, address: str, problem: str | None = None):
    """The three tables (engines, requests, recent migrations) as one rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    stamp = datetime.now().strftime("%H:%M:%S")
    engines = Table(title=f"engines (router {address}, {stamp})", title_justify="left")
    for column in ("name", "kind", "health", "KV blocks", "cached", "indexed", "running", "waiting", "ITL p50",
                   "ITL p99"):
        engines.add_column(column, justify="right" if column not in ("name", "kind", "health") else "left",
                           no_wrap=column != "name")
    for engine in placements["engines"]:
        total, used = engine["kv_blocks_total"], engine["kv_blocks_used"]
        share = f" ({100 * used / total:.0f}%)" if total else ""
        engines.add_row(engine["name"], engine["kind"],
                        Text("ok", style="green") if engine["healthy"] else Text("DOWN", style="bold red"),
                        f"{used}/{total}{share}", str(engine["kv_blocks_cached"]),
                        str(engine.get("prefix_index_blocks", 0)), str(engine["running"]),
                        str(engine["waiting"]),
                        _ms(engine["itl_p50_ms"]), _ms(engine["itl_p99_ms"]))

    requests = Table(title=f"requests ({len(placements['requests'])})", title_justify="left")
    for column in ("id", "engine", "state", "prompt", "generated", "KV blocks"):
        requests.add_column(column, justify="left" if column in ("id", "engine", "state") else "right")
    for request in placements["requests"]:
        requests.add_row(request["request_id"], request["engine"], request["state"], str(request["prompt_tokens"]),
                         str(request["generated_tokens"]), str(request["kv_blocks"]))

    recent = placements["migrations"][-MAX_MIGRATIONS_SHOWN:]
    migrations = Table(title=f"recent migrations ({len(recent)} of {len(placements['migrations'])})",
                       title_justify="left")
    for column in ("time", "request", "from", "to", "outcome", "detail"):
        migrations.add_column(column)
    outcome_style = {"committed": "green", "failed": "red", "in_progress": "yellow"}
    for migration in recent:
        when = datetime.fromtimestamp(migration["timestamp_unix_ms"] / 1e3).strftime("%H:%M:%S")
        migrations.add_row(when, migration["request_id"], migration["from_engine"], migration["to_engine"],
                           Text(migration["outcome"], style=outcome_style.get(migration["outcome"], "")),
                           migration["detail"])

    parts = [engines, requests, migrations]
    if problem is not None:
        parts.insert(0, Text(f"last refresh failed: {problem}", style="bold red"))
    return Group(*parts)


def run_placement(args: argparse.Namespace) -> int:
    if not args.interval_s > 0:
        print(f"{PROG}: error: --interval-s: must be positive, got {args.interval_s}", file=sys.stderr)
        return 2
    with grpc.insecure_channel(args.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        try:
            placements = fetch(stub, args.router)
        except PlacementError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        try:
            if args.json:
                return _print_json(stub, args, placements)
            return _print_tables(stub, args, placements)
        except KeyboardInterrupt:
            return 0
        except BrokenPipeError:  # the reader went away (e.g. `| head`): not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0


def _print_json(stub, args: argparse.Namespace, placements: dict) -> int:
    print(json.dumps(placements), flush=True)
    while args.watch:
        time.sleep(args.interval_s)
        try:
            print(json.dumps(fetch(stub, args.router)), flush=True)
        except PlacementError as exc:  # keep watching: the router may come back
            print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
    return 0


def _print_tables(stub, args: argparse.Namespace, placements: dict) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal:
        console = Console(width=UNCROPPED_WIDTH)
    if not args.watch:
        console.print(render(placements, args.router))
        return 0
    with Live(render(placements, args.router), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(args.interval_s)
            try:
                placements, problem = fetch(stub, args.router), None
            except PlacementError as exc:  # show the last good view with the error above it
                problem = str(exc)
            live.update(render(placements, args.router, problem), refresh=True)
