"""Models a tenant makes upstream are that tenant's: a fine-tune made through a pool's passthrough of
`/v1/fine_tuning/jobs` (OpenAI names it `ft:<base>:<org>:<suffix>:<id>` in the job's `fine_tuned_model`, and each
checkpoint `...:ckpt-step-<n>`) is recorded with its tenant when an answer names it (gateway/tenancy/catalog.py), and
only that tenant may call, list, read or delete it, though every tenant reaches the upstream with the pool's one key.

Who may use a model, on a pool, for the model requests' every upstream attempt (gateway/stages/authority.py: the
first and each fallback), a passthrough request's `model` (a fine-tune built on a fine-tune, an assistant, a batch's
lines) and the gateway's model list:
- a model recorded as another tenant's: a 404 in OpenAI's words, the same as for a model that does not exist, and
  nothing goes upstream;
- a model recorded as the tenant's: served (a recorded model is its maker's alone, even where a pool names it);
- a fine-tune by its name (`ft:`) with no record (made outside the gateway, or its record expired): hidden the same
  way, unless the operator lets it be used: named in the pool's `models:`, `tenant_objects.unrecorded: readable`
  (every tenant may use unrecorded objects), or the tenant reaches the pool with its own upstream key
  (`tenant_api_key_env`: the provider keeps its models apart);
- any other model: the pool's to serve, as before.
Deleting a model needs a record of the tenant's: an unrecorded model is no one's to delete.

A model request looks its model up in the object store only where a record could decide: for a fine-tune by its
name, and for any model where a pool passes through a route that records models. A deployment that does neither makes
no store call per request; a model an earlier configuration recorded under another form of name is then not found
(the ones made through OpenAI's fine-tuning all start with `ft:`).

Anonymous access (no key exists anywhere) has one tenant: nothing to keep apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gateway.apis.model_name import MAX_MODEL_CHARS
from gateway.apis.passthrough import matches
from gateway.config import PoolConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.routing.pool import Pool
from gateway.tenancy.catalog import COLLECTIONS, MODEL, is_object_id
from gateway.tenancy.ownership import TenantObjects, anonymous
from gateway.tenancy.records import ObjectRecord
from gateway.tenancy.references import Reference

FINE_TUNE_PREFIX = "ft:"  # OpenAI's fine-tuned models and checkpoints


def is_fine_tune(model: str) -> bool:
    """Whether `model` is a fine-tune by its name: one some tenant made, whether or not through the gateway."""
    return model.startswith(FINE_TUNE_PREFIX)


def records_models(pools: Sequence[PoolConfig]) -> bool:
    """Whether any pool passes through a route whose answers name models made for the tenant (a collection's root,
    or anything under it: a job's read names its model too)."""
    return any(
        matches(pattern, collection.root) or pattern.removesuffix("*").startswith(collection.root + "/")
        for pool in pools
        for pattern in pool.passthrough
        for collection in COLLECTIONS[pool.api]
        if any(named.kind == MODEL for names in (collection.names, *collection.sub_lists.values()) for named in names)
    )


class TenantModels:
    def __init__(self, objects: TenantObjects, pools: Sequence[PoolConfig]) -> None:
        self._objects = objects
        self._recorded = records_models(pools)

    async def require(
        self, ctx: RequestContext, model: str, pool: Pool, *, change: bool = False, param: str = "model"
    ) -> None:
        """Pass if the request's tenant may use `model` on `pool` (`change`: delete it), else raise the 404 naming
        `param` (where the request names the model)."""
        await self.require_all(ctx, [Reference(MODEL, model, param)], pool, change=change)

    async def require_all(
        self, ctx: RequestContext, wanted: Sequence[Reference], pool: Pool, *, change: bool = False
    ) -> None:
        """`require` for every model `wanted` names (a batch's lines), with one store call for them all; the 404 is
        for the first refused."""
        if anonymous(ctx) or ctx.tenant is None:
            return
        asked = [r for r in wanted if change or self.looked_up(r.object_id)]
        found = await self._objects.find(r.object_id for r in asked if is_object_id(r.object_id, MODEL))
        for reference in asked:
            if not self._reaches(ctx.tenant, reference.object_id, found.get(reference.object_id), pool, change):
                raise model_not_found(reference.object_id, reference.param)

    async def refusal(self, ctx: RequestContext, model: str, pool: Pool) -> GatewayError | None:
        """`require` for one upstream attempt: None where the tenant may call `model` on `pool`, else the refusal
        (the 404, or the 503 of a store that did not answer)."""
        try:
            await self.require(ctx, model, pool)
        except GatewayError as refusal:
            return refusal
        return None

    async def visible(self, ctx: RequestContext, offered: Iterable[tuple[str, Pool]]) -> set[str]:
        """Those of the models pools offer (each with the pool that offers it) the request's tenant may use."""
        offered = list(offered)
        if anonymous(ctx) or ctx.tenant is None:
            return {model for model, _ in offered}
        tenant = ctx.tenant
        found = await self._objects.find(m for m, _ in offered if self.looked_up(m) and is_object_id(m, MODEL))
        return {m for m, pool in offered if self._reaches(tenant, m, found.get(m), pool, False)}

    def looked_up(self, model: str) -> bool:
        """Whether a record could decide who may use `model`; where none could, it is the pool's to serve."""
        return self._recorded or model.startswith(FINE_TUNE_PREFIX)  # is_fine_tune, without a call per attempt

    def _reaches(self, tenant: str, model: str, record: ObjectRecord | None, pool: Pool, change: bool) -> bool:
        if record is not None:
            return record.tenant == tenant and record.kind == MODEL
        if change:
            return False
        if not is_fine_tune(model):
            return True
        return self._objects.unrecorded_readable or model in pool.config.models or pool.has_own_key(tenant)


def model_not_found(model: str, param: str = "model") -> GatewayError:
    """The same answer whether the model is another tenant's or does not exist (OpenAI's own words)."""
    shown = model[:MAX_MODEL_CHARS]
    message = f"The model `{shown}` does not exist or you do not have access to it."
    return GatewayError(404, message, code="model_not_found", param=param)
