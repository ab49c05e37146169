"""The completions dialect (``POST /v1/completions``), passed through to vLLM's own.

Modules: ``serving`` (``Completions``: one prompt per call, text or token ids; the shared
``choices`` reading is ``gateway.dialects.choices``).
"""

from gateway.dialects.completions.serving import Completions

__all__ = ["Completions"]
