"""Rewards: numbers attached to steps and trajectories, and the functions that compute them.

- ``values``: append-only reward records and their current values (``add_rewards``,
  ``current_rewards``, ``current_rewards_query``, ``check_reward``, ``read_reward_file``), and
  running the configured reward functions on a completed trajectory (``RewardContext``,
  ``resolve_reward_function``, ``run_reward_functions``; plug-ins by the entry-point group
  ``ENTRY_POINT_GROUP``).
- ``group_stats``: mean, std, scored size and degeneracy of rewards within groups
  (``group_stats``, ``GroupStats``), shared by curation and the advantage estimators.
- ``step_rewards``: step reward functions, run once per ok step of a completed trajectory
  (``StepRewardContext``, ``run_step_reward_functions``; entry-point group
  ``STEP_ENTRY_POINT_GROUP``).
- ``functions``: the built-in reward functions ``exact_match``, ``tool_call_format`` and
  ``http_reward_model``, and step reward functions ``step_tool_call_format`` and
  ``http_step_reward_model``.

Three outcomes, never confused: a number is a reward; None (no record) is *unrewarded*, never
0.0; a function that raised is recorded as a failed reward. Never: overwrites or deletes a record
(the current value is the latest one); never decides when a trajectory is complete.

Imports: ``datapool``'s shared modules and ``datapool.steps`` (to read a trajectory's steps);
never ``gateway`` or ``trainer_bridge``.
"""
