"""Every route refuses bad input in the one error envelope, with a string code, streamed or not.

The walk: every (method, path) the app serves (the operations of its OpenAPI document and the
routes left out of it: the docs pages, the inspector page and its JSON API) gets each bad request
its inputs allow, derived from the route's schema:

- a method the path does not serve (405);
- a path or query parameter of the wrong type (an integer, number, boolean, date-time or enum
  parameter given a word), or outside its bounds (``maximum`` + 1, ``minimum`` - 1, a string one
  character over ``maxLength``), and an over-long unknown id (201 characters, one over the
  gateway's id bound) for a string path parameter;
- each required query parameter left out, and on the pool's routes (``/api``, ``/admin``) a query
  parameter the route does not declare (``?limt=5``);
- a body that is not JSON, a JSON body of the wrong type (an array), an empty object when fields
  are required, and each bounded top-level field out of bounds in an otherwise valid body. The
  OpenAI routes read their body themselves, so every POST gets the first three.

Each answer must be a 4xx whose body is exactly ``{"error": {"message", "type", "param", "code"}}``
with a string code and a non-empty message; a schema-derived refusal must name the field in
``param``. The upstream is an ``httpx.MockTransport`` that fails its health check, and afterwards
it must have seen no call and the pool must hold no trajectory, step or attempt: bad input is
refused before vLLM is asked and before anything is written.

Also here: a stream that fails after its 200 went out ends in an event with the same type and
string code as the unstreamed answer to the same upstream fault; the tree drawn at the top of
``gateway/errors.py`` is the real one; a dialect can render an error in its own shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import RouteContext, iter_route_contexts
from fastapi.testclient import TestClient
from gateway_helpers import steps_of
from sqlalchemy import func, select

from datapool import db
from datapool.db import make_engine
from datapool.models import CallAttempt, Step, Trajectory
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.errors import (
    TrajgateError,
    UpstreamTimeoutError,
    error_response,
    openai_envelope,
    sse_error_event,
)
from gateway.settings import GatewaySettings

UPSTREAM = "http://upstream.test"
# The gateway answers only its own host names (gateway.guard): not TestClient's "testserver".
LOOPBACK = "http://127.0.0.1"
ENVELOPE_KEYS = {"message", "type", "param", "code"}
# The gateway bounds trajectory, group and API-key ids to 200 characters.
OVER_LONG_ID = "z" * 201
# JSON a parser takes but no part behind it can use: each must be a 400 on every route with a
# body, not a 500 from deeper down (the fields are those of a chat call, a trajectory, a reward).
_VALID_FIELDS = (
    b'"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
    b'"id": "t", "target": "trajectory", "target_id": "t", "name": "final", "value": 1.0'
)
HOSTILE_JSON = {
    "a lone surrogate in a string": b'{"content": "\\ud800", "note": "\\udfff x", '
    + _VALID_FIELDS
    + b"}",
    "a number that overflows a float": b'{"temperature": 1e999, "value": 1e999, '
    + _VALID_FIELDS.replace(b'"value": 1.0', b'"x": -1e999')
    + b"}",
    "an integer of 5000 digits": b'{"max_tokens": ' + b"9" * 5000 + b", " + _VALID_FIELDS + b"}",
    "JSON nested 1000 levels deep": b'{"metadata": {"a": '
    + b"[" * 1000
    + b"]" * 1000
    + b"}, "
    + _VALID_FIELDS
    + b"}",
}
# Catch-all path parameters for which every string is a valid value, with the reason.
ANY_VALUE_IS_VALID = {("/inspector/{view:path}", "view"): "every path is a view of the one page"}


# -- the walk ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shown(RouteContext):
    """A route context that the OpenAPI generator documents even when the route hides itself."""

    @property
    def include_in_schema(self) -> bool:
        return True


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # as routed, converters included: /inspector/static/{relative:path}
    operation: dict[str, Any]
    documented: bool

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class BadRequest:
    what: str
    method: str
    url: str
    params: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    param: str | None = None  # the field the envelope must name, when the schema says which


def _template_app() -> FastAPI:
    """An app built like the real one, only to read its routes (no lifespan, no database)."""
    return create_app(
        GatewaySettings(upstream_url=UPSTREAM),
        PoolSettings(database_url="sqlite:///unused.sqlite3"),
    )


def app_routes(app: FastAPI) -> tuple[list[Route], dict[str, Any]]:
    """Every (method, route) the app serves, each with its OpenAPI operation, and the schemas.

    Hidden routes are documented by the same generator as the app's own document (``_Shown``),
    so both kinds are walked the same way.
    """
    contexts = list(iter_route_contexts(app.routes))
    documented = app.openapi()["paths"]
    shown = [
        _Shown(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}) for c in contexts
    ]
    full = get_openapi(title="all routes", version="0", routes=shown)
    routes = []
    for context in contexts:
        for method in sorted(context.methods or ()):
            if method == "HEAD":  # Starlette's implicit twin of GET
                continue
            template = context.path_format or ""
            operation = full["paths"].get(template, {}).get(method.lower(), {})
            routes.append(
                Route(
                    method,
                    context.path or "",
                    operation,
                    method.lower() in documented.get(template, {}),
                )
            )
    return routes, full.get("components", {}).get("schemas", {})


def _resolve(schema: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """The schema itself: ``$ref`` followed, ``anyOf [X, null]`` reduced to ``X``."""
    if "$ref" in schema:
        return _resolve(schemas[schema["$ref"].rsplit("/", 1)[1]], schemas)
    options = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    if len(options) == 1:
        return {
            **_resolve(options[0], schemas),
            **{k: v for k, v in schema.items() if k != "anyOf"},
        }
    return schema


def _valid(schema: dict[str, Any], schemas: dict[str, Any]) -> Any:
    """A smallest value the schema accepts (required object fields only)."""
    schema = _resolve(schema, schemas)
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.0))
    if kind == "boolean":
        return True
    if kind == "array":
        return [_valid(schema.get("items", {}), schemas)] * int(schema.get("minItems", 0))
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: _valid(properties[name], schemas) for name in schema.get("required", [])}
    return "x"


def _out_of_bounds(schema: dict[str, Any], schemas: dict[str, Any]) -> list[tuple[str, Any]]:
    """Values the schema's declared bounds refuse, each with what it breaks."""
    schema = _resolve(schema, schemas)
    bad: list[tuple[str, Any]] = []
    if "enum" in schema:
        bad.append(("not one of its values", "no-such-value"))
    if "maximum" in schema:
        bad.append((f"above its maximum {schema['maximum']}", schema["maximum"] + 1))
    if "minimum" in schema:
        bad.append((f"below its minimum {schema['minimum']}", schema["minimum"] - 1))
    if "exclusiveMinimum" in schema:
        bad.append(
            (f"at its exclusive minimum {schema['exclusiveMinimum']}", schema["exclusiveMinimum"])
        )
    if "maxLength" in schema:
        bad.append((f"over its maxLength {schema['maxLength']}", "x" * (schema["maxLength"] + 1)))
    if schema.get("minLength", 0) >= 1:
        bad.append(("under its minLength", ""))
    if "pattern" in schema and re.search(schema["pattern"], " bad value") is None:
        bad.append(("not matching its pattern", " bad value"))
    if "maxItems" in schema:
        item = _valid(schema.get("items", {}), schemas)
        bad.append((f"over its maxItems {schema['maxItems']}", [item] * (schema["maxItems"] + 1)))
    if schema.get("minItems", 0) >= 1:
        bad.append(("under its minItems", []))
    return bad


def _wrong_word(schema: dict[str, Any], schemas: dict[str, Any]) -> tuple[str, str] | None:
    """A word a query or path parameter of this type refuses, or None for a free string."""
    schema = _resolve(schema, schemas)
    if schema.get("type") == "array":
        return _wrong_word(schema.get("items", {}), schemas)
    if schema.get("format") == "date-time":
        return "not a date-time", "not-a-date"
    words = {"integer": "not-a-number", "number": "not-a-number", "boolean": "maybe"}
    kind = schema.get("type")
    return (f"not a {kind}", words[kind]) if kind in words else None


def bad_requests(route: Route, schemas: dict[str, Any]) -> list[BadRequest]:
    """The bad requests the route's inputs allow (see the module docstring)."""
    parameters = route.operation.get("parameters", [])
    path_values = {
        p["name"]: str(_valid(p["schema"], schemas)) for p in parameters if p["in"] == "path"
    }
    required = {
        p["name"]: str(_valid(p["schema"], schemas))
        for p in parameters
        if p["in"] == "query" and p.get("required")
    }

    def case(
        what: str,
        *,
        method: str = route.method,
        path: dict[str, str] | None = None,
        query: dict[str, str] | None = None,
        content: bytes | None = None,
        param: str | None = None,
    ) -> BadRequest:
        values = {**path_values, **(path or {})}
        url = re.sub(r"\{(\w+)(:\w+)?\}", lambda m: values[m.group(1)], route.path)
        return BadRequest(what, method, url, {**required, **(query or {})}, content, param)

    cases = [case("a method the path does not serve", method="PATCH")]
    for p in parameters:
        name, where = p["name"], f"{p['in']} parameter {p['name']!r}"
        bad = _out_of_bounds(p["schema"], schemas)
        wrong = _wrong_word(p["schema"], schemas)
        for what, value in [*bad, *([wrong] if wrong else [])]:
            given = {name: str(value)}
            if p["in"] == "path":
                cases.append(case(f"{where} {what}", path=given, param=name))
            else:
                cases.append(case(f"{where} {what}", query=given, param=name))
        if p["in"] == "path" and not wrong and (route.path, name) not in ANY_VALUE_IS_VALID:
            cases.append(case(f"{where} an over-long unknown id", path={name: OVER_LONG_ID}))
        if p["in"] == "query" and p.get("required"):
            left_out = case(f"{where} left out", param=name)
            del left_out.params[name]
            cases.append(left_out)
    if route.path.startswith(("/api/", "/admin/")):  # gateway.api.bodies.PoolRoute's routes
        cases.append(case("an unknown query parameter", query={"limt": "5"}, param="limt"))
    body = route.operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    schema = _resolve(body.get("schema", {}), schemas)
    if body or route.method == "POST":  # the OpenAI routes read their JSON body themselves
        cases.append(case("a body that is not JSON", content=b"{not json"))
        cases.append(case("a JSON array body", content=b"[1, 2]"))
        for what, content in HOSTILE_JSON.items():
            cases.append(case(what, content=content))
    if schema.get("required") or (route.method == "POST" and not body):
        cases.append(case("an empty object body", content=b"{}"))
    valid_body = _valid(schema, schemas) if schema.get("type") == "object" else {}
    for name, field_schema in schema.get("properties", {}).items():
        for what, value in _out_of_bounds(field_schema, schemas):
            content = json.dumps({**valid_body, name: value}).encode()
            cases.append(case(f"body field {name!r} {what}", content=content, param=name))
    return cases


ROUTES, SCHEMAS = app_routes(_template_app())


# -- the app under test --------------------------------------------------------------------


def _row_counts(pool: PoolSettings) -> tuple[int, int, int]:
    engine = make_engine(pool.resolved_database_url())
    try:
        with engine.connect() as conn:
            trajectories, steps, attempts = (
                conn.execute(select(func.count()).select_from(model)).scalar_one()
                for model in (Trajectory, Step, CallAttempt)
            )
            return trajectories, steps, attempts
    finally:
        engine.dispose()


@dataclass
class Walked:
    client: TestClient
    pool: PoolSettings
    upstream_calls: list[str]


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Walked]:
    """One gateway for the whole walk: a SQLite pool, an upstream that fails its health check."""
    root: Path = tmp_path_factory.mktemp("envelope")
    url = f"sqlite:///{root / 'pool.sqlite3'}"
    db.upgrade(url)
    pool = PoolSettings(data_dir=root / "data", database_url=url)
    calls: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        # Health checks and the gateway's own model list (tokenizer directories) are not calls.
        if request.url.path not in ("/health", "/v1/models"):
            calls.append(f"{request.method} {request.url.path}")
        return httpx.Response(503)

    app = create_app(
        GatewaySettings(upstream_url=UPSTREAM, health_check_interval_s=3600),
        pool,
        upstream_transport=httpx.MockTransport(upstream),
    )
    with TestClient(app, base_url=LOOPBACK, raise_server_exceptions=False) as client:
        yield Walked(client, pool, calls)


def _envelope_problems(body: Any, param: str | None = None) -> list[str]:
    """What keeps ``body`` from being the one envelope with a string code ([] when nothing);
    ``param``: the field the envelope must name."""
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or not isinstance(error, dict) or set(error) != ENVELOPE_KEYS:
        return [f"not the envelope: {body!r}"[:200]]
    problems = [
        f"{key} {error[key]!r} is not a non-empty string"
        for key in ("code", "type", "message")
        if not isinstance(error[key], str) or not error[key]
    ]
    if param is not None and (error["param"] or "").split(".")[0] != param:
        problems.append(f"param {error['param']!r}, expected {param!r}")
    return problems


def _anthropic_problems(body: Any, param: str | None = None) -> list[str]:
    """What keeps ``body`` from being Anthropic's envelope, the Messages routes' own
    (``{"type": "error", "error": {"type", "message"}}``, the field leading the message)."""
    error = body.get("error") if isinstance(body, dict) else None
    if (
        body.get("type") != "error"
        or not isinstance(error, dict)
        or set(error)
        != {
            "type",
            "message",
        }
    ):
        return [f"not Anthropic's envelope: {body!r}"[:200]]
    if not all(isinstance(error[key], str) and error[key] for key in ("type", "message")):
        return [f"type or message not a non-empty string: {error!r}"[:200]]
    if param is not None and not error["message"].startswith(param):
        return [f"message {error['message']!r:.120} does not lead with {param!r}"]
    return []


def _refusal_problems(status_code: int, text: str, param: str | None, path: str = "") -> list[str]:
    """What keeps an answer from being a 4xx in its route's envelope ([] when nothing): the one
    envelope, Anthropic's on the Messages API's routes (``path``, served as POST: another
    method never reaches the route, and gets the one envelope)."""
    status = [] if 400 <= status_code < 500 else [f"status {status_code}"]
    try:
        body = json.loads(text)
    except ValueError:
        return [*status, f"not JSON: {text[:80]!r}"]
    if "/v1/messages" in path:
        return [*status, *_anthropic_problems(body, param)]
    return [*status, *_envelope_problems(body, param)]


def test_the_walk_covers_every_documented_operation_and_the_hidden_routes() -> None:
    documented = {
        (method.upper(), path)
        for path, operations in _template_app().openapi()["paths"].items()
        for method in operations
    }
    walked = {(r.method, re.sub(r":\w+\}", "}", r.path)) for r in ROUTES if r.documented}
    assert walked == documented
    hidden = {r.name for r in ROUTES if not r.documented}
    # The docs pages and the inspector are left out of the schema on purpose; they are walked.
    assert {
        "GET /openapi.json",
        "GET /inspector/{view:path}",
    } <= hidden
    # The inspector's JSON endpoints are documented (and fuzzed, tests/test_fuzz_api.py).
    assert "POST /api/batches/preview" not in hidden


@pytest.mark.parametrize("route", ROUTES, ids=[r.name for r in ROUTES])
def test_every_route_refuses_bad_input_in_the_envelope_and_records_nothing(
    walked: Walked, route: Route
) -> None:
    cases = bad_requests(route, SCHEMAS)
    failures = []
    for case in cases:
        headers = {"content-type": "application/json"} if case.content is not None else {}
        response = walked.client.request(
            case.method, case.url, params=case.params, content=case.content, headers=headers
        )
        path = route.path if case.method == "POST" else ""
        problems = _refusal_problems(response.status_code, response.text, case.param, path)
        for problem in problems:
            failures.append(f"{case.what} ({case.method} {case.url} {case.params}): {problem}")
    assert failures == []
    assert _row_counts(walked.pool) == (0, 0, 0)
    assert walked.upstream_calls == []


def test_an_unknown_path_gets_404_not_found_in_the_envelope(walked: Walked) -> None:
    response = walked.client.get("/no/such/route")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "Not Found",
            "type": "not_found_error",
            "param": None,
            "code": "not_found",
        }
    }


@pytest.mark.parametrize(
    ("url", "unknown", "expected"),
    [
        ("/api/trajectories?limt=5&statuss=x", "'limt', 'statuss'", "limit"),
        # The inspector's list reads its filters as one model: its fields are the names.
        ("/api/inspector/trajectories?status=complete&cursor=x", "'cursor'", "offset"),
        ("/api/batches?limit=2&limt=2", "'limt'", "limit, status"),
    ],
)
def test_an_unknown_query_parameter_is_named_in_a_400_not_ignored(
    walked: Walked, url: str, unknown: str, expected: str
) -> None:
    """A misspelt filter would otherwise answer as if it were not there: every row, the default
    page size. The declared names come along, so the fix is in the message."""
    response = walked.client.get(url)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unknown_parameter" and error["param"] == unknown.split("'")[1]
    assert error["message"].startswith(
        f"unknown query parameter{'s' if ',' in unknown else ''} {unknown}; expected: "
    )
    assert expected in error["message"]
    declared = walked.client.get(url.split("?")[0], params={"limit": 2})
    assert declared.status_code == 200, declared.text


@pytest.mark.parametrize(
    ("url", "param", "values"),
    [
        ("/api/trajectories?limit=1&limit=3", "limit", "'1', '3'"),  # was 3 rows, the last
        ("/api/trajectories?channel=train&channel=nope", "channel", "'train', 'nope'"),
        ("/api/batches?status=ready&status=ready", "status", "'ready', 'ready'"),
    ],
)
def test_a_single_valued_query_parameter_sent_twice_is_a_400_not_the_last_one_read(
    walked: Walked, url: str, param: str, values: str
) -> None:
    response = walked.client.get(url)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("repeated_parameter", param)
    assert (
        error["message"]
        == f"query parameter {param!r} is sent 2 times ({values}); it takes one value"
    )


def test_a_list_query_parameter_may_repeat(walked: Walked) -> None:
    response = walked.client.get("/api/trajectories?status=complete&status=open&tag=a&tag=b")
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("where", "bad_id"), [("path", "abc%0A"), ("header", "abc\n"), ("path", "abc%0Adef")]
)
def test_an_id_with_a_newline_is_refused_whole_not_up_to_the_newline(
    walked: Walked, where: str, bad_id: str, stream: bool
) -> None:
    """A regex anchored with ``$`` matches before a final newline; ids are checked whole."""
    before = _row_counts(walked.pool)
    calls_before = len(walked.upstream_calls)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if where == "path":
        response = walked.client.post(f"/t/{bad_id}/v1/chat/completions", json=body)
    else:
        headers = {"X-Trajgate-Trajectory": bad_id}
        response = walked.client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "trajectory_id"
    assert response.json()["error"]["code"] == "invalid_request"
    assert _row_counts(walked.pool) == before
    assert len(walked.upstream_calls) == calls_before


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_header_naming_another_trajectory_than_the_url_is_refused_before_anything_runs(
    walked: Walked, path: str, body: dict[str, Any]
) -> None:
    """Either id would file the call's step under a trajectory the other says it is not in."""
    before = _row_counts(walked.pool)
    calls_before = len(walked.upstream_calls)
    response = walked.client.post(
        f"/t/url-id/{path}",
        json={"model": "tiny", **body},
        headers={"X-Trajgate-Trajectory": "header-id"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert error.get("code", "trajectory_id_conflict") == "trajectory_id_conflict"
    assert "'url-id'" in error["message"] and "'header-id'" in error["message"]
    assert _row_counts(walked.pool) == before
    assert len(walked.upstream_calls) == calls_before
    same = walked.client.post(
        "/t/url-id/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Trajgate-Trajectory": "url-id"},
    )
    assert same.status_code != 400, same.text  # the same id twice is one trajectory


def test_an_id_with_a_newline_is_refused_in_pool_api_bodies_too(walked: Walked) -> None:
    before = _row_counts(walked.pool)
    for body in (
        {"id": "abc\n"},
        {"id": "abc", "group_id": "g\n"},
        {"id": "abc", "channel": "c\n"},
    ):
        response = walked.client.post("/api/trajectories", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["code"] == "invalid_request"
    assert _row_counts(walked.pool) == before


# -- generation limits: refused before vLLM is asked, in every dialect ----------------------

_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
_HUGE = 10**30
# (path, body, the client's field, the gateway setting bounding it: defaults 128, 262144, 20)
OVER_THE_LIMIT = [
    ("/v1/chat/completions", {**_CHAT, "n": _HUGE}, "n"),
    ("/v1/chat/completions", {**_CHAT, "n": 129}, "n"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": _HUGE}, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "max_completion_tokens": 262_145}, "max_completion_tokens"),
    ("/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**_CHAT, "min_tokens": _HUGE}, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": _HUGE}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": _HUGE}, "max_tokens"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_completion_tokens": _HUGE},
        "max_completion_tokens",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 21}, "logprobs"),
    (
        "/v1/responses",
        {"model": "tiny", "input": "hi", "max_output_tokens": _HUGE},
        "max_output_tokens",
    ),
    ("/v1/responses", {"model": "tiny", "input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ("/v1/messages", {**_CHAT, "max_tokens": _HUGE}, "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), OVER_THE_LIMIT)
def test_a_generation_field_past_the_gateways_limit_is_refused_before_vllm_is_asked(
    walked: Walked, path: str, body: dict[str, Any], param: str
) -> None:
    before = _row_counts(walked.pool)
    calls_before = len(walked.upstream_calls)
    answer = walked.client.post(f"/t/limits{path}", json=body)
    assert answer.status_code == 400, answer.text
    assert _refusal_problems(answer.status_code, answer.text, param, path) == []
    assert "at most" in answer.text
    assert _row_counts(walked.pool) == before
    assert len(walked.upstream_calls) == calls_before


@pytest.mark.parametrize("model", ["ti\u0000ny", "m" * 201], ids=["NUL", "201 characters"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", _CHAT),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {**_CHAT, "max_tokens": 4}),
    ],
)
def test_a_model_name_the_pool_cannot_store_is_refused_before_vllm_is_asked(
    walked: Walked, path: str, body: dict[str, Any], model: str
) -> None:
    """The step's model column holds 200 characters and, on PostgreSQL, no NUL: vLLM took
    such a name and sampled, then the commit failed with a 503."""
    before = _row_counts(walked.pool)
    calls_before = len(walked.upstream_calls)
    answer = walked.client.post(f"/t/model{path}", json={**body, "model": model})
    assert answer.status_code == 400, answer.text
    assert _refusal_problems(answer.status_code, answer.text, "model", path) == []
    assert _row_counts(walked.pool) == before
    assert len(walked.upstream_calls) == calls_before


# -- streamed and unstreamed: the same code ------------------------------------------------


def _chunk(content: str, token_id: int) -> bytes:
    """One vLLM chat stream event (the fields the gateway reads)."""
    chunk = {
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "prompt_token_ids": [1, 2, 3] if token_id == 0 else None,
        "choices": [
            {
                "index": 0,
                "delta": {"content": content},
                "logprobs": {"content": [{"token": content, "logprob": -0.5, "top_logprobs": []}]},
                "finish_reason": None,
                "token_ids": [token_id],
            }
        ],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


class _FaultyStream(httpx.AsyncByteStream):
    """An upstream answer that sends one event, then stalls past the total limit or breaks."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield _chunk("a", 0)
        if self.fault == "broken":
            raise httpx.ReadError("connection reset by peer")
        await asyncio.sleep(0.6)  # the gateway's total limit is 0.3 s
        yield _chunk("b", 1)
        yield b"data: [DONE]\n\n"


def _faulty_upstream(fault: str) -> httpx.MockTransport:
    """Every chat completion, streamed or not, gets a 200 whose body then meets ``fault``."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404)
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_FaultyStream(fault))

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(
    ("fault", "status", "code", "outcomes"),
    [
        # A stall past the total limit: the step says upstream_timeout either way.
        ("timeout", 504, "upstream_timeout", ("upstream_timeout", "upstream_timeout")),
        # A connection reset: while reading a whole answer it is a transport failure (the
        # replica is unreachable); mid-stream it ends the stream.
        ("broken", 502, "upstream_error", ("upstream_unreachable", "upstream_error")),
    ],
)
def test_a_streamed_error_event_carries_the_same_string_code_as_the_unstreamed_answer(
    tmp_path: Path, fault: str, status: int, code: str, outcomes: tuple[str, str]
) -> None:
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    db.upgrade(url)
    pool = PoolSettings(data_dir=tmp_path / "data", database_url=url)
    settings = GatewaySettings(
        upstream_url=UPSTREAM,
        health_check_interval_s=3600,
        upstream_total_timeout_s=0.3,
        upstream_max_attempts=1,
    )
    app = create_app(settings, pool, upstream_transport=_faulty_upstream(fault))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with TestClient(app, base_url=LOOPBACK, raise_server_exceptions=False) as client:
        unstreamed = client.post("/t/unary/v1/chat/completions", json=body)
        streamed = client.post("/t/streamed/v1/chat/completions", json={**body, "stream": True})
    assert unstreamed.status_code == status
    unstreamed_error = unstreamed.json()
    # The status line went out with the first event: the stream is a 200 that ends in the error.
    assert streamed.status_code == 200
    events = [
        line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data: ")
    ]
    assert len(events) == 2 and json.loads(events[0])["choices"][0]["delta"] == {"content": "a"}
    streamed_error = json.loads(events[1])
    for error in (unstreamed_error, streamed_error):
        assert _envelope_problems(error) == []
        assert (error["error"]["type"], error["error"]["code"]) == (
            unstreamed_error["error"]["type"],
            code,
        )
    recorded = tuple(steps_of(pool, t)[0].outcome for t in ("unary", "streamed"))
    assert recorded == outcomes


# -- the tree and its renderings -----------------------------------------------------------


def _tree() -> list[type[TrajgateError]]:
    classes, todo = [], [TrajgateError]
    while todo:
        cls = todo.pop(0)
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


def test_the_drawn_tree_lists_every_error_class_with_its_status_type_and_code() -> None:
    import gateway.errors

    drawn = {}
    for line in (gateway.errors.__doc__ or "").splitlines():
        match = re.match(r"^[\s│├└─]*(\w+Error)\s+(\d{3})\s+(\w+)\s+(\w+)$", line)
        if match:
            drawn[match.group(1)] = (int(match.group(2)), match.group(3), match.group(4))
    actual = {c.__name__: (c.status_code, c.error_type, c.default_code) for c in _tree()}
    assert drawn == actual


@pytest.mark.parametrize("error_class", _tree(), ids=lambda c: c.__name__)
def test_every_error_class_renders_its_status_and_a_string_code_unstreamed_and_streamed(
    error_class: type[TrajgateError],
) -> None:
    error = error_class("expected x, got y", param="x")
    response = error_response(error)
    body = json.loads(bytes(response.body))
    assert response.status_code == error_class.status_code
    assert body == {
        "error": {
            "message": "expected x, got y",
            "type": error_class.error_type,
            "param": "x",
            "code": error_class.default_code,
        }
    }
    assert sse_error_event(error) == b"data: " + json.dumps(body).encode() + b"\n\n"
    assert openai_envelope(error) == body


def test_a_dialect_renders_the_same_error_in_its_own_shape() -> None:
    # Anthropic's Messages envelope, as the next dialect will render it.
    def anthropic(error: TrajgateError) -> dict[str, Any]:
        return {"type": "error", "error": {"type": error.error_type, "message": error.message}}

    error = UpstreamTimeoutError("upstream did not answer within 0.3 s")
    response = error_response(error, anthropic)
    assert response.status_code == 504
    assert json.loads(bytes(response.body)) == {
        "type": "error",
        "error": {"type": "upstream_timeout", "message": "upstream did not answer within 0.3 s"},
    }


# -- upstream errors: vLLM's own 4xx/5xx bodies -----------------------------------------------


def _refusing_upstream(status: int, vllm_error: dict[str, Any]) -> httpx.MockTransport:
    """A healthy upstream that answers every chat or completions call with ``status`` and vLLM's
    error body (whose ``code`` is the HTTP status as a number)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(status, json={"error": vllm_error})

    return httpx.MockTransport(handler)


_TOO_MANY_TOKENS = {
    "message": "max_tokens=99999 cannot be greater than max_model_len=2048.",
    "type": "BadRequestError",
    "param": "max_tokens",
    "code": 400,
}
_ENGINE_DIED = {"message": "engine died", "type": "InternalServerError", "param": None, "code": 500}


@pytest.mark.parametrize(
    ("path", "body", "status", "vllm_error", "expected"),
    [
        # Chat and completions: vLLM's message and param as it wrote them; the type and code
        # are ours (a 4xx from the engine: invalid_request_error / invalid_request; a 5xx:
        # upstream_error / upstream_error), never vLLM's class name (BadRequestError).
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999},
            400,
            _TOO_MANY_TOKENS,
            {**_TOO_MANY_TOKENS, "type": "invalid_request_error", "code": "invalid_request"},
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "max_tokens": 99999},
            400,
            _TOO_MANY_TOKENS,
            {**_TOO_MANY_TOKENS, "type": "invalid_request_error", "code": "invalid_request"},
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            500,
            _ENGINE_DIED,
            {**_ENGINE_DIED, "type": "upstream_error", "code": "upstream_error"},
        ),
        # An unknown model: vLLM's 404 NotFoundError is a refused request like any 4xx.
        (
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            404,
            {"message": "The model `nope` does not exist.", "type": "NotFoundError", "code": 404},
            {
                "message": "The model `nope` does not exist.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_request",
            },
        ),
        # Responses: the chat field max_tokens came from the client's max_output_tokens.
        (
            "/v1/responses",
            {"model": "tiny", "input": "hi", "max_output_tokens": 99999},
            400,
            _TOO_MANY_TOKENS,
            {
                **_TOO_MANY_TOKENS,
                "type": "invalid_request_error",
                "param": "max_output_tokens",
                "code": "invalid_request",
            },
        ),
        # ... and a chat field no Responses field became (the capture's own) is no param.
        (
            "/v1/responses",
            {"model": "tiny", "input": "hi"},
            400,
            {**_TOO_MANY_TOKENS, "param": "body.return_token_ids"},
            {
                **_TOO_MANY_TOKENS,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_request",
            },
        ),
    ],
)
def test_an_upstream_error_keeps_vllms_message_and_param_with_our_type_and_code(
    tmp_path: Path,
    path: str,
    body: dict[str, Any],
    status: int,
    vllm_error: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    db.upgrade(url)
    pool = PoolSettings(data_dir=tmp_path / "data", database_url=url)
    settings = GatewaySettings(
        upstream_url=UPSTREAM, health_check_interval_s=3600, upstream_max_attempts=1
    )
    app = create_app(settings, pool, upstream_transport=_refusing_upstream(status, vllm_error))
    with TestClient(app, base_url=LOOPBACK, raise_server_exceptions=False) as client:
        answer = client.post(f"/t/refused{path.replace('/', '-')}{path}", json=body)
    assert answer.status_code == status
    assert answer.json() == {"error": expected}
    assert _envelope_problems(answer.json()) == []


def test_an_upstream_error_on_the_messages_api_is_in_anthropics_envelope(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    db.upgrade(url)
    pool = PoolSettings(data_dir=tmp_path / "data", database_url=url)
    settings = GatewaySettings(
        upstream_url=UPSTREAM, health_check_interval_s=3600, upstream_max_attempts=1
    )
    app = create_app(settings, pool, upstream_transport=_refusing_upstream(500, _ENGINE_DIED))
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app, base_url=LOOPBACK, raise_server_exceptions=False) as client:
        answer = client.post("/t/refused-messages/v1/messages", json=body)
    assert answer.status_code == 500
    # Anthropic's type for a 500 is api_error; its envelope has no param or code field.
    assert answer.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "engine died"},
    }
