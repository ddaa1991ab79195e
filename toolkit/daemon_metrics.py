"""Watching daemons from outside: one slot per role with its RSS samples (the soak), reading a
process's RSS, and counters scraped from a daemon's Prometheus endpoint (the router's migrations;
an engine's preemptions, which bench.compare_policies reports per rate)."""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.processes import Daemon

METRICS_LINE = re.compile(r"metrics on (\S+:\d+)")
MIGRATION_SAMPLE = re.compile(r'^dualpace_migrations_total\{([^}]*)\}\s+([0-9.eE+-]+)$', re.MULTILINE)


def rss_kib(pid: int) -> int | None:
    """VmRSS of a live process in KiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def metrics_address(daemon: Daemon, timeout_s: float = 10.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(daemon.output):
            match = METRICS_LINE.search(line)
            if match:
                return match.group(1)
        time.sleep(0.1)
    return None


def _scrape(address: str | None) -> str | None:
    if address is None:
        return None
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def counter_total_from_metrics(address: str | None, name: str) -> int | None:
    """The sum of counter `name` (e.g. dualpace_preemptions_total) over its label sets, None if unreadable."""
    text = _scrape(address)
    if text is None:
        return None
    sample = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", re.MULTILINE)
    return int(sum(float(value) for value in sample.findall(text)))


def router_migrations_from_metrics(address: str | None) -> dict[str, int] | None:
    """`dualpace_migrations_total` by "direction/outcome" (hand-offs included), None if unreadable."""
    text = _scrape(address)
    if text is None:
        return None
    counts: dict[str, int] = {}
    for labels, value in MIGRATION_SAMPLE.findall(text):
        parts = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counts[f"{parts.get('direction', '?')}/{parts.get('outcome', '?')}"] = int(float(value))
    return counts


@dataclass
class DaemonSlot:
    """One role (gpu, cpu, router) and its current process; RSS samples per process generation."""
    role: str
    daemon: Daemon
    rss_start_kib: int | None = None  # after warm-up (of this generation)
    rss_end_kib: int | None = None
    restarted_at_s: float | None = None  # soak clock, when the current generation started serving
    rss_series: list = field(default_factory=list)  # [soak clock s, MiB] at each progress line
