"""What the ``/api`` and ``/admin`` routes accept: the bounds every value must keep to be stored.

Owns: ``PoolRoute``, the route class of those routers, which reads a JSON body with the
gateway's strict parser (``gateway.proxy.attribution.parse_json``, NUL refused), refuses an
object that names a key twice (JSON parsers keep the last one silently, so ``{"consumer": "a",
"consumer": "b"}`` would act for ``b`` whatever the sender meant), refuses a query parameter
the route does not declare (``?limt=5`` is a 400 ``unknown_parameter`` naming ``limt``, never a
page read with the default limit), a single-valued parameter sent twice (``?limit=1&limit=3`` is
a 400 ``repeated_parameter``, never the last one read) and a NUL character in a query or path
parameter; ``StrictBody``, the base of every request body there, which refuses a field the
body's schema does not name (``{"rewrd": 1}`` is a 400 naming ``rewrd``, never a request read
without it) and a value of another JSON type (no ``"4"`` or ``true`` read as 4 or 1, no number
read as a string). Every integer field and parameter there is bounded by
``datapool.models.INTEGER_MAX`` in its route's schema. Never: checks a field's meaning (the
route's schema does).

Why: a value the pool cannot store would otherwise reach the database and come back as a 500.
PostgreSQL's ``INTEGER`` columns hold at most 2^31 - 1 (SQLite's 2^63 - 1), its text columns no
NUL character, and neither backend a lone UTF-16 surrogate; each is refused here with a 400
naming the field and the bound, identically on both backends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, get_args, get_origin

from fastapi import HTTPException, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict

from gateway.errors import InvalidRequestError
from gateway.proxy.attribution import parse_json
from gateway.settings import GatewaySettings


class StrictBody(BaseModel):
    """A request body of the ``/api`` and ``/admin`` routes: unknown fields and values of another
    JSON type are refused (400 naming the field), so a misspelt or mistyped field never leaves
    the request half-read and acted on. A nested model keeps its own configuration."""

    model_config = ConfigDict(extra="forbid", strict=True)


def check_tags(tags: list[str], settings: GatewaySettings, param: str = "tags") -> None:
    """Raise ``InvalidRequestError`` (400 naming ``param`` or ``param.<i>``) for more than
    ``max_trajectory_tags`` tags or a tag over ``max_tag_chars`` characters: a trajectory's tags
    (its own, and those its labels add) come back whole on every listing page."""
    if len(tags) > settings.max_trajectory_tags:
        raise InvalidRequestError(
            f"{param} holds {len(tags)} tags; expected at most {settings.max_trajectory_tags} "
            "(TRAJGATE_MAX_TRAJECTORY_TAGS)",
            param=param,
        )
    for index, tag in enumerate(tags):
        if len(tag) > settings.max_tag_chars:
            raise InvalidRequestError(
                f"{param}.{index} is {len(tag)} characters long; expected at most "
                f"{settings.max_tag_chars} (TRAJGATE_MAX_TAG_CHARS)",
                param=f"{param}.{index}",
            )


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object's members as a dict; raises ``InvalidRequestError`` on a key named twice."""
    members: dict[str, Any] = {}
    for key, value in pairs:
        if key in members:
            raise InvalidRequestError(
                f"request body names {key!r} twice in one object; expected each key once",
                param=key,
            )
        members[key] = value
    return members


def _parse_body(data: bytes) -> Any:
    """``data`` parsed as ``parse_json`` does (NUL refused), then read again for keys named twice
    (``parse_json``'s fast parser keeps the last one without saying so)."""
    value = parse_json(data, refuse_nul=True)
    if isinstance(value, (dict, list)):
        json.loads(data, object_pairs_hook=_once_each)
    return value


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = _parse_body(await self.body())
            except InvalidRequestError as exc:
                # FastAPI turns any other exception raised while it reads a body into a bare
                # "There was an error parsing the body"; an HTTPException keeps the message.
                raise HTTPException(status_code=400, detail=exc.message) from exc
        return self._json


def _repeatable(annotation: Any) -> bool:
    """Whether a parameter of this type reads every value it is sent (``list[str] | None``)."""
    if get_origin(annotation) in (list, set, frozenset, tuple):
        return True
    return any(_repeatable(arg) for arg in get_args(annotation) if arg is not type(None))


def _query_names(dependant: Dependant) -> dict[str, bool]:
    """The query parameters a route declares, each with whether it may repeat (a list): its own,
    its dependencies', and the fields of a model it reads from the query (``Annotated[Model,
    Query()]``), each by the name a client sends (its alias when it has one)."""
    names: dict[str, bool] = {}
    for field in dependant.query_params:
        model = field.field_info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            for name, info in model.model_fields.items():
                names[info.alias or name] = _repeatable(info.annotation)
        else:
            names[field.alias] = _repeatable(model)
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def _check_parameters(request: Request, query_names: dict[str, bool]) -> None:
    """Raise ``InvalidRequestError`` naming the query parameters the route does not declare
    (``query_names``), then the first single-valued one sent twice, then the first query or path
    parameter holding NUL."""
    unknown = sorted(set(request.query_params) - set(query_names))
    if unknown:
        expected = ", ".join(sorted(query_names)) or "none"
        raise InvalidRequestError(
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; expected: {expected}",
            param=unknown[0],
            code="unknown_parameter",
        )
    # Starlette keeps the last of ``?limit=1&limit=3``: the sender meant one of them, not both.
    for name in request.query_params:
        values = request.query_params.getlist(name)
        if len(values) > 1 and not query_names[name]:
            raise InvalidRequestError(
                f"query parameter {name!r} is sent {len(values)} times "
                f"({', '.join(repr(v[:40]) for v in values[:5])}); it takes one value",
                param=name,
                code="repeated_parameter",
            )
    for name, value in [*request.query_params.multi_items(), *request.path_params.items()]:
        if "\x00" in str(value):
            raise InvalidRequestError(
                f"{name} holds a NUL character (%00): the pool cannot store it", param=name
            )


class PoolRoute(APIRoute):
    """An ``APIRoute`` whose JSON body and parameters keep to what the pool stores, and whose
    query names only parameters it declares."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        query_names = _query_names(self.dependant)

        async def strict(request: Request) -> Response:
            _check_parameters(request, query_names)
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
