"""The Anthropic Messages API dialect (``POST /v1/messages``), translated to chat upstream.

Modules: ``serving`` (``Messages``: the dialect behind ``gateway.dialects.base.Dialect``),
``request`` (a Messages body checked and translated into the chat body sent to vLLM, tool-use id
mapping; with ``gateway.dialects.translation_memory``, a call re-sending its history translates
only the messages it added), ``render`` (a chat completion rendered as a Messages ``message``),
``stream`` (chat chunks as Messages events, as they come), ``wire`` (the Messages API's request
blocks, message and stream events as ``TypedDict``s, read where a check just ran).
"""

from gateway.dialects.messages.serving import Messages

__all__ = ["Messages"]
