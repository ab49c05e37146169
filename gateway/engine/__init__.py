"""The engine room: the only code that speaks vLLM.

Modules, one per exchange:

- ``paths``: every vLLM endpoint path, written nowhere else (``tests/test_engine_room.py``).
- ``errors``: what an exchange raises besides httpx's own (``UnreadableAnswerError``, an
  ``httpx.DecodingError``; ``ExchangeTimeoutError``, an ``httpx.TimeoutException``), and the
  overall deadline of one exchange (``deadline``).
- ``exact``: an exact continuation's render, generate, derender and forwarded chat call
  (``send_exact``, ``render_ahead``, ``continues_exactly``).
- ``admin``: pause, resume, reload, prefix-cache reset and weight label of full-weight updates,
  LoRA load, list and unload (``ReloadError``, ``AdapterRefusedError``).
- ``models``: the model list (``model_entries``, ``served_models``,
  ``base_models_everywhere``, ``models_answer``).
- ``probe``: the health check, the token-id probe and the exact-continuation probe
  (``healthy``, ``probe_token_ids``, ``probe_exact_endpoints``), found as values.
- ``tokenize``: ``/tokenize``, for the dialects' side routes (``tokenize``).
- ``wire``: JSON as the engine writes and reads it (``dumps``, ``loads``, ``loads_object``),
  what an unreadable answer raises (``UNREADABLE``), the shape check (``check_shape``), token
  ids (``token_ids``) and choice indices (``choice_index``).
- ``answers``: the shapes of vLLM's chat and completion answers and stream chunks.

Never: chooses a replica, holds a call, decides a policy version or reads a client's dialect;
the replicas (``gateway.upstream``) and the proxy (``gateway.proxy``) hand it what it needs,
typed here as protocols (``exact.ExactReplica``, ``exact.ExactPrefix``), and gets back what
it learnt as values (``exact.ExactAnswer``).

Imports: httpx and orjson; never ``gateway.upstream``, ``gateway.proxy``,
``gateway.dialects`` or ``gateway.state`` (``.importlinter``). This file imports nothing.
"""
