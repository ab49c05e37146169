"""Steps: captured calls written into the pool and read back, with the exact IDs vLLM reported.

The write path, top-down: the gateway hands a ``CallRecord`` to ``PoolWriter``, whose writer
thread commits calls in groups through ``PoolStore.record_calls``; each call's steps are placed
in their trajectory's token lineage, their request and token payloads are stored as deltas on
the parent step, and the rows are written in one transaction.

- ``records``: what the gateway hands over for one call (``CallRecord``, ``ChoiceRecord``,
  ``AttemptRecord``, ``PendingCall``); plain data, no SQL.
- ``writer``: ``PoolWriter``, durable group commit off the request's hot path (``record``,
  ``check_accepting``, ``check_open``, ``upkeep``).
- ``closed``: the trajectories this process knows are closed (``KnownClosed``), so a late call
  is refused before it is sampled.
- ``store``: ``PoolStore``, writes calls (``record_call``, ``record_calls``) and reads steps back
  whole (``get_step``, ``steps_of``, ``get_trajectory``; ``StoredStep``).
- ``transaction``: the SQL of one write transaction (``WriteBatch``, ``lock_trajectories``,
  ``Statements`` compiled once per engine).
- ``lineage``: each open trajectory's token sequences and where a new call's steps go
  (``TrajectoryTokens``, ``LineageCache``, ``Placement``).
- ``prefix``: the pure comparison of token sequences: does a prompt extend a parent, where it
  diverges and why (``choose_parent``, ``first_divergence``, ``classify_divergence``).
- ``messages``: requests as stored: messages as a delta on the parent step, the upstream body as
  a merge patch (``request_delta``, ``full_request``, ``expand_requests``).
- ``bodies``: every other field of a step's bodies as a delta on the parent's or a shared
  ``json_blobs`` row (``encode_body``, ``decode_body``, ``BodyKeys``).
- ``payloads``: token payloads: SQL blobs, then Parquet files, prompts as a delta on the parent
  (``encode_payload``, ``reconstruct``, ``prompts_of``, ``PayloadFiles`` for compaction).
- ``chain``: the one walk back along a step's parent deltas (``walk``, ``resolve``).
- ``calls``: logical calls: upstream attempts, ``Idempotency-Key`` replays and re-sends
  (``record_attempts``, ``find_replay``, ``find_resend``).
- ``crashes``: what a crashed writer leaves: its open trajectories flagged ``incomplete``
  (``mark_interrupted``, ``release_writer``).
- ``faults``: which storage fault the pool hit (``fault_reason``, ``FAULT_REASONS``).

Never: tokenizes, decodes or repairs token IDs (missing IDs stay missing, a prefix break is
recorded, not fixed); never decides rewards, curation or batches.

Imports: ``datapool``'s shared modules (``models``, ``db``, ``settings``, ``errors``) only: it is
the bottom of the pool (the idle timeout reaches the writer as a function, ``IdleCloser``); never
``gateway`` or ``trainer_bridge``.
"""
