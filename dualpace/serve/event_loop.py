"""The daemon's event loop: uvloop when available, SIGINT/SIGTERM as a clean stop.

    async def run(stop: asyncio.Event) -> int:
        running = await start_server(...)
        print_listening("cpu_service", running.address)
        await stop.wait()
        await running.stop(grace_s=5.0)
        return 0

    sys.exit(serve_forever(run))
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def install_uvloop() -> bool:
    """Installs uvloop's event loop policy if uvloop imports; returns whether it did."""
    try:
        import uvloop
    except ImportError:
        logger.info("uvloop is not installed; using the default asyncio loop")
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def serve_forever(main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int:
    """Runs `main(stop)` on uvloop until it returns; returns its exit code (None -> 0).

    The first SIGINT or SIGTERM sets `stop`, which main awaits to shut down
    cleanly; after that the signals get their default action back, so a second
    Ctrl-C ends a stuck shutdown.
    """
    # A crash in native code (a segfault, libuv's abort) prints every thread's Python stack on
    # stderr instead of ending the daemon without a word.
    faulthandler.enable()
    install_uvloop()
    return asyncio.run(_run_until_stopped(main)) or 0


async def _run_until_stopped(main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int | None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: signal.Signals) -> None:
        logger.info("received %s; stopping (a second SIGINT or SIGTERM ends the process at once)", signum.name)
        stop.set()
        for restored in STOP_SIGNALS:
            loop.remove_signal_handler(restored)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await main(stop)
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
