"""After the release: a stream's messages answered until it ends, or its request is preempted before its response began.

Most streams read their remaining messages plainly, each answered by their
attachment. Only a preemptible request pays for the race between its next
message and its preemption (a task per message until its response headers
come); preempted, the stream answers 503 ``preempted`` itself
(``core/preemption.py``): Envoy sends that to the client and resets the
request to the engine, which aborts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.ext_proc.attach.base import Attachment, Stream
from extproc.adapters.ext_proc.attach.served import ServedModel
from extproc.core.held import Held
from extproc.core.values.outcomes import Refusal, Refused


async def follow(side: Attachment, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
                 model: ServedModel, held: Held, priority: int | None) -> AsyncIterator[pb.ProcessingResponse]:
    """After the release: answer the stream's messages until it ends, or ``held`` is preempted before its response began.

    The release's reply is written once the loop has run what is ready (the
    transports write many streams' replies at once): this waits for that
    turn first, so that nothing here comes before the write.
    """
    await asyncio.sleep(0)
    async for message in messages if held.preempted is None else _until_preempted(messages, held):
        for reply in side.after_release(stream, model, held, message, priority):
            yield reply
    if held.preempted is not None and held.preempted.done() and not held.started:
        yield side.refusal(_preempted())


def _preempted() -> Refused:
    return Refused(Refusal.PREEMPTED, "a request of a higher priority class needed the engine before this one's "
                   "response began; retry (it will not be preempted again)")


async def _until_preempted(messages: AsyncIterator[pb.ProcessingRequest], held: Held) -> AsyncIterator[pb.ProcessingRequest]:
    """The stream's messages after the release, until it ends or ``held`` is preempted before its response began.

    Only a preemptible request pays for the race (a task per message until its
    response headers come); every other stream reads its messages plainly.
    The reading task is this stream's to end and its outcome this stream's to
    take, however the wait ends: preempted, or cancelled (the client gone, the
    server stopping). Left behind, it waits on a dead stream until it is
    destroyed pending, or it ends (StopAsyncIteration: Envoy half-closes a
    stream just before resetting it) with an exception nobody retrieves.
    """
    preempted = held.preempted
    while preempted is not None and not held.started:
        following = asyncio.ensure_future(anext(messages))
        try:
            await asyncio.wait((following, preempted), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the stream ends here, and the reader with it
            await _end_reader(following)
            raise
        if preempted.done():  # preempted: the stream ends with our answer
            # Its response headers may have come in the same instant: Envoy holds them for our reply (the mode
            # sends them), so the 503 replaces them; answered CONTINUE, the client would get a cut 200.
            await _end_reader(following)
            return
        try:
            message = following.result()
        except StopAsyncIteration:
            return
        yield message
    async for message in messages:
        yield message


async def _end_reader(reader: asyncio.Future[pb.ProcessingRequest]) -> None:
    """Cancel ``reader`` (if still reading) and wait for it, taking its outcome: a message, the stream's end, an error."""
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
