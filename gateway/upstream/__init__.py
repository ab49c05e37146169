"""The engine side of the gateway: the vLLM replicas, how bytes reach them, and their weights.

Modules:

- ``replicas``: the vLLM replicas: choosing one per call, health checks, what the probes found
  (``UpstreamPool``, ``Replica``, ``InFlight``, ``probe_exact``).
- ``transport``: the own HTTP/1.1 transport for plain-``http://`` replicas, under httpx's client
  API (``UpstreamTransport``).
- ``answer_limit``: the most bytes one answer may have, for every transport, and no encoded
  answers (``AnswerLimit``, ``AnswerTooLargeError``, ``EncodedAnswerError``).
- ``policy``: ``PolicyRegistry``, which policy version the alias serves and which one produced a
  step.
- ``weight_update``: the pause around a full-weight reload (``WeightGate``: hold new calls, drain
  or abort the calls in flight, release them on the new version; ``reload_label``).
- ``adapters``: LoRA updates, a new adapter name per policy version and which old ones to
  unload, never paused (``adapter_name``, ``stale_adapters``).

Every exchange with a replica is the engine room's (``gateway.engine``): this package decides
when to ask and what an answer means for routing, and keeps what was learnt.

Never: reads a request or an answer (that is ``gateway.dialects``), knows trajectories or steps
(``gateway.proxy``), or writes SQL.

Imports: ``gateway.engine``, ``gateway.errors`` and ``datapool``; never ``gateway.proxy``,
``gateway.dialects`` or ``gateway.state``. This file imports nothing.
"""
