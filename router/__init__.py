"""The router: admission and migration planning (pure), the asyncio service, engine clients, CLI."""
