"""PeerChannels: one channel per target kept across transfers, replaced after a failed one."""

from __future__ import annotations

import asyncio

from grpc import ChannelConnectivity

from dualpace.serve.peer_channels import PeerChannels


async def test_one_channel_per_target_until_a_failure_drops_it():
    channels = PeerChannels()
    first = channels.get("127.0.0.1:1", None)
    assert channels.get("127.0.0.1:1", None) is first
    other = channels.get("127.0.0.1:2", None)
    assert other is not first
    channels.drop("127.0.0.1:1", None, first)
    replacement = channels.get("127.0.0.1:1", None)
    assert replacement is not first
    channels.drop("127.0.0.1:1", None, first)  # a second failure on the old channel: the new one stays
    assert channels.get("127.0.0.1:1", None) is replacement
    await asyncio.sleep(0)  # the dropped channel's close (with grace) starts; no call is on it
    await channels.close()
    for channel in (first, replacement, other):
        assert channel.get_state() == ChannelConnectivity.SHUTDOWN
