"""The HTTP API of the pool, curation, batches and administration: each module one FastAPI
``router`` that ``gateway.app`` includes.

- ``pool``: ``/api`` trajectories (list, create, get, complete / abandon / fail), groups, steps,
  stale steps, rewards and the summary.
- ``batches``: ``/api`` labels, curation rules, readiness, batches, leases, rows (Arrow stream)
  and the batches a step went into.
- ``admin``: ``/admin`` policy versions and agents' API keys, behind the admin token.
- ``lora``: ``/admin/adapter-releases``, unloading a run's LoRA adapters from every replica,
  behind the admin token.
- ``dependencies``: the dependency aliases routes declare to get the pool (``StoreDep``,
  ``SessionsDep``, ``BatchSettingsDep``) and the admin token checked (``AdminDep``).

Each module also holds its request and response schemas (``...Create``, ``...Public``). Route
functions read like prose: they validate, call ``datapool`` functions and shape the answer.

Never: builds SQL or opens sessions itself (queries live in ``datapool``); never serves model
calls (``gateway.proxy.routes`` does).

Imports: ``datapool`` and ``gateway``'s shared modules (``state``, ``errors``, ``auth``,
``attribution``); never ``gateway.app``, ``trainer_bridge`` or the ``trajgate`` CLI.
"""
