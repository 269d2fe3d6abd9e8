"""Ending the simulated pod's background tasks (the engine loop, the lease reaper, the replay server)."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended; whatever it raised on the way out is
    dropped, since the pod is shutting that part down anyway."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
