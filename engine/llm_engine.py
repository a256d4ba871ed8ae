"""The synchronous engine: admit requests, then `step()` until done.

    schedule → prepare inputs → run the model → sample → postprocess

Each stage has its module: `Scheduler.schedule`, `ModelRunner.prepare` and `.run`, `sample`,
`Scheduler.postprocess` (tokens, blocks, finishing), then `OutputProcessor` (deltas, usage). The
engine never touches text: gateways tokenize, detokenize and match stop strings.

With asynchronous scheduling (`EngineConfig.async_scheduling`, on CUDA by default) a step's
device work is queued before the previous step is postprocessed, so the host schedules and
prepares step N + 1 while the device computes step N; `step()` then returns step N's outputs.

Faults stay with their requests: a step the device cannot compute fails the requests in it, a
request whose logits are not finite, whose output cannot be made or whose adapter can no
longer be read from disk fails alone; only a broken device (or broken bookkeeping, which
raises out of `step`) stops the engine.

Not thread-safe: one thread owns an LLMEngine (the async facade runs it off the event loop).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoTokenizer

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.peft_format import AdapterLimits
from loramux.engine.block_manager import BlockManager
from loramux.engine.config import EngineConfig
from loramux.engine.errors import (
    AdapterUnavailableError,
    InvalidRequestError,
    RequestFailedError,
    StructuredOutputFailedError,
    UnknownAdapterError,
    number_text,
)
from loramux.engine.identity import model_identity
from loramux.engine.lora.manager import LoraManager
from loramux.engine.lora.stats import AdapterStats
from loramux.engine.metrics import EngineMetrics
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LlamaModel
from loramux.engine.model.loader import load_model
from loramux.engine.model_runner import ModelRunner, kv_pool_blocks
from loramux.engine.output_processor import OutputProcessor
from loramux.engine.outputs import (
    MAX_CACHE_SALT_CHARS,
    EngineRequest,
    EngineStats,
    RequestOutput,
    TokenLogprob,
)
from loramux.engine.prompt import prompt_token_ids
from loramux.engine.sampler import sample_step
from loramux.engine.sampling import SamplingParams, choice_seed
from loramux.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, SequenceUpdate
from loramux.engine.sequence import BASE_ADAPTER, FinishReason, Sequence
from loramux.engine.step_inputs import LaunchedStep, StepInputs
from loramux.engine.structured import StructuredOutputError
from loramux.engine.structured.grammar import CompiledGrammar, GrammarCompiler
from loramux.engine.structured.mask import GrammarBitmask
from loramux.engine.structured.schema import is_panic

log = logging.getLogger(__name__)

NON_FINITE_LOGITS = (
    "the model's output for this request was not finite (NaN or infinity); "
    "an adapter with out-of-range weights does this"
)
STEP_FAILED = "the engine failed while computing this request; the error is in the engine's log"


class Checked(NamedTuple):
    """A request as `LLMEngine.checked` finds it: prompt ids, compiled grammar (or None)."""

    prompt_ids: list[int]
    grammar: CompiledGrammar | None


GRAMMAR_FAILED = "the structured output's grammar could not follow this request's tokens"
ADAPTER_UNREADABLE = (
    "this request's adapter could not be loaded: its files were deleted or changed on disk "
    "since it was registered; the error is in the engine's log"
)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(0)
        # For validate(), on callers' threads (the step thread never touches text).
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(config.model))
        self.max_model_len = ModelConfig.from_folder(config.model).context_limit(
            config.max_model_len
        )
        self.model: LlamaModel = load_model(
            config.model,
            config.torch_dtype,
            config.device,
            self.max_model_len,
            config.random_weights,
            config.fused_kernels,
        )
        self.model_config = self.model.config
        self.model_identity = model_identity(config.model, config.dtype, config.random_weights)
        """The served base model's files and dtype, as a digest (engine.identity): what a
        gateway keys its response cache and system_fingerprint by."""
        self.lora = self._lora_manager()
        self.runner = ModelRunner(config, self.model, self.max_model_len, self.lora)
        num_blocks = kv_pool_blocks(
            config, self.model_config, self.max_model_len, self.runner.graph_memory()
        )
        self.runner.allocate_kv(num_blocks)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.lora,
        )
        self.outputs = OutputProcessor()
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self.grammars = GrammarCompiler.for_tokenizer(
            self.tokenizer, self.model_config.vocab_size, self.eos_ids
        )
        self.grammar_masks = GrammarBitmask(
            config.max_num_seqs, self.model_config.vocab_size, self.runner.device
        )
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        self._in_flight: LaunchedStep | None = None
        self._steps = 0
        self._aborted = 0
        self.metrics = EngineMetrics(self)
        if self.lora is not None:
            self.lora.on_load = self.metrics.lora_load.observe

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
            c.lora_memory_bytes,
            load_workers=c.lora_load_workers,
            copy_groups_per_step=c.lora_copy_groups_per_step,
            base_weights=self.model,
        )

    # -- adapters -----------------------------------------------------------------------------
    def register_adapter(self, folder: Path) -> str:
        """Validate and register the PEFT adapter in `folder`; its digest names it in requests.
        Safe from any thread. Raises adapters.errors.AdapterError for a bad adapter."""
        if self.lora is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        return self.lora.register(folder)

    def prefetch_adapter(self, digest: str) -> None:
        """Start loading adapter `digest` for a request that is on its way; ignored for unknown
        digests and when loads are already backed up. Safe from any thread."""
        if self.lora is not None:
            self.lora.hint(digest)

    def sweep_adapters(self) -> None:
        """Drop retired adapters no request uses (step thread, between steps; `step` does it
        too, before each step)."""
        if self.lora is not None:
            self.lora.sweep()

    def retire_adapter(self, digest: str) -> bool:
        """New requests for `digest` are refused at once; it is dropped when its last one ends."""
        return self.lora.retire(digest) if self.lora is not None else False

    def adapter_stats(self) -> dict[str, AdapterStats]:
        return dict(self.lora.stats) if self.lora is not None else {}

    # -- requests ---------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> list[int]:
        """Token ids of the request's prompt; raises InvalidRequestError and queues nothing."""
        return self.checked(request).prompt_ids

    def checked(self, request: EngineRequest, compile: bool = True) -> Checked:
        """The request's prompt ids and compiled structured output, if any; raises
        InvalidRequestError and queues nothing. Compiling takes time: call it off the step
        thread (the async facade does) and hand both to `add_request`. With `compile` False, a
        grammar not compiled yet raises NotCompiled (grammar.GrammarCompiler.compiled)."""
        if request.adapter is not None and (
            self.lora is None or not self.lora.is_servable(request.adapter)
        ):
            raise UnknownAdapterError(f"adapter {request.adapter!r} is not loaded")
        salt = request.cache_salt
        if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(
                f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters"
            )
        self._check_sampling(request.params)
        ids = prompt_token_ids(
            self.tokenizer, request, self.model_config.vocab_size, self.max_model_len
        )
        return Checked(ids, self._compiled_grammar(request, compile))

    def _compiled_grammar(self, request: EngineRequest, compile: bool) -> CompiledGrammar | None:
        """The request's structured output compiled (cached after the first time, for its owner
        alone: GrammarCompiler.compile); raises StructuredOutputError when it cannot be."""
        if (spec := request.params.structured) is None:
            return None
        if (grammars := self.grammars) is None:
            raise StructuredOutputError("this model's tokenizer does not support structured output")
        owner = request.owner
        return grammars.compile(spec, owner) if compile else grammars.compiled(spec, owner)

    def _check_sampling(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids in the vocabulary, n in a step."""
        vocab = self.model_config.vocab_size
        for token_id, _ in params.logit_bias:
            if token_id >= vocab:
                raise InvalidRequestError(
                    f"logit_bias token id {number_text(token_id)} is not in the vocabulary "
                    f"[0, {vocab})"
                )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n must be at most {self.config.max_num_seqs} on this engine (max_num_seqs)"
            )

    def add_request(
        self,
        request: EngineRequest,
        prompt_ids: list[int] | None = None,
        *,
        checked: Checked | None = None,
    ) -> None:
        """Queue a request, given what `checked` returned for it (or its `prompt_ids` alone).
        Raises before changing anything when it cannot be queued. Given `checked`, nothing is
        compiled here, on the step thread: a grammar `checked` compiled may have left the
        compiler's cache since (other requests' schemas), and compiling it again here stalled
        every request's steps (a large schema: seconds)."""
        if self.outputs.open_choices(request.request_id):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if checked is None and prompt_ids is not None:
            checked = Checked(prompt_ids, self._compiled_grammar(request, True))
        ids, compiled = checked if checked is not None else self.checked(request)
        params = request.params
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_ids
        )
        choices = [
            Sequence(
                request.request_id,
                list(ids),
                replace(params, seed=choice_seed(params.seed, i)) if i else params,
                adapter_id=request.adapter or BASE_ADAPTER,
                cache_salt=request.cache_salt,
                owner=request.owner or "",
                stop_token_ids=stop_ids,
                index=i,
                grammar=compiled.matcher() if compiled is not None else None,
            )
            for i in range(params.n)
        ]
        # `checked` found the adapter servable, but a retire (and the sweep dropping it, as no
        # request used it yet) may have come since: the request would wait for it forever.
        if request.adapter is not None and (self.lora is None or not self.lora.add_users(choices)):
            raise UnknownAdapterError(f"adapter {request.adapter!r} is not loaded")
        choices[0].forks = choices[1:]
        self.outputs.add(choices)
        self.scheduler.add(choices[0])

    def abort(self, request_id: str, choice: int | None = None) -> RequestOutput | None:
        """Stop a request (every choice, or only choice `choice`) wherever it is and free its
        blocks; its last output (ABORT, with usage; choices it ends before make none), or None
        if unknown or already ended."""
        choices = self.outputs.open_choices(request_id)
        if choice is not None:
            choices = [seq for seq in choices if seq.index == choice]
        if not choices:
            return None
        self._aborted += choice is None  # requests: a choice stopped alone is not one
        return [self._end(seq, FinishReason.ABORT) for seq in choices][-1]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule → prepare → run → sample → postprocess; the outputs of the step landed."""
        if self.lora is not None:
            self.lora.sweep()
            self.lora.advance()
        batch = self.scheduler.schedule()
        # Each request once: failing one choice ends its others, which may be waiting too.
        outputs = [
            self._fail(seq, ADAPTER_UNREADABLE, AdapterUnavailableError)
            for seq in batch.failed
            if self.outputs.is_open(seq)
        ]
        launched: LaunchedStep | None = None
        if batch.chunks:
            launched, landed = self._launch(batch)
            outputs += landed
        if self.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        if launched is not None:
            outputs += self._land(launched)
        return outputs

    def _launch(self, batch: SchedulerOutput) -> tuple[LaunchedStep | None, list[RequestOutput]]:
        """Prepare, run and sample: the step's device work, queued (computed, on the CPU). With
        it, the outputs of anything that ended meanwhile: the step in flight, landed early
        because a grammar's mask needs its tokens, or this step's requests if it failed."""
        outputs: list[RequestOutput] = []
        try:
            inputs, logits = self._forward(batch.chunks)
        except Exception:
            return None, self._fail_step(batch)
        if self._in_flight is not None and self.grammar_masks.waits_for_landing(inputs.chunks):
            # The device goes on with this step's forward pass while the step before lands.
            outputs, self._in_flight = self._land(self._in_flight), None
        try:
            return self._sample(inputs, logits), outputs
        except BaseException as exc:  # the grammar library's panics are BaseExceptions
            if not (isinstance(exc, Exception) or is_panic(exc)):
                raise
            return None, outputs + self._fail_step(batch)

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[StepInputs, torch.Tensor]:
        inputs = self.runner.prepare(chunks, self._in_flight)
        self.runner.copy_blocks(self.block_manager.take_copies())
        return inputs, self.runner.run(inputs)

    def _sample(self, inputs: StepInputs, logits: torch.Tensor) -> LaunchedStep:
        """Mask the constrained rows (filled on the host while the device runs the forward
        pass), process and sample."""
        grammar = self.grammar_masks.fill(inputs.chunks)
        return LaunchedStep(inputs.chunks, sample_step(logits, inputs.sampling, grammar))

    def _land(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for the step's tokens and postprocess it."""
        tokens = step.sampled.tolist()
        self._steps += 1
        updates = self.scheduler.postprocess(step.chunks, tokens)
        # A choice whose request failed earlier in this list has nothing more to say.
        return [self._output(u, step) for u in updates if self.outputs.is_open(u.seq)]

    def _fail_step(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """The device could not compute this step: fail exactly its requests (it wrote only the
        KV of their chunks, and they end here). Raises if the device itself has failed: a CUDA
        error (an illegal memory access, say) is sticky, every later step would fail too."""
        log.exception("a step of %d requests failed; failing them", len(batch.chunks))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        return [self._fail(c.seq, STEP_FAILED) for c in batch.chunks if self.outputs.is_open(c.seq)]

    def _output(self, update: SequenceUpdate, step: LaunchedStep) -> RequestOutput:
        """The delta of one choice that sampled; if making it raises, its request fails."""
        seq, token = update.seq, update.token
        if token is None:
            return self._fail(seq, NON_FINITE_LOGITS)
        if seq.grammar is not None and not seq.grammar.accept(token):
            log.warning("request %s: grammar failed: %s", seq.request_id, seq.grammar.error)
            error = f"{GRAMMAR_FAILED}: {seq.grammar.error.strip()}"
            return self._fail(seq, error, StructuredOutputFailedError)
        forcing = seq.grammar.forcing_error() if seq.grammar and update.finish is None else ""
        if forcing:  # what follows is too long to mask: see engine.structured.grammar
            return self._fail(seq, f"{GRAMMAR_FAILED}: {forcing}", StructuredOutputFailedError)
        try:
            if self.lora is not None:
                self.lora.count_tokens(seq.adapter_id, 1)
            self.metrics.token_landed(seq)
            logprob = None
            if seq.params.logprobs:
                logprob = step.sampled.logprob(step.sample_row(seq), seq.params.top_logprobs)
            if update.finish is None:
                return self.outputs.delta(seq, token, logprob)
            return self._end(
                seq, update.finish, [token], logprobs=None if logprob is None else [logprob]
            )
        except Exception:
            log.exception("request %s failed after its step", seq.request_id)
            return self._fail(seq, STEP_FAILED)

    def _fail(
        self,
        seq: Sequence,
        error: str,
        error_type: type[RequestFailedError] = RequestFailedError,
    ) -> RequestOutput:
        """Fail `seq`'s whole request: its other open choices end silently, and `seq`'s ERROR
        output, which its stream raises as `error_type`, is the request's last."""
        for other in self.outputs.open_choices(seq.request_id):
            if other is not seq:
                self._end(other, FinishReason.ERROR, error=error)
        return self._end(seq, FinishReason.ERROR, error=error, error_type=error_type)

    def _end(
        self,
        seq: Sequence,
        reason: FinishReason,
        token_ids: list[int] | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        error_type: type[RequestFailedError] = RequestFailedError,
    ) -> RequestOutput:
        """End an open choice wherever it is: free its blocks and adapter pin (unless the
        scheduler already finished it), count its adapter user out, make its final output."""
        if not seq.is_finished:
            self.scheduler.finish(seq)
        if self.lora is not None:
            self.lora.remove_user(seq)
        final = self.outputs.final(seq, reason, token_ids, error, logprobs, error_type)
        if final.timings is not None:
            self.metrics.request_finished(final.timings)
        return final

    def stats(self) -> EngineStats:
        blocks = self.block_manager.stats()
        c = self.scheduler.stats
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
            aborted=self._aborted,
            steps=self._steps,
            prefix_cache_query_tokens=c.prefix_cache_query_tokens,
        )
