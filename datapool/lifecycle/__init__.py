"""Lifecycle: how trajectories and groups open and close, and what runs once one completes.

- ``transitions``: open → complete / abandoned / failed, explicitly or by idle timeout
  (``create_trajectory``, ``close_trajectory``, ``close_idle``, which the gateway hands to the
  pool writer's upkeep), groups (``set_group``, ``update_group``), the ``EMPTY`` flag of a
  trajectory closed without a step, and stale steps (``stale_steps``).
- ``hooks``: ``CompletionHooks``, which runs each completed trajectory's reward functions, then
  its curation rules, at least once across crashes (``due_trajectories``, ``claim``, ``settle``;
  counters in ``HookStats``).

Never: deletes a step (a closed trajectory keeps everything; a late call is refused); never
decides whether a trajectory is complete from outside its closing transaction; never computes a
reward or a curation verdict itself (``datapool.rewards``, ``datapool.curation`` do).

Imports: ``datapool``'s shared modules, ``datapool.steps``, ``datapool.rewards`` and
``datapool.curation``; never ``gateway`` or ``trainer_bridge``.
"""
