"""A TLS engine's KV migration reaches its peer over TLS (mutual, with its own certificate),
with the token; plaintext to the same TLS port does not get through. The same on channels kept
across transfers, as a daemon's senders share them (PeerChannels: one per address and TLS settings)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvLayout, KvTransferHeader
from dualpace.errors import Unavailable
from dualpace.sampling import SamplingParams
from dualpace.serve.kv_transport import KvControlSender
from dualpace.serve.peer_channels import PeerChannels
from dualpace.serve.security import ServerSecurity, load_tls
from dualpace.serve.server import start_server
from tests.serve.fake_services import ENGINE_SERVICE, FailingEngine, register_all
from tests.serve.test_security import TOKEN, _self_signed

HEADER = KvTransferHeader("ok", (1, 2), (3,), SamplingParams(seed=1), 0, KvLayout(1, 1, 4, 8, "float32"),
                          0, "source")
NO_KV = OutgoingKv(storage=None, slot_ids=[])  # a move without KV: no pool is read


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
@pytest.mark.parametrize("kept", [False, True])
async def test_migration_channel_uses_the_daemons_tls_and_token(tmp_path: Path, kept: bool) -> None:
    channels = PeerChannels() if kept else None
    cert, key = _self_signed(tmp_path, "engine")  # both engines' certificate, and their CA (self-signed)
    tls = load_tls(str(cert), str(key), str(cert))  # mutual TLS: clients need a certificate from that CA
    target = await start_server("127.0.0.1:0", lambda server: register_all(server, FailingEngine()),
                                [ENGINE_SERVICE], security=ServerSecurity(tls=tls, auth_token=TOKEN))
    try:
        # Past TLS and the token, the fake target answers 'prepared' where 'committed' is due.
        with pytest.raises(Unavailable, match="expected 'committed'"):
            await KvControlSender(target.address, auth_token=TOKEN, tls=tls, channels=channels)(HEADER, NO_KV)
        with pytest.raises(Unavailable) as plaintext:
            await KvControlSender(target.address, auth_token=TOKEN, timeout_s=10, channels=channels)(HEADER, NO_KV)
        assert "expected 'committed'" not in str(plaintext.value)
        other_cert, other_key = _self_signed(tmp_path, "stranger")  # a certificate the target does not trust
        stranger = load_tls(str(other_cert), str(other_key), str(cert))
        with pytest.raises(Unavailable) as untrusted:
            await KvControlSender(target.address, auth_token=TOKEN, tls=stranger, timeout_s=10,
                                  channels=channels)(HEADER, NO_KV)
        assert "expected 'committed'" not in str(untrusted.value)
        with pytest.raises(Unavailable, match="expected 'committed'"):  # after those failures, TLS again
            await KvControlSender(target.address, auth_token=TOKEN, tls=tls, channels=channels)(HEADER, NO_KV)
    finally:
        if channels is not None:
            await channels.close()
        await target.stop(grace_s=None)
