"""The end-to-end load generator behind `dualpace bench`.

- workloads: the chat-shaped workloads, and cold twins of prompts (pure; length SPECs, traces,
  seeded arrivals and prompts are toolkit.workload's);
- stats: per-request records -> the report's statistics (pure);
- generator: the asyncio open-loop driver over the router's gRPC streaming API, and one request
  waited for (closed loop); conversations: the multi-turn driver;
- report: sweep tables and plots.
"""
