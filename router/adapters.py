"""Each pod's LoRA adapters, as its own ``GET /v1/models`` lists them.

vLLM loads and unloads adapters at run time (``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and a pod found by
discovery has no ``lora_adapters`` of its own. So every ``adapters_check_interval_s`` the router
reads each healthy pod's ``/v1/models``, where vLLM lists every adapter it serves with its base
model as ``parent``, and takes that list as the pod's adapters (``PodRegistry.set_adapters``): a
request naming an adapter goes to the pods that list it, an adapter no pod lists is the 404 of a
model that does not exist, and the router's own ``/v1/models`` lists what the pods do. Until a pod
has answered, its ``lora_adapters`` stand; a pod that does not answer keeps what it listed last.
"""

from __future__ import annotations

from typing import Any

from router.event_sources import PodPoll
from router.pods import PodState

MAX_ADAPTERS = 4096  # a pod's list past this is not taken (vLLM's --max-cpu-loras is far below it)


def listed_adapters(answer: Any) -> frozenset[str] | None:
    """The adapters a ``/v1/models`` answer lists (its entries with a ``parent``), or None for an
    answer that is not vLLM's list."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) > MAX_ADAPTERS:
        return None
    return frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
                     and isinstance(m.get("parent"), str))


class AdapterCheck(PodPoll):
    path = "/v1/models"
    what = "LoRA adapters"

    def apply(self, pods: list[PodState], answer: Any) -> None:
        adapters = listed_adapters(answer)
        if adapters is None:
            return
        for pod in pods:
            self.registry.set_adapters(pod.id, adapters)
