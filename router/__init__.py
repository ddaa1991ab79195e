"""The router daemon: the asyncio service, engine handles (typed client methods), relay, HTTP front, CLI. Its pure decisions live in dualpace.policy."""
