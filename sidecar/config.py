"""The sidecar's settings: one typed object, read from defaults < YAML < ``KVROUTE_SIDECAR_*`` env < flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SidecarSettings(BaseSettings):
    """Everything ``kvroute sidecar`` can be told; each field is a ``--flag`` of the same name."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_SIDECAR_", extra="forbid")

    host: str = Field("0.0.0.0", description="Address the sidecar listens on")
    port: int = Field(8000, ge=1, le=65535, description="Port the sidecar listens on")
    vllm_url: str = Field("http://127.0.0.1:8001", description="Base URL of the local decode vLLM")

    data_parallel_size: int = Field(1, ge=1, le=256, description=(
        "Data-parallel engines behind the local vLLM (llm-d's --data-parallel-size): the sidecar also "
        "listens on --port+1 .. --port+N-1, one port per rank, and honours llm-d's (deprecated) "
        "x-data-parallel-host-port header naming one of them"))
    data_parallel_mode: Literal["external-lb", "internal-lb"] = Field("external-lb", description=(
        "How rank r is reached: external-lb, vLLM runs one API server per rank on --vllm-url's port + r; "
        "internal-lb, one API server for every rank, and the request carries X-data-parallel-rank: r"))
    pod_ip: str | None = Field(None, description=(
        "This pod's IP (set it from the Downward API): the host an x-data-parallel-host-port header "
        "names; loopback and --host are always accepted"))

    prefill_timeout: float = Field(60.0, gt=0, description="Seconds the whole prefill leg may take")
    decode_timeout: float = Field(600.0, gt=0, description=(
        "Longest wait in seconds for the decoder's next bytes (response headers or the next chunk)"))
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to open a connection to either leg")
    fallback_on_prefill_error: bool = Field(True, description=(
        "On a prefill connection error, timeout or 5xx, prefill locally on the decode pod instead of failing"))
    prefill_scheme: Literal["http", "https"] = Field("http", description=(
        "Scheme for the prefill leg when the target names none"))
    prefill_ca_file: str | None = Field(None, description=(
        "CA bundle (PEM) that signs the prefill pods' HTTPS certificates (default: the system's CAs)"))
    prefill_tls_verify: bool = Field(True, description=(
        "Verify prefill pods' HTTPS certificates; --no-prefill-tls-verify accepts any certificate"))

    ssrf_protection: bool = Field(True, description=(
        "Only send prefill legs to allowlisted hosts; --no-ssrf-protection lets any target through"))
    prefill_sampling: bool = Field(False, description=(
        "When the prefill header names several targets, pick one uniformly at random (llm-d's "
        "--enable-prefiller-sampling); off: the first"))
    prefill_allowlist: list[str] = Field(default_factory=list, description=(
        'Allowed prefill targets as a JSON list: IPs, CIDRs, hostnames, each optionally with :port, '
        'e.g. ["10.0.0.0/8", "[fd00::1]:8000", "prefill.ns.svc:8000"]'))
    prefill_allow_dns: list[str] = Field(default_factory=list, description=(
        "DNS names (optionally name:port) whose addresses are allowed, re-resolved every --dns-refresh-s"))
    dns_refresh_s: float = Field(30.0, gt=0, description="Seconds between re-resolutions of allowlisted names")
    prefill_allowlist_url: str | None = Field(None, description=(
        'URL answering a JSON list of allowed "host:port" prefill targets (e.g. the router\'s '
        '/internal/prefill-pods), fetched every --allowlist-refresh-s'))
    prefill_allowlist_key: str | None = Field(None, repr=False, description=(
        "Bearer key sent when fetching --prefill-allowlist-url (an admin API key of a router with api_keys); "
        "a secret: give it by env var or the YAML file, not this flag (a command line is visible to other "
        "processes)"))
    allowlist_refresh_s: float = Field(10.0, gt=0, description="Seconds between fetches of --prefill-allowlist-url")
    target_dns_cache_s: float = Field(5.0, ge=0, description=(
        "Seconds a prefill target name's resolved addresses are reused"))

    strip_client_kv_transfer_params: bool = Field(True, description=(
        "Drop kv_transfer_params sent by the client (they could point the decoder at any host)"))
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0, description="Largest request body accepted, in bytes")
    max_prefill_answer_bytes: int = Field(8 * 1024 * 1024, gt=0, description=(
        "Largest prefill answer read, in bytes; a larger one is an unusable answer (a local prefill "
        "with --fallback-on-prefill-error)"))
    body_timeout_s: float = Field(30.0, gt=0, description=(
        "A request body must arrive within this many seconds (408 after; bounds slow clients)"))
    header_timeout_s: float = Field(10.0, gt=0, description=(
        "A connection must send a request's complete headers within this many seconds (from connecting, "
        "or from its first byte); closed after"))
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="Largest request line plus headers (431 above)")
    keep_alive_s: float = Field(60.0, gt=0, description="An idle keep-alive connection is closed after this long")
    max_connections: int = Field(4096, ge=0, description="Upstream connection pool size (0 = unlimited)")

    ssl_certfile: str | None = Field(None, description="TLS certificate for the listener (enables HTTPS)")
    ssl_keyfile: str | None = Field(None, description="TLS private key for the listener")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level")
    log_format: Literal["text", "json"] = Field("text", description=(
        "Log lines: text (time level logger: message) or json (one object per line: ts, level, logger, pid, "
        "msg, exc)"))

    @field_validator("vllm_url", "prefill_allowlist_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value.rstrip("/")

    @field_validator("prefill_allowlist_key")
    @classmethod
    def _bearer_key(cls, value: str | None) -> str | None:
        # the message never holds the value: it is a secret
        if value is not None and (not value or not all("!" <= ch <= "~" for ch in value)):
            raise ValueError("expected a non-empty key of printable ASCII characters without spaces")
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> SidecarSettings:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        if self.port + self.data_parallel_size - 1 > 65535:
            raise ValueError(f"--port {self.port} leaves no room for {self.data_parallel_size} rank ports")
        return self
