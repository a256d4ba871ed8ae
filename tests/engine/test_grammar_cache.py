"""The grammar compiler's cache: the step thread gets a request's grammar compiled, one
owner's compiled grammar is compiled again for another, and concurrent asks share a compile."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.engine.structured import StructuredOutput
from loramux.engine.structured.grammar import CACHE_ENTRIES, GrammarCompiler, NotCompiled
from tests.engine.conftest import make_engine
from tests.engine.structured_schemas import schema_text


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, max_loras=4)


def _constrained(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", schema_text(schema))


def test_the_step_thread_gets_a_request_s_grammar_compiled(engine: LLMEngine) -> None:
    """`checked` compiles a request's grammar off the step thread, and `add_request` takes it
    as compiled. It compiled again when the grammar had left the compiler's cache in between
    (CACHE_ENTRIES other schemas): on the step thread, stalling every request's steps (a
    3,000-property schema took 0.9-3.6 s)."""
    assert engine.grammars is not None

    def request(request_id: str, schema: dict[str, Any]) -> EngineRequest:
        params = SamplingParams(max_tokens=8, structured=_constrained(schema))
        return EngineRequest(request_id, params, prompt_token_ids=[5, 6, 7])

    mine = request("compiled-once", {"type": "object", "properties": {"n": {"type": "integer"}}})
    checked = engine.checked(mine)
    for i in range(CACHE_ENTRIES):  # others' schemas push it out of the cache
        engine.checked(request(f"other-{i}", {"const": i}))
    spec = mine.params.structured
    assert spec is not None and not engine.grammars.cached(spec)
    engine.add_request(mine, checked=checked)
    assert not engine.grammars.cached(spec), "compiled again, on the step thread"
    outputs = [out for _ in iter(lambda: engine.has_work, False) for out in engine.step()]
    assert outputs[-1].finished and outputs[-1].error is None


def test_a_grammar_one_owner_compiled_is_compiled_again_for_another(engine: LLMEngine) -> None:
    """The grammar cache is per owner (tenant). Shared, a request whose schema another tenant
    had just used was checked at once (no compile: about 0.07 s against 1 s for a large new
    schema through the gateway), which told a tenant whether others used the schemas it
    guessed. Each owner's own repeat still takes no compile."""
    spec = _constrained({"type": "object", "properties": {"scoped": {"type": "boolean"}}})

    def request(owner: str) -> EngineRequest:
        params = SamplingParams(max_tokens=4, structured=spec)
        return EngineRequest(f"scope-{owner}", params, prompt_token_ids=[5, 6, 7], owner=owner)

    engine.checked(request("tenant-a"))
    assert engine.checked(request("tenant-a"), compile=False).grammar is not None
    with pytest.raises(NotCompiled):
        engine.checked(request("tenant-b"), compile=False)
    assert engine.checked(request("tenant-b")).grammar is not None  # compiled for b too


def test_concurrent_requests_for_one_schema_compile_it_once(engine: LLMEngine) -> None:
    """Threads asking at once for a schema that is not cached share one compile and its
    result. The bug: each compiled it again (a 3,000-property schema took about a second, on
    each thread that admits a request)."""
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_ids)
    properties = {f"p{i}": {"type": "integer"} for i in range(2000)}
    spec = _constrained({"type": "object", "properties": properties, "required": list(properties)})
    start = threading.Barrier(8)

    def ask(_: int) -> object:
        start.wait()
        return compiler.compile(spec)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    assert compiler.compiles == 1
    assert all(r is results[0] for r in results)
