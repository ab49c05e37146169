"""The shape of vLLM's completions answers and stream chunks, as the capture reads them
(``gateway.capture.check_shape``).

Owns: ``ANSWER`` and ``CHUNK`` (the same shape: a completions chunk is a partial answer), the
JSON type of every field of vLLM 0.32's ``CompletionResponse`` a client reads. Fields absent or
``null`` pass, fields not listed pass unread; token ids and choice indices are checked apart
(``gateway.capture.token_ids``, ``choice_index``).
"""

from __future__ import annotations

from gateway.capture import INTEGER, NUMBER, TEXT, Shape
from gateway.dialects.chat_completions.protocol import TOP_FIELDS

_LOGPROBS: Shape = {
    "tokens": [TEXT],
    "token_logprobs": [NUMBER],
    "text_offset": [INTEGER],
    "top_logprobs": [{}],
}
ANSWER: Shape = {
    **TOP_FIELDS,
    "choices": [
        {
            "index": INTEGER,
            "text": TEXT,
            "logprobs": _LOGPROBS,
            "finish_reason": TEXT,
            "stop_reason": (int, str),
        }
    ],
}
CHUNK: Shape = ANSWER
