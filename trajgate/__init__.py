"""trajgate: token-exact capture of agent LLM calls and the data pool that turns them into RL
training batches. This package is the top: the command line and the local tooling. The system
itself lives in ``gateway``, ``datapool`` and ``trainer_bridge``.

- ``cli``: the ``trajgate`` command line (Typer ``app``: ``serve``, ``train``, ``demo``, ``db``,
  ``vllm``, ``model``, ``export``, ``rewards``, ``batches``, ``bench``, ...).
- ``config``: one configuration file for every component (``TRAJGATE_CONFIG``): its keys are
  checked against the explicit ``SETTINGS_CLASSES`` (``load_config_file``,
  ``ConfigFileSettings``, ``ConfigFileError``). A leaf: it imports no other trajgate package,
  and every layer may import it.
- ``demo``: ``trajgate demo``, the whole RL loop on a CPU (``run_demo``, ``DemoConfig``).
- ``demo_task``: the demo's task and its reward (``question``, ``numeric_answer``).
- ``tinymodel``: a tiny Qwen2 chat model generated locally, no download (``generate``,
  ``TinyModelSpec``, ``CHAT_TEMPLATE``).
- ``vllm_server``: vLLM (CPU build) in its own environment, installed and started by us
  (``install``, ``start``, ``VLLMServer``).
- ``bench/``: the benchmarks, the vLLM-shaped upstream emulator and the multi-gateway fleet.

Never: holds capture, storage or training logic (those are ``gateway``, ``datapool``,
``trainer_bridge``).

Imports: anything below it (layers: ``trajgate.cli`` → ``trajgate.demo`` / ``trajgate.bench`` →
``demo_task`` / ``tinymodel`` / ``vllm_server`` → ``gateway`` / ``trainer_bridge`` →
``datapool`` → ``trajgate.config``, checked by ``lint-imports`` against ``.importlinter``).
Only ``__version__`` is defined here; nothing is imported.
"""

__version__ = "0.1.0"
