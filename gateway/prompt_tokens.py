"""Text at the edge: the gateway turns prompts into token ids and generated ids back into text,
so the engine never handles text.

Prompts are chat-templated and tokenized once per request, on a small pool of threads (one
tokenizer per thread: a Rust tokenizer must not be used from two threads at once), never on the
event loop. The threads serve tenants in turn (engine.fair_pool): one tenant's burst of prompts
waits behind itself, not in front of every other tenant's. A prompt longer than the context could hold, were every token the vocabulary's
longest, is refused before it is tokenized: tokenizing costs time in proportion to the text (a
megabyte, about a third of a second of a tokenizer thread), and it could not fit. Generated ids
are detokenized incrementally on the event loop, where each new token costs one short decode,
with stop strings matched there too (engine.detokenizer).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from transformers import AutoTokenizer

from loramux.engine.chat_prompt import chat_template, named_roles
from loramux.engine.detokenizer import IncrementalDetokenizer, rust_decoder
from loramux.engine.errors import PromptTooLongError
from loramux.engine.fair_pool import Backlogged, FairPool
from loramux.engine.outputs import EngineRequest
from loramux.engine.prompt import prompt_token_ids
from loramux.gateway.errors import ClientClosedRequest, RateLimited
from loramux.gateway.schema_checks import SchemaChecks

T = TypeVar("T")

TOKENIZER_THREADS = 2
SCHEMA_THREADS = 1
"""Threads (each with a checking process) for structured-output schemas not checked before."""
MAX_WAITING_PER_TENANT = 256
"""Prompts of one tenant waiting for a tokenizer thread at most; another is refused (429) until
one starts: a bound on the memory and tokenizer time one tenant's burst can claim ahead of the
others (a prompt under the character limit takes up to ~10 ms of a thread; 256 of them, 2.5 s)."""


class PromptTokens:
    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        max_model_len: int,
        max_waiting_per_tenant: int = MAX_WAITING_PER_TENANT,
    ):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._local = threading.local()
        self._pool = FairPool(TOKENIZER_THREADS, "loramux-tokenize", max_waiting_per_tenant)
        self.schemas = SchemaChecks(SCHEMA_THREADS)
        """A request's structured-output schema is checked before its prompt is tokenized,
        bounded in time (gateway.schema_checks), on a thread of its own, tenants in turn: a
        tenant sending slow schemas delays others' new schemas, never their prompts."""
        self._schema_pool = FairPool(SCHEMA_THREADS, "loramux-schema", max_waiting_per_tenant)
        self._loop_tokenizer = self._tokenizer()
        self._loop_decoder = rust_decoder(self._loop_tokenizer)
        self.chat_template = chat_template(self._loop_tokenizer)
        """The model's chat template ("" without one): `gateway.openai.tools.tool_call_format`
        reads from it how the model writes tool calls."""
        self.named_roles = named_roles(self._loop_tokenizer)
        """The roles whose message `name` the chat template writes (probed once, at start): a
        name in another role changes nothing, and is not passed (`gateway.openai.prompt`)."""
        backend = getattr(self._loop_tokenizer, "backend_tokenizer", None)
        self.max_prompt_chars = max_model_len * token_chars(backend) if backend else None
        """Characters a prompt that fits can have at most (None: not known, not checked)."""
        self._normalizes = backend is not None and backend.normalizer is not None

    def close(self) -> None:
        self._pool.close()
        self._schema_pool.close()
        self.schemas.close()

    async def prompt_ids(
        self, request: EngineRequest, owner: str = "", gone: asyncio.Future[None] | None = None
    ) -> list[int]:
        """The request's prompt as token ids (engine.prompt.prompt_token_ids), off the loop, in
        `owner`'s turn (a tenant's id). PromptTooLongError, untokenized, for more characters
        than the context could hold (when the tokenizer normalizes text first, which can
        shorten it, counted once normalized); RateLimited (429) when the owner already has
        `max_waiting_per_tenant` prompts waiting; ClientClosedRequest (499), untokenized, when
        `gone` (the client's connection closing) completes before the prompt's turn;
        StructuredOutputError, untokenized, when its schema cannot be served (checked first,
        on the schema thread, in `owner`'s turn)."""
        limit = self.max_prompt_chars
        oversized = limit is not None and prompt_chars(request, len) > limit
        if oversized and not self._normalizes:
            self._refuse(prompt_chars(request, len))
        spec = request.params.structured
        if spec is not None and self.schemas.knows(spec, owner):
            self.schemas.check(spec, owner)  # answered from the owner's verdicts kept, at once
        elif spec is not None:
            await self._in_turn(self._schema_pool, owner, gone, self.schemas.check, spec, owner)
        ids: list[int] = await self._in_turn(
            self._pool, owner, gone, self._prompt_ids, request, oversized
        )
        return ids

    async def _in_turn(
        self,
        pool: FairPool,
        owner: str,
        gone: asyncio.Future[None] | None,
        fn: Callable[..., Any],
        *args: Any,
    ) -> Any:
        try:
            job = pool.run(owner, fn, *args)
        except Backlogged:
            raise RateLimited(
                f"{pool.max_waiting} prompts of this tenant are already waiting to be "
                "tokenized; retry shortly",
                limit_type="requests",
                refusal="backlog",
                headers={"retry-after": "1"},
            ) from None
        if gone is None:
            return await job
        return await _unless_gone(job, gone)

    def waiting(self) -> int:
        """Prompts waiting for a tokenizer thread."""
        return self._pool.waiting()

    def _refuse(self, chars: int) -> None:
        raise PromptTooLongError(
            f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
            f"has {chars} characters, more than that many tokens of this tokenizer can hold "
            f"({self.max_prompt_chars})"
        )

    def detokenizer(self, stop: tuple[str, ...]) -> IncrementalDetokenizer:
        """A detokenizer for one generation; use it on the event loop's thread only."""
        return IncrementalDetokenizer(self._loop_decoder, stop=stop)

    @property
    def loop_tokenizer(self) -> Any:
        """The tokenizer of the event loop's thread (for detokenizing there)."""
        return self._loop_tokenizer

    def _prompt_ids(self, request: EngineRequest, oversized: bool) -> list[int]:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = self._tokenizer()
        if oversized:  # over the limit as sent; the tokenizer reads it normalized
            normalize = tokenizer.backend_tokenizer.normalizer.normalize_str
            chars = prompt_chars(request, lambda text: len(normalize(text)))
            if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
                self._refuse(chars)
        return prompt_token_ids(tokenizer, request, self.vocab_size, self.max_model_len)

    def _tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(str(self.model_dir))


async def _unless_gone(job: asyncio.Future[T], gone: asyncio.Future[None]) -> T:
    """The job's result, or ClientClosedRequest when `gone` completes first: the job is then
    cancelled, and dropped by the pool unrun if it had not started."""

    def drop(_: asyncio.Future[None]) -> None:
        job.cancel()

    gone.add_done_callback(drop)
    try:
        return await job
    except asyncio.CancelledError:
        task = asyncio.current_task()
        left = gone.done() and not gone.cancelled()
        if left and task is not None and not task.cancelling():
            raise ClientClosedRequest(
                "the client closed the connection before its prompt was tokenized"
            ) from None
        raise
    finally:
        gone.remove_done_callback(drop)


def token_chars(backend: Any) -> int:
    """At most how many characters of a prompt one token covers: the most any token of the
    vocabulary decodes to alone, plus one (decoded alone, a SentencePiece token drops the
    space it begins with)."""
    ids = [[i] for i in range(backend.get_vocab_size(with_added_tokens=True))]
    texts = backend.decode_batch(ids, skip_special_tokens=False)
    return max(map(len, texts), default=0) + 1


def prompt_chars(request: EngineRequest, measure: Callable[[str], int]) -> int:
    """Characters of the request's prompt text by `measure`: the prompt, or the messages'
    contents and names with their tool calls and the tools as JSON (0 for token ids)."""
    if request.prompt is not None:
        return measure(request.prompt)
    chars = measure(json.dumps(request.tools, ensure_ascii=False)) if request.tools else 0
    for m in request.messages or ():
        content = m.get("content")
        chars += measure(content) if isinstance(content, str) else 0
        chars += measure(m["name"]) if isinstance(m.get("name"), str) else 0
        if m.get("tool_calls"):
            chars += measure(json.dumps(m["tool_calls"], ensure_ascii=False))
    return chars
