"""PNG plots of a run: TTFT CDF, TTFT over time, requests per pod (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replay.metrics import RequestRecord


def write_plots(records: Sequence[RequestRecord], summary: dict[str, Any], stem: str | Path,
                label: str | None = None) -> list[Path]:
    """Write ``<stem>-ttft-cdf.png``, ``<stem>-ttft-time.png`` and ``<stem>-pods.png``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    title = f" ({label})" if label else ""
    paths: list[Path] = []
    ok = [(r.sent, r.ttft * 1000) for r in records if r.ok and r.sent is not None and r.ttft is not None]  # (s, ms)
    failed = [r.sent for r in records if not r.ok and r.sent is not None]
    slo = summary.get("slo_ttft")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if ok:
        ttfts = np.sort([ms for _, ms in ok])
        total = max(1, summary.get("requests") or len(ttfts))
        ax.step(ttfts, np.arange(1, len(ttfts) + 1) / total, where="post", label="completed requests")
    if slo is not None:
        ax.axvline(slo * 1000, color="red", linestyle="--", label=f"SLO {slo * 1000:.0f} ms")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of all requests sent")
    ax.set_ylim(0, 1.02)
    ax.set_title("TTFT CDF" + title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-ttft-cdf.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if ok:
        ax.scatter([sent for sent, _ in ok], [ms for _, ms in ok], s=6, label="TTFT")
    if failed:
        ax.scatter(failed, [0] * len(failed), s=12, marker="x", color="red",
                   label="rejected / failed")
    if slo is not None:
        ax.axhline(slo * 1000, color="red", linestyle="--", label=f"SLO {slo * 1000:.0f} ms")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over time" + title)
    ax.grid(alpha=0.3)
    if ok or failed:
        ax.legend(loc="upper left")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-ttft-time.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    per_pod = summary.get("per_pod") or {}
    if per_pod:
        ax.bar(list(per_pod), list(per_pod.values()))
        ax.tick_params(axis="x", rotation=30)
    else:
        ax.text(0.5, 0.5, "no x-kvroute-pod header in responses", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylabel("requests")
    ax.set_title("Requests per pod" + title)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-pods.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
