"""Profiles: the schema of a hardware+model profile, the cost model over it, and the simulator that uses it."""
