"""The gateway tunes the garbage collector while it serves (``gc_young_threshold``) and gives
the interpreter its own settings back when it stops."""

from __future__ import annotations

import gc

from fastapi.testclient import TestClient

from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.settings import GatewaySettings


def test_serving_app_freezes_start_up_and_raises_young_threshold(
    sqlite_pool: PoolSettings,
) -> None:
    before = gc.get_threshold()
    settings = GatewaySettings(gc_young_threshold=12_345)
    with TestClient(create_app(settings, sqlite_pool), base_url="http://127.0.0.1") as api:
        assert api.get("/health").status_code == 200
        serving, frozen = gc.get_threshold(), gc.get_freeze_count()
    # the young threshold is the setting's, the older generations' the interpreter's
    assert serving == (12_345, *before[1:])
    assert frozen > 0  # the app's start-up objects: modules, routes, settings
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_zero_leaves_the_collector_alone(sqlite_pool: PoolSettings) -> None:
    before = gc.get_threshold()
    settings = GatewaySettings(gc_young_threshold=0)
    with TestClient(create_app(settings, sqlite_pool), base_url="http://127.0.0.1") as api:
        assert api.get("/health").status_code == 200
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0
