"""Penalties, logit bias, min-p and logprobs: the engine's processed logits and greedy outputs
equal transformers' logits processors (and OpenAI's formula in torch) on the same inputs, and
its logprobs are the log-softmax of transformers' logits for the same prefix."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from loramux.engine.logits_processing import apply_processors, build_processors
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampler import min_p_filter
from loramux.engine.sampling import SamplingParams
from loramux.engine.scheduler import ScheduledChunk
from loramux.engine.sequence import Sequence
from tests.engine.conftest import make_engine, run_to_completion

VOCAB = 4096
PROMPT = [17, 254, 3011, 42, 42, 981, 17, 5, 600, 77, 1203]
Process = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
"""(raw logits [V], prompt, generated so far) → the logits greedy decoding takes the argmax of."""


def _openai_penalties(presence: float, frequency: float) -> Process:
    def process(logits: torch.Tensor, prompt: list[int], generated: list[int]) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=VOCAB)
        return logits - presence * (counts > 0) - frequency * counts

    return process


def _repetition(penalty: float) -> Process:
    processor = RepetitionPenaltyLogitsProcessor(penalty)

    def process(logits: torch.Tensor, prompt: list[int], generated: list[int]) -> torch.Tensor:
        return processor(torch.tensor([prompt + generated]), logits[None].clone())[0]

    return process


def _bias(bias: dict[int, float]) -> Process:
    def process(logits: torch.Tensor, prompt: list[int], generated: list[int]) -> torch.Tensor:
        out = logits.clone()
        for token, value in bias.items():
            out[token] += value
        return out

    return process


def _raw(logits: torch.Tensor, prompt: list[int], generated: list[int]) -> torch.Tensor:
    return logits


def _reference(
    model: Any, prompt: list[int], steps: int, process: Process, adapter: str | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers' logits: the tokens and each step's processed logits."""
    generated: list[int] = []
    processed: list[torch.Tensor] = []
    extra = {} if adapter is None else {"adapter_names": [adapter]}
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + generated]), **extra).logits[0, -1].float()
            logits = process(logits, prompt, generated)
            processed.append(logits)
            generated.append(int(logits.argmax()))
    return generated, processed


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _engine_run(engine: Any, params: SamplingParams, adapter: str | None = None) -> Any:
    request = EngineRequest("r", params, prompt_token_ids=PROMPT, adapter=adapter)
    return run_to_completion(engine, [request])["r"]


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> Any:
    return make_engine(demo_model_dir, enable_lora=True, max_loras=2)


# -- the processors on the same inputs ------------------------------------------------------------


def _row(params: SamplingParams, prompt: list[int], generated: list[int]) -> ScheduledChunk:
    seq = Sequence("r", list(prompt), params)
    seq.token_ids += generated
    return ScheduledChunk(seq, len(seq) - 1, 1, True)


def test_processed_logits_equal_transformers_and_openai_on_the_same_inputs() -> None:
    rng = random.Random(3)
    cases = [
        (SamplingParams(repetition_penalty=1.7), _repetition(1.7)),
        (SamplingParams(repetition_penalty=0.6), _repetition(0.6)),
        (
            SamplingParams(presence_penalty=1.5, frequency_penalty=-0.7),
            _openai_penalties(1.5, -0.7),
        ),
        (SamplingParams(logit_bias=((7, 100.0), (3000, -42.5))), _bias({7: 100.0, 3000: -42.5})),
        (SamplingParams(), _raw),
    ]
    rows, expected = [], []
    logits = torch.randn(len(cases), VOCAB) * 4
    for i, (params, process) in enumerate(cases):
        prompt = [rng.randrange(VOCAB) for _ in range(30)]
        generated = [rng.choice([*prompt[:5], 9, 9, 10]) for _ in range(12)]
        rows.append(_row(params, prompt, generated))
        expected.append(process(logits[i], prompt, generated))
    processors = build_processors(rows, VOCAB, torch.device("cpu"))
    assert processors is not None
    got = apply_processors(logits, processors)
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=1e-5)


def test_rows_without_processors_build_nothing() -> None:
    rows = [_row(SamplingParams(temperature=0.5), [1, 2, 3], [4]) for _ in range(3)]
    assert build_processors(rows, VOCAB, torch.device("cpu")) is None


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_equals_transformers_min_p_warper(min_p: float) -> None:
    logits = torch.randn(6, VOCAB) * 3
    got = min_p_filter(logits, torch.full((6,), min_p))
    expected = MinPLogitsWarper(min_p)(torch.zeros(6, 1, dtype=torch.long), logits)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(expected)])


# -- through the engine ---------------------------------------------------------------------------


def _then(first: Process, second: Process) -> Process:
    def process(logits: torch.Tensor, prompt: list[int], generated: list[int]) -> torch.Tensor:
        return second(first(logits, prompt, generated), prompt, generated)

    return process


@pytest.mark.parametrize(
    ("params", "process", "without"),
    [
        (SamplingParams(repetition_penalty=0.3), _repetition(0.3), _raw),
        (
            SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, logit_bias=((500, 15.0),)),
            _then(_openai_penalties(2.0, 2.0), _bias({500: 15.0})),
            _bias({500: 15.0}),
        ),
        (
            SamplingParams(presence_penalty=-2.0, frequency_penalty=-2.0, logit_bias=((9, 10.0),)),
            _then(_openai_penalties(-2.0, -2.0), _bias({9: 10.0})),
            _bias({9: 10.0}),
        ),
        (SamplingParams(logit_bias=((500, 100.0),)), _bias({500: 100.0}), _raw),
    ],
    ids=["repetition", "presence-frequency", "negative-penalties", "logit-bias"],
)
def test_greedy_with_processors_equals_the_reference_and_logprobs_are_of_processed_logits(
    engine: Any, hf_model: Any, params: SamplingParams, process: Process, without: Process
) -> None:
    steps = 10
    asked = replace(params, max_tokens=steps, ignore_eos=True, logprobs=True, top_logprobs=5)
    outputs = _engine_run(engine, asked)
    expected, processed = _reference(hf_model, PROMPT, steps, process)
    assert _tokens(outputs) == expected
    assert expected != _reference(hf_model, PROMPT, steps, without)[0], "the processor matters"
    logprobs = [lp for o in outputs for lp in o.logprobs or []]
    for lp, logits in zip(logprobs, processed, strict=True):
        reference = torch.log_softmax(logits, dim=-1)
        assert lp.logprob == pytest.approx(float(reference.max()), abs=1e-4)
        top = reference.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("penalty", [0.25, 5.0])
def test_greedy_with_a_strong_repetition_penalty_equals_transformers_generate(
    engine: Any, hf_model: Any, penalty: float
) -> None:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            repetition_penalty=penalty,
        )
    expected = out[0, len(PROMPT) :].tolist()
    params = SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=penalty)
    assert _tokens(_engine_run(engine, params)) == expected
    if penalty < 1:  # the random demo model repeats nothing by itself: this one makes it
        assert expected != _reference(hf_model, PROMPT, 16, _raw)[0]


def test_logprobs_equal_log_softmax_of_transformers_logits_for_base_and_adapter(
    engine: Any, demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    folder = demo_adapter_dirs[1]
    digest = engine.register_adapter(folder)
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, folder, adapter_name="a").eval()
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=20)
    for adapter, name in ((None, "__base__"), (digest, "a")):
        outputs = _engine_run(engine, params, adapter)
        expected, logits = _reference(peft, PROMPT, 8, _raw, adapter=name)
        assert _tokens(outputs) == expected
        for lp, row in zip([x for o in outputs for x in o.logprobs or []], logits, strict=True):
            reference = torch.log_softmax(row, dim=-1)
            assert lp.logprob == pytest.approx(float(reference.max()), abs=1e-4)
            top = reference.topk(20)
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            # Ties within float noise may swap places; the ids must name those values.
            assert [float(reference[t]) for t, _ in lp.top] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )


def test_logprobs_do_not_depend_on_temperature(engine: Any, hf_model: Any) -> None:
    """Reported logprobs are of the distribution before temperature (OpenAI's definition):
    a sampled token's logprob is the log-softmax of the model's logits at its prefix."""
    params = SamplingParams(max_tokens=6, temperature=1.7, seed=11, logprobs=True, ignore_eos=True)
    outputs = _engine_run(engine, params)
    tokens = _tokens(outputs)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    got = [lp.logprob for o in outputs for lp in o.logprobs or []]
    assert got == pytest.approx(expected, abs=1e-4)
    assert all(lp.top == [] for o in outputs for lp in o.logprobs or [])


def test_min_p_of_one_samples_the_greedy_token(engine: Any) -> None:
    greedy = _tokens(_engine_run(engine, SamplingParams(max_tokens=10, ignore_eos=True)))
    sampled = SamplingParams(max_tokens=10, ignore_eos=True, temperature=2.0, seed=5, min_p=1.0)
    loose = SamplingParams(max_tokens=10, ignore_eos=True, temperature=2.0, seed=5)
    assert _tokens(_engine_run(engine, sampled)) == greedy
    assert _tokens(_engine_run(engine, loose)) != greedy


def test_a_mixed_batch_gives_each_request_its_solo_output(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    """Rows with and without each processor, greedy and seeded, base and two adapters, in the
    same steps: each request gets exactly what it gets alone."""
    engine = make_engine(demo_model_dir, enable_lora=True, max_loras=2)
    adapters = [None, *(engine.register_adapter(f) for f in demo_adapter_dirs[2:4])]
    controls = [
        {},
        {"repetition_penalty": 0.3},
        {"presence_penalty": -2.0, "frequency_penalty": -2.0, "logit_bias": ((9, 10.0),)},
        {"logit_bias": ((500, 6.0), (7, -100.0))},
        {"min_p": 0.2},
        {"logprobs": True, "top_logprobs": 3},
    ]
    requests = [
        EngineRequest(
            f"r{i}",
            SamplingParams(
                max_tokens=8,
                ignore_eos=True,
                **({"temperature": 1.0, "seed": i} if i % 2 else {}),  # type: ignore[arg-type]
                **control,  # type: ignore[arg-type]
            ),
            prompt_token_ids=random.Random(i).sample(range(3, 4096), 5 + 3 * i),
            adapter=adapters[i % 3],
        )
        for i, control in enumerate(controls * 2)
    ]
    together = run_to_completion(engine, requests)
    for r in requests:
        alone = run_to_completion(engine, [replace(r, request_id=f"alone-{r.request_id}")])
        got, expected = together[r.request_id], alone[f"alone-{r.request_id}"]
        assert _tokens(got) == _tokens(expected), r.request_id
        # Logits of a batch differ from a lone row's in float noise (~1e-6), never more.
        got_lp = [lp for o in got for lp in o.logprobs or []]
        expected_lp = [lp for o in expected for lp in o.logprobs or []]
        assert len(got_lp) == len(expected_lp) == (8 if r.params.logprobs else 0)
        for g, e in zip(got_lp, expected_lp, strict=True):
            assert g.logprob == pytest.approx(e.logprob, abs=1e-4)
            assert [t for t, _ in g.top] == [t for t, _ in e.top]
    assert engine.stats().kv_blocks_used == 0
