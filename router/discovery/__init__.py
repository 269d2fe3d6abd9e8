"""Pod discovery: where the fleet comes from when it is not a static list.

Three modes (``discovery`` setting): ``static`` (the ``pods`` list, nothing runs), ``dns`` (a
headless Service's A/AAAA records, re-resolved; see :mod:`router.discovery.dns`) and ``kubernetes``
(list and watch pods by label selector; see :mod:`router.discovery.kubernetes`). Every source keeps
the *whole* desired fleet and hands it to a :class:`~router.discovery.fleet.FleetSync`, which works
out joins, leaves and readiness changes against what the router has and applies them through
callbacks the router's wiring provides (registry, prefix index, KV-event subscriber, booking ledger).
"""

from __future__ import annotations

from kvcommon.settings import ConfigError
from router.config import RouterSettings
from router.discovery.fleet import DiscoveredPod, DiscoveryStats, FleetSync

__all__ = ["DiscoveredPod", "DiscoveryStats", "FleetSync", "build_discovery", "discovery_problem"]


def discovery_problem(settings: RouterSettings) -> str | None:
    """Why the discovery settings cannot work, or None (checked at start-up for a clear message)."""
    try:
        build_discovery(settings, FleetSync(lambda p: None, lambda i: None, lambda i, r: None))
    except ConfigError as exc:
        return str(exc)
    return None


def build_discovery(settings: RouterSettings, sync: FleetSync):
    """The discovery source for ``settings`` (None for ``static``); raises ConfigError if incomplete."""
    if settings.discovery == "static":
        return None
    if settings.discovery == "dns":
        from router.discovery.dns import DNSDiscovery, resolver_for

        if not settings.discovery_dns_name:
            raise ConfigError("discovery 'dns' needs discovery_dns_name (the headless Service's name)")
        return DNSDiscovery(settings, sync, resolver_for(settings))
    from router.discovery.kubernetes import KubernetesDiscovery

    return KubernetesDiscovery.from_settings(settings, sync)
