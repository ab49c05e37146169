"""The API dialects the gateway serves: one module each, behind ``gateway.dialects.base``.

Adding a dialect is one module (a ``Dialect`` subclass) plus one line in ``DIALECTS``; the proxy
generates its routes and runs its calls. Offers: ``DIALECTS``, ``Dialect``, ``DialectStream``,
``Prepared``, ``Captured``, ``ClientAsked``, ``with_sampling_defaults``, ``check_limits``.
"""

from __future__ import annotations

from gateway.dialects.base import (
    Captured,
    ClientAsked,
    Dialect,
    DialectStream,
    EarlierCall,
    Prepared,
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
    "Prepared",
    "check_limits",
    "with_sampling_defaults",
]
