"""The RL admin routes' guards, against the fake leader: every route needs the API key,
and every query parameter is checked (name, value, count) before anything reaches the
leader. tests/e2e/test_sleep.py drives them against a real engine."""

from __future__ import annotations

import pytest

KEY = "sekrit"
ROUTES = [("post", "/pause"), ("post", "/resume"), ("get", "/is_paused"),
          ("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"),
          ("get", "/weight_info")]
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("method,path", ROUTES)
def test_admin_routes_need_the_key(gateway, method, path):
    c = gateway(api_key=KEY)
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = getattr(c, method)(path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("method,path,query,param", [
    ("post", "/pause", "mode=nap", "mode"),
    ("post", "/pause", "mode=abort&mode=keep", "mode"),
    ("post", "/pause", "clear_cache=maybe", "clear_cache"),
    ("post", "/sleep", "level=3", "level"),
    ("post", "/sleep", "level=1.0", "level"),
    ("post", "/sleep", "mode=" + "x" * 5000, "mode"),
    ("post", "/wake_up", "tags=weights&tags=everything", "tags"),
    ("post", "/wake_up", "tags=weights&tags=weights", "tags"),
    ("post", "/wake_up", "tag=weights", "tag"),
    ("post", "/resume", "now=1", "now"),
    ("get", "/weight_info", "verbose=true", "verbose"),
])
def test_admin_parameters_are_bounded(gateway, leader, method, path, query, param):
    c = gateway(api_key=KEY)
    r = getattr(c, method)(f"{path}?{query}", headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert len(err["message"]) < 200  # a long value is not echoed back whole
    assert not leader.submits
