"""Fuzzing the whole OpenAPI document with schemathesis finds no server error, on both backends.

Every operation of the app's ``/openapi.json`` (the OpenAI surface, the pool API, ``/admin`` and
the inspector's JSON endpoints) gets ``EXAMPLES`` requests that schemathesis derives from its
schema, positive and negative (values out of the declared bounds, wrong types, missing fields),
from a fixed seed, so a run is repeatable. Every answer must be below 500: a value the pool
cannot store (an integer past PostgreSQL's ``INTEGER``, a NUL in text) must be refused at the
edge with a 400, not met by the database.

The pool is seeded with a trajectory, a group, a reward, a label and a policy version so that
reads and writes meet real rows as well as unknown ids. The upstream is an
``httpx.MockTransport`` (an edge we do not own): healthy, and answering every call with vLLM's
400 envelope, so the OpenAI routes are fuzzed up to the engine and nothing is sampled.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis

# schemathesis imports its OpenAPI modules on the first schema it loads; pytest rewrites them
# as they load (schemathesis is a pytest plugin). Loaded that late, deep in a test's stack,
# CPython 3.11's AST validator once failed ("AST constructor recursion depth mismatch", a
# SystemError, in a CI run): import them here, at collection time, on a shallow stack.
import schemathesis.specs.openapi.schemas
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis.checks import not_a_server_error

from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.settings import GatewaySettings

UPSTREAM = "http://upstream.test"
# Requests per operation and the seed: about 60 operations x 2 backends in well under 90 s.
EXAMPLES = 10
SEED = 17


def _upstream(request: httpx.Request) -> httpx.Response:
    """A healthy vLLM serving ``tiny`` that refuses every call as vLLM does (its envelope, its
    numeric code), and reloads weights when asked (``POST /admin/weight-updates``): a replica
    refusing a reload is rightly a 502, not what the fuzz looks for."""
    if request.url.path == "/health":
        return httpx.Response(200, json={})
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
    # a full-weight update's calls: reload and cache reset, and in mode 'keep' (the default)
    # the pause, the version and the resume around them
    reload_paths = ("/collective_rpc", "/reset_prefix_cache", "/pause", "/resume")
    if request.url.path in (*reload_paths, "/update_weight_version"):
        return httpx.Response(200, json={})
    error = {"message": "refused by the test upstream", "type": "BadRequestError", "code": 400}
    return httpx.Response(400, json={"error": error})


def _seed_pool(client: TestClient) -> None:
    """A trajectory in a group with a reward and a label, and a registered policy version."""
    for method, path, body in [
        ("POST", "/api/trajectories", {"id": "t1", "group_id": "g1"}),
        (
            "POST",
            "/api/rewards",
            {"rewards": [{"target": "trajectory", "target_id": "t1", "name": "final", "value": 1}]},
        ),
        ("POST", "/api/labels", {"target": "trajectory", "target_id": "t1", "note": "seen"}),
        ("POST", "/admin/policy-versions", {"version": 1, "model_name": "tiny"}),
    ]:
        answer = client.request(method, path, json=body)
        assert answer.status_code < 300, (path, answer.text)


def test_fuzzing_every_operation_finds_no_server_error(pool_settings: PoolSettings) -> None:
    app = create_app(
        GatewaySettings(upstream_url=UPSTREAM, health_check_interval_s=3600),
        pool_settings,
        upstream_transport=httpx.MockTransport(_upstream),
    )
    schema = schemathesis.openapi.from_dict(app.openapi())  # the document /openapi.json serves
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 50  # the inspector's endpoints are in the document too
    server_errors: list[str] = []
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        _seed_pool(client)
        for operation in operations:

            @seed(SEED)
            @settings(
                max_examples=EXAMPLES,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],  # report, do not shrink
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def call(case: schemathesis.Case) -> None:
                kwargs = case.as_transport_kwargs(base_url="http://127.0.0.1")
                kwargs.pop("cookies", None)  # the API reads none; per-request cookies warn
                response = client.request(**kwargs)
                if response.status_code >= 500:
                    server_errors.append(
                        f"{case.method} {case.formatted_path} {case.query or ''} "
                        f"{str(case.body)[:120]} -> {response.status_code} {response.text[:200]}"
                    )
                else:  # schemathesis's own verdict agrees
                    case.validate_response(response, checks=[not_a_server_error])

            call()
    assert server_errors == []


# Each value one past what PostgreSQL stores (INTEGER: 2^31 - 1; no NUL in text), where the
# issue met a 500: a 400 naming the field, on both backends, and nothing written.
PAST_THE_BOUND = 2**31
PAST_WHAT_IS_STORED = [
    ("POST", "/admin/policy-versions", {"version": PAST_THE_BOUND, "model_name": "m"}, "version"),
    ("POST", f"/admin/policy-versions/{PAST_THE_BOUND}/activate", None, "version"),
    ("DELETE", f"/api/curation/rules/{PAST_THE_BOUND}", None, "rule_id"),
    ("PUT", "/api/groups/g1", {"expected_size": PAST_THE_BOUND}, "expected_size"),
    ("GET", f"/api/inspector/trajectories?offset={PAST_THE_BOUND}", None, "offset"),
    ("GET", f"/api/charts?bucket_s={PAST_THE_BOUND}", None, "bucket_s"),
    ("GET", f"/api/steps/stale?current_version={PAST_THE_BOUND}", None, "current_version"),
    ("GET", f"/api/training-metrics?after_id={2**63}", None, "after_id"),
    ("POST", "/api/training-metrics", {"rows": [{"step": PAST_THE_BOUND, "metrics": {}}]}, "rows"),
    ("POST", "/api/labels", {"target": "trajectory", "target_id": "t1", "note": "a\u0000b"}, None),
    ("GET", "/api/trajectories?channel=a%00b", None, "channel"),
    # String(200) and String(100) columns: PostgreSQL refuses longer text, SQLite keeps it.
    ("POST", "/admin/policy-versions", {"version": 2, "model_name": "m" * 201}, "model_name"),
    ("POST", "/admin/api-keys", {"name": "k", "trajectory_id": "t" * 201}, "trajectory_id"),
    ("POST", "/admin/api-keys", {"name": "k", "channel": "c" * 101}, "channel"),
    (
        "POST",
        "/api/labels",
        {"target": "trajectory", "target_id": "t1", "note": "n", "author": "a" * 201},
        "author",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    PAST_WHAT_IS_STORED,
    ids=[f"{m} {p.split('?')[0]} {f}" for m, p, _, f in PAST_WHAT_IS_STORED],
)
def test_a_value_the_pool_cannot_store_is_refused_at_the_edge(
    pool_settings: PoolSettings, method: str, path: str, body: Any, param: str | None
) -> None:
    app = create_app(
        GatewaySettings(upstream_url=UPSTREAM, health_check_interval_s=3600),
        pool_settings,
        upstream_transport=httpx.MockTransport(_upstream),
    )
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        _seed_pool(client)
        before = client.get("/api/summary").json()
        answer = client.request(method, path, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "invalid_request"
        if param is not None:
            assert error["param"].split(".")[0] == param
        # The bound is named: "less than or equal to 2147483647", "at most 200 characters", the
        # id pattern (1-200 characters), or NUL.
        bounds = (str(2**31 - 1), "200 characters", "{0,199}", "{0,99}", "NUL")
        assert any(bound in error["message"] for bound in bounds), error["message"]
        assert client.get("/api/summary").json() == before
