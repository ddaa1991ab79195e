"""System tests start daemons with the same launcher as the benchmarks."""

from toolkit.processes import Daemon, start_daemon, wait_serving  # noqa: F401
