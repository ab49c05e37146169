"""The chat completions dialect (``POST /v1/chat/completions``), passed through to vLLM's own.

Modules: ``serving`` (``ChatCompletions``: what is added upstream and hidden from the client; the
shared ``choices`` reading is ``gateway.dialects.choices``).
"""

from gateway.dialects.chat_completions.serving import ChatCompletions

__all__ = ["ChatCompletions"]
