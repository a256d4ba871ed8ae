"""The in-process engine client: the engine runs on a thread of this process (tests and
benchmarks; `loramux serve` runs it in a process of its own). It takes and gives token ids, like
the remote client, so the gateway's path is the same with either."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import InvalidRequestError, UnknownAdapterError
from loramux.engine.identity import engine_build
from loramux.engine.outputs import EngineRequest, EngineStats, RequestOutput
from loramux.gateway.engine_client.base import EngineInfo
from loramux.gateway.engine_client.uploads import DELETED


class LocalEngineClient:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    async def start(self) -> None:
        self.engine.start()

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)

    async def info(self) -> EngineInfo:
        llm = self.engine.engine
        return EngineInfo(
            self.model_name,
            llm.max_model_len,
            llm.model_config.vocab_size,
            llm.model_identity,
            engine_build(),
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if request.prompt_token_ids is None:
            raise InvalidRequestError("the engine takes prompts as token ids")
        async for out in self.engine.generate(request):
            yield out

    async def stream(self, request: EngineRequest, sink: Callable[[RequestOutput], None]) -> None:
        async for out in self.generate(request):
            sink(out)

    async def abort(self, request_id: str, choice: int | None = None) -> None:
        self.engine.abort(request_id, choice)

    async def ensure_adapter(self, digest: str, folder: Path) -> None:
        llm = self.engine.engine
        if llm.lora is not None and llm.lora.is_servable(digest):
            return
        if not folder.is_dir():  # deleted since a catalog (another worker's) resolved it
            raise UnknownAdapterError(DELETED)
        registered = await self.engine.register_adapter(folder)
        if registered != digest:
            raise RuntimeError(f"adapter files in {folder} have digest {registered}, not {digest}")

    def prefetch_adapter(self, digest: str) -> None:
        self.engine.prefetch_adapter(digest)

    async def retire_adapter(self, digest: str) -> None:
        self.engine.retire_adapter(digest)

    async def stats(self) -> list[EngineStats | None]:
        """None (down) while the engine serves nothing: its step loop stopped or stalled."""
        return [self.engine.stats() if self.engine.health == "ok" else None]

    async def metrics(self) -> dict[str, str | None]:
        return {"0": self.engine.engine.metrics.render()}

    async def ready(self) -> bool:
        return self.engine.health == "ok"
