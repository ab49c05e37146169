"""Every vLLM endpoint path the gateway (and its benchmarks) call: the one place they are written.

A path is the part after a replica's base URL (``Replica.url``, without ``/v1``); a query, where
an exchange needs one, is added by that exchange (``gateway.engine.admin``). vLLM 0.32's
routes; which of them need a server flag is said by the exchange that uses them.
``tests/test_engine_room.py`` fails on any module outside ``gateway/engine/`` that writes one of
these strings itself (the upstream emulator, which serves them, and the vLLM launcher excepted).
"""

from __future__ import annotations

# Liveness: 200 once the engine serves.
HEALTH_PATH = "/health"
# The models served now (a LoRA adapter appears once loaded, with its ``parent``).
MODELS_PATH = "/v1/models"
# Sampling through the OpenAI-compatible APIs (the dialects' upstream paths).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# The prompt's ids of a chat body, counted (the Messages API's count_tokens).
TOKENIZE_PATH = "/tokenize"
# Exact continuation (``--enable-scale-out``): the template's ids and sampling parameters of a
# chat body, sampling from ids, and generate's answer back as a chat answer.
RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DERENDER_PATH = "/v1/chat/completions/derender"
# Full-weight updates (``VLLM_SERVER_DEV_MODE=1``): freeze and thaw the engine, reload the
# weights (``reload_weights`` through ``collective_rpc``), drop the prefix cache, label the
# weights (what generate reports per token as ``weight_versions``).
PAUSE_PATH = "/pause"
RESUME_PATH = "/resume"
COLLECTIVE_RPC_PATH = "/collective_rpc"
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
UPDATE_WEIGHT_VERSION_PATH = "/update_weight_version"
# LoRA adapters at runtime (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, ``--enable-lora``).
LOAD_LORA_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_ADAPTER_PATH = "/v1/unload_lora_adapter"

ENGINE_PATHS: tuple[str, ...] = (
    HEALTH_PATH,
    MODELS_PATH,
    CHAT_PATH,
    COMPLETIONS_PATH,
    TOKENIZE_PATH,
    RENDER_PATH,
    GENERATE_PATH,
    DERENDER_PATH,
    PAUSE_PATH,
    RESUME_PATH,
    COLLECTIVE_RPC_PATH,
    RESET_PREFIX_CACHE_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    LOAD_LORA_ADAPTER_PATH,
    UNLOAD_LORA_ADAPTER_PATH,
)
