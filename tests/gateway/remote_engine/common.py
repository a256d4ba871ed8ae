"""What the remote engine client's tests share: sampling, prompts, and how outputs are read."""

from __future__ import annotations

from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.engine.conftest import run_to_completion

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
IMPORT_OS, CLASS_TREE, WHILE_TRUE = [300, 12, 77, 5], [99, 1000, 3, 58], [61, 62, 63]


async def collect(client: RemoteEngineClient, request: EngineRequest) -> list[RequestOutput]:
    return [out async for out in client.generate(request)]


def run_locally(local: LLMEngine, request: EngineRequest) -> list[RequestOutput]:
    return run_to_completion(local, [request])[request.request_id]


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def served_by(services: list[RunningEngineService], digest: str) -> list[int]:
    """Indexes of the engines that ran requests for `digest`."""
    stats = [s.engine.adapter_stats().get(digest) for s in services]
    return [i for i, st in enumerate(stats) if st is not None and st.requests > 0]
