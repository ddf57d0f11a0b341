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


WEIGHT_ROUTES = ["/init_weight_update_group", "/update_weights_from_distributed",
                 "/update_weights_from_path", "/update_weights_from_disk"]
GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
         "world_size": 2}
SPEC = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4, 8]]}


@pytest.mark.parametrize("path", WEIGHT_ROUTES)
def test_weight_routes_need_the_key(gateway, leader, path):
    r = gateway(api_key=KEY).post(path, json={"path": "/ckpt"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert not leader.controls


@pytest.mark.parametrize("path,body,param", [
    ("/init_weight_update_group", {**GROUP, "master_port": 0}, "master_port"),
    ("/init_weight_update_group", {**GROUP, "rank_offset": 0}, "rank_offset"),
    ("/init_weight_update_group", {**GROUP, "world_size": 10**6}, "world_size"),
    ("/init_weight_update_group", {**GROUP, "master_address": "h" * 300}, "master_address"),
    ("/init_weight_update_group", {**GROUP, "backend": "mpi"}, "backend"),
    ("/init_weight_update_group", {**GROUP, "timeout_s": 1e9}, "timeout_s"),
    ("/init_weight_update_group", {**GROUP, "group_name": ""}, "group_name"),
    ("/init_weight_update_group", {"master_port": 1}, "master_address"),
    ("/update_weights_from_distributed", {**SPEC, "dtypes": ["int8"]}, "dtypes"),
    ("/update_weights_from_distributed", {**SPEC, "shapes": [[1] * 9]}, "shapes"),
    ("/update_weights_from_distributed", {**SPEC, "names": ["x" * 300]}, "names"),
    ("/update_weights_from_distributed", {**SPEC, "names": ["a", "b"]}, "names"),
    ("/update_weights_from_distributed", {**SPEC, "weight_version": "v" * 300},
     "weight_version"),
    ("/update_weights_from_path", {"path": "p" * 5000}, "path"),
    ("/update_weights_from_path", {}, "path"),
    ("/update_weights_from_path", {"path": "/a", "model_path": "/b"}, "path"),
    ("/update_weights_from_disk", {"model_path": "/a", "load_format": "auto"},
     "load_format"),
])
def test_weight_route_bodies_are_bounded(gateway, leader, path, body, param):
    r = gateway(api_key=KEY).post(path, json=body, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert len(err["message"]) < 400
    assert not leader.controls


def test_update_weights_from_disk_forwards_model_path(gateway, leader):
    """SGLang's name and field reach the leader as update_weights_from_path; a state
    refusal is a 409 with the leader's reason."""
    c = gateway(api_key=KEY)
    r = c.post("/update_weights_from_disk", json={"model_path": "/ckpt/b",
                                                  "weight_version": "b"}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"success": True, "weight_version": "b"}
    assert [(m["path"], m["weight_version"]) for m in leader.controls] == [("/ckpt/b", "b")]
    leader.error = ("bad_state", "pause generation before updating the weights")
    r = c.post("/update_weights_from_path", json={"path": "/ckpt/b"}, headers=AUTH)
    assert r.status_code == 409 and "pause generation" in r.json()["error"]["message"]


def test_init_weight_update_group_forwards_and_a_routers_refusal_is_a_400(gateway, leader):
    c = gateway(api_key=KEY)
    r = c.post("/init_weight_update_group", json={**GROUP, "backend": "gloo"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["success"], r.text
    (sent,) = leader.controls
    assert {k: sent[k] for k in GROUP} == GROUP and sent["backend"] == "gloo"
    assert sent["group_name"] == "weight_update_group" and sent["timeout_s"] == 60.0
    leader.error = ("bad_op", "the router does not relay init_weight_update_group: ...")
    r = c.post("/init_weight_update_group", json=GROUP, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_op"
