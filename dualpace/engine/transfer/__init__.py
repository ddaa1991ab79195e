"""A request's KV between engines: two-phase migration (migration), what a transfer sends
(kv_source, kv_transfer, kv_bytes, kv_checksum), the same-host path through shared memory
(same_host, shm_*, kv_shm_*, kv_copy_native), the network path over a TCP data socket (kv_tcp_*),
and the host tier built on them (host_tier, host_tier_import, prefix_copy). The gRPC control
plane of each is in dualpace.serve (kv_transport, kv_shm_transport, kv_tcp_transport); a data
path declined or out of reach fails the transfer."""
