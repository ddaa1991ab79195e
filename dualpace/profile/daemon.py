"""How the daemons (cpu_service, router) read `--profile`: load and validate the file, check
it was made for the model being served, and say clearly when not.

One-line errors (ProfileError, printed by the daemons as `NAME: error: ...`): unreadable
file, wrong version, missing table or field, model fingerprint mismatch, CPU kernels other than
those it was measured with (variant, AMX tiles) (each unless --profile-ignore-fingerprint). A
hardware mismatch is only a warning: a profile from a similar machine is still a better guide
than none, and the measured latencies correct it.
"""

from __future__ import annotations

import logging

from dualpace.model.config import ModelConfig
from dualpace.profile.files import load_profile
from dualpace.profile.fingerprint import (
    cpu_model_name,
    memory_bytes,
    model_fingerprint,
)
from dualpace.profile.schema import HardwareFingerprint, Profile, ProfileError, fingerprint_mismatches

log = logging.getLogger(__name__)
IGNORE_FLAG = "--profile-ignore-fingerprint"


def load_daemon_profile(path: str, config: ModelConfig, dtype: str | None = None, block_size: int | None = None,
                        ignore_fingerprint: bool = False, cpu_kernel_variant: str | None = None,
                        cpu_amx: bool | None = None) -> Profile:
    """The profile at `path`, checked against the served model. dtype / block_size None: not
    compared (the router does not know the engines' dtype). `cpu_kernel_variant` and `cpu_amx`
    (cpu_service: the kernels it computes with, and whether they run AMX tiles): a profile whose
    CPU tables were measured with another variant, or with AMX tiles where this engine has none
    (or the reverse), is refused, naming the difference, since its latencies describe other code.
    A profile that does not record them (an older one) is accepted."""
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        raise ProfileError(f"--profile: {exc}") from None
    served = model_fingerprint(config, dtype or profile.model.dtype, block_size or profile.model.block_size)
    ignore = [name for name, value in (("model.dtype", dtype), ("model.block_size", block_size)) if value is None]
    problems = fingerprint_mismatches(profile, model=served, ignore=ignore)
    if problems:
        if not ignore_fingerprint:
            raise ProfileError(f"--profile {path}: made for another model ({'; '.join(problems)}); "
                               f"pass {IGNORE_FLAG} to use it anyway")
        log.warning("profile %s: model fingerprint mismatch ignored (%s)", path, "; ".join(problems))
    difference = _kernel_difference(profile.hardware, cpu_kernel_variant, cpu_amx)
    if difference:
        message = f"--profile {path}: measured with {difference}"
        if not ignore_fingerprint:
            raise ProfileError(f"{message}; pass {IGNORE_FLAG} to use it anyway")
        log.warning("%s (ignored)", message)
    here = HardwareFingerprint(cpu_model=cpu_model_name(), cpu_cores=_cores(), memory_bytes=memory_bytes())
    hardware_problems = fingerprint_mismatches(profile, hardware=here,
                                               ignore=("hardware.gpu_model", "hardware.gpu_memory_bytes"))
    if hardware_problems:
        log.warning("profile %s was measured on other hardware (%s); its predictions seed decisions until "
                    "measurements take over", path, "; ".join(hardware_problems))
    return profile


def _kernel_difference(measured: HardwareFingerprint, variant: str | None, amx: bool | None) -> str:
    """How the CPU kernels a profile was measured with differ from this engine's ("" where they do
    not, or where either side is unknown)."""
    if variant is not None and measured.cpu_kernel_variant is not None and measured.cpu_kernel_variant != variant:
        return f"CPU kernel variant {measured.cpu_kernel_variant!r}, this engine runs {variant!r}"
    if amx is not None and measured.cpu_amx is not None and measured.cpu_amx != amx:
        return ("AMX tiles on, this engine's CPU kernels run without them" if measured.cpu_amx
                else "no AMX tiles, this engine's CPU kernels run them")
    return ""


def _cores() -> int:
    import os

    return os.cpu_count() or 1
