"""``kvroute serve`` in front of real engines, and a workload they can take: shared by
``kvroute demo --real`` and ``bench/real_vllm.py``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from realvllm.engines import Engine
from simulator.testing import free_port, spawn, stop_process, wait_ready


def start_kvroute(pods: list[dict[str, Any]], workdir: Path, name: str, timeout: float = 60.0,
                  **settings: Any) -> tuple[subprocess.Popen, str]:
    """Start ``kvroute serve`` (a child process; stop it with ``stop_process``) over ``pods``; return it
    and its base URL once every pod is healthy."""
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"port": port, "pods": pods, "log_level": "warning", "scrape_interval_s": 0.25,
                                   **settings}))
    log = workdir / f"{name}.log"
    proc = spawn([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)], log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + "/ready", proc, timeout, log=log)
        deadline = time.monotonic() + timeout
        while httpx.get(base + "/ready", timeout=5, trust_env=False).json().get("healthy_pods") != len(pods):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every pod became healthy behind kvroute within {timeout:g}s")
            time.sleep(0.2)
    except BaseException:  # not ready in time, or Ctrl-C: the router is not left running
        stop_process(proc)
        raise
    return proc, base


def reset_prefix_caches(engines: Sequence[Engine]) -> None:
    """Empty every engine's prefix cache (needs ``dev_mode``), so the next run starts cold."""
    for e in engines:
        httpx.post(e.url + "/reset_prefix_cache", timeout=30, trust_env=False).raise_for_status()


def multiturn_workload(seed: int, sessions: int = 160, turns: int = 4) -> list[Any]:
    """Multi-turn chat as token ids sized for the tiny model: 4 system prompts of 1,024 tokens,
    ``sessions`` sessions of ``turns`` turns of 192 new tokens (prompts of 1,216-1,792 tokens when
    4 turns), 16 output tokens; ids below 256 fit any vocabulary."""
    from replay.workloads import multiturn

    return multiturn(system_prompts=4, system_prompt_len=1024, sessions=sessions, turns=turns, turn_tokens=192,
                     output_len=16, seed=seed, vocab_size=256)
