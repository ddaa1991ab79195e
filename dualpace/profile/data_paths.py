"""Which data path a KV transfer or a Dense Assist iteration takes, and the profile's figures for it.

Pure (no torch, grpc, asyncio or clock). Two daemons on one host move KV and assist tensors through
shared memory; anything else goes over a TCP data socket (same-host shared memory runs several times
its rate). A profile may hold
each path's figures (dualpace.profile.schema); the cost model, the mode chooser and the migration
planner read `profile.kv_transfer` and the `assist_ms` table, so `for_paths` returns the profile
with those set to the figures of the paths in force.

The rules:

- KV: shared memory iff the sender's `--kv-transport` is auto, both engines are on this host,
  and the target's pool is in host memory (a CUDA pool is not shared); else the target's TCP data
  socket. A profile without `tcp` figures measured nothing over the data socket: it is priced at
  the slowest of the profile's own KV figures and the migration planner's no-profile default
  (dualpace.policy.migration_planner.MEASURED_KV_TRANSFER_*), so a move over it is never
  overstated.
- Assist: shared memory iff cpu_service's `--assist-transport` is auto and gpu_service is on
  this host; else gpu_service's TCP data socket (priced at the profile's plain assist figures
  where it has none for the data socket).
- "On this host" is proved by the daemons themselves at run time (boot ids and a memfd
  handshake); a planner only knows addresses, so `on_this_host` reads an address the way the
  daemons are deployed: a Unix socket or a loopback address is on the host of whoever dials it.
  An address that is not (a host name, another IP) may still be local, but is priced as another
  host's: the slower figure never overstates what shared memory would give a move or an
  assisted iteration.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from dualpace.policy.migration_planner import MEASURED_KV_TRANSFER_BYTES_PER_S, MEASURED_KV_TRANSFER_FIXED_MS
from dualpace.profile.schema import DATA_PATHS, KVTransfer, Profile, ProfileError

SHM, TCP = DATA_PATHS
KV_PATHS = (SHM, TCP)  # the KV transfer's: the target's blocks in shared memory, or its data socket
ASSIST_PATHS = (SHM, TCP)  # Dense Assist's: the per-session rings, or gpu_service's data socket
TRANSPORT_SETTINGS = ("auto", "tcp")  # the daemons' --assist-transport values
KV_TRANSPORT_SETTINGS = ("auto", "tcp")  # the engines' --kv-transport values


def on_this_host(address: str) -> bool:
    """Whether a daemon address is certainly on the host that dials it (Unix socket or loopback)."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.removeprefix("ipv4:").removeprefix("ipv6:").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_setting(setting: str, flag: str, settings: tuple[str, ...] = TRANSPORT_SETTINGS) -> None:
    if setting not in settings:
        raise ProfileError(f"{flag}: expected one of {', '.join(settings)}, got {setting!r}")


def kv_path(kv_transport: str, same_host: bool, target_pool_in_host_memory: bool = True) -> str:
    """The path a KV transfer takes (see the module doc)."""
    _check_setting(kv_transport, "--kv-transport", KV_TRANSPORT_SETTINGS)
    return SHM if kv_transport == "auto" and same_host and target_pool_in_host_memory else TCP


def assist_path(assist_transport: str, same_host: bool) -> str:
    """The path Dense Assist takes (see the module doc)."""
    _check_setting(assist_transport, "--assist-transport")
    return SHM if assist_transport == "auto" and same_host else TCP


def _unmeasured_data_socket(profile: Profile) -> KVTransfer:
    """The data socket's KV figures for a profile that has none: the lowest rate among its own
    figures (plain and any path's) and the no-profile default."""
    default = KVTransfer(MEASURED_KV_TRANSFER_BYTES_PER_S, MEASURED_KV_TRANSFER_FIXED_MS)
    held = [default, profile.kv_transfer, *profile.kv_transfer_paths.values()]
    return min(held, key=lambda transfer: (transfer.bytes_per_s, -transfer.fixed_ms))


def for_paths(profile: Profile, kv: str | None = None, assist: str | None = None) -> Profile:
    """`profile` with `kv_transfer` and the `assist_ms` table of the given paths, where it has them
    (an older profile, or one measured over one path only, keeps its plain figures)."""
    for path, paths in ((kv, KV_PATHS), (assist, ASSIST_PATHS)):
        if path is not None and path not in paths:
            raise ProfileError(f"data path: expected one of {', '.join(paths)}, got {path!r}")
    changes = {}
    if kv == TCP and TCP not in profile.kv_transfer_paths:
        changes["kv_transfer"] = _unmeasured_data_socket(profile)
    elif kv is not None and kv in profile.kv_transfer_paths:
        changes["kv_transfer"] = profile.kv_transfer_paths[kv]
    if assist is not None and f"assist_ms_{assist}" in profile.tables:
        changes["tables"] = {**profile.tables, "assist_ms": profile.tables[f"assist_ms_{assist}"]}
    return dataclasses.replace(profile, **changes) if changes else profile
