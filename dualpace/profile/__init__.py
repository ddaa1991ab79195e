"""What the daemons read from a profile at run time: the schema (schema.py), the cost model
over it (cost_model.py), the fingerprints (fingerprint.py) and the daemons' --profile check
(daemon.py). The profiler that measures profiles is a tool (profiles/profiler)."""
