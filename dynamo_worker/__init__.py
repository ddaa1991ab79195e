"""`dualpace-dynamo`: one DualPace node (gpu_service + cpu_service + router on one host) as a
worker of NVIDIA Dynamo (floor 2, a thin shell like the daemons).

Dynamo's frontend tokenizes, applies the chat template, matches stop strings and routes; this
worker receives token ids and sampling options, sends them to its node's router over gRPC
(router_client.RouterClient) and streams token ids back. Only engine.py and __main__.py import
Dynamo (the optional extra `[dynamo]`); the translation (requests.py), the error mapping
(errors.py) and the load signals (load.py) are plain Python and tested without it.
See docs/scale-out.md.
"""
