"""One tenant flooding the gateway's tokenizer threads does not hold up another tenant's prompt:
the threads take tenants in turn (gateway.fair_pool). The flood's prompts are each just under
the characters the context could hold and far over its tokens, so each is tokenized
(milliseconds of a tokenizer thread) before it is refused: the costliest request a tenant can
send without reaching the engine, and one its rate limit does not stop (admission comes after
tokenizing)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from loramux.engine.errors import PromptTooLongError
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.gateway.errors import RateLimited
from loramux.gateway.prompt_tokens import TOKENIZER_THREADS, PromptTokens

FLOOD = 20


def _chat(content: str) -> EngineRequest:
    messages = [{"role": "user", "content": content}]
    return EngineRequest("r", SamplingParams(max_tokens=8), messages=messages)


def _flood_prompt(limit: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["otter", "harbour", "bridge", "stone", "quiet", "river", "north", "count"]
    return " ".join(rng.choice(words) for _ in range(limit // 4))[: limit - 64]


async def test_a_tenants_flood_of_prompts_waits_behind_itself_not_before_other_tenants(
    demo_model_dir: Path,
) -> None:
    prompts = PromptTokens(demo_model_dir, vocab_size=4096, max_model_len=512)
    try:
        limit = prompts.max_prompt_chars
        assert limit is not None
        finished: list[str] = []

        def track(name: str, job: asyncio.Future[list[int]]) -> asyncio.Future[list[int]]:
            job.add_done_callback(lambda _: finished.append(name))
            return job

        flood = [
            track(f"flood{i}", asyncio.ensure_future(prompts.prompt_ids(_chat(p), "flooder")))
            for i, p in enumerate(_flood_prompt(limit, seed) for seed in range(FLOOD))
        ]
        await asyncio.sleep(0)  # the flood is queued
        quiet = track("quiet", asyncio.ensure_future(prompts.prompt_ids(_chat("hi"), "quiet")))
        outcomes = await asyncio.gather(*flood, return_exceptions=True)
        assert await quiet
        assert all(isinstance(o, PromptTooLongError) for o in outcomes), outcomes
        # In one queue for all, the quiet prompt was tokenized last; in turns, right after the
        # flood's prompt that was next when it came (each thread was busy with one).
        assert finished.index("quiet") <= 3, finished
    finally:
        prompts.close()


async def test_a_tenant_with_its_bound_of_prompts_waiting_is_refused_another_until_one_starts(
    demo_model_dir: Path,
) -> None:
    """429 `rate_limit_exceeded` at once, untokenized; another tenant's prompt is served."""
    bound = 2
    prompts = PromptTokens(demo_model_dir, 4096, 512, max_waiting_per_tenant=bound)
    try:
        limit = prompts.max_prompt_chars
        assert limit is not None
        # Enqueued in one turn of the loop: however many the threads took meanwhile, the last
        # finds `bound` waiting.
        flood = [prompts.prompt_ids(_chat(_flood_prompt(limit, i)), "flooder") for i in range(5)]
        outcomes = await asyncio.gather(*flood, return_exceptions=True)
        refused = outcomes[TOKENIZER_THREADS + bound :]
        assert refused and all(isinstance(o, RateLimited) for o in refused), outcomes
        assert refused[0].status == 429 and refused[0].refusal == "backlog"
        assert refused[0].headers == {"retry-after": "1"}
        assert await prompts.prompt_ids(_chat("hi"), "quiet")
        assert await prompts.prompt_ids(_chat("hi"), "flooder")  # room again
    finally:
        prompts.close()
