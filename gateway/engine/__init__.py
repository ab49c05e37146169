"""The engine room: every exchange with vLLM.

Modules:

- ``exact``: an exact continuation's render, generate, derender and forwarded chat call
  (``send_exact``, ``render_ahead``).
"""
