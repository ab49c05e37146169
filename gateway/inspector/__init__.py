"""The web inspector at ``/inspector``: a page for people to look at what the pool holds.

- ``page``: the ``/inspector`` page and its static files (``static/``: HTML, CSS, JS, vendored
  Alpine.js and uPlot; no build step) with their security headers (``router``, ``page``,
  ``static_file``).
- ``api``: the JSON endpoints the page reads under ``/api`` (trajectory list and view, step
  tokens, group rollouts, curation marks, batch preview, charts, training metrics), guarded
  against cross-site calls (``router``, ``guard``).

Never: changes what the pool holds, except the trainer's metrics it is posted; never builds SQL
(reads go through ``datapool.queries``); never decodes tokens into the data (text is for display).

Imports: ``datapool`` (mainly ``datapool.queries``) and ``gateway``'s shared modules and
``gateway.api``; never ``gateway.app``, ``trainer_bridge`` or the ``trajgate`` CLI.
"""
