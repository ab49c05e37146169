"""The OpenAI Responses API dialect (``POST /v1/responses``), translated to chat upstream.

Modules: ``serving`` (``Responses``: the dialect behind ``gateway.dialects.base.Dialect``),
``request`` (a Responses body checked and translated into the chat body sent to vLLM),
``render`` (a chat completion rendered as a ``response`` object), ``stream`` (chat chunks as
Responses events, as they come).
"""

from gateway.dialects.responses.serving import Responses

__all__ = ["Responses"]
