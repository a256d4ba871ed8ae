"""The engine's queue, shared between its requests' owners (tenants).

The engine takes `max_num_seqs + max_waiting` requests at once; past that it refuses new ones
(EngineOverloadedError). One owner alone could so fill it and lock every other owner out for as
long as it kept it full. So when the queue is full, a request whose owner has at least two
fewer *queued* requests (waiting, never computed) than the owner with the most gets in, and
the newest queued request of that owner is refused instead, with the same EngineOverloadedError
it would have got had it arrived last. Requests that have run are never displaced (a preempted
one has produced tokens), nor are requests whose prefill has started, nor requests whose stream
has had any output (a choice aborted alone while its request waits).

The margin of two makes the exchange strictly even the queue out: with one, two owners that
each keep sending would displace each other's requests in turn for ever; with two, once their
queued requests differ by at most one, each owner's new requests are refused at the door. With
one owner alone nothing changes: its own requests never displace each other.

Inside the queue, the scheduler orders new requests round-robin by owner (`Scheduler.add`), so
the queue's order is not arrival order: "newest" here is by arrival (`Sequence.arrival_time`),
never by place in the queue.

Owners are what the gateway names (`EngineRequest.owner`, the tenant's id); requests without
one share one owner, "".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from loramux.engine.sequence import Sequence

NO_OWNER = ""
"""The owner of requests that name none."""


def may_displace(queued: Counter[str], owner: str) -> bool:
    """Whether `owner`'s request may displace another owner's queued one, by the counts of
    requests with no output yet per owner (`queued`, the event loop's view; the step thread
    decides with `displaced`): a quick refusal for the owner with the most, off the step thread."""
    return queued[owner] + 1 < max(queued.values(), default=0)


def displaced(
    waiting: Iterable[Sequence], owner_of: Callable[[str], str | None], owner: str
) -> str | None:
    """The request id to refuse so that a request of `owner` gets into the full queue, or None
    when `owner` may not have it. `waiting` is the scheduler's waiting queue; only requests that
    were never computed count, and only those with a stream (`owner_of` names their owner, None
    for a request whose consumer left). Of the owner with the most of them (ties: the owner with
    the newest), the newest by arrival: `waiting` is in fair order, not arrival order."""
    counts: Counter[str] = Counter()
    newest: dict[str, Sequence] = {}
    for seq in waiting:
        if seq.scheduled_time is not None:
            continue
        seq_owner = owner_of(seq.request_id)
        if seq_owner is None:
            continue
        counts[seq_owner] += 1
        latest = newest.get(seq_owner)
        if latest is None or seq.arrival_time >= latest.arrival_time:
            newest[seq_owner] = seq
    if not counts:
        return None
    top = max(counts, key=lambda o: (counts[o], newest[o].arrival_time))
    if counts[owner] + 1 >= counts[top]:
        return None
    return newest[top].request_id
