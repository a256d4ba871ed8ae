"""The rules of a completion request, in the order of the request path:

    resolve model → sampling parameters → tokenize the prompt (once, off the event loop) →
    admission (quotas) → response cache → engine → finish (usage event, cache store, settle)

(Tried, 2026-11-27, and taken out: the cache lookup's round trip started before tokenizing. It
saved under 0.1 ms at 1 stream, and made time to first token at 64 streams worse, 134 → 165 ms.)

`prepare` does everything that can refuse the request, before a byte of the response is sent.
Once admitted, the request runs as a `Generation` of its own, and the reservation is settled
exactly once when it ends (success, error, or a client that left, which aborts it), by what the
engine generated: the prompt plus every completion token, or nothing when no token was
generated (refused by the engine, or left before its first token). A request for n choices
reserves n × max_tokens.

Cache hits count as one request against request and concurrency limits but consume no tokens:
their reservation is settled with 0, and their usage event records 0 billable tokens (the
response's `usage` still shows the original counts, as the client expects), exactly once, when
the replay or the response ends (`end_hit`; 499 when the client left before the replay ended).
A request for more than one choice is neither looked up nor stored: the cache keeps one choice
per entry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial

from loramux.adapters.store import AdapterStore
from loramux.cache.response_cache import ResponseCache
from loramux.cache.types import CacheHit, CachePolicy, CacheRequest, Consulted
from loramux.engine.errors import InvalidRequestError, PromptTooLongError
from loramux.engine.outputs import EngineRequest
from loramux.engine.structured import StructuredOutputError
from loramux.gateway import tracing
from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.catalog import ModelCatalog, ResolvedModel
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.errors import BadRequest, ClientClosedRequest, InsufficientQuota, RateLimited
from loramux.gateway.metrics import completion_route
from loramux.gateway.openai.cache_plan import cache_plan
from loramux.gateway.openai.finish import Metering
from loramux.gateway.openai.generation import Generation
from loramux.gateway.openai.logprobs import TokenPieces
from loramux.gateway.openai.prepared import CacheLookup, Draft, Prepared, ServingLimits, Tokenized
from loramux.gateway.openai.prompt import engine_prompt
from loramux.gateway.openai.responses import (
    Ending,
    Kind,
    Part,
    ResponseMeta,
    answer_of,
    cached,
    chunk,
    openings,
    part_of,
    replay_parts,
    replayed,
    usage_chunk,
    whole,
)
from loramux.gateway.openai.sampling import sampling_params, schema_param
from loramux.gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    refuse_unsupported,
)
from loramux.gateway.openai.shapes import SSE_DONE, ChatCompletion, TextCompletion, Usage, sse
from loramux.gateway.openai.tool_use import NONE as NO_TOOL_USE
from loramux.gateway.openai.tool_use import ToolUse
from loramux.gateway.openai.tools import ToolCallFormat, tool_plan
from loramux.gateway.prefix_cache import cache_salt
from loramux.gateway.prompt_tokens import PromptTokens
from loramux.gateway.quotas import Admission, QuotaService
from loramux.gateway.request_ids import response_id
from loramux.gateway.runs_in_flight import RunsInFlight

Body = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class CompletionService:
    """Completions for the OpenAI routes: one per process, provided to the handlers."""

    engine: EngineClient
    catalog: ModelCatalog
    adapters: AdapterStore
    prompts: PromptTokens
    pieces: TokenPieces
    quotas: QuotaService
    cache: ResponseCache
    metering: Metering
    runs: RunsInFlight
    """Every run started here, until it has ended (the gateway's shutdown ends them)."""
    limits: ServingLimits
    tool_format: ToolCallFormat | None
    """The tool-call format the model's chat template teaches; None when it renders no tools."""

    # -- preparing: everything that can refuse the request ---------------------------------------
    async def resolve(self, principal: Principal, req: Body) -> ResolvedModel:
        """The model the request names, for this caller; refuses what no model serves."""
        refuse_unsupported(req)
        return await self.catalog.resolve(principal, req.model)

    async def prepare(
        self,
        principal: Principal,
        req: Body,
        model: ResolvedModel,
        request_id: str,
        arrived: float,
        cache_control: str | None = None,
        gone: asyncio.Future[None] | None = None,
    ) -> Prepared:
        """Validate, tokenize, admit and look up the cache, then (on a miss) see the adapter
        onto the engine; raises before anything is sent. `model` is what `resolve` gave.
        `arrived` (time.perf_counter) is when the request reached the gateway: its latency and
        time to first token count from there. `gone` completes if the client closes its
        connection: a prompt not yet tokenized then never is (ClientClosedRequest)."""
        meta = self._meta(req, request_id, model)
        tools = self._tool_use(req, meta.id)
        draft = self._draft(req, request_id, model, principal, tools)
        await self._refuse_early(principal)
        tokenized = await self._tokenize(draft, principal.tenant_id, gone)
        params = tokenized.text_request.params
        operation = tracing.OPERATIONS[meta.kind]
        tracing.describe_request(
            operation, model.name, params, bool(req.stream), principal.tenant_id
        )
        admission = await self._admit(principal, tokenized)
        try:
            cache = cache_plan(
                self.limits.served_base, principal, req, tokenized.text_request, cache_control
            )
            consulted = await self._consult_cache(*cache, completion_route(meta.kind), request_id)
            if consulted.hit is None:
                await self._engage(model)
        except BaseException:
            await admission.settle(0)
            raise
        return Prepared(
            request=tokenized.engine_request,
            stop=params.stop,
            meta=meta.answered_by(consulted.hit),
            model=model,
            principal=principal,
            prompt_tokens=len(tokenized.prompt_ids),
            stream=bool(req.stream),
            admission=admission,
            cache=CacheLookup(*cache, consulted.hit, consulted.fence),
            tools=tools,
            started=arrived,
        )

    async def _engage(self, model: ResolvedModel) -> None:
        """The adapter of an admitted request on its way to the engine: registered there if the
        engine lacks it, and its load started. A refused request, or a cache hit, touches no
        adapter, so it cannot evict other tenants' adapters from the engine's memory. Resolved
        for this caller's tenant, the hint names no other tenant's adapter."""
        if model.digest is not None:
            await self.engine.ensure_adapter(model.digest, self.adapters.root / model.digest)
            self.engine.prefetch_adapter(model.digest)

    def _tool_use(self, req: Body, response_id: str) -> ToolUse:
        if not isinstance(req, ChatCompletionRequest):
            return NO_TOOL_USE
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_format)
        return ToolUse(plan, response_id)

    def _draft(
        self,
        req: Body,
        request_id: str,
        model: ResolvedModel,
        principal: Principal,
        tools: ToolUse,
    ) -> Draft:
        """The request with its prompt as text or messages, and its sampling parameters."""
        requested = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
        requested = requested if requested is not None else req.max_tokens
        forced = tools.plan.forced_schema
        params = sampling_params(req, requested or 1, self.limits.vocab_size, forced)
        salt = cache_salt(owner := principal.tenant_id, principal.tenant_settings)
        named = self.prompts.named_roles
        prompt = engine_prompt(
            req, self.limits.vocab_size, tools.plan.template_tools, self.tool_format, named
        )
        text_request = EngineRequest(
            request_id, params, adapter=model.digest, cache_salt=salt, owner=owner, **prompt
        )
        return Draft(text_request, requested is not None, schema_param(forced))

    async def _tokenize(
        self, draft: Draft, tenant_id: str, gone: asyncio.Future[None] | None
    ) -> Tokenized:
        """The prompt as token ids, tokenized in the tenant's turn; without a max_tokens, the
        request gets the room left in the context (at most the server's default)."""
        text_request = draft.text_request
        try:
            prompt_ids = await self.prompts.prompt_ids(text_request, tenant_id, gone)
        except PromptTooLongError as exc:
            raise self._too_long(draft, exc) from None
        except StructuredOutputError as exc:
            raise BadRequest(str(exc), param=draft.schema_param) from None
        except InvalidRequestError as exc:  # an empty prompt; messages the template refused
            raise BadRequest(str(exc), param=draft.prompt_param) from None
        except RateLimited as refused:  # the tenant's bound of prompts waiting (backlog)
            self.metering.metrics.admission.quota_refusals.labels(refused.refusal).inc()
            raise
        if not draft.max_tokens_given:
            room = self.limits.max_model_len - len(prompt_ids)
            params = text_request.params
            params = replace(params, max_tokens=max(1, min(room, self.limits.default_max_tokens)))
            text_request = replace(text_request, params=params)
        return Tokenized(text_request, prompt_ids)

    def _too_long(self, draft: Draft, exc: PromptTooLongError) -> BadRequest:
        """The 400 for a prompt that does not fit, naming the field that holds it; a request
        without max_tokens is not told it asked for some."""
        message = str(exc)
        if not draft.max_tokens_given and exc.prompt_tokens is not None:
            message = (
                f"this model's maximum context length is {self.limits.max_model_len} tokens; the "
                f"prompt has {exc.prompt_tokens} tokens, which leave no room for a completion"
            )
        return BadRequest(message, param=draft.prompt_param, code="context_length_exceeded")

    async def _refuse_early(self, principal: Principal) -> None:
        """The 429 a request gets before its prompt is tokenized, when its principal's limits
        already refuse any request (gateway.quotas.early)."""
        try:
            await self.quotas.refuse_early(principal)
        except RateLimited as refused:
            self.metering.metrics.admission.quota_refusals.labels(refused.refusal).inc()
            raise

    async def _admit(self, principal: Principal, tokenized: Tokenized) -> Admission:
        """Reserve the prompt and n × max_tokens (RateLimited, InsufficientQuota)."""
        params = tokenized.text_request.params
        prompt_tokens, max_tokens = len(tokenized.prompt_ids), params.n * params.max_tokens
        try:
            with tracing.step("admission"):
                return await self.quotas.admit(principal, prompt_tokens, max_tokens)
        except (RateLimited, InsufficientQuota) as refused:
            reason = refused.refusal if isinstance(refused, RateLimited) else "budget"
            self.metering.metrics.admission.quota_refusals.labels(reason).inc()
            raise

    async def _consult_cache(
        self, key: CacheRequest, policy: CachePolicy, route: str, request_id: str
    ) -> Consulted:
        """The cache's hit, if any, and the fence a store of this request's answer carries
        (`ResponseCache.begin`: a purge after this point refuses that store)."""
        if not policy.lookup:
            return await self.cache.begin(key, policy)
        families = self.metering.metrics.admission
        families.cache_lookups.labels(route).inc()
        with tracing.step("response_cache.lookup"):
            consulted = await self.cache.begin(key, policy, request_id)
        if consulted.hit is not None:
            families.cache_hits.labels(route, consulted.hit.kind).inc()
        return consulted

    def _meta(self, req: Body, request_id: str, model: ResolvedModel) -> ResponseMeta:
        kind: Kind = "chat" if isinstance(req, ChatCompletionRequest) else "text"
        fingerprint = self.limits.fingerprint(model.digest)
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        named = response_id(kind, request_id)
        return ResponseMeta(kind, named, int(time.time()), model.name, fingerprint, include_usage)

    # -- answering: one sequence of parts, streamed or gathered ------------------------------------
    def start(self, p: Prepared) -> Generation | None:
        """Hand the request to the engine now, before the response starts (its prefill then
        overlaps the response's start); None for a cache hit (see `end_hit`). Whoever starts a
        run aborts it if its response ends early (`abort` does nothing once it ended)."""
        if p.cache.hit is not None:
            return None
        if p.run is None:
            detokenizer = partial(self.prompts.detokenizer, p.stop)
            finish = partial(self._finish, p)
            param = schema_param(p.tools.plan.forced_schema)
            run = Generation(self.engine, p.request, detokenizer, p.started, finish, param)
            p.run = self.runs.add(run)
        return p.run

    async def outputs(self, p: Prepared) -> AsyncGenerator[Part | Ending]:
        """The response's parts as they come, then how it ended: from the engine, or replayed
        from the cache. Closing it early aborts the run (which still ends and is billed)."""
        run = self.start(p)
        if run is None:
            assert p.cache.hit is not None
            async for out in self._replay(p, p.cache.hit):
                yield out
            return
        readers = [p.tools.reader(i) for i in range(p.request.params.n)]
        try:
            async for delta in run.deltas():
                if delta.text or delta.finish_reason or (delta.token_ids and delta.logprobs):
                    yield part_of(delta, p.meta.kind, self.pieces, readers[delta.index])
            usage = Usage.of(p.prompt_tokens, run.completion_tokens, run.cached_tokens)
            yield Ending(p.answers, usage, run.error)
        finally:
            run.abort()

    async def _replay(self, p: Prepared, hit: CacheHit) -> AsyncIterator[Part | Ending]:
        answer = replayed(hit.response, p.meta.kind)
        served = False
        first_sent: float | None = None  # its TTFT, kept by a client that leaves mid-replay
        try:
            pacing = p.cache.policy.pacing
            for part, delay in replay_parts(answer, hit.response.completion_tokens, pacing):
                if delay:
                    await asyncio.sleep(delay)
                first_sent = time.perf_counter() if first_sent is None else first_sent
                yield part
            # This request's prompt: a semantic hit's cached answer came from another one.
            usage = Usage.of(p.prompt_tokens, hit.response.completion_tokens, 0)
            yield Ending([answer], usage)
            served = True
        finally:
            await self.metering.settle_hit(p, served, first_sent)

    async def end_hit(self, p: Prepared) -> None:
        """A cache hit's response ended: metered (a 499) and settled unless its replay ended
        first. A stream whose response never started is never read, so its replay never
        starts, nor ends; whoever sends a hit's response calls this once it has ended."""
        await self.metering.settle_hit(p, served=False, first_sent=None)

    async def complete(
        self, p: Prepared, client_gone: Callable[[], Awaitable[None]]
    ) -> ChatCompletion | TextCompletion:
        """The whole response; generation is aborted if `client_gone()` returns first (the
        client closed its connection)."""
        gathering = asyncio.ensure_future(_ending(self.outputs(p)))
        watcher = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({gathering, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            left = not gathering.done()
            if left:  # closing the outputs aborts the run, which still ends and is billed
                gathering.cancel()
        if left:
            raise ClientClosedRequest("the client closed the connection")
        ending = gathering.result()
        if ending.error is not None:
            raise ending.error
        return whole(p.meta, ending)

    async def stream(self, p: Prepared) -> AsyncIterator[bytes]:
        """SSE chunks as OpenAI sends them, ending with `data: [DONE]`. The run ends (and is
        billed) before the end is sent, so the client's next request finds its cache entry and
        settled quota; a client that stops reading aborts it."""
        outputs = self.outputs(p)
        try:
            if p.meta.kind == "chat":
                for opening in openings(p.meta, p.request.params.n):
                    yield sse(opening)
            async for out in outputs:
                if isinstance(out, Part):
                    yield sse(chunk(p.meta, out))
                elif out.error is not None:
                    yield sse(out.error.body())
                else:
                    if p.meta.include_usage:
                        yield sse(usage_chunk(p.meta, out.usage))
                    yield SSE_DONE
        finally:
            await outputs.aclose()

    async def _finish(self, p: Prepared, run: Generation) -> None:
        """The run ended: its answers, then meter, cache and settle (exactly once)."""
        logprobs = p.request.params.logprobs
        p.answers = [
            answer_of(c, p.meta.kind, self.pieces, logprobs, p.tools.read(c.text, c.index))
            for c in run.choices
        ]
        completion = run.completion_tokens
        try:
            self.metering.meter_run(p, run)
            if run.status == 200 and run.finished and p.cache.policy.store:
                entry = cached(p.answers[0], p.prompt_tokens, completion, p.meta.fingerprint)
                request_id, fence = p.request.request_id, p.cache.fence
                await self.cache.store(p.cache.key, p.cache.policy, entry, request_id, fence)
        finally:
            await self.metering.settle_run(p, run)


async def _ending(outputs: AsyncIterator[Part | Ending]) -> Ending:
    ending = None
    async for out in outputs:
        if isinstance(out, Ending):
            ending = out
    assert ending is not None, "outputs end with an Ending"
    return ending
