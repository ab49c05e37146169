"""What the ``/api`` and ``/admin`` routes accept: the bounds every value must keep to be stored.

Owns: ``PoolRoute``, the route class of those routers, which reads a JSON body with the
gateway's strict parser (``gateway.proxy.attribution.parse_json``, NUL refused) and refuses a NUL
character in a query or path parameter. Every integer field and parameter there is bounded by
``datapool.models.INTEGER_MAX`` in its route's schema. Never: checks a field's meaning (the
route's schema does).

Why: a value the pool cannot store would otherwise reach the database and come back as a 500.
PostgreSQL's ``INTEGER`` columns hold at most 2^31 - 1 (SQLite's 2^63 - 1), its text columns no
NUL character, and neither backend a lone UTF-16 surrogate; each is refused here with a 400
naming the field and the bound, identically on both backends.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from gateway.errors import InvalidRequestError
from gateway.proxy.attribution import parse_json


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body(), refuse_nul=True)
            except InvalidRequestError as exc:
                # FastAPI turns any other exception raised while it reads a body into a bare
                # "There was an error parsing the body"; an HTTPException keeps the message.
                raise HTTPException(status_code=400, detail=exc.message) from exc
        return self._json


def _check_parameters(request: Request) -> None:
    """Raise ``InvalidRequestError`` naming the first query or path parameter holding NUL."""
    for name, value in [*request.query_params.multi_items(), *request.path_params.items()]:
        if "\x00" in str(value):
            raise InvalidRequestError(
                f"{name} holds a NUL character (%00): the pool cannot store it", param=name
            )


class PoolRoute(APIRoute):
    """An ``APIRoute`` whose JSON body and parameters keep to what the pool stores."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            _check_parameters(request)
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
