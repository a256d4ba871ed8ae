"""A prompt longer than the context could hold is refused before it is tokenized, counted as the
tokenizer reads it: for a tokenizer that normalizes text first (NFC here), once normalized."""

from __future__ import annotations

from pathlib import Path

import pytest

from loramux.engine.errors import PromptTooLongError
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.gateway.prompt_tokens import PromptTokens
from tests.engine.chat_families import family_tokenizer


def _prompt(text: str) -> EngineRequest:
    return EngineRequest("r", SamplingParams(max_tokens=1), prompt=text)


async def test_a_normalizing_tokenizer_counts_the_prompt_normalized(tmp_path: Path) -> None:
    tokenizer = family_tokenizer("qwen2", tmp_path)
    assert tokenizer.backend_tokenizer.normalizer is not None  # NFC
    prompts = PromptTokens(tmp_path, len(tokenizer), max_model_len=16)
    try:
        limit = prompts.max_prompt_chars
        assert limit is not None and limit > 16
        with pytest.raises(PromptTooLongError, match="characters"):
            await prompts.prompt_ids(_prompt("\u00e9" * (limit + 1)))
        # Over the limit as sent, under it once NFC composes each pair: tokenized, and refused
        # by its tokens.
        decomposed = "e\u0301" * (limit // 2 + 1)
        assert len(decomposed) > limit
        with pytest.raises(PromptTooLongError, match="prompt tokens"):
            await prompts.prompt_ids(_prompt(decomposed))
        assert await prompts.prompt_ids(_prompt("e\u0301 x"))  # short ones are served
    finally:
        prompts.close()
