"""The data pool: every captured LLM call stored as a step of a trajectory, token-exact, and all
that turns steps into training data (rewards, curation, batches). All of trajgate's SQL lives here.

Packages, one concern each (each ``__init__`` names its modules):

- ``steps``: the write path of captured calls (``PoolWriter`` group commit → ``PoolStore``) and
  the read path of steps with their exact token payloads.
- ``lifecycle``: open → complete / abandoned / failed, idle timeout, crash flags, and the
  completion hooks (reward functions, then curation rules, once per completed trajectory).
- ``rewards``: append-only reward records and reward functions (built-in and plug-in).
- ``curation``: labels, curation rules and their marks, readiness, trajectory selection.
- ``batches``: batch specs, advantage estimators, training rows, leases, exports.
- ``queries``: the read side for the pool API, the inspector and ``trajgate export``.

Modules at this level, shared by all of them:

- ``models``: the SQL schema (SQLAlchemy 2.0 typed models: ``Trajectory``, ``Step``, ``Reward``,
  ``Batch``, ...); the tables themselves come only from the Alembic migrations (``migrations/``).
- ``db``: engines and sessions (``make_engine``, ``make_sessionmaker``, ``Sessions``) and
  migrations (``upgrade``, ``downgrade``).
- ``settings``: ``PoolSettings``, the pool's ``TRAJGATE_*`` settings.
- ``errors``: the exception tree (``PoolError`` and its subclasses); the gateway maps each class
  to one HTTP status.
- ``api_keys``, ``policy_versions``: the agents' API keys (``add_key``, ``revoke_key``,
  ``list_keys``, ``active_key``) and the policy versions (``register``, ``activate``,
  ``list_versions``).

Never: serves HTTP, imports torch, or re-encodes text into token IDs (the IDs are the engine's).

Imports: nothing of ``gateway``, ``trainer_bridge`` or the CLI; of ``trajgate`` only the
``trajgate.config`` leaf (layers: ``trajgate`` CLI → ``gateway`` / ``trainer_bridge`` →
``datapool`` → ``trajgate.config``, checked by ``lint-imports`` against ``.importlinter``).
This file imports nothing, so importing one subpackage never pays for the others.
"""
