"""Channels from this daemon to its peers, kept open across KV transfers to the same target.

Opening a channel for each transfer costs a connection and an HTTP/2 handshake on the way in and
a teardown on the way out, about 2 ms of a small transfer's 10 ms on a loaded 2-core machine.
A cached channel is shared by concurrent transfers to that target (gRPC
multiplexes their streams). When a transfer fails the channel is dropped from the cache, so the
next transfer connects afresh (the target may have restarted); it is closed with a grace period
that lets the other transfers still on it finish.
"""

from __future__ import annotations

import asyncio

import grpc

from dualpace.serve.security import TlsConfig, peer_channel
from dualpace.serve.server import channel_options

# The deadline of one KV transfer's call (KvControlSender's default), so the grace the calls still on
# a dropped channel get. Here, not in kv_transport, which imports this module.
TRANSFER_TIMEOUT_S = 120.0
# A channel of its own connections: by default gRPC shares connections (subchannels) across the
# process's channels, so a new channel to a target that just refused would inherit that failed
# connection and its reconnect backoff, and fail at once too (tests/serve/test_daemon_peer_channels).
CHANNEL_OPTIONS = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]


class PeerChannels:
    """One open channel per (target address, TLS settings), for one event loop."""

    def __init__(self):
        self._channels: dict[tuple[str, TlsConfig | None], grpc.aio.Channel] = {}
        self._dropped: set[grpc.aio.Channel] = set()  # closing once the calls still on them end
        self._closing_tasks: set[asyncio.Task] = set()

    def get(self, address: str, tls: TlsConfig | None) -> grpc.aio.Channel:
        channel = self._channels.get((address, tls))
        if channel is None:
            channel = self._channels[(address, tls)] = peer_channel(address, tls, CHANNEL_OPTIONS)
        return channel

    def kept(self, address: str, tls: TlsConfig | None) -> grpc.aio.Channel | None:
        """The channel the next transfer to `address` would use, if one is open (opens none)."""
        return self._channels.get((address, tls))

    def drop(self, address: str, tls: TlsConfig | None, channel: grpc.aio.Channel) -> None:
        """After a failed transfer on `channel`: the next transfer opens a new one."""
        if self._channels.get((address, tls)) is channel:
            del self._channels[(address, tls)]
            self._dropped.add(channel)
            task = asyncio.get_running_loop().create_task(self._close_dropped(channel))
            self._closing_tasks.add(task)
            task.add_done_callback(self._closing_tasks.discard)

    async def _close_dropped(self, channel: grpc.aio.Channel) -> None:
        await channel.close(grace=TRANSFER_TIMEOUT_S)
        self._dropped.discard(channel)

    async def close(self) -> None:
        """At shutdown: every channel closed, calls still on them cancelled."""
        channels = [*self._channels.values(), *self._dropped]
        self._channels, self._dropped = {}, set()
        for channel in channels:
            await channel.close()
