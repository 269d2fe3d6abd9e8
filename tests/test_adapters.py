"""Each pod's LoRA adapters read from its own ``GET /v1/models`` (router/adapters.py): an adapter a
pod loads at run time is routed to once listed, one it unloads no longer; a pod that does not answer
keeps its configured ``lora_adapters``. Recording pods on loopback (tests/test_router_api.py) whose
list of adapters the test changes."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from router.adapters import listed_adapters
from tests.helpers import free_port, until
from tests.test_router_api import Pod, running_router, settings_for, started


@dataclass
class ListingPod(Pod):
    """A recording pod whose ``/v1/models`` lists ``adapters`` as vLLM does (``parent``: the base
    model); with ``lists=False`` it has no such route (a 404, as a server that is not vLLM)."""

    adapters: list[str] = field(default_factory=list)
    lists: bool = True

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        if not self.lists:
            return web.Response(status=404)
        cards = [{"id": "m", "object": "model", "root": "m", "parent": None}]
        cards += [{"id": a, "object": "model", "root": f"/adapters/{a}", "parent": "m"} for a in self.adapters]
        return web.json_response({"object": "list", "data": cards})


def test_the_adapters_of_a_models_answer_are_its_cards_with_a_parent():
    answer = {"object": "list", "data": [{"id": "m", "parent": None}, {"id": "sql", "parent": "m"},
                                         {"id": 7, "parent": "m"}, "junk", {"parent": "m"}]}
    assert listed_adapters(answer) == frozenset({"sql"})
    for not_a_list in (None, [], {"data": "x"}, {"data": [{}] * 5000}):
        assert listed_adapters(not_a_list) is None


@pytest.mark.e2e
async def test_adapters_loaded_and_unloaded_at_run_time_are_routed_as_the_pods_list_them():
    a, b = ListingPod("a", free_port()), ListingPod("b", free_port(), lists=False)
    async with started([a, b]):
        settings = settings_for([a, b], adapters_check_interval_s=0.1)
        settings.pods[1].lora_adapters = ["configured"]   # b does not list: its configured adapter stands
        async with running_router(settings) as (base, services), httpx.AsyncClient(base_url=base, timeout=10) as c:
            async def complete(model: str) -> httpx.Response:
                return await c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})

            assert (await complete("sql")).status_code == 404
            a.adapters = ["sql"]   # loaded at run time
            await until(lambda: "sql" in services.registry.adapters(), 5, "the loaded adapter")
            listed = {m["id"]: m.get("parent") for m in (await c.get("/v1/models")).json()["data"]}
            assert listed == {"m": None, "sql": "m", "configured": "m"}
            for _ in range(4):
                r = await complete("sql")
                assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "a", r.text
            r = await complete("configured")
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "b"
            a.adapters = []   # unloaded
            await until(lambda: "sql" not in services.registry.adapters(), 5, "the unloaded adapter gone")
            assert (await complete("sql")).status_code == 404
    assert [s["path"] for s in a.seen] == ["/v1/completions"] * 4
