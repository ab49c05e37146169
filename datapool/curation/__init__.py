"""Curation: what may enter a training batch, and every reason why not.

- ``labels``: append-only human judgements on steps, trajectories and groups, and their current
  view (``add_labels``, ``current_labels``, ``labels_of_trajectories``).
- ``bulk_labels``: one label appended to everything a filter selects (``bulk_label``).
- ``rules``: curation rules declared in the pool and the marks they leave (``create_rule``,
  ``list_rules``, ``delete_rule``, ``apply_rules``, ``apply_on_completion``; group verdicts with
  ``judge_group``).
- ``readiness``: whether a trajectory or a group may enter a batch, with all reasons
  (``trajectory_readiness``, ``group_readiness``, ``assess``; ``Verdict``).
- ``selection``: which trajectories a filter names, shared by bulk labels, rule scopes and batch
  specs (``TrajectoryFilter``, ``trajectory_conditions``, ``select_trajectory_ids``).

Never: deletes or edits steps (an exclusion is a mark or a label, undone by another); never builds
batches (``datapool.batches`` reads the verdicts).

Imports: ``datapool``'s shared modules, ``datapool.steps`` and ``datapool.rewards``; never
``datapool.lifecycle`` or ``datapool.batches`` (both sit above it), ``gateway`` or
``trainer_bridge``.
"""
