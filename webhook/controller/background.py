"""A controller loop that lives as long as the operator: started by a kopf startup
handler, stopped (and awaited) by its cleanup handler. The loop gets an ``asyncio.Event``
that is set when it should end; its task and that event live in kopf's memo as
``<name>_task`` and ``<name>_stop``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import kopf


def start(memo: kopf.Memo, name: str, run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    memo[f"{name}_stop"] = stop

    async def main() -> None:
        await run(stop)

    memo[f"{name}_task"] = asyncio.create_task(main(), name=f"epguard-{name}")


async def stop(memo: kopf.Memo, name: str) -> None:
    event: asyncio.Event | None = memo.get(f"{name}_stop")
    task: asyncio.Task[None] | None = memo.get(f"{name}_task")
    if event is not None:
        event.set()
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)
