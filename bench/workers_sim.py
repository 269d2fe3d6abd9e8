"""Routing quality with several router processes, in simulated time: 1 router against N routers that
share their bookings (the booking bus) or do not, on the seed workload of bench/routing_quality.py.

``kvroute simulate`` (whatif/) runs the router's own ``Router`` (ledger, calibrator, scorers,
admission, prefix index) against the simulator's timing model with a simulated clock, so the
result does not depend on how loaded the machine is. Here its one router is replaced by N, as
``kvroute serve --workers N`` has: each request goes to one of them at random (SO_REUSEPORT), each
has its own index (every pod's KV events reach all of them; none with ``--no-events``, whose pods
publish none, so each index knows only the credits of routed prompts), calibrator, speculative
credits and scrape of the pods; with ``shared`` every local book and release is applied to the
others' ledgers as a foreign booking, and (unless ``credits`` is off: the rows "without credits")
every credit of a routed prompt's blocks to a pod to the others' indexes, as the bus would deliver
them: sent at once, or, with an interval
(``booking_bus_min_interval_s``, one row per value of ``--bus-interval-s``), held until that long
after the router's last message and sent together with the changes made meanwhile; then applied
``--bus-latency-s`` later (the wire, ~0.5 ms on loopback; 0 by default, as in the runs before this
option).

    python bench/workers_sim.py [--rate 70] [--duration 60] [--routers 2] [--bus-interval-s 0,0.005]
                                [--bus-latency-s 0.0005] [--no-events] [--json out.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import stamp  # noqa: E402
from fleet.trial import FleetSpec  # noqa: E402
from replay.arrivals import cut, poisson  # noqa: E402
from replay.workloads import multiturn  # noqa: E402
from router.config import PodConfig  # noqa: E402
from whatif.podmodel import PodSpec  # noqa: E402
from whatif.simulate import SimConfig, _build_router, _Run  # noqa: E402


class _State:
    """A pod's registry entry in every router at once: what a scrape writes, each router reads."""

    def __init__(self, states: list[Any]):
        object.__setattr__(self, "_states", states)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._states[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        for s in self._states:
            setattr(s, name, value)


class _Registry:
    def __init__(self, registries: list[Any]):
        self.pods = {pid: _State([r.pods[pid] for r in registries]) for pid in registries[0].pods}


class _Index:
    """Every pod's KV events reach every router's index (none: pods without KV events)."""

    def __init__(self, indexes: list[Any], events: bool = True):
        self.indexes = indexes
        self.events = events

    def apply_batch(self, pod_id: str, events: Any) -> None:
        if not self.events:
            return
        for ix in self.indexes:
            ix.apply_batch(pod_id, events)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.indexes[0], name)


class Routers:
    """N routers behind one port, looking like the one ``Router`` the simulation drives."""

    def __init__(self, routers: list[Any], shared: bool, seed: int, interval_s: float = 0.0,
                 latency_s: float = 0.0, clock: Any = None, credits: bool = True, events: bool = True):
        self.routers = routers
        self.index = _Index([r.index for r in routers], events)
        self.registry = _Registry([r.registry for r in routers])
        self.rng = random.Random(seed)
        self.owner: dict[int, tuple[Any, Any]] = {}
        self.last: Any = routers[0]
        self.interval_s, self.latency_s, self.clock = interval_s, latency_s, clock
        # heap: (due, order, the receiving router's method, its args): foreign books, releases, credits
        self.in_flight: list[tuple[float, int, Any, tuple]] = []
        self._order = 0
        self.last_sent = [-float("inf")] * len(routers)  # when each router's last message went
        if shared:
            for i, r in enumerate(routers):
                r.ledger.on_change = self._hook(i, f"router-{i}")
                if credits:
                    r.on_credit = self._sender(i)

    def _send(self, i: int, apply: Any) -> None:
        """Router ``i`` publishes: ``apply(other)`` runs at each other router when the bus delivers it."""
        others = [o for o in self.routers if o is not self.routers[i]]
        if self.interval_s <= 0 and self.latency_s <= 0:
            for o in others:
                apply(o)
            return
        now = self.clock.now
        # the bus's rule: at once after a quiet interval, else with the message at its end
        last = self.last_sent[i]
        sent = now if now >= last + self.interval_s else last + self.interval_s
        self.last_sent[i] = max(last, sent)
        for o in others:
            self._order += 1
            heapq.heappush(self.in_flight, (sent + self.latency_s, self._order, apply, (o,)))

    def _hook(self, i: int, origin: str):
        def on_change(event: str, pod: str, ticket: int, tokens: float, resource: str) -> None:
            args = (origin, event, pod, ticket, tokens, resource)
            self._send(i, lambda o: o.ledger.apply_foreign(*args))
        return on_change

    def _sender(self, i: int):
        def on_credit(pod: str, keys: list[int]) -> None:
            self._send(i, lambda o: o.credit_foreign(pod, keys))
        return on_credit

    def _arrived(self) -> None:
        """Apply what has reached the others (a router reads its ledger and index only when it plans)."""
        while self.in_flight and self.in_flight[0][0] <= self.clock.now:
            _, _, apply, args = heapq.heappop(self.in_flight)
            apply(*args)

    def keys_for(self, model: str, tokens: list[int]) -> Any:
        return self.routers[0].keys_for(model, tokens)

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        self._arrived()
        self.last = self.rng.choice(self.routers)
        return self.last.plan(*args, **kwargs)

    def book(self, plan: Any, cand: Any) -> Any:
        booking = self.last.book(plan, cand)
        self.owner[id(booking)] = (booking, self.last)
        return booking

    def first_token(self, booking: Any, *args: Any, **kwargs: Any) -> None:
        self.owner[id(booking)][1].first_token(booking, *args, **kwargs)

    def finish(self, booking: Any) -> None:
        self.owner[id(booking)][1].finish(booking)

    def ended(self, booking: Any) -> None:
        self.owner[id(booking)][1].ended(booking)

    def observe_answer(self, booking: Any, headers: Any) -> None:
        self.owner[id(booking)][1].observe_answer(booking, headers)


class _MultiRun(_Run):
    def __init__(self, specs: Any, arrivals: Any, cfg: SimConfig, routers: int, shared: bool, seed: int,
                 interval_s: float = 0.0, latency_s: float = 0.0, credits: bool = True, events: bool = True):
        super().__init__(specs, arrivals, cfg, None)
        if routers > 1 or not events:
            self.router = Routers([_build_router(cfg, self.clock) for _ in range(routers)], shared, seed,
                                  interval_s, latency_s, self.clock, credits, events)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=70.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--objective", type=float, default=2.0)
    ap.add_argument("--routers", default="2", help="comma-separated router counts besides 1 (default: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bus-interval-s", default="0",
                    help="comma-separated booking_bus_min_interval_s values, a row each (0: every change at once)")
    ap.add_argument("--bus-latency-s", type=float, default=0.0, help="the bus's wire latency")
    ap.add_argument("--no-events", action="store_true",
                    help="pods that publish no KV events: the routers know only the credits of routed prompts")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    fleet = FleetSpec()
    n = int(args.rate * args.duration)
    turns = max(2, -(-n // 400))
    specs = multiturn(system_prompts=20, system_prompt_len=2048, sessions=400, turns=turns, turn_tokens=300,
                      output_len=4, seed=args.seed)
    arrivals = poisson(len(specs), args.rate, seed=args.seed + 1)
    n = cut(arrivals, duration=args.duration)
    spec = PodSpec(timing="seed", block_size=fleet.block_size, num_gpu_blocks=fleet.num_gpu_blocks,
                   prefill_tokens_per_s=fleet.prefill_tokens_per_s, decode_s_per_token=fleet.decode_s_per_token)
    setups = [("1 process", 1, False, 0.0, False)]
    intervals = [float(x) for x in args.bus_interval_s.split(",") if x.strip()]
    for k in [int(x) for x in args.routers.split(",") if x.strip()]:
        setups += [(f"{k} workers, booking bus" + (f", {d * 1000:g} ms interval" if d else ""), k, True, d, True)
                   for d in intervals]
        d = intervals[-1] if intervals else 0.0
        setups += [(f"{k} workers, booking bus without credits" + (f", {d * 1000:g} ms interval" if d else ""),
                    k, True, d, False)]
        setups += [(f"{k} workers, no bus", k, False, 0.0, False)]
    rows = []
    for label, admission in (("predicted-ttft + early rejection", True), ("predicted-ttft", False)):
        for name, k, shared, interval, credits in setups:
            cfg = SimConfig(policy="predicted-ttft", admission=admission, objective_s=args.objective, pods=fleet.pods,
                            spec=spec, model=fleet.model)
            if args.no_events:
                cfg.router = {"pods": [PodConfig(id=pid, url=f"http://{pid}.simulated:8000", role=role,
                                                 model=cfg.model) for pid, role in cfg.pod_ids()]}
            s = _MultiRun(specs[:n], arrivals[:n], cfg, k, shared, args.seed, interval,
                          args.bus_latency_s if shared else 0.0, credits, not args.no_events).run().summary
            r = {"router": f"kvroute {label}, {name} (simulated)", "routers": k, "shared_bookings": shared,
                 "shared_credits": credits, "kv_events": not args.no_events,
                 "bus_interval_s": interval, "bus_latency_s": args.bus_latency_s if shared else 0.0,
                 "admission": admission, "requests": s["requests"], "hit_rate": s["hit_rate"],
                 "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"], "slo_attainment": s["slo_attainment"],
                 "rejected": (s["errors_by_status"] or {}).get("429", 0) / max(s["requests"], 1)}
            rows.append(r)
            print(f"  {r['router']:<72} met {r['slo_attainment'] * 100:5.1f} %  rejected {r['rejected'] * 100:4.1f} %  "
                  f"hit {100 * (r['hit_rate'] or 0):5.1f} %  p50 {r['ttft_p50'] or 0:6.3f} s  "
                  f"p99 {r['ttft_p99'] or 0:6.2f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**stamp("workers_sim.py", argv),
                                               "rate": args.rate, "duration_s": args.duration,
                                               "objective_s": args.objective, "requests": n, "rows": rows},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
