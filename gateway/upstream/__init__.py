"""The engine side of the gateway: the vLLM replicas, how bytes reach them, and their weights.

Modules:

- ``replicas``: the vLLM replicas: choosing one per call, health checks, the token-ID probe
  (``UpstreamPool``, ``Replica``, ``InFlight``, ``probe_token_ids``).
- ``transport``: the own HTTP/1.1 transport for plain-``http://`` replicas, under httpx's client
  API (``UpstreamTransport``).
- ``answer_limit``: the most bytes one answer may have, for every transport, and no encoded
  answers (``AnswerLimit``, ``AnswerTooLargeError``, ``EncodedAnswerError``).
- ``policy``: ``PolicyRegistry``, which policy version the alias serves and which one produced a
  step.
- ``weight_update``: the pause around a full-weight reload (``WeightGate``: hold new calls, drain
  or abort the calls in flight, release them on the new version; ``reload_replicas``).
- ``adapters``: LoRA updates, a new adapter per policy version loaded into every replica and the
  old ones unloaded, never paused (``load_adapter``, ``stale_adapters``, ``unload_adapters``).

Never: reads a request or an answer (that is ``gateway.dialects``), knows trajectories or steps
(``gateway.proxy``), or writes SQL.

Imports: ``gateway.errors`` and ``datapool``; never ``gateway.proxy``, ``gateway.dialects`` or
``gateway.state``. This file imports nothing.
"""
