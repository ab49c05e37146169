"""Batches: from ready trajectories to immutable training batches, handed out exactly once.

- ``build``: batch specs and materialisation (``BatchSpec``, ``build_rows``, ``materialise``,
  ``get_batch``, ``list_batches``, ``read_rows``, ``consumptions``, ``step_lineage``).
- ``advantages``: the advantage estimators on numpy (``ALGORITHMS``, ``estimate_advantages``,
  ``group_stats``, ``grpo_advantages``, ``rloo_advantages``, ``discounted_returns``, ...): adding
  a batch algorithm means one function here.
- ``rows``: training rows assembled from stored steps into Arrow columns (``load_tokens``,
  ``segments``, ``assemble``).
- ``leases``: batches to consumers exactly once each (``lease_next``, ``ack``, ``nack``,
  ``Lease``, ``LeaseLostError``).
- ``exports``: a materialised batch for other trainers (``export_batch``, ``EXPORT_FORMATS``).
- ``settings``: ``BatchSettings`` (where materialised batches go, the bounds of a lease).

Never: imports torch or trains (``trainer_bridge`` does, from the rows); never changes a batch
once materialised; never exports a step flagged for integrity.

Imports: ``datapool``'s shared modules, ``datapool.steps`` and ``datapool.curation``, and
``trajgate.config``; never ``gateway`` or ``trainer_bridge``.
"""
