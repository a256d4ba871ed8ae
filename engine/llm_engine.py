"""The synchronous engine: admit requests, then `step()` until done.

    schedule → prepare inputs → run the model → sample → postprocess

Not thread-safe: one thread owns an LLMEngine (the async facade runs it off the event loop).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from adapters.base_spec import BaseModelSpec
from adapters.peft_format import AdapterLimits
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, UnknownAdapterError
from engine.lora.batch import LoraBatch
from engine.lora.manager import AdapterStats, LoraManager
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.loader import load_model
from engine.model_runner import ModelRunner, kv_bytes_per_block
from engine.outputs import (
    MAX_CACHE_SALT_CHARS,
    EngineRequest,
    EngineStats,
    RequestOutput,
    Usage,
)
from engine.prompt import prompt_token_ids
from engine.sampler import sample
from engine.scheduler import ScheduledChunk, Scheduler
from engine.sequence import BASE_ADAPTER, FinishReason, Sequence
from kernels.lora_meta import LoraMetaBuffers

log = logging.getLogger(__name__)

NON_FINITE_LOGITS = (
    "the model's output for this request was not finite (NaN or infinity); "
    "an adapter with out-of-range weights does this"
)
STEP_FAILED = "the engine failed while computing this request; the error is in the engine's log"


@dataclass
class _Counters:
    prefix_cache_hit_tokens: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    aborted: int = 0
    steps: int = 0


@dataclass
class _Active:
    seq: Sequence
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    cached_prompt_tokens: int = 0
    """Prompt tokens found in the prefix cache at first admission (reported in usage)."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(0)
        # For validate(), on callers' threads (the step thread never touches text).
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(config.model))
        self.max_model_len = _max_model_len(config)
        self.model: LlamaModel = load_model(
            config.model, config.torch_dtype, config.device, self.max_model_len
        )
        self.model_config = self.model.config
        num_blocks = self._num_blocks()
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.lora = self._lora_manager()
        self._lora_buffers = LoraMetaBuffers(
            config.max_num_batched_tokens, torch.device(config.device)
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.lora
        )
        self.runner = ModelRunner(config, self.model, num_blocks)
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self._active: dict[str, _Active] = {}
        self._arrivals = 0
        self._counters = _Counters()

    def _num_blocks(self) -> int:
        c = self.config
        per_block = kv_bytes_per_block(self.model_config, c.block_size, c.torch_dtype)
        num_blocks = c.num_kv_blocks or c.kv_cache_bytes // per_block
        needed = -(-self.max_model_len // c.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV pool ({num_blocks} blocks of {c.block_size}) cannot hold one sequence of "
                f"max_model_len {self.max_model_len}; raise the KV budget or lower max_model_len"
            )
        return num_blocks

    def _lora_manager(self) -> LoraManager | None:
        c = self.config
        if not c.enable_lora:
            return None
        return LoraManager(
            BaseModelSpec.from_model_dir(c.model),
            c.max_loras,
            c.max_cpu_loras,
            AdapterLimits(max_rank=c.max_lora_rank),
            c.torch_dtype,
            c.device,
        )

    # -- adapters -----------------------------------------------------------------------------
    def register_adapter(self, folder: Path) -> str:
        """Validate and register the PEFT adapter in `folder`; its digest names it in requests.
        Safe from any thread. Raises adapters.errors.AdapterError for a bad adapter."""
        if self.lora is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        return self.lora.register(folder)

    def retire_adapter(self, digest: str) -> bool:
        """New requests for `digest` are refused at once; it is dropped when its last one ends."""
        return self.lora.retire(digest) if self.lora is not None else False

    def adapter_stats(self) -> dict[str, AdapterStats]:
        return dict(self.lora.stats) if self.lora is not None else {}

    # -- requests ---------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> list[int]:
        """Token ids of the request's prompt; raises InvalidRequestError and queues nothing."""
        if request.adapter is not None and (
            self.lora is None or not self.lora.is_servable(request.adapter)
        ):
            raise UnknownAdapterError(f"adapter {request.adapter!r} is not loaded")
        salt = request.cache_salt
        if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(
                f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters"
            )
        return prompt_token_ids(
            self.tokenizer, request, self.model_config.vocab_size, self.max_model_len
        )

    def add_request(self, request: EngineRequest, prompt_ids: list[int] | None = None) -> None:
        """Queue a request (`prompt_ids`: what `validate` returned for it). Raises before
        changing anything when it cannot be queued."""
        if request.request_id in self._active:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        ids = prompt_ids if prompt_ids is not None else self.validate(request)
        self._arrivals += 1
        seq = Sequence(
            request.request_id,
            list(ids),
            request.params,
            self._arrivals,
            adapter_id=request.adapter or BASE_ADAPTER,
            cache_salt=request.cache_salt,
        )
        stop_ids = frozenset(request.params.stop_token_ids) | (
            frozenset() if request.params.ignore_eos else self.eos_ids
        )
        self._active[seq.request_id] = _Active(seq, stop_ids)
        if self.lora is not None:
            self.lora.add_user(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; its final output, or None if unknown."""
        active = self._active.pop(request_id, None)
        if active is None:
            return None
        self._finish(active.seq)
        self._counters.aborted += 1
        return self._final(active, FinishReason.ABORT)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.lora is not None:
            self.lora.remove_user(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.lora is not None:
            self.lora.sweep()
        batch = self.scheduler.schedule()
        self._counters.preemptions += len(batch.preempted)
        if not batch.chunks:
            return []
        try:
            chunks, tokens = self._execute(batch.chunks)
        except Exception:
            log.exception("a step of %d requests failed; failing them", len(batch.chunks))
            self._check_device()
            return [self._fail(self._active[c.seq.request_id], STEP_FAILED) for c in batch.chunks]
        return self._postprocess(chunks, tokens)

    def _execute(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[int | None]]:
        """Run the model over the step's chunks and sample: the chunks in the order run, and a
        token (None: not finite) for each that samples. It changes no request or block
        bookkeeping, only the KV of these chunks, so a failure here fails exactly these requests."""
        chunks, lora = self._lora_batch(chunks)
        inputs = self.runner.prepare(chunks, lora)
        logits = self.runner.run(inputs)
        sampling = [c.seq for c in chunks if c.samples]
        return chunks, sample(logits, [s.params for s in sampling], [s.generator for s in sampling])

    def _check_device(self) -> None:
        """Raise if the device itself has failed. A CUDA error (an illegal memory access, say)
        is sticky: every later step would fail too, so the engine as a whole must stop."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _lora_batch(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], LoraBatch | None]:
        """Order chunks by adapter slot (one segment per adapter) and build the step's LoRA work."""
        if self.lora is None:
            return chunks, None
        lora = self.lora
        slots = {id(c): lora.slot_of(c.seq.adapter_id) for c in chunks}
        chunks = sorted(chunks, key=lambda c: (slots[id(c)] is None, slots[id(c)] or 0))
        token_slots = [slots[id(c)] for c in chunks for _ in range(c.num_tokens)]
        per_token = all(c.num_tokens == 1 for c in chunks)
        return chunks, LoraBatch.build(lora.stack, self._lora_buffers, token_slots, per_token)

    def _postprocess(
        self, chunks: list[ScheduledChunk], tokens: list[int | None]
    ) -> list[RequestOutput]:
        """Advance each request by its chunk; a request whose advance raises fails alone."""
        self._counters.steps += 1
        sampled = iter(tokens)
        outputs: list[RequestOutput] = []
        for chunk in chunks:
            active = self._active[chunk.seq.request_id]
            token = next(sampled) if chunk.samples else None
            try:
                out = self._advance(active, chunk, token)
            except Exception:
                log.exception("request %s failed after its step", chunk.seq.request_id)
                out = self._fail(active, STEP_FAILED)
            if out is not None:
                outputs.append(out)
        return outputs

    def _advance(
        self, active: _Active, chunk: ScheduledChunk, token: int | None
    ) -> RequestOutput | None:
        """Count the chunk's computed tokens and append its sampled token, if it sampled one
        (`token` None while `chunk.samples`: the logits were not finite)."""
        seq = chunk.seq
        prompt_left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        self._counters.prompt_tokens_computed += min(prompt_left, chunk.num_tokens)
        if seq.num_computed_tokens == seq.num_cached_tokens and seq.num_completion_tokens == 0:
            # First chunk since admission: count the prefix-cache hit once.
            self._counters.prefix_cache_hit_tokens += seq.num_cached_tokens
            active.cached_prompt_tokens = seq.num_cached_tokens
        if chunk.samples and token is None:
            # Its blocks are not sealed: KV that led to non-finite logits is never shared.
            return self._fail(active, NON_FINITE_LOGITS)
        seq.num_computed_tokens += chunk.num_tokens
        self.block_manager.seal_full_blocks(seq)
        if token is None:
            return None
        if self.lora is not None:
            self.lora.count_tokens(seq.adapter_id, 1)
        return self._append_token(active, token)

    def _append_token(self, active: _Active, token: int) -> RequestOutput:
        seq = active.seq
        seq.token_ids.append(token)
        self._counters.generated_tokens += 1
        reason: FinishReason | None = None
        if token in active.stop_ids:
            reason = FinishReason.STOP
        elif seq.num_completion_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return RequestOutput(seq.request_id, [token])
        del self._active[seq.request_id]
        self._finish(seq)
        return self._final(active, reason, [token])

    def _fail(self, active: _Active, error: str) -> RequestOutput:
        """End one request with FinishReason.ERROR, freeing its blocks and adapter pin (unless
        it had already finished when its processing failed)."""
        seq = active.seq
        self._active.pop(seq.request_id, None)
        if not seq.is_finished:
            self._finish(seq)
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, active.cached_prompt_tokens)
        return RequestOutput(seq.request_id, [], FinishReason.ERROR, usage, error)

    def _final(
        self, active: _Active, reason: FinishReason, token_ids: list[int] | None = None
    ) -> RequestOutput:
        seq = active.seq
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, active.cached_prompt_tokens)
        return RequestOutput(seq.request_id, token_ids or [], reason, usage)

    def stats(self) -> EngineStats:
        blocks = self.block_manager.stats()
        c = self._counters
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_total=blocks.total,
            kv_blocks_used=blocks.used,
            kv_blocks_free=blocks.free,
            prefix_cache_hit_tokens=c.prefix_cache_hit_tokens,
            prompt_tokens_computed=c.prompt_tokens_computed,
            generated_tokens=c.generated_tokens,
            preemptions=c.preemptions,
            aborted=c.aborted,
            steps=c.steps,
        )


def _max_model_len(config: EngineConfig) -> int:
    mc = ModelConfig.from_folder(config.model)
    limit = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    return limit if mc.sliding_window is None else min(limit, mc.sliding_window)
