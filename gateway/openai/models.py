"""The models a key may name (`GET /v1/models`, `GET /v1/models/{model}`), and the system
fingerprint of what produces a model's output."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.catalog import ModelCatalog, unknown_model
from loramux.gateway.db.adapter import SHARED_OWNER
from loramux.gateway.errors import PermissionDenied
from loramux.gateway.openai.shapes import Model, ModelList


def system_fingerprint(build: str, base_model: str, adapter_digest: str | None) -> str:
    """`fp_` and a short hash of the engine build, the base model and the adapter's digest:
    the same fingerprint means the same code, weights and adapter produced the output. `build`
    and `base_model` are what the engine reports (engine.identity: a digest of its code, and
    the base model's name with a digest of its files and dtype: `ServingLimits.served_base`),
    not what the gateway's host holds."""
    identity = "\0".join((build, base_model, adapter_digest or "base"))
    return "fp_" + hashlib.sha256(identity.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ModelDirectory:
    """The base model and the adapters each tenant may use."""

    catalog: ModelCatalog
    base_model: str

    async def list(self, principal: Principal) -> ModelList:
        """The base model and every adapter this key may use (own adapters first; a shared
        adapter shadowed by an own one of the same name is listed as `shared/<name>`)."""
        models = [Model(self.base_model, "model", 0, "loramux")]
        own: set[str] = set()
        for row in await self.catalog.visible(principal.tenant_id):
            shadowed = row.owner == SHARED_OWNER and row.name in own
            model_id = f"{SHARED_OWNER}/{row.name}" if shadowed else row.name
            if row.owner != SHARED_OWNER:
                own.add(row.name)
            owned_by = "shared" if row.owner == SHARED_OWNER else principal.tenant_name
            created = int(row.created_at.timestamp())
            models.append(Model(model_id, "model", created, owned_by, self.base_model))
        return ModelList("list", [m for m in models if principal.may_use(m.id)])

    async def get(self, principal: Principal, model_id: str) -> Model:
        """The model a completion naming `model_id` is served by (`ModelCatalog.resolve`: an
        own or shared adapter, `owner/name`, `name@version` or the base model), under that id.
        A model this key may not use is as unknown as one that does not exist (404 either way),
        as is another tenant's adapter."""
        try:
            resolved = await self.catalog.resolve(principal, model_id)
        except PermissionDenied:
            raise unknown_model(model_id) from None
        if resolved.adapter is None:
            return Model(model_id, "model", 0, "loramux")
        owned_by = "shared" if resolved.owner == SHARED_OWNER else principal.tenant_name
        return Model(model_id, "model", resolved.created, owned_by, self.base_model)
