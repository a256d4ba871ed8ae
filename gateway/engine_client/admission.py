"""Which engines of LORAMUX_ENGINE_URLS a remote engine client uses. Each engine is admitted on
each connection to it (at the start, and again after every reconnect: another process may answer
there now) before the client routes a request, call or upload to it.

Admission asks the engine for its `info`. Every engine behind a gateway must serve one model:
the gateway learns it from them (gateway.served_identity: the response cache keys entries by
its identity, `system_fingerprint` hashes it, prompts are tokenized for its vocabulary and
bounded by its context), so the first engine admitted sets it (at the start, the first in
LORAMUX_ENGINE_URLS order that answers) and an engine that speaks another channel version, or
serves another checkpoint (model identity), `max_model_len` or vocabulary, is refused: logged
as an error naming it and what differs, it is sent nothing and counts as down (no stats, no
metrics) until a later connection to it is admitted.

An admitted engine is then sent the retires it missed while this client could not reach it (a
partition, a paused process: one that restarted lost its adapters anyway), so that a deleted
adapter's weights leave every engine, and the client learns which adapters it holds. The
retires owed are kept per engine, at most MAX_OWED_RETIRES each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from loramux.engine.errors import EngineError, EngineStoppedError
from loramux.gateway.engine_client.base import EngineInfo, EngineVersionError, require_wire
from loramux.gateway.engine_client.channel import Channel
from loramux.gateway.engine_client.routing import Endpoint

log = logging.getLogger(__name__)

PROBE_SECONDS = 5.0
MAX_OWED_RETIRES = 4096
"""Retires kept for one engine that missed them; past it the oldest is dropped (logged)."""


class EngineRefusedError(EngineStoppedError):
    """This gateway refused the engine: it serves another model than the engine admitted first
    (or speaks another channel version). It is sent nothing, as if it were down."""


class Admission:
    """The admission of a client's engines, and the model they must all serve."""

    def __init__(self, channel: Callable[[Endpoint], Channel]):
        self._channel = channel
        self.model: EngineInfo | None = None
        """What every engine must serve: the `info` of the first engine admitted."""
        self._model_url = ""
        self._locks: dict[str, asyncio.Lock] = {}
        self._owed: dict[str, dict[str, None]] = {}
        """The digests each engine (by URL) missed the retire of, oldest first."""

    async def start(self, endpoints: list[Endpoint]) -> None:
        """Admit every engine that answers, asked together; the first of them in
        LORAMUX_ENGINE_URLS order sets the model. The others are admitted once they answer."""
        answers = await asyncio.gather(*(self._info(e) for e in endpoints), return_exceptions=True)
        judged = []
        for endpoint, answer in zip(endpoints, answers, strict=True):
            if isinstance(answer, EngineInfo):  # else unreachable, or refused (and logged)
                with contextlib.suppress(EngineRefusedError):
                    self._judge(endpoint, answer)
                    judged.append(endpoint)
        await asyncio.gather(*(self._settle(e) for e in judged), return_exceptions=True)

    async def served_model(self, endpoints: list[Endpoint]) -> EngineInfo:
        """The model every engine must serve. While none is known, every engine not admitted is
        asked: EngineStoppedError when none answers, EngineVersionError when those that answer
        are of another release."""
        if self.model is None:
            outcomes = await asyncio.gather(
                *(self.admit(e) for e in endpoints), return_exceptions=True
            )
            if self.model is None:
                errors = [o for o in outcomes if isinstance(o, BaseException)]
                raise next((e for e in errors if not isinstance(e, EngineStoppedError)), errors[0])
        return self.model

    async def admit(self, endpoint: Endpoint) -> None:
        """Returns once `endpoint` is admitted on its current connection (at once when it is);
        EngineStoppedError while it does not answer, EngineRefusedError (or EngineVersionError)
        when it is refused. A refused engine is asked again on its next connection, or while no
        engine has set the model."""
        if self._decided(endpoint):
            return
        async with self._locks.setdefault(endpoint.url, asyncio.Lock()):
            if self._decided(endpoint):  # admitted meanwhile
                return
            self._judge(endpoint, await self._info(endpoint))
            await self._settle(endpoint)

    def _decided(self, endpoint: Endpoint) -> bool:
        """True when `endpoint` is admitted on its current connection; its refusal (raised)
        when it is refused there and the model is known; False while it is to be asked."""
        if not endpoint.judged or (endpoint.refused is not None and self.model is None):
            return False
        if endpoint.refused is not None:
            raise EngineRefusedError(endpoint.refused)
        return True

    def owe_retire(self, endpoint: Endpoint, digest: str) -> None:
        """`endpoint` missed the retire of `digest`: it is sent before its next admission."""
        owed = self._owed.setdefault(endpoint.url, {})
        owed[digest] = None
        if len(owed) > MAX_OWED_RETIRES:
            dropped = next(iter(owed))
            del owed[dropped]
            log.error(
                "engine %s missed more than %d retires: adapter %s stays on it until it restarts",
                endpoint.url,
                MAX_OWED_RETIRES,
                dropped,
            )

    def forgive_retire(self, digest: str) -> None:
        """`digest` is served again (its files were published anew): no engine owes its retire."""
        for owed in self._owed.values():
            owed.pop(digest, None)

    async def _info(self, endpoint: Endpoint) -> EngineInfo:
        """The engine's `info`; EngineVersionError (the engine refused) for another release."""
        reply = await self._channel(endpoint).call("info", PROBE_SECONDS)
        try:
            require_wire(endpoint.url, reply)
        except EngineVersionError as exc:
            self._refuse(endpoint, exc)
            raise
        endpoint.max_adapter_bytes = int(reply["max_adapter_bytes"])
        return EngineInfo.of(reply)

    def _judge(self, endpoint: Endpoint, info: EngineInfo) -> None:
        """Take `info` as the model when none is known yet; EngineRefusedError (the engine
        refused) when it differs from the model."""
        if self.model is None:
            self.model, self._model_url = info, endpoint.url
            return
        differences = [
            f"{name} {theirs} where {self._model_url} has {ours}"
            for name, ours, theirs in (
                ("model identity", self.model.model_identity, info.model_identity),
                ("max_model_len", self.model.max_model_len, info.max_model_len),
                ("vocabulary size", self.model.vocab_size, info.vocab_size),
            )
            if ours != theirs
        ]
        if differences:
            error = EngineRefusedError(
                f"engine {endpoint.url} serves another model than the engine admitted first: "
                f"{'; '.join(differences)}. Every engine of LORAMUX_ENGINE_URLS must serve the "
                "same checkpoint with the same LORAMUX_MAX_MODEL_LEN"
            )
            self._refuse(endpoint, error)
            raise error

    def _refuse(self, endpoint: Endpoint, error: Exception) -> None:
        """Refuse `endpoint` on its current connection; logged as an error once per reason."""
        if endpoint.refused != str(error):
            log.error("%s; this gateway sends it nothing until it is fixed", error)
        endpoint.refused, endpoint.judged = str(error), True

    async def _settle(self, endpoint: Endpoint) -> None:
        """Send the judged engine the retires it missed, learn which adapters it holds, then
        take it in."""
        channel, owed = self._channel(endpoint), self._owed.get(endpoint.url, {})
        for digest in list(owed):
            try:
                await channel.call("retire", PROBE_SECONDS, digest=digest)
                log.info("retired adapter %s on %s, which missed its retire", digest, endpoint.url)
            except EngineStoppedError:
                raise
            except EngineError as exc:  # never holds the engine back
                log.error(
                    "engine %s refused the retire of adapter %s: %s", endpoint.url, digest, exc
                )
            owed.pop(digest, None)
        endpoint.adapters.update(await channel.call("adapters", PROBE_SECONDS))
        endpoint.refused, endpoint.judged = None, True
