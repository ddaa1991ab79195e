"""The end-to-end load generator behind `dualpace bench`.

- lengths: length SPECs, traces, seeded arrival times and prompts (pure);
- stats: per-request records -> the report's statistics (pure);
- generator: the asyncio open-loop driver over the router's gRPC streaming API;
- report: sweep tables and plots.
"""
