"""Where the time of one same-host KV transfer went, from the sender's marks (SameHostKvSender.marks:
(event, perf_counter s) pairs, in order), for `python -m bench.data_plane --timeline`.

The events, in order: start, stream_opened, header (written), reservation (answered), mapped (the
target's pool in hand, geometry checked), lease_held, copied (copy + CRC32C of every layer done),
lease_ended, lease_and_copy, written (shm_written sent, with the commit where the target takes
both), verify_prepare_commit (the target's answer read). One host, one clock: the target's own
marks (its debug log) line up with these.
"""

from __future__ import annotations


def timeline_rows(marks: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """(event, ms since the first mark, ms since the previous mark) per mark."""
    if not marks:
        return []
    first = previous = marks[0][1]
    rows = []
    for name, moment in marks:
        rows.append((name, (moment - first) * 1e3, (moment - previous) * 1e3))
        previous = moment
    return rows


def format_timeline(title: str, marks: list[tuple[str, float]]) -> str:
    """A small table of timeline_rows under `title`."""
    lines = [title, f"  {'event':<24}{'at ms':>9}{'+ms':>9}"]
    lines += [f"  {name:<24}{at_ms:>9.3f}{step_ms:>9.3f}" for name, at_ms, step_ms in timeline_rows(marks)]
    return "\n".join(lines)
