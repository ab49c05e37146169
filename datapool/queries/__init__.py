"""Queries: the read side of the pool, shaped for the pool API, the inspector and the CLI.

- ``trajectories``: filtered keyset pages of trajectories and one trajectory with its steps
  (``trajectory_page``, ``trajectory_with_steps``).
- ``listing``: the inspector's sorted, filtered, paged list and trajectory view (``ListQuery``,
  ``list_page``, ``trajectory_view``, ``describe``, ``list_marks``).
- ``conversation``: what each step of a trajectory added to its conversation, and one step's
  full conversation on demand (``conversation_deltas``, ``step_history``).
- ``edits``: a text as edits of another, how the view ships a replaced message that changed a
  little (``text_edits``, ``apply_edits``).
- ``lineages``: a trajectory as its lineages, each with its spawning step and merged rows
  (``lineage_view``).
- ``steps``: one step, and its tokens with their text, whole or a window at a time
  (``step_view``, ``step_tokens``).
- ``groups``: a group of rollouts with its counts (``group_with_counts``, ``group_rollouts``).
- ``labels``, ``rewards``: label and reward histories as stored (``label_history``,
  ``current_label``, ``reward_history``).
- ``summary``: whole-pool counts for dashboards (``pool_counts``).
- ``charts``: aggregates for the inspector's charts and the trainer's metrics (``charts``,
  ``add_training_metrics``, ``training_metrics``).
- ``export``: ``trajgate export trajectories`` to Parquet or JSONL (``export_trajectories``).
- ``token_text``: stored token IDs decoded for people to read (``decode``, ``decode_each``).

Never: writes steps, rewards, labels or batches (the trainer's metrics are the one append it
owns), and never feeds decoded text back into the data: decoding is for display only.

Imports: any other ``datapool`` package (it sits on top of them); never ``gateway`` or
``trainer_bridge``.
"""
