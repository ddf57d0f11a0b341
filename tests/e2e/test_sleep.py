"""sleep(level) / wake_up(tags) / is_sleeping end to end, on an MoE preset at tp=2:
bytes freed and allocated again as the engine counts them, outputs after a level-1 wake
equal those before, a level-2 wake generates nothing until update_weights wrote every
tensor and then equals HF on the new weights (the experts through their own loaders),
requests that arrive asleep wait, and a request held across a sleep (keep) recomputes
and ends as if never interrupted; served, an update from a trainer process's gloo group
(the experts from broadcasts) equals HF on the new weights."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from served import serve, teardown
from weight_ckpts import finish_trainer, free_port, group_specs, start_trainer

from nvllm import LLM, AsyncClient, Client, SamplingParams
from nvllm.common.client import ClientError
from nvllm.common.errors import RequestRejected
from nvllm.common.model_source import safetensors_files

pytestmark = pytest.mark.e2e

PRESET = "qwen3-moe"  # experts: the update after level 2 goes through their loaders
MAX_TOKENS = 10
PROMPTS = [[1, 5, 9, 200, 17, 33, 4, 81, 99, 120, 7], [400, 12, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KV_GIB = 0.01  # a small cache: quick to free and allocate


@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory):
    """(A's folder, A's tensors, B's tensors, B's folder): B is A's preset with another
    seed."""
    from nvllm.launch.tiny import PRESETS, make_tiny_checkpoint

    a = tiny(PRESET)
    b = make_tiny_checkpoint(tmp_path_factory.mktemp("sleep-b"), **PRESETS[PRESET], seed=2)
    return a, _tensors(a), _tensors(b), str(b)


def _tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        out.update(load_file(str(f)))
    return out


@torch.no_grad()
def hf_greedy(folder: str) -> list[list[int]]:
    """HF's greedy tokens for every prompt on the checkpoint in `folder`. Loaded from the
    folder, not by load_state_dict: HF fuses the per-expert tensors on load, and
    load_state_dict(strict=False) would skip the per-expert names silently."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS,
                           min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]


def _kv_bytes(folder: str, num_blocks: int, block_size: int, tp: int) -> int:
    """The paged caches' bytes over `tp` ranks (float32) from the config, not from the
    engine: the KV heads split over the ranks (unevenly if need be), or each rank holds
    one when there are fewer heads than ranks."""
    cfg = json.loads((pathlib.Path(folder) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = max(cfg["num_key_value_heads"], tp)
    return 2 * cfg["num_hidden_layers"] * num_blocks * block_size * heads * head_dim * 4


def _run(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs]


def test_sleep_in_process_then_served_at_tp2(ckpts):
    """One tp=2 engine: both levels through LLM, then behind an EngineServer through
    Client and AsyncClient."""
    folder, a, b, b_dir = ckpts
    llm = LLM(folder, tensor_parallel_size=2, device="cpu", dtype="float32", block_size=8,
              cpu_kv_cache_gib=KV_GIB)
    try:
        refs_a, refs_b = hf_greedy(folder), hf_greedy(b_dir)
        _in_process(llm, folder, a, b, refs_a, refs_b)
        llm.update_weights(a, weight_version="A")
        s = serve(llm)
    except BaseException:
        llm.shutdown()
        raise
    try:
        _served(s.endpoint, folder, a, b, b_dir, refs_a, refs_b)
    finally:
        teardown(s)


def _in_process(llm: LLM, folder: str, a: dict, b: dict, refs_a: list, refs_b: list
                ) -> None:
    """Level 1 (KV freed, CPU weights kept), level 2 (weights freed too), the refusals
    while asleep and until the weights are whole, and B's outputs after."""
    assert _run(llm) == refs_a
    kv = _kv_bytes(folder, llm.engine.kv.num_blocks, 8, tp=2)
    assert llm.engine.kv.pool.num_cached_blocks > 0

    slept = llm.sleep(level=1)
    assert llm.is_sleeping() and slept.asleep == ["kv_cache", "weights"]
    assert slept.kv_cache_bytes == kv and slept.weights_bytes == 0  # CPU: weights stay
    assert llm.engine.kv.pool.num_cached_blocks == 0
    with pytest.raises(RuntimeError, match=r"asleep .*wake_up\(\)"):
        _run(llm)
    with pytest.raises(RuntimeError, match=r"weights are asleep"):
        llm.update_weights(b)
    woke = llm.wake_up()
    assert not llm.is_sleeping() and woke.kv_cache_bytes == kv and not woke.asleep
    assert _run(llm) == refs_a

    slept = llm.sleep(level=2)
    params = sum(t.numel() * 4 for t in a.values())  # float32, whole on one rank
    assert params < slept.weights_bytes < 2 * params and slept.kv_cache_bytes == kv
    woke = llm.wake_up()
    assert woke.weights_bytes == slept.weights_bytes and woke.weights_missing == len(a)
    with pytest.raises(RuntimeError, match=r"discarded by sleep\(level=2\)"):
        _run(llm)
    with pytest.raises(RequestRejected, match=f"{len(a)} checkpoint tensors"):
        llm.engine.submit(prompt_token_ids=PROMPTS[0], params=GREEDY)
    norm = "model.norm.weight"
    llm.update_weights({norm: b[norm]})  # a part: generation still waits
    assert llm.engine.weights_missing == len(a) - 1 and llm.engine.is_paused
    llm.update_weights(b, weight_version="B")  # whole: generation resumes by itself
    assert not llm.engine.is_paused and llm.engine.sleep_level == 0
    assert _run(llm) == refs_b


def _served(endpoint: str, a_dir: str, a: dict, b: dict, b_dir: str, refs_a: list,
            refs_b: list) -> None:
    """A request held across a keep-mode sleep and one that arrives asleep both finish
    once, as if never interrupted; level 2 through Client, then B from its folder,
    A from a trainer's gloo group (equal to HF on A), B again over HTTP."""
    with Client(endpoint, timeout_s=60) as client:
        assert [client.generate(p, GREEDY).token_ids for p in PROMPTS] == refs_a
        held, late, woke = asyncio.run(_sleep_keep(endpoint))
        assert [held, late] == refs_a
        assert woke.kv_cache_bytes > 0 and not woke.asleep

        slept = client.sleep(level=2)
        assert slept.weights_bytes > 0 and client.engine_state()["is_paused"]
        with pytest.raises(ClientError, match="bad_state.*asleep"):
            client.resume_generation()
        woke = client.wake_up()
        assert woke.weights_bytes == slept.weights_bytes and woke.weights_missing == len(a)
        with pytest.raises(RequestRejected, match="discarded"):
            client.generate(PROMPTS[0], GREEDY)
        assert client.update_weights_from_path(b_dir, weight_version="B") == "B"
        assert [client.generate(p, GREEDY).token_ids for p in PROMPTS] == refs_b
        assert client.engine_state() == {
            "op": "state", "is_sleeping": False, "is_paused": False, "level": 0,
            "asleep": [], "weights_missing": 0, "weight_version": "B"}
        # A from a trainer process over a gloo group: the experts from broadcasts.
        port = free_port()
        trainer = start_trainer(port, 3, a_dir)
        client.init_weight_update_group("127.0.0.1", port, 1, 3, backend="gloo",
                                        timeout_s=30)
        assert client.update_weights_from_distributed(*group_specs(a),
                                                      weight_version="A") == "A"
        finish_trainer(trainer, 0)
        assert [client.generate(p, GREEDY).token_ids for p in PROMPTS] == refs_a
    _admin_routes(endpoint, b_dir)  # back to B from its folder, over HTTP
    with Client(endpoint, timeout_s=60) as client:
        assert [client.generate(p, GREEDY).token_ids for p in PROMPTS] == refs_b


def _admin_routes(endpoint: str, b_dir: str) -> None:
    """The gateway's admin routes against the engine (their guards: test_admin.py)."""
    from fastapi.testclient import TestClient

    from nvllm.launch.openai.app import GatewayConfig, create_app

    key = {"authorization": "Bearer k"}
    with TestClient(create_app(GatewayConfig(endpoint, "tiny", api_key="k"))) as c:
        def call(method: str, route: str, status: int = 200, **body: object) -> dict:
            r = getattr(c, method)(route, headers=key, **({"json": body} if body else {}))
            assert r.status_code == status, r.text
            return r.json()

        assert call("get", "/weight_info") == {"weight_version": "A"}
        assert call("post", "/pause?mode=keep&clear_cache=false") == {"status": "paused"}
        assert call("get", "/is_paused") == {"is_paused": True}
        assert call("post", "/resume") == {"status": "resumed"}
        slept = call("post", "/sleep?level=1&mode=wait")
        assert slept["level"] == 1 and slept["kv_cache_bytes"] > 0
        assert call("get", "/is_sleeping") == {"is_sleeping": True}
        assert "already asleep" in call("post", "/sleep", 409)["error"]["message"]
        assert "asleep" in call("post", "/update_weights_from_path", 409,
                                path=b_dir)["error"]["message"]
        assert call("post", "/wake_up?tags=scheduling", 409)["error"]["code"] == "bad_state"
        woke = call("post", "/wake_up?tags=kv_cache&tags=weights")
        assert woke["kv_cache_bytes"] == slept["kv_cache_bytes"] and not woke["asleep"]
        assert call("get", "/is_paused") == {"is_paused": True}
        call("post", "/wake_up?tags=scheduling")
        assert call("get", "/is_sleeping") == {"is_sleeping": False}
        assert call("get", "/is_paused") == {"is_paused": False}
        assert call("post", "/update_weights_from_disk", model_path=b_dir,
                    weight_version="B2") == {"success": True, "weight_version": "B2"}
        assert call("get", "/weight_info") == {"weight_version": "B2"}
        missing = call("post", "/update_weights_from_path", 400, path=b_dir + "-none")
        assert missing["error"]["code"] == "weights_refused", missing


async def _sleep_keep(endpoint: str) -> tuple:
    """Stream PROMPTS[0]; once it has tokens, sleep (keep), submit PROMPTS[1] while
    asleep, wake: returns both requests' tokens and the wake's report."""
    client = AsyncClient(endpoint, timeout_s=60)
    first = asyncio.Event()
    deltas: list = []

    async def consume() -> None:
        async for d in client.stream(PROMPTS[0], GREEDY):
            deltas.append(d)
            first.set()

    try:
        task = asyncio.create_task(consume())
        await first.wait()
        slept = await client.sleep(level=1, mode="keep")
        assert slept.asleep == ["kv_cache", "weights"] and await client.is_sleeping()
        late = asyncio.create_task(client.generate(PROMPTS[1], GREEDY))
        await asyncio.sleep(0.3)
        assert not late.done() and not task.done()  # both wait for the wake
        woke = await client.wake_up()
        await task
        late_out = await late
    finally:
        client.close()
    assert sum(d.finish_reason is not None for d in deltas) == 1
    return [t for d in deltas for t in d.token_ids], late_out.token_ids, woke
