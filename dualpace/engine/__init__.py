"""The engine core shared by gpu_service and cpu_service: a pure scheduler, a model
runner, and the plain EngineCore class that joins them (no asyncio, no grpc)."""
