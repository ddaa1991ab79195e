"""The kernel libraries' variants the model tests load, built in the background from the session's
start: the tests load every variant this CPU runs (generic, avx2, avx512, ...), of both kernel
libraries, and where they are not cached yet (a fresh clone, changed sources) each is a compile of
seconds. Started early, they compile on the core the tests leave idle while the modules before
tests/model run; a test that wants one still being built waits for it (native_build's lock) rather
than compiling it again."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

from dualpace.model import cpu_kernels_build as kbuild
from dualpace.model import quant_kernels

log = logging.getLogger(__name__)

# The modules that load every variant (in this order of the suite).
VARIANT_MODULES = ("tests/model/test_cpu_kernels.py", "tests/model/test_cpu_moe.py", "tests/model/test_quant.py")


def missing_builds() -> list[Callable[[], object]]:
    """A build call for each variant not yet in the cache, in the order the tests want them. Paths
    and build functions are taken now, so that a test replacing them later
    (tests/model/test_kernel_builds.py) changes nothing here."""
    names = kbuild.supported_variants()
    builds: list[Callable[[], object]] = []
    for variant in (kbuild.VARIANTS[name] for name in names):
        path = kbuild.library_path(variant)
        if not path.exists():
            builds.append(functools.partial(kbuild.build, variant, path))
    for flags in (quant_kernels.compile_flags(name) for name in names):
        path = quant_kernels.library_path(flags)
        if not path.exists():
            builds.append(functools.partial(quant_kernels._build, path, flags))
    return builds


def start_background_kernel_builds() -> threading.Thread | None:
    """One thread compiling the missing variants one after another (one core: the tests keep the
    other); None when nothing is missing."""
    builds = missing_builds()
    if not builds:
        return None

    def run() -> None:
        for build in builds:
            try:
                build()
            except OSError as exc:  # no compiler: the tests that need one say so themselves
                log.info("background kernel build stopped: %s", exc)
                return
            except Exception as exc:  # noqa: BLE001 - a failed build is the test's to report, when it builds again
                log.info("background kernel build failed: %s", exc)

    thread = threading.Thread(target=run, name="kernel-builds", daemon=True)
    thread.start()
    return thread
