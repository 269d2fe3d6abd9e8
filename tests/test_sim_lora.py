"""The simulated pod's LoRA adapters loaded and unloaded at run time, as vLLM 0.32 serves them with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``): the
answers and refusals word for word (vllm/entrypoints/openai/models/serving.py), the model list, and a
request naming a loaded adapter served under its name."""

from __future__ import annotations

import httpx
import pytest

from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process

pytestmark = pytest.mark.e2e


def test_adapters_load_and_unload_at_run_time_only_when_the_server_allows_it():
    port = consecutive_free_ports(1)
    args = ["sim", "--port", str(port), "--lora-modules", '["sql=/adapters/sql"]']
    base = f"http://127.0.0.1:{port}"
    with kvroute_process(args, ready_url=base + "/health", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}), \
            httpx.Client(base_url=base, timeout=10) as c:
        def cards() -> dict[str, tuple[str, str | None]]:
            return {m["id"]: (m["root"], m["parent"]) for m in c.get("/v1/models").json()["data"]}

        def complete(model: str) -> httpx.Response:
            return c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})

        assert complete("chat").status_code == 404
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
        assert cards() == {"sim-model": ("sim-model", None), "sql": ("/adapters/sql", "sim-model"),
                           "chat": ("/adapters/chat", "sim-model")}
        r = complete("chat")
        assert r.status_code == 200 and r.json()["model"] == "chat"
        for body, status, kind, said in (
                ({"lora_name": "chat", "lora_path": "/elsewhere"}, 400, "InvalidUserInput", "has already been loaded"),
                ({"lora_name": "sim-model", "lora_path": "/x"}, 400, "InvalidUserInput", "conflicts with a served"),
                ({"lora_name": "", "lora_path": "/x"}, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path'"),
                ({"lora_name": 7, "lora_path": "/x"}, 400, None, "string")):
            r = c.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status and said in r.json()["error"]["message"], (body, r.text)
            assert kind is None or r.json()["error"]["type"] == kind
        # in place: the same adapter id, a new path
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/v2/chat", "load_inplace": True})
        assert r.status_code == 200 and cards()["chat"] == ("/v2/chat", "sim-model")
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' removed successfully."
        assert "chat" not in cards() and complete("chat").status_code == 404
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        assert r.json()["error"]["message"] == "The lora adapter 'chat' cannot be found."
    # without the variable the routes are not there, as on vLLM
    with kvroute_process(args, ready_url=base + "/health"), httpx.Client(base_url=base, timeout=10) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert r.status_code == 404
