"""The engine core shared by gpu_service and cpu_service (no grpc: the servicers are in dualpace.serve).

The scheduling core is this package's top level: the pure scheduler (scheduler, step_plan,
request, prefix_cache), the model runner (runner, step_sampling), EngineCore that joins them
(core), the daemon's step loop (loop, with channel, load, gate, step_window, step_timeline,
metrics_sink, run_delay). The machinery beside it sits in subpackages named for what they move:
- transfer/: a request's KV between engines (two-phase migration, the KV source and bytes,
  checksums, the same-host shared-memory path and the TCP network path, the host tier);
- assist/: Dense Assist (its messages, the shared-memory ring and doorbell, the TCP link,
  the join desk and joined steps).
Their gRPC side lives in dualpace.serve and in the daemons."""
