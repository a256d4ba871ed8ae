"""A request's deltas as the remote engine client reads them off its channel: into the queue
its caller reads (`next_delta`), or pushed to the caller's sink as the channel's reader reads
each (`PushSink`), as RequestOutputs (`output_of`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from loramux.engine.outputs import RequestOutput
from loramux.engine.sequence import FinishReason
from loramux.engine.service.wire import Delta
from loramux.gateway.engine_client.channel import StreamItem, StreamSink


class PushSink:
    """A stream's sink on its channel, in place of its queue: each delta is handed to `sink`
    as the channel's reader reads it; `done` ends with the last one, or with the stream's error
    (or the sink's: the channel's reader, serving every stream, never sees it)."""

    def __init__(self, sink: Callable[[RequestOutput], None], done: asyncio.Future[None]):
        self.sink = sink
        self.done = done

    def put_nowait(self, item: StreamItem) -> None:
        if self.done.done():
            return
        if isinstance(item, Exception):
            self.done.set_exception(item)
            return
        try:
            self.sink(output_of(item))
        except Exception as exc:
            self.done.set_exception(exc)
            return
        if item.usage is not None:  # the request's last choice ended
            self.done.set_result(None)


async def next_delta(stream: StreamSink) -> Delta:
    """The stream's next delta; its error raised."""
    assert isinstance(stream, asyncio.Queue), "a stream read by its caller has a queue"
    item = await stream.get()
    if isinstance(item, Exception):
        raise item
    return item


def output_of(delta: Delta) -> RequestOutput:
    reason = None if delta.finish_reason is None else FinishReason(delta.finish_reason)
    return RequestOutput(
        delta.ref,
        delta.token_ids,
        reason,
        delta.usage,
        index=delta.index,
        logprobs=delta.logprobs,
        timings=delta.timings,
    )
