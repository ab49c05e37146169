"""The proxy core: one model call's path from a client's request to its committed steps.

Modules:

- ``routes``: the model-serving routes of the dialects an app serves (``dialect_router``, with
  each dialect's side routes) and ``/v1/models``, and one call's walk through the modules below
  (``proxy_call``, ``forward_call``); it names no dialect.
- ``preparation``: what a call is before it goes upstream (``new_call``): its channel, policy
  version, sampling, re-send, the earlier call it continues, its exact-continuation plan, and
  the pool reads for them (``pool_lookup``).
- ``attempts``: the upstream attempt loop (``open_upstream``): a replica, the time limits,
  retries only before any byte reached the client, what a failed attempt is recorded as.
- ``answer``: the client's answer (``answer_call``): a replayed one, an upstream refusal, a
  stream handed to ``streaming``, or a unary answer committed before it is sent.
- ``lifetime``: the one owner of what a call holds (``CallLifetime``: its trajectory's in-flight
  count and journal entry, its weight-gate ticket, its open upstream response, the render sent
  ahead of an exact continuation), ended once however the call ends, by its streamed answer
  (``CallStream``) when it outlives the route.
- ``call``: one logical call (``Call``): its attempts (``Attempts``, where each outcome an
  attempt ends in is written), its commit to the pool (``commit``, ``fail_call``) and the
  ``x-trajgate-*`` headers.
- ``streaming``: reading an upstream SSE stream in bytes and relaying it to the client, one write
  per upstream read, while the dialect captures it (``first_event``, ``relay_stream``,
  ``record_stream``).
- ``attribution``: which trajectory, group and channel a call belongs to (``attribute``), checked
  before any upstream call, with the conversation (lineage) its headers name.
- ``lineages``: the lineage a coding agent's headers (Claude Code, Codex, OpenCode) or trajgate's
  ``X-Trajgate-Lineage*`` headers name (``lineage_of``); a malformed own header is a 400.
- ``continuation/``: exact continuation: whether a call's history extends an earlier turn
  (``history``), the engine prompt built from that turn's own ids plus the template's rendering
  of only the new messages (``prompt``), and the call's plan (``plan.Continuation``), which it
  hands to the engine room's exact exchange (``gateway.engine.exact``) and which keeps what
  the engine reported.

Never: reads a client's dialect (``gateway.dialects`` does), talks to a replica's sockets
(``gateway.upstream`` does), writes a vLLM endpoint path (``gateway.engine`` does) or writes SQL
(``datapool`` does).

Imports: ``gateway.dialects``, ``gateway.engine``, ``gateway.upstream``, ``gateway.state`` and
the leaves below them; never ``gateway.app``, ``gateway.api`` or ``gateway.inspector``. This
file imports nothing.
"""
