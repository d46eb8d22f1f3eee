"""Engine request streams as the HTTP layer uses them: submitted at once, merged across the n
samples of a request, and aborted however the response ends (disconnect, error, cancel)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling import SamplingParams
from dsinfer.server.async_engine import RequestStream
from dsinfer.server.errors import APIError
from dsinfer.server.serving import ServedModel


def open_streams(
    served: ServedModel, prompt_ids: list[int], params: list[SamplingParams], rid: str
) -> list[RequestStream]:
    """Submit one engine request per sample now (so admission counts them and they batch)."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(params):
            streams.append(
                served.engine.submit(prompt_ids, p, rid if len(params) == 1 else f"{rid}-{i}")
            )
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: Sequence[RequestStream]) -> None:
    for s in streams:
        s.close()


async def fan_out(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Merge the samples' streams; yield (choice index, delta output) as they arrive. Closing
    (or abandoning) the iterator aborts what has not finished."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await q.put((i, out))
            except BaseException as e:  # surfaced to the consumer below
                await q.put((i, e))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(tasks)
            while live:
                i, item = await q.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        close_all(streams)


class EngineStreamingResponse(StreamingResponse):
    """A streamed answer that aborts its engine requests however the response ends — also
    when the client left before the body started, which never runs the body's own cleanup."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"X-Accel-Buffering": "no"}
        )
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)


async def until_disconnected(
    request: Request, coro: Awaitable[Any], streams: Sequence[RequestStream] = ()
) -> Any:
    """Await `coro`, cancelling it and aborting its engine requests if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
        close_all(streams)
