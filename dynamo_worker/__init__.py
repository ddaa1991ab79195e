"""`dualpace-dynamo`: one DualPace node (gpu_service + cpu_service + router on one host) as a
worker of NVIDIA Dynamo (floor 2, a thin shell like the daemons).

Dynamo's frontend tokenizes, applies the chat template, matches stop strings and routes; this
worker receives token ids and sampling options, sends them to its node's router over gRPC
(router_client.RouterClient) and streams token ids back; it follows the node's engines' KV events
(engine_client, kv_relay) and republishes them as one worker's (kv_events) for Dynamo's KV router.
Only engine.py and __main__.py import Dynamo (the optional extra `[dynamo]`); the translation
(requests.py), the error mapping (errors.py), the load signals (load.py) and the KV view and relay
are plain Python and tested without it.
See docs/scale-out.md.
"""
