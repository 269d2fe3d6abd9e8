"""Who may call the router, and how fast: API keys and per-key token buckets.

``Gate`` is built from the settings and can be re-configured at run time (``configure``): the
router re-reads its YAML on SIGHUP (``install_reload``), so a key removed from the file stops
working at once, without a restart, and the buckets of the keys that stay keep what they spent.

Several router processes (the workers of ``--workers N``, replicas) share their buckets' spending
over the booking bus: each tells the others what it charged each caller (``on_spent``) and charges
its own buckets with what they charged (``charge_foreign``), so a key's limits hold for the tier of
routers as a whole, within the bus's delay, instead of once in each process (``router/bookbus.py``).

A key with a ``cache_salt`` of its own (``TenantSalt``) has the ``cache_salt`` of each of its
generation requests replaced by one derived from that secret (and from the client's own, if it sent
one), so its prompts share vLLM's prefix cache only with keys of the same ``cache_salt``: no other
tenant can tell by timing whether its prompts are cached (docs/reliability.md).

Keys are looked up by their SHA-256 digest, so a guess costs one hash and one dict lookup whatever
the number of keys, and no comparison leaks how much of a key was right. Only a key's *name*
(``name:`` in the config, else ``key-<n>``) ever reaches logs, metrics or error messages; nor
does a key's ``cache_salt``, nor the salt derived from it (only the pods see that).
"""

from __future__ import annotations

import hashlib
import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.config import ApiKey, RouterSettings
from router.errors import APIError
from router.ratelimit import TokenBucket, retry_after_s

log = logging.getLogger("kvroute.auth")

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Limits:
    """Per-caller limits; ``None`` rates mean unlimited."""

    requests_per_s: float | None = None
    request_burst: float | None = None
    prompt_tokens_per_s: float | None = None
    prompt_token_burst: float | None = None


@dataclass(frozen=True)
class Grants:
    """What a caller may do beyond sending requests. The anonymous caller of an open router (no keys)
    has every grant: an open router trusts whoever reaches it."""

    admin: bool = False            # /debug/route, /metrics, /internal/prefill-pods
    priority: bool = False         # the priority header is honoured
    objective: bool = False        # the objective header may loosen the objective


TRUSTED = Grants(admin=True, priority=True, objective=True)


@dataclass
class Caller:
    """An authenticated caller (or the anonymous one when the router is open) and its buckets."""

    name: str
    limits: Limits
    grants: Grants = TRUSTED
    models: frozenset[str] | None = None  # what the key may use (None: every model and adapter)
    salt: TenantSalt | None = field(default=None, repr=False)  # the key's cache_salt (None: the client's own)
    requests: TokenBucket | None = field(default=None, repr=False)
    prompt_tokens: TokenBucket | None = field(default=None, repr=False)

    def retune(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.requests = _bucket(self.requests, limits.requests_per_s, limits.request_burst, now)
        self.prompt_tokens = _bucket(self.prompt_tokens, limits.prompt_tokens_per_s, limits.prompt_token_burst, now)


# in every derived salt: a salt derived here never equals one derived for another purpose from the same secret
SALT_DOMAIN = b"kvroute/api-key-cache-salt/v1"
# vLLM's validate_cache_salt (vllm/entrypoints/generate/base/protocol.py), for a client's own salt
_SALT_MAX_CHARS = 128
_SALT_FORBIDDEN = frozenset("@/\\\0")


class TenantSalt:
    """A key's ``cache_salt`` setting, as the salt each of its requests is forwarded with: the hex
    SHA-256 of ``SALT_DOMAIN``, the secret and the client's own salt if it sent one (64 characters, a
    valid vLLM salt whatever the inputs). Keys of one secret share cached prefixes; keys of another
    secret or of none never meet them, whatever salt their clients send (a client cannot send a
    derived salt without the secret). A client's own salt on such a key still splits its key's cache
    (a tenant's sub-isolation), within the key's and never across keys. The secret is held only as
    a hash state; ``repr`` shows neither it nor a derived salt."""

    __slots__ = ("_state", "plain")

    def __init__(self, secret: str) -> None:
        data = secret.encode("utf-8", "surrogatepass")
        state = hashlib.sha256(SALT_DOMAIN)
        state.update(len(data).to_bytes(4, "big"))  # length-prefixed: (secret, client) pairs never run together
        state.update(data)
        self._state = state
        self.plain = self._derive(b"\x00")  # no client salt: the same for every request, computed once

    def _derive(self, tail: bytes) -> str:
        state = self._state.copy()
        state.update(tail)
        return state.hexdigest()

    def derive(self, client: str | None) -> str:
        """The salt to forward for a request whose client sent ``client`` (None: none)."""
        if client is None:
            return self.plain
        return self._derive(b"\x01" + client.encode("utf-8", "surrogatepass"))

    def apply(self, body: dict[str, Any]) -> None:
        """Put the derived salt in ``body`` (the parsed request), the client's own checked first as
        vLLM checks it (400 as vLLM answers; it would never see the client's value to refuse it)."""
        client = body.get("cache_salt")
        if client is not None and (not isinstance(client, str) or not client):
            raise APIError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
        if client is not None and (len(client) > _SALT_MAX_CHARS or not _SALT_FORBIDDEN.isdisjoint(client)):
            raise APIError(400, "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
                                "'/', '\\\\', or NUL.", param="cache_salt")
        body["cache_salt"] = self.derive(client)

    def __repr__(self) -> str:
        return "TenantSalt(<secret>)"


def _bucket(old: TokenBucket | None, rate: float | None, burst: float | None, now: float) -> TokenBucket | None:
    if rate is None:
        return None
    size = burst if burst is not None else rate
    if old is None:
        return TokenBucket(rate, size, now)
    old.retune(rate, size)
    return old


def _digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def _keys(settings: RouterSettings) -> list[tuple[bytes, str, Limits, Grants, frozenset[str] | None, str | None]]:
    """(digest, name, limits, grants, models, cache salt) of every configured key; per-key limits
    override the fleet's."""
    out = []
    for i, entry in enumerate(settings.api_keys):
        spec = entry if isinstance(entry, ApiKey) else ApiKey(key=entry)
        # a key's own rate comes with its own burst (default: one second's worth), never the fleet's
        requests: tuple[float | None, float | None]
        tokens: tuple[float | None, float | None]
        if spec.requests_per_s:
            requests = (spec.requests_per_s, spec.request_burst)
        else:
            requests = (settings.rate_limit_requests_per_s, spec.request_burst or settings.rate_limit_request_burst)
        if spec.prompt_tokens_per_s:
            tokens = (spec.prompt_tokens_per_s, spec.prompt_token_burst)
        else:
            tokens = (settings.rate_limit_prompt_tokens_per_s,
                      spec.prompt_token_burst or settings.rate_limit_prompt_token_burst)
        limits = Limits(*requests, *tokens)
        grants = Grants(admin=spec.admin, priority=spec.allow_priority, objective=spec.allow_objective)
        models = frozenset(spec.models) if spec.models is not None else None
        out.append((_digest(spec.key), spec.name or f"key-{i + 1}", limits, grants, models, spec.cache_salt))
    return out


class Gate:
    """Authenticates a request's bearer key and charges its caller's buckets."""

    def __init__(self, settings: RouterSettings, clock: Callable[[], float] = time.monotonic,
                 on_limited: Callable[[str], None] | None = None) -> None:
        self.clock = clock
        self.on_limited = on_limited or (lambda kind: None)
        # (caller's name, requests, prompt tokens) charged here: the booking bus sends it to the others
        self.on_spent: Callable[[str, float, float], None] | None = None
        self.callers: dict[bytes, Caller] = {}
        self.by_name: dict[str, Caller] = {}
        self.anonymous: Caller | None = None
        self.configure(settings)

    @property
    def open(self) -> bool:
        """No keys configured: anyone may call (still subject to the fleet-wide limits)."""
        return not self.callers

    def configure(self, settings: RouterSettings) -> None:
        """Adopt the keys and limits of ``settings``; buckets of keys that stay keep their level."""
        now = self.clock()
        fresh: dict[bytes, Caller] = {}
        for digest, name, limits, grants, models, salt in _keys(settings):
            caller = self.callers.get(digest) or Caller(name, limits)
            caller.name = name
            caller.grants = grants
            caller.models = models
            caller.salt = TenantSalt(salt) if salt is not None else None
            caller.retune(limits, now)
            fresh[digest] = caller
        self.callers = fresh
        self.by_name = {c.name: c for c in fresh.values()}
        fleet = Limits(settings.rate_limit_requests_per_s, settings.rate_limit_request_burst,
                       settings.rate_limit_prompt_tokens_per_s, settings.rate_limit_prompt_token_burst)
        if self.anonymous is None:
            self.anonymous = Caller(ANONYMOUS, fleet)
        self.anonymous.retune(fleet, now)

    def authenticate(self, headers: Mapping[str, str]) -> Caller:
        """The caller a request's ``Authorization: Bearer`` key names, or its ``x-api-key`` (the
        header Anthropic's SDKs send their key in, for the Messages API); 401 when keys are required
        and neither names one."""
        if not self.callers:
            assert self.anonymous is not None
            return self.anonymous
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            token = headers.get("x-api-key", "").strip()
        if token:
            caller = self.callers.get(_digest(token.encode("utf-8", "surrogateescape")))
            if caller is not None:
                return caller
        raise APIError(401, "Incorrect or missing API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                       headers={"www-authenticate": "Bearer"})

    def admit(self, headers: Mapping[str, str]) -> Caller:
        """Authenticate, then charge one request to the caller's request bucket (429 when empty)."""
        caller = self.authenticate(headers)
        if caller.requests is not None:
            wait = caller.requests.take(1.0, self.clock())
            if wait:
                self._limited("requests", caller, wait, "requests")
            if self.on_spent is not None:
                self.on_spent(caller.name, 1.0, 0.0)
        return caller

    @staticmethod
    def check_model(caller: Caller, model: str) -> None:
        """404 when the caller's key may not use ``model`` (answered as for a model that does not
        exist: another tenant's adapter is not revealed)."""
        if caller.models is not None and model not in caller.models:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def require_admin(self, caller: Caller, what: str) -> None:
        """403 unless the caller holds the admin grant (always held on an open router)."""
        if not caller.grants.admin:
            raise APIError(403, f"{what} needs an admin API key (admin: true in api_keys)")

    def check_prompt_debt(self, caller: Caller) -> None:
        """429 before the body is even read when the caller's prompt-token bucket is in debt."""
        if caller.prompt_tokens is not None:
            wait = caller.prompt_tokens.take(0.0, self.clock())
            if wait:
                self._limited("prompt-tokens", caller, wait, "prompt tokens")

    def precharge(self, caller: Caller, estimate: int) -> int:
        """Charge a cheap estimate of a request's prompt tokens before any tokenizing (429 when the
        bucket cannot take it); returns what was charged, for ``settle``."""
        if caller.prompt_tokens is None or estimate <= 0:
            return 0
        wait = caller.prompt_tokens.take(float(estimate), self.clock())
        if wait:
            self._limited("prompt-tokens", caller, wait, "prompt tokens")
        if self.on_spent is not None:
            self.on_spent(caller.name, 0.0, float(estimate))
        return estimate

    def settle(self, caller: Caller, charged: int, prompt_tokens: int) -> None:
        """The prompt was tokenized: charge what the estimate missed (the work is done, so never a
        refusal; the bucket may go into debt) or give back what it over-charged."""
        bucket = caller.prompt_tokens
        if bucket is not None and prompt_tokens != charged:
            bucket.adjust(float(prompt_tokens - charged), self.clock())
            if self.on_spent is not None:
                self.on_spent(caller.name, 0.0, float(prompt_tokens - charged))

    def charge_prompt(self, caller: Caller, prompt_tokens: int) -> None:
        """Charge a routed request's prompt tokens (429 when the caller's token bucket is empty)."""
        charged = self.precharge(caller, prompt_tokens)
        self.settle(caller, charged, prompt_tokens)

    def charge_foreign(self, name: str, requests: float, prompt_tokens: float) -> None:
        """What another router process charged the caller ``name`` (a key's name, or ``anonymous`` on an
        open router), charged here too, into debt if need be (or given back, when negative); a name
        this process does not know (another configuration) is skipped."""
        caller = self.by_name.get(name) if self.callers else \
            (self.anonymous if name == ANONYMOUS else None)
        if caller is None:
            return
        now = self.clock()
        if requests and caller.requests is not None:
            caller.requests.adjust(requests, now)
        if prompt_tokens and caller.prompt_tokens is not None:
            caller.prompt_tokens.adjust(prompt_tokens, now)

    def _limited(self, kind: str, caller: Caller, wait: float, what: str) -> None:
        self.on_limited(kind)
        limits = caller.limits
        rate = limits.requests_per_s if kind == "requests" else limits.prompt_tokens_per_s
        raise APIError(429, f"rate limit exceeded for {caller.name}: {rate:g} {what} per second; "
                            f"retry in {wait:.2f} s", headers={"retry-after": str(retry_after_s(wait))})


def install_reload(gate: Gate, reload_settings: Callable[[], RouterSettings], loop: Any) -> bool:
    """Re-read the settings on SIGHUP and hand their keys and limits to ``gate``. Other settings
    need a restart. A bad file keeps the old keys and says why (never printing the values)."""
    if not hasattr(signal, "SIGHUP"):
        return False

    def reload() -> None:
        try:
            settings = reload_settings()
        except BaseException as exc:  # noqa: BLE001 - argparse exits with SystemExit on a bad file
            log.error("config reload failed (%s); keeping the previous API keys and limits", _safe_reason(exc))
            return
        gate.configure(settings)
        log.warning("config reloaded: %d API key(s) accepted", len(gate.callers))

    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def _safe_reason(exc: BaseException) -> str:
    """Why a reload failed, without echoing any value from the file (it may hold keys)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            locs = [".".join(str(p) for p in e.get("loc", ())) for e in errors()]
            return f"{type(exc).__name__} at {', '.join(locs) or '?'}"
        except Exception:  # noqa: BLE001
            pass
    return type(exc).__name__
