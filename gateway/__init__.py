"""The gateway: an OpenAI-compatible proxy in front of vLLM that records every call an agent
makes as steps of a trajectory, plus the pool's HTTP API, the admin API and the web inspector.

Modules:

- ``app``: ``create_app`` wires settings, state, routers and background tasks into one FastAPI
  app; ``/health``, ``/ready``, ``/metrics``.
- ``state``: ``GatewayState`` (what every handler of one app shares) and ``gateway_state``, the
  dependency that hands it over.
- ``settings``: ``GatewaySettings`` (``TRAJGATE_*`` variables and CLI flags).
- ``proxy``: the model-serving routes of the dialects an app serves (``dialect_router``, side
  routes included), forwarding a call upstream with retries (``forward_call``), the one owner
  of a call's lifetime (``lifetime.CallLifetime``), and ``/v1/models``.
- ``call``: one logical call (``Call``): its attempts, its commit to the pool (``commit``,
  ``fail_call``) and the ``x-trajgate-*`` headers.
- ``dialects/``: one folder per API dialect behind ``gateway.dialects.base.Dialect`` (what to add
  upstream, where the IDs and logprobs are, what to strip for the client, its side routes);
  ``DIALECTS``, the built-in ones (``create_app(dialects=...)`` serves others).
- ``capture``: the dialect-independent checks of a captured call (``integrity_flags``,
  ``quality_flags``, ``check_against_usage``), exact JSON (``loads``, ``dumps``) and the re-send
  hash (``request_hash``).
- ``streaming``: reading an upstream SSE stream in bytes (``SSEPayloads``, ``sse_reads``) and
  relaying it to the client, one write per upstream read, while the dialect captures it
  (``first_event``, ``relay_stream``, ``record_stream``).
- ``attribution``: which trajectory, group and channel a call belongs to (``attribute``), checked
  before any upstream call.
- ``engine/``: the engine room, the only code that speaks vLLM: every endpoint path
  (``paths``), the exact continuation's exchanges (``exact``), the weight and adapter
  exchanges (``admin``), the model list (``models``), the probes (``probe``), ``/tokenize``
  (``tokenize``), each with an overall deadline and one error for an unreadable answer
  (``errors``).
- ``upstreams``: the vLLM replicas: choosing one per call, health checks and what the probes
  found (``UpstreamPool``, ``Replica``, ``InFlight``).
- ``policy``: ``PolicyRegistry``, which policy version the alias serves and which one produced a
  step.
- ``weight_update``: the pause around a full-weight reload (``WeightGate``: hold new calls, drain
  or abort the calls in flight, release them on the new version).
- ``auth``: agents' API keys (``KeyRing``, looked up off the event loop) and the admin token
  (``check_admin_token``).
- ``guard``: ``EdgeGuard``, the raw ASGI middleware every request passes before a route reads its
  body: host names, cross-site writes, JSON content types, the admin token, the body limit.
- ``errors``: the exception tree and the one OpenAI-style error envelope, streamed or not
  (``TrajgateError`` and subclasses, ``install_error_handlers``, ``sse_error_event``).
- ``metrics``: ``GatewayMetrics``, Prometheus metrics on the app's own registry.
- ``server``: ``BackgroundServer``, the app in a thread of this process (demo and tests).
- ``api/``: the ``/api`` routes for the pool, curation and batches, and ``/admin``.
- ``inspector/``: the web inspector's page, static files and JSON endpoints.

Never: tokenizes or decodes to build the data (token IDs and logprobs are exactly vLLM's, and a
call whose IDs are missing is flagged, never repaired); never writes SQL (storage is
``datapool``'s); never imports ``trainer_bridge``.

Imports: ``datapool`` and the ``trajgate.config`` leaf; never the ``trajgate`` CLI, demo or
benchmarks (layers: ``trajgate`` CLI → ``gateway`` / ``trainer_bridge`` → ``datapool``, checked
by ``lint-imports`` against ``.importlinter``). This file imports nothing.
"""
