"""Iteration-level scheduling: which sequences compute how many tokens in the next step, and
what a computed step changes (`postprocess`).

One token budget per step is shared by decode tokens and prefill chunks. Running sequences
are served first, oldest first; then waiting ones are admitted in queue order while budget,
sequence slots, adapter slots and KV blocks last; `_admit_waiting` says who may go ahead of
whom and why no request starves. When blocks run out for a running sequence, the newest running
sequence is preempted (its blocks freed, to be recomputed later — usually largely from the prefix
cache). The oldest running sequence can always proceed, since the pool holds at least one full
context, so the scheduler never deadlocks and never runs out of memory.

A scheduled chunk counts as computed at once (`num_computed_tokens` moves when it is scheduled)
and a chunk that samples adds a pending token (`Sequence.num_pending_tokens`), so the next step
can be scheduled before this one has been postprocessed: a decode of the pending token takes its
value on the device. The token lands, full blocks are published in the prefix cache and
finishing is decided when the step is postprocessed; a sequence that a pending token will end
for its length is not scheduled again meanwhile (one ended by a stop token computes one wasted
token, which its postprocessing drops).

Fair order. A new request is queued round-robin by owner (`Sequence.owner`, the tenant) over
the requests that were never computed (`add`), so one owner's thousands of queued requests
cannot hold another's back for long; sequences that have been computed (preempted ones, at the
head) keep their places. With one owner the order is arrival order.

Choices (n > 1). A request's choice 0 is scheduled like any sequence, holding the others in its
`forks` and, from admission on, a running seat for each. The step that computes the end of its
prompt forks them (`_fork`): they share its blocks, are running from then on, and sample their
first tokens from the same logits row (`sample_rows`). From there each choice is an ordinary
sequence: preempted and recomputed alone, its blocks copied on its first write to a shared one.
A choice that ends before the fork (aborted alone) leaves `forks`, so it is never forked; a
choice 0 that does hands its forks to the next choice, which computes the prompt in its place.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from loramux.engine.block_manager import Allocation, BlockManager
from loramux.engine.lora.stats import Readiness
from loramux.engine.sequence import FinishReason, Sequence, SequenceStatus


class AdapterGate(Protocol):
    """Admission control for adapters: a running sequence's adapter is always in a device slot.

    `acquire` pins the slot of an admitted sequence (after `readiness` said READY); `release`
    unpins it when the sequence is preempted or finishes. Slots and adapter memory are the
    limit on distinct adapters in one step. FAILED: the adapter cannot be loaded; the request
    is handed to the engine to fail (`SchedulerOutput.failed`). With `may_defer`, an adapter that would take a
    large share of the memory from resident ones is not READY (it lets smaller ones go first).
    """

    def readiness(self, seq: Sequence, may_defer: bool = False) -> Readiness: ...
    def acquire(self, seq: Sequence) -> None: ...
    def release(self, seq: Sequence) -> None: ...
    def prefetch(self, seq: Sequence) -> None: ...


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int
    """First position computed this step (the sequence's `num_computed_tokens` when scheduled)."""
    num_tokens: int
    samples: bool
    """This chunk reaches the end of the sequence, so its last logit is sampled."""
    forks: tuple[Sequence, ...] = ()
    """Choices forked from `seq` in this step: each samples its own token from the same logits
    row as `seq` (and has that token pending)."""

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        """The next `num_tokens` of `seq`, which from now on count as computed."""
        assert num_tokens > 0, "a scheduled chunk computes at least one token"
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num_tokens
        samples = start + num_tokens == len(seq)
        seq.num_pending_tokens += samples
        return cls(seq, start, num_tokens, samples)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def sample_rows(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """One entry per token the step samples, in sampling-row order: each sampling chunk, then
    one for each of its forks (the same positions, computed once, with the fork's sequence)."""
    rows: list[ScheduledChunk] = []
    for c in chunks:
        if c.samples:
            rows.append(c)
            rows.extend(ScheduledChunk(f, c.start, c.num_tokens, True) for f in c.forks)
    return rows


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    """Waiting requests whose adapter could not be loaded: the engine fails them (they keep
    their place in the queue until it does)."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class SequenceUpdate:
    """What a postprocessed step did to one sequence that sampled in it."""

    seq: Sequence
    token: int | None
    """The token appended to it; None when its logits were not finite (it then fails)."""
    finish: FinishReason | None
    """Set when this token ended it (it is finished and its blocks are free)."""


@dataclass
class SchedulerStats:
    prefix_cache_hit_tokens: int = 0
    """Prompt tokens served from the prefix cache at requests' first admission (readmissions
    after a preemption find their own blocks: not counted)."""
    prefix_cache_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache at those admissions."""
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    preemptions: int = 0


class Scheduler:
    prefetch_depth = 16
    """Waiting requests whose adapters are fetched from disk ahead of their turn."""
    max_slot_wait_steps = 64
    """Steps a request waiting for an adapter slot lets others (needing no new slot) go first."""
    max_large_adapter_defer_steps = 8
    """Of those, steps a request whose adapter would evict a large share of adapter memory
    defers to the requests behind it (rank-aware admission: a few large adapters do not crowd
    out many small ones)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        adapters: AdapterGate | None = None,
    ):
        self.block_manager = block_manager
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stats = SchedulerStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        """Running sequences in admission order: the last is the newest, preempted first."""
        self._fresh: Counter[str] = Counter()
        """Waiting sequences never computed (`scheduled_time` None), per owner."""

    def add(self, seq: Sequence) -> None:
        """Queue a new request's sequence at its fair place: round-robin by owner over the
        waiting sequences never computed. Ranking those from the head (an owner's first is 0,
        its next 1, ...), a request whose owner has r of them goes before the first whose rank
        is above r and behind its owner's own, else at the end. So with one owner (or none) it
        goes at the end, and a request of an owner with none queued goes after at most one of
        every other owner's. Sequences that were computed (preempted: at the head) neither rank
        nor move. Unless some owner has r + 2 or more queued, it goes at the end without a look
        at the queue; otherwise the scan stops at its place, (r + 1) rounds from the head."""
        rank = self._fresh[seq.owner]
        self._count(seq, 1)
        if max(self._fresh.values()) <= rank + 1:
            self.waiting.append(seq)
            return
        seen: Counter[str] = Counter()
        for position, other in enumerate(self.waiting):
            if other.scheduled_time is not None:
                continue
            if seen[other.owner] > rank and seen[seq.owner] == rank:
                self.waiting.insert(position, seq)
                return
            seen[other.owner] += 1
        self.waiting.append(seq)

    def _count(self, seq: Sequence, delta: int) -> None:
        """`seq` joins (1) or leaves (-1) the waiting queue: count it if never computed."""
        if seq.scheduled_time is None:
            self._fresh[seq.owner] += delta
            if not self._fresh[seq.owner]:
                del self._fresh[seq.owner]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Over a snapshot: choices forked by this step join `running` but compute nothing in it.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._reaches_its_length(seq):
                continue  # preempted by this step, or done once its pending token lands
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    return budget
            self.block_manager.append(seq, n)
            out.chunks.append(self._chunk(seq, n))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit in queue order (arrival order, round-robin by owner: `add`).

        - A request whose adapter is still loading from disk is passed over: it loads off the
          step loop and keeps its place. One whose adapter failed to load is passed over too,
          and handed to the engine to fail (`out.failed`).
        - A request that waits for an adapter slot (all slots pinned) may be overtaken only by
          requests that need no new slot (adapter already in one, or the base model), and only
          for `max_slot_wait_steps` steps; after that, admission stops until a slot frees, which
          happens as running sequences finish. So no request waits forever.
        - A request whose adapter would evict resident ones to take over a quarter of adapter
          memory waits like that, for at most `max_large_adapter_defer_steps` steps, while
          requests wait behind it: smaller adapters go first (rank-aware admission).
        - Running out of KV blocks stops admission: nobody overtakes the oldest request there.
        """
        if out.preempted:
            return
        if self.adapters is not None:
            for seq in itertools.islice(self.waiting, self.prefetch_depth):
                self.adapters.prefetch(seq)
        passed: list[Sequence] = []
        slot_waiter: Sequence | None = None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            may_defer = len(self.waiting) > 1 and seq.slot_wait_steps < min(
                self.max_large_adapter_defer_steps, self.max_slot_wait_steps
            )
            readiness = (
                self.adapters.readiness(seq, may_defer) if self.adapters else Readiness.READY
            )
            if readiness is Readiness.FAILED:
                out.failed.append(seq)
            if readiness in (Readiness.LOADING, Readiness.FAILED) or (
                readiness is Readiness.NO_SLOT and slot_waiter is not None
            ):
                passed.append(self.waiting.popleft())
                continue
            if readiness is Readiness.NO_SLOT:
                seq.slot_wait_steps += 1
                if seq.slot_wait_steps > self.max_slot_wait_steps:
                    break
                slot_waiter = seq
                passed.append(self.waiting.popleft())
                continue
            if seq.num_pending_tokens or self._seats() + 1 + len(seq.forks) > self.max_num_seqs:
                break  # preempted as it sampled: its token lands first; or no seats for its forks
            allocation = self.block_manager.can_allocate(seq, budget)
            if allocation is None:
                break
            self.waiting.popleft()
            self._start(seq, allocation, out)
            budget -= allocation.num_new_tokens
        self.waiting.extendleft(reversed(passed))

    def _seats(self) -> int:
        """Running sequences and the forks running ones will have: new ones must fit beside."""
        return len(self.running) + sum(len(s.forks) for s in self.running)

    def _chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        """The next `num_tokens` of `seq`; forks its waiting choices if it samples."""
        chunk = ScheduledChunk.of(seq, num_tokens)
        if not (chunk.samples and seq.forks):
            return chunk
        forks, seq.forks = tuple(seq.forks), []
        for child in forks:
            self._fork(seq, child)
        return replace(chunk, forks=forks)

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Make `child` a running copy of `parent` (its prompt computed by this step) whose
        first token is the one it samples in this step."""
        self.block_manager.fork(parent, child)
        child.num_pending_tokens = 1
        child.scheduled_time = time.time()
        if self.adapters is not None:
            self.adapters.acquire(child)  # the parent's adapter: already in a slot
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def _reaches_its_length(self, seq: Sequence) -> bool:
        """Its pending tokens will end it at max_tokens or the context length."""
        completion = len(seq) - seq.num_prompt_tokens
        return seq.num_pending_tokens > 0 and (
            completion >= seq.params.max_tokens or len(seq) >= self.max_model_len
        )

    def _start(self, seq: Sequence, allocation: Allocation, out: SchedulerOutput) -> None:
        """Move an admitted request to running: pin its adapter, attach its cached prefix, grow."""
        assert seq.num_pending_tokens == 0, "admitted with a token still on the device"
        self._count(seq, -1)
        if self.adapters is not None:
            self.adapters.acquire(seq)
        self.block_manager.allocate(seq, allocation)
        if seq.scheduled_time is None:  # its first admission, not one after a preemption
            seq.scheduled_time = time.time()  # when a step first computes it
            # Readmitted, it finds its own blocks from before the preemption: not cached for
            # the client (and telling it so would tell it that others' load preempted it).
            seq.num_cached_tokens = allocation.num_cached_tokens
            self.stats.prefix_cache_hit_tokens += allocation.num_cached_tokens
            self.stats.prefix_cache_query_tokens += seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.chunks.append(self._chunk(seq, allocation.num_new_tokens))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free `seq`'s blocks and put it back at the head of the queue, to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        if self.adapters is not None:
            self.adapters.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.stats.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks. A choice
        that has not forked yet leaves its choice 0's `forks`; a choice 0 that ends before
        forking hands its forks on (`_hand_on_forks`)."""
        if seq in self.running:
            self.running.remove(seq)
            if self.adapters is not None:
                self.adapters.release(seq)
            self._hand_on_forks(seq, None)
        elif seq in self.waiting:
            self._hand_on_forks(seq, self.waiting.index(seq))
            self.waiting.remove(seq)
            self._count(seq, -1)
        else:
            for parent in itertools.chain(self.waiting, self.running):
                if seq in parent.forks:
                    parent.forks.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _hand_on_forks(self, seq: Sequence, position: int | None) -> None:
        """`seq` (a choice 0) ends before its choices forked: the first of them takes its place
        in the queue (`position`, or the head for a running `seq`: it was admitted already)
        holding the others, and computes the prompt for them. They are scheduled from nowhere
        else, so without this they would wait forever."""
        if not seq.forks:
            return
        heir, *others = seq.forks
        seq.forks, heir.forks = [], others
        self.waiting.insert(0 if position is None else position, heir)
        self._count(heir, 1)

    # -- after a step --------------------------------------------------------------------------
    def postprocess(
        self, chunks: list[ScheduledChunk], tokens: list[int | None]
    ) -> list[SequenceUpdate]:
        """Land a computed step: publish its newly full blocks, append each sampled token
        (`tokens`: one per sampling chunk, in order; None for non-finite logits) and finish the
        sequences it ends. A sequence finished while the step ran (aborted) is left alone."""
        sampled = iter(tokens)
        updates: list[SequenceUpdate] = []
        for chunk in chunks:
            token = next(sampled) if chunk.samples else None
            fork_tokens = [next(sampled) for _ in chunk.forks]
            self._land_forks(chunk.forks, fork_tokens, updates)
            seq = chunk.seq
            if seq.is_finished:
                continue
            prompt_end = min(chunk.end, seq.num_prompt_tokens)
            self.stats.prompt_tokens_computed += max(0, prompt_end - chunk.start)
            seq.num_pending_tokens -= chunk.samples
            if chunk.samples and token is None:
                # Its blocks are not sealed: KV that led to non-finite logits is never shared.
                self.finish(seq)
                updates.append(SequenceUpdate(seq, None, FinishReason.ERROR))
                continue
            if seq.status is SequenceStatus.RUNNING:  # not preempted since it was scheduled
                self.block_manager.seal_full_blocks(seq, chunk.end)
            if token is not None:
                updates.append(self._append(seq, token))
        return updates

    def _land_forks(
        self, forks: tuple[Sequence, ...], tokens: list[int | None], out: list[SequenceUpdate]
    ) -> None:
        """Land the first tokens of the choices forked in this step."""
        for seq, token in zip(forks, tokens, strict=True):
            if seq.is_finished:
                continue
            seq.num_pending_tokens -= 1
            if token is None:
                self.finish(seq)
                out.append(SequenceUpdate(seq, None, FinishReason.ERROR))
            else:
                out.append(self._append(seq, token))

    def _append(self, seq: Sequence, token: int) -> SequenceUpdate:
        seq.token_ids.append(token)
        self.stats.generated_tokens += 1
        finish: FinishReason | None = None
        if token in seq.stop_token_ids:
            finish = FinishReason.STOP
        elif (
            seq.num_completion_tokens >= seq.params.max_tokens
            or len(seq.token_ids) >= self.max_model_len
        ):
            finish = FinishReason.LENGTH
        if finish is not None:
            self.finish(seq)
        return SequenceUpdate(seq, token, finish)
