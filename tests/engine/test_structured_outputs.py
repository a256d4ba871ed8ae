"""Structured outputs on the real engine over the demo model (random weights): with a grammar,
every output is JSON that validates against its schema, whatever the sampling temperature, the
adapters and the unconstrained requests in the same batches, preemption or asynchronous
scheduling; a schema the grammar library cannot compile is refused before anything is queued."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import InvalidRequestError, StructuredOutputFailedError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason
from loramux.engine.structured import StructuredOutput, StructuredOutputError
from tests.engine.conftest import make_engine, run_to_completion
from tests.engine.structured_schemas import (
    FAILING_MID_RUN,
    FORCES_MID_RUN,
    NESTED,
    RECURSIVE,
    SCHEMAS,
    schema_text,
)

PROMPT = "Answer in JSON:"


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, max_loras=4)


def _constrained(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", schema_text(schema))


def _text(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple[str, FinishReason | None]:
    """The output's text without its final EOS, and how it finished."""
    ids = [t for o in outputs for t in o.token_ids]
    if ids and ids[-1] in engine.eos_ids:
        ids = ids[:-1]
    return engine.tokenizer.decode(ids), outputs[-1].finish_reason


def test_constrained_outputs_validate_when_mixed_with_free_requests_and_adapters(
    engine: LLMEngine, demo_adapter_dirs: list[Path]
) -> None:
    adapters = [None] + [engine.register_adapter(f) for f in demo_adapter_dirs[:3]]
    schemas = list(SCHEMAS.values())
    requests: list[EngineRequest] = []
    expected: dict[str, dict[str, Any]] = {}
    for i in range(50):
        schema = schemas[i % len(schemas)]
        params = SamplingParams(
            max_tokens=200, temperature=1.0, seed=i, structured=_constrained(schema)
        )
        requests.append(
            EngineRequest(f"c{i}", params, prompt=f"{PROMPT} {i}", adapter=adapters[i % 4])
        )
        expected[f"c{i}"] = schema
        if i % 4 == 0:  # free requests in between, on the same adapters
            free = SamplingParams(max_tokens=24, temperature=1.0, seed=i)
            requests.append(EngineRequest(f"f{i}", free, prompt=PROMPT, adapter=adapters[i % 3]))
    steps_before = engine.stats().steps
    outputs = run_to_completion(engine, requests)

    steps = engine.stats().steps - steps_before
    assert steps < 200, "constrained and free requests were meant to share steps"
    for request_id, schema in expected.items():
        text, finish = _text(engine, outputs[request_id])
        assert finish is FinishReason.STOP, (request_id, text)
        jsonschema.validate(json.loads(text), schema)
    free_finishes = {
        outputs[r.request_id][-1].finish_reason for r in requests if r.request_id[0] == "f"
    }
    assert free_finishes <= {FinishReason.STOP, FinishReason.LENGTH}


def test_json_object_outputs_that_end_are_json_objects(engine: LLMEngine) -> None:
    requests = [
        EngineRequest(
            f"o{i}",
            SamplingParams(
                max_tokens=48, temperature=1.0, seed=i, structured=StructuredOutput("json_object")
            ),
            prompt=PROMPT,
        )
        for i in range(12)
    ]
    outputs = run_to_completion(engine, requests)
    finished = [_text(engine, outputs[r.request_id]) for r in requests]
    complete = [text for text, finish in finished if finish is FinishReason.STOP]
    assert complete, "some object was meant to close within 48 tokens"
    assert all(isinstance(json.loads(text), dict) for text in complete)
    # An object cut by max_tokens is reported as such, and is a prefix of an object.
    assert all(text.startswith("{") for text, _ in finished)


def test_a_recursive_schema_generates_valid_trees(engine: LLMEngine) -> None:
    structured = _constrained(RECURSIVE)
    requests = [
        EngineRequest(
            f"t{i}",
            SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=structured),
            prompt=PROMPT,
        )
        for i in range(6)
    ]
    outputs = run_to_completion(engine, requests)
    finished = [_text(engine, outputs[r.request_id]) for r in requests]
    complete = [text for text, finish in finished if finish is FinishReason.STOP]
    assert complete, "some tree was meant to close within 200 tokens"
    for text in complete:
        jsonschema.validate(json.loads(text), RECURSIVE)


def _choices(outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    """A request's deltas split by choice, each in order."""
    by_choice: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        by_choice.setdefault(out.index, []).append(out)
    return by_choice


def test_every_choice_of_a_constrained_request_follows_its_own_grammar(
    engine: LLMEngine,
) -> None:
    """With n > 1 each choice samples from its own masked row and its own matcher, so every
    choice ends its value and validates. The bug: the step's masks were numbered per sampling
    chunk, not per sampled row, so the choices forked from choice 0 sampled unmasked and the
    request failed when the grammar could not follow their tokens."""
    params = SamplingParams(
        max_tokens=200, temperature=1.0, seed=3, n=4, structured=_constrained(NESTED)
    )
    outputs = run_to_completion(engine, [EngineRequest("n4", params, prompt=PROMPT)])["n4"]
    choices = _choices(outputs)
    assert sorted(choices) == [0, 1, 2, 3]
    texts = set()
    for choice in choices.values():
        text, finish = _text(engine, choice)
        assert finish is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), NESTED)
        texts.add(text)
    assert len(texts) > 1, "seeded choices at temperature 1 were meant to differ"


def test_another_requests_choices_do_not_move_a_constrained_requests_mask(
    engine: LLMEngine,
) -> None:
    """A free request for n = 4 and a constrained one finish their prompts in the same step:
    the free one's choices are exactly what they are alone, and the constrained one's output
    validates. The bug: the free request's forked choices shifted the rows after them, so its
    second choice was masked by the other request's grammar and the constrained request sampled
    unmasked and failed."""
    free = EngineRequest(
        "free", SamplingParams(max_tokens=12, n=4, temperature=1.0, seed=5), prompt=PROMPT
    )
    bound = EngineRequest(
        "bound",
        SamplingParams(max_tokens=200, temperature=1.0, seed=6, structured=_constrained(NESTED)),
        prompt=f"{PROMPT} 1",
    )
    alone = run_to_completion(engine, [replace_id(free, "free-alone")])["free-alone"]
    together = run_to_completion(engine, [free, bound])
    tokens = {i: [t for o in c for t in o.token_ids] for i, c in _choices(alone).items()}
    shared = {i: [t for o in c for t in o.token_ids] for i, c in _choices(together["free"]).items()}
    assert shared == tokens
    text, finish = _text(engine, together["bound"])
    assert finish is FinishReason.STOP, text
    jsonschema.validate(json.loads(text), NESTED)


def _preemption_run(demo_model_dir: Path, **overrides: Any) -> tuple[dict[str, str], LLMEngine]:
    engine = make_engine(demo_model_dir, max_model_len=160, max_num_batched_tokens=48, **overrides)
    schemas = list(SCHEMAS.values())
    requests = [
        EngineRequest(
            f"p{i}",
            SamplingParams(max_tokens=90, structured=_constrained(schemas[i % len(schemas)])),
            prompt_token_ids=list(range(10 + i, 30 + 2 * i)),
        )
        for i in range(5)
    ]
    outputs = run_to_completion(engine, requests)
    texts = {}
    for i, r in enumerate(requests):
        text, finish = _text(engine, outputs[r.request_id])
        assert finish is FinishReason.STOP, (r.request_id, text)
        jsonschema.validate(json.loads(text), schemas[i % len(schemas)])
        texts[r.request_id] = text
    return texts, engine


def test_preempted_recomputed_or_overlapped_constrained_requests_stay_valid_and_unchanged(
    demo_model_dir: Path,
) -> None:
    """Recompute after preemption leaves each grammar where it was; with asynchronous
    scheduling a constrained row's mask waits for the token still in flight."""
    roomy, _ = _preemption_run(demo_model_dir, num_kv_blocks=256)
    cramped, engine = _preemption_run(demo_model_dir, num_kv_blocks=12)
    overlapped, async_engine = _preemption_run(
        demo_model_dir, num_kv_blocks=12, async_scheduling=True
    )
    assert engine.stats().preemptions > 0 and async_engine.stats().preemptions > 0
    assert cramped == roomy == overlapped


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("true", "must be a JSON object"),
        ('{"a":' * 1000 + "1" + "}" * 1000, "nests 1000 levels"),
        ('{"type": "string", "pattern": "("}', "cannot be compiled"),
        ('{"type": "integer", "minimum": 5, "maximum": 1}', "cannot be compiled"),
        ('{"$ref": "#/$defs/missing"}', "cannot be compiled"),
        ('{"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}', "cannot be compiled"),
        ('{"type": "string", "format": "no-such-format"}', "cannot be compiled"),
        ('{"not": {"type": "string"}}', "cannot be compiled"),
        # each mask of a forced run tokenizes all the rest of it: past 4,096 bytes, refused
        ('{"const": "' + " " * 20_000 + '"}', "forces at least 20,002 bytes of output in a row"),
        ('{"type": "string", "pattern": "^x{5000}$"}', "forces at least 5,002 bytes"),
        # 100,000 items forced (the parser's item limit stops counting them first)
        ('{"type": "array", "items": {"const": 1}, "minItems": 100000}', "bytes of output in a"),
    ],
)
def test_an_uncompilable_schema_is_refused_before_anything_is_queued(
    engine: LLMEngine, schema: str, reason: str
) -> None:
    before = engine.stats()
    request = EngineRequest(
        "bad", SamplingParams(structured=StructuredOutput("json_schema", schema)), prompt=PROMPT
    )
    with pytest.raises(StructuredOutputError, match=reason):
        engine.add_request(request)
    after = engine.stats()
    assert (after.waiting, after.running) == (before.waiting, before.running)
    assert engine.outputs.open_choices("bad") == []


@pytest.mark.parametrize("reason", FAILING_MID_RUN)
def test_a_grammar_failing_mid_generation_fails_its_request_alone_as_the_schemas_fault(
    engine: LLMEngine, reason: str
) -> None:
    """The request's last output says its schema failed it (the gateway's 400, not a 500),
    with the library's reason; the request beside it is served. A grammar that fails while
    computing its mask counts too: the bug was that its mask allowed only EOS, and the cut
    output `{"a":` ended as a complete value (finish reason STOP)."""
    spec = _constrained(FAILING_MID_RUN[reason])
    bound = EngineRequest(
        "mid-run", SamplingParams(max_tokens=20, structured=spec), prompt_token_ids=[5, 6, 7]
    )
    free = EngineRequest("beside", SamplingParams(max_tokens=6), prompt_token_ids=[5, 6, 8])
    outputs = run_to_completion(engine, [bound, free])
    last = outputs["mid-run"][-1]
    assert (last.finish_reason, last.error_type) == (
        FinishReason.ERROR,
        StructuredOutputFailedError,
    ), last
    assert reason in (last.error or "")
    assert outputs["beside"][-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().kv_blocks_used == 0


def test_a_grammar_that_comes_to_force_a_long_run_fails_its_request_there(
    engine: LLMEngine,
) -> None:
    """A grammar may force at most MAX_FORCED_BYTES in a row: past that, each mask of the run
    tokenized all the rest of it again (99,000 spaces: 0.2-0.4 s a mask, for every row of the
    request, every step, and the whole batch waited). One that forces more only after its first
    tokens (one branch of an `anyOf`) passes admission, and fails its own request, as its
    schema's fault, when the token that led there lands; the request beside it is served."""
    n = 4
    spec = _constrained(FORCES_MID_RUN)
    bound = EngineRequest(
        "forces", SamplingParams(max_tokens=20, n=n, structured=spec), prompt_token_ids=[5, 6, 7]
    )
    free = EngineRequest("beside", SamplingParams(max_tokens=6), prompt_token_ids=[5, 6, 8])
    outputs = run_to_completion(engine, [bound, free])
    last = outputs["forces"][-1]
    assert (last.finish_reason, last.error_type) == (
        FinishReason.ERROR,
        StructuredOutputFailedError,
    ), last
    assert "forces at least 20,00" in (last.error or ""), last.error
    assert "at most 4,096 are served" in (last.error or "")
    assert sum(len(o.token_ids) for o in outputs["forces"]) <= 2 * n, "decoded into the run"
    assert outputs["beside"][-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().kv_blocks_used == 0


def test_a_huge_schema_is_refused_when_the_request_is_made() -> None:
    with pytest.raises(StructuredOutputError, match="characters long"):
        StructuredOutput("json_schema", '{"enum": [' + '"x",' * 50_000 + '"x"]}')


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"type": "string"}, "minItems": 100_000},
        {"type": "string", "maxLength": 1_000_000_000},
        {"anyOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}] * 20},
        {"enum": [f"value-{i}" for i in range(3000)]},
    ],
)
def test_a_large_but_valid_schema_compiles_and_serves(
    engine: LLMEngine, schema: dict[str, Any]
) -> None:
    structured = _constrained(schema)
    request = EngineRequest(
        "big", SamplingParams(max_tokens=8, structured=structured), prompt=PROMPT
    )
    outputs = run_to_completion(engine, [request])["big"]
    assert outputs[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_structured_output_is_validated_with_the_sampling_parameters() -> None:
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("json_object"))
    with pytest.raises(StructuredOutputError, match="kind"):
        StructuredOutput("yaml")  # type: ignore[arg-type]
    with pytest.raises(StructuredOutputError, match="takes no schema"):
        StructuredOutput("json_object", "{}")
    with pytest.raises(StructuredOutputError, match="needs the schema"):
        StructuredOutput("json_schema")
    with pytest.raises(InvalidRequestError, match="structured"):
        SamplingParams(structured="json")  # type: ignore[arg-type]


async def test_the_async_facade_compiles_off_the_step_loop_while_others_stream(
    demo_model_dir: Path,
) -> None:
    """A request streams while others' schemas compile (or are refused) beside it."""
    facade = AsyncEngine(make_engine(demo_model_dir))
    facade.start()
    try:
        free = EngineRequest("free", SamplingParams(max_tokens=40, ignore_eos=True), prompt=PROMPT)
        stream = facade.generate(free)
        first = await anext(stream)
        bad = StructuredOutput("json_schema", '{"type": "string", "pattern": "("}')
        refused = EngineRequest("bad", SamplingParams(structured=bad), prompt=PROMPT)
        with pytest.raises(StructuredOutputError, match="cannot be compiled"):
            await anext(facade.generate(refused))
        params = SamplingParams(
            max_tokens=120, temperature=1.0, seed=1, structured=_constrained(NESTED)
        )
        outputs = [o async for o in facade.generate(EngineRequest("good", params, prompt=PROMPT))]
        rest = [o async for o in stream]
    finally:
        facade.shutdown()
    assert sum(len(o.token_ids) for o in [first, *rest]) == 40
    text = facade.engine.tokenizer.decode([t for o in outputs for t in o.token_ids][:-1])
    jsonschema.validate(json.loads(text), NESTED)


PANIC = type("PanicException", (BaseException,), {})
"""What pyo3 raises for a Rust panic inside the grammar library: a BaseException, which an
`except Exception` does not catch (a real one takes a hostile schema minutes to reach)."""


def test_a_panic_of_the_grammar_library_fails_its_requests_not_the_engine(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A panic while a constrained token is accepted fails that request alone; while a step's
    masks are filled, that step's requests. Either way the engine goes on serving."""
    engine = make_engine(demo_model_dir)
    spec = _constrained({"type": "object"})
    free = EngineRequest("free", SamplingParams(max_tokens=6), prompt_token_ids=[5, 6, 7])
    bound = EngineRequest(
        "bound", SamplingParams(max_tokens=6, structured=spec), prompt_token_ids=[5, 6, 8]
    )
    assert engine.grammars is not None
    engine.grammars.compile(spec)  # its compile probe accepts a token too: not the panic here
    with monkeypatch.context() as m:
        m.setattr("llguidance.LLMatcher.consume_token", _panics)
        outputs = run_to_completion(engine, [free, bound])
    assert outputs["bound"][-1].finish_reason is FinishReason.ERROR
    assert outputs["free"][-1].finish_reason is FinishReason.LENGTH
    with monkeypatch.context() as m:
        m.setattr("llguidance.torch.fill_next_token_bitmask_par", _panics)
        failed = run_to_completion(engine, [replace_id(bound, "bound-2")])
    assert failed["bound-2"][-1].finish_reason is FinishReason.ERROR
    after = run_to_completion(engine, [replace_id(free, "after"), replace_id(bound, "bound-3")])
    assert after["after"][-1].finish_reason is FinishReason.LENGTH
    assert after["bound-3"][-1].finish_reason is not FinishReason.ERROR
    assert engine.stats().kv_blocks_used == 0


def _panics(*args: object, **kwargs: object) -> None:
    raise PANIC("called `Option::unwrap()` on a `None` value")


def replace_id(request: EngineRequest, request_id: str) -> EngineRequest:
    return dataclasses.replace(request, request_id=request_id)
