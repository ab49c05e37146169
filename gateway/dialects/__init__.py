"""The API dialects the gateway serves: one folder each, behind ``gateway.dialects.base``.

A dialect is one folder: a ``Dialect`` subclass (its routes, its one translation, its canonical
record, its answers and streams, its side routes such as the Messages API's token count). An
app serves ``DIALECTS`` unless built with others (``gateway.app.create_app(dialects=...)``);
the proxy generates the routes and runs the calls, and the pool reads only the canonical
record each call wrote. Offers: ``DIALECTS``, ``Dialect``, ``DialectStream``, ``Prepared``,
``Captured``, ``ClientAsked``, ``EarlierCall``, ``SideRoute``, ``Engine``, ``EngineRefused``,
``with_sampling_defaults``, ``check_limits``.
"""

from __future__ import annotations

from gateway.dialects.base import (
    Captured,
    ClientAsked,
    Dialect,
    DialectStream,
    EarlierCall,
    Engine,
    EngineRefused,
    Prepared,
    SideRoute,
    check_limits,
    with_sampling_defaults,
)
from gateway.dialects.chat_completions.serving import ChatCompletions
from gateway.dialects.completions.serving import Completions
from gateway.dialects.messages.serving import Messages
from gateway.dialects.responses.serving import Responses

DIALECTS: tuple[Dialect, ...] = (
    ChatCompletions(),
    Completions(),
    Responses(),
    Messages(),
)

__all__ = [
    "DIALECTS",
    "Captured",
    "ClientAsked",
    "Dialect",
    "DialectStream",
    "EarlierCall",
    "Engine",
    "EngineRefused",
    "Prepared",
    "SideRoute",
    "check_limits",
    "with_sampling_defaults",
]
