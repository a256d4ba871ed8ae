"""A tenant's adapter that calls a tool, served by the real engine on the demo model: the call
it writes in the demo template's Hermes format is read back as an OpenAI tool call, streamed
token by token exactly as the whole output parses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from loramux.engine.chat_prompt import chat_prompt_ids
from loramux.engine.detokenizer import IncrementalDetokenizer
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.gateway.openai.tools import (
    FunctionCall,
    StreamDelta,
    ToolCall,
    ToolCallStreamParser,
    call_id,
    parse_tool_calls,
    tool_call_format,
)
from tests.engine.conftest import make_engine, run_to_completion
from tests.gateway.openai.tools.reassembly import reassemble
from tests.gateway.openai.tools.tool_adapter import (
    MESSAGES,
    TOOLS,
    build_tool_calling_adapter,
)

pytestmark = pytest.mark.slow  # trains an adapter, then decodes under the Triton interpreter


@pytest.fixture(scope="module")
def tool_adapter(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tool_calling_adapter(demo_model_dir, tmp_path_factory.mktemp("tool-adapter"))


def generate(model_dir: Path, adapter: Path, prompt: list[int]) -> list[int]:
    engine = make_engine(model_dir)
    digest = engine.register_adapter(adapter)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    request = EngineRequest("req_tool", params, prompt_token_ids=prompt, adapter=digest)
    return [t for out in run_to_completion(engine, [request])["req_tool"] for t in out.token_ids]


def test_the_adapters_call_is_read_as_a_tool_call_whole_and_streamed(
    demo_model_dir: Path, tool_adapter: Path
) -> None:
    tokenizer: Any = AutoTokenizer.from_pretrained(demo_model_dir)
    fmt = tool_call_format(tokenizer)
    assert fmt is not None
    ids = generate(demo_model_dir, tool_adapter, chat_prompt_ids(tokenizer, MESSAGES, TOOLS))

    detokenizer = IncrementalDetokenizer(tokenizer)
    parser = ToolCallStreamParser(fmt, "req_tool")
    deltas: list[StreamDelta] = []
    for token in ids:
        deltas += parser.feed(detokenizer.add(token))
    deltas += parser.feed(detokenizer.flush()) + parser.finish()

    whole = parse_tool_calls(detokenizer.text, fmt, "req_tool")
    expected = ToolCall(call_id("req_tool", 0), FunctionCall("get_weather", '{"city": "Paris"}'))
    assert (whole.content, whole.calls) == (None, [expected])
    assert reassemble(deltas) == whole
