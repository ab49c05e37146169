"""Batches: from ready trajectories to immutable training batches, handed out exactly once.

- ``spec``: ``BatchSpec``, what a batch is made of, validated before anything is read.
- ``build``: from a spec to an immutable batch, and batches read back (``build_rows``,
  ``materialise``, ``get_batch``, ``list_batches``, ``read_rows``, ``consumptions``,
  ``step_lineage``, ``NothingToBatchError``).
- ``stages``: the stages ``build_rows`` runs, one function each and testable alone
  (``select_candidates``, ``trainable_steps``, ``form_groups``, ``keep_groups``,
  ``fit_token_budget``, ``score``, ``place_rewards``, ``shuffle_rows``, ``credit_steps``,
  ``assemble_table``).
- ``advantages``: the advantage estimators on numpy and ``ESTIMATORS``, the one registry of
  batch algorithms (``ALGORITHMS``, ``estimate_advantages``, ...): adding a
  batch algorithm means one function and one registry entry here.
- ``step_advantages``: the step-level estimators (discounted step returns, GiGPO's anchor-state
  grouping) and ``STEP_ESTIMATORS``, their registry (``BatchSpec.step_advantage``).
- ``step_credit``: step rewards and the step-level estimator on a batch's rows (``credit_rows``,
  ``StepScores``); ``anchors``: the state key of each step and the sub-group report.
- ``rows``: training rows assembled from stored steps into Arrow columns (``load_tokens``,
  ``segments``, ``assemble``).
- ``leases``: batches to consumers exactly once each (``lease_next``, ``ack``, ``nack``,
  ``Lease``, ``LeaseNotCurrentError``).
- ``exports``: a materialised batch for other trainers (``export_batch``, ``EXPORT_FORMATS``).
- ``settings``: ``BatchSettings`` (where materialised batches go, the bounds of a lease).

Never: imports torch or trains (``trainer_bridge`` does, from the rows); never changes a batch
once materialised; never exports a step flagged for integrity.

Imports: ``datapool``'s shared modules, ``datapool.steps``, ``datapool.rewards`` and
``datapool.curation``, and
``trajgate.config``; never ``gateway`` or ``trainer_bridge``.
"""
