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

import httpx
import schemathesis
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
    """A healthy vLLM that refuses every call as vLLM does (its envelope, its numeric code)."""
    if request.url.path in ("/health", "/v1/models"):
        return httpx.Response(200, json={"object": "list", "data": []})
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
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
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
