"""The OpenAI Responses API dialect (``POST /v1/responses``), translated to chat upstream.

Modules: ``serving`` (``Responses``: the dialect behind ``gateway.dialects.base.Dialect``),
``request`` (a Responses body checked and translated into the chat body sent to vLLM; with
``gateway.dialects.translation_memory``, a call re-sending its ``input`` translates only the
items it added), ``render`` (a chat completion rendered as a ``response`` object), ``stream``
(chat chunks as Responses events, as they come), ``wire`` (the Responses API's input and
output items as ``TypedDict``s, read where a check just ran).
"""

from gateway.dialects.responses.serving import Responses

__all__ = ["Responses"]
