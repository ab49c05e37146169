"""Benchmarks and their stand-ins, outside the library packages: what the ``trajgate bench``
commands run. Figures and how to read them: docs/benchmarks.md.

- ``gateway``: ``trajgate bench gateway``, the latency and throughput the gateway costs a call
  (``BenchSettings``, ``run_benchmark``, ``goals_met``).
- ``pool``: ``trajgate bench pool``, the writer's commit rate, storage per token and exact
  reconstruction (``run_pool_benchmark``, ``bench_pool``).
- ``export``: ``trajgate bench export``, stored steps to trainer-ready rows (``bench_export``).
- ``inspector``: ``trajgate bench inspector``, the inspector's JSON endpoints on a large pool
  (``run_inspector_benchmark``).
- ``emulator``: a fast upstream that answers in vLLM's exact shapes (``EmulatorSettings``,
  ``EmulatorThread``; ``python -m trajgate.bench.emulator``), also used by the tests.
- ``fleet``: several gateway processes on one pool behind a balancer, and an audit of what the
  pool holds afterwards (``start_gateway``, ``Balancer``, ``drive``, ``audit``).

Never: asserts goals (reports say how a run went; tests decide), and never used by ``gateway``,
``datapool`` or ``trainer_bridge``. Test helpers live in ``tests/``, not here.

Imports: ``gateway``, ``datapool`` and ``trajgate``'s lower layers; never ``trajgate.cli`` or
``trajgate.demo``.
"""
