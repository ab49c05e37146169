"""trajgate: token-exact capture of agent LLM calls and the data pool that turns them into RL
training batches. This package holds the command line and the local tooling (tiny model, vLLM on
CPU, demo); the system itself lives in ``gateway``, ``datapool`` and ``trainer_bridge``."""

__version__ = "0.1.0"
