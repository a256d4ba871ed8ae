"""What decides a response besides its request, as the engine reports it: the base model's
identity and the engine's build (EngineInfo). The response cache keys entries by the identity
and `system_fingerprint` hashes both, so they must be the engine's own. With several engines
(LORAMUX_ENGINE_URLS) they are the first admitted engine's, and the engine client refuses any
engine that serves another model (gateway.engine_client.admission), so they are every serving
engine's.

A gateway whose engine does not answer at its start (an external engine still loading its
model) starts degraded, with a stand-in of its own (`ServedIdentity.stand_in`): an identity no
other process has, so nothing it caches before the engine answers is found by any other
gateway, or by itself once it has the engine's (`confirm_identity`, which asks until it does).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from loramux.engine.errors import EngineError, EngineStoppedError
from loramux.engine.identity import engine_build
from loramux.engine.model.config import ModelConfig
from loramux.gateway.engine_client.base import EngineClient, EngineInfo, EngineVersionError
from loramux.gateway.settings import Settings

log = logging.getLogger(__name__)

CONFIRM_EVERY_SECONDS = 1.0
"""How often a gateway that started without its engine asks it for its identity."""


@dataclass
class ServedIdentity:
    """The served base model's identity and the engine's build; shared by every request's
    limits, so that a confirmation reaches them all."""

    model_identity: str
    build: str
    confirmed: bool = True
    """False while it is a stand-in (the engine has not answered since this gateway started)."""

    @classmethod
    def of(cls, info: EngineInfo) -> ServedIdentity:
        return cls(info.model_identity, info.build)

    @classmethod
    def stand_in(cls) -> ServedIdentity:
        """An identity unique to this process, until the engine gives its own."""
        return cls(f"unconfirmed-{secrets.token_hex(8)}", engine_build(), confirmed=False)

    def confirm(self, info: EngineInfo) -> None:
        self.model_identity, self.build, self.confirmed = info.model_identity, info.build, True


async def engine_info(
    engine: EngineClient, settings: Settings, model_dir: Path
) -> tuple[EngineInfo, ServedIdentity]:
    """What the engine serves, as it says; when no engine answers (an external one not up
    yet), what this gateway's settings and model folder say it will serve, with a stand-in
    identity. The gateway then starts degraded, as when its engine goes down later: /ready
    answers 503 and requests 503 `engine_unavailable` until an engine answers (the channel
    reconnects by itself). It died with a traceback instead, so an orchestrator starting
    gateways and engines together had its gateways crash-looping until the engine had loaded
    its model."""
    try:
        info = await engine.info()
        return info, ServedIdentity.of(info)
    except EngineStoppedError as exc:
        model = ModelConfig.from_folder(model_dir)
        identity = ServedIdentity.stand_in()
        info = EngineInfo(
            settings.model_name,
            model.context_limit(settings.engine.max_model_len),
            model.vocab_size,
            identity.model_identity,
            identity.build,
        )
        log.warning(
            "%s (LORAMUX_ENGINE_URLS): starting without it, not ready until it answers; "
            "assuming it serves %s with max_model_len %d",
            exc,
            info.model_name,
            info.max_model_len,
        )
        return info, identity


async def confirm_identity(
    engine: EngineClient, identity: ServedIdentity, assumed: EngineInfo
) -> None:
    """Asks the engine for its info until it answers, then takes its identity and build;
    until then the gateway is not ready (/ready 503). An engine that refuses it (holding another
    token) is logged as an error, once per reason; one of another release is logged by the
    engine client, which refuses it by URL (gateway.engine_client.admission). An engine
    serving another model, context or vocabulary than the gateway assumed is logged as an
    error: the gateway's tokenizer and limits stay what it started with."""
    reported = ""
    while True:
        try:
            info = await engine.info()
            break
        except (EngineStoppedError, EngineVersionError) as exc:  # not up yet, or refused by
            log.debug("the engine's identity is not known yet: %s", exc)  # the client (logged)
        except EngineError as exc:  # another token: the operator's to fix
            if str(exc) != reported:
                log.error("%s; this gateway stays not ready until it is fixed", exc)
                reported = str(exc)
        await asyncio.sleep(CONFIRM_EVERY_SECONDS)
    identity.confirm(info)
    log.info(
        "the engine answered: it serves %s (identity %s)", info.model_name, info.model_identity
    )
    facts = (info.model_name, info.max_model_len, info.vocab_size)
    if facts != (assumed.model_name, assumed.max_model_len, assumed.vocab_size):
        log.error(
            "the engine serves %s with max_model_len %d and %d tokens, but this gateway "
            "started assuming %s, %d and %d: restart the gateway",
            *facts,
            assumed.model_name,
            assumed.max_model_len,
            assumed.vocab_size,
        )
