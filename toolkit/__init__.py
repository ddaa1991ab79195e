"""Helpers the tools share (bench/, the profiler, the simulator, the CLI): starting daemons,
measuring memory bandwidth, workload specs. Tools floor; imports only the core."""
