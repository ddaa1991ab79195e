"""Helpers the tools share (bench/, the profiler, the simulator, the CLI): starting daemons,
measuring memory bandwidth, workload specs, a synchronous Engine client, reading daemons' RSS and
metrics, transformers as a reference. Tools floor; imports only the core."""
