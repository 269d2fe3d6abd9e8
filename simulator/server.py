"""The simulated pod's HTTP surface (vLLM's OpenAI server), as a plain ASGI app.

Plain ASGI rather than a framework keeps the hot path to: read the body, ``orjson.loads``, validate
by hand, hash the prompt's blocks, wait for tokens, write bytes. One process can run several pods
(``--count``): one uvicorn server listens on every pod's socket and ``MultiPodApp`` picks the pod by
the local port of the connection.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/chat/completions/batch``
(vLLM 0.32's batch of conversations, one whole answer), ``POST /v1/responses``,
``GET /v1/responses/{response_id}``, ``POST /v1/responses/{response_id}/cancel``, ``POST /v1/messages``,
``POST /v1/messages/count_tokens`` (Anthropic's Messages API), ``POST /inference/v1/generate`` (vLLM 0.32's
token-in generation), ``GET /v1/models``,
``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache``,
``GET /metrics``; simulator-only: ``GET|POST /sim/faults``, ``GET /sim/state``,
``POST /sim/nixl/read``, ``POST /sim/nixl/release``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import zmq
import zmq.asyncio
from prometheus_client import CONTENT_TYPE_LATEST

from indexer.messages import disabled_thinking_effort, merges_inline_system
from indexer.responses import Unrenderable
from indexer.responses import chat_body as responses_chat_body
from indexer.tokens import ChatTemplateError, Tokenizer, load_tokenizer
from kvcommon import asgi
from kvcommon.asgi import header
from kvcommon.errors import APIError, ClientDisconnected, error_body, error_payload
from kvcommon.transfer import wants_prompt_logprobs
from simulator import anthropic_shapes as anthropic
from simulator.engine import CostEngine, OutputTokens, SeedEngine
from simulator.events import KVEventsConfig
from simulator.faults import FaultError, Faults, RequestFaults
from simulator.hashing import BlockHasher
from simulator.metrics import PodMetrics, merge_expositions
from simulator.nixl import LeaseTable, decode_params_problem, producer_params, remote_read
from simulator.openai_shapes import (
    ERROR_TYPES,
    VALIDATION_TYPE,
    GenRequest,
    ShapeError,
    chat_batch_conversations,
    chat_body,
    chat_choice,
    chat_chunk,
    chat_ids_of,
    chat_role_chunk,
    check_object,
    completion_body,
    completion_chunk,
    content_part_event,
    error_input,
    fingerprint,
    generate_body,
    generate_chunk,
    generate_usage_chunk,
    invalid,
    models_body,
    output_item_event,
    output_message,
    output_text_part,
    parse_generation,
    response_event,
    response_object,
    response_request_fields,
    response_state_event,
    response_usage,
    running_usage,
    text_delta_event,
    text_done_event,
    token_request,
    usage,
    usage_chunk,
    validation_message,
    vllm_validation_error,
)
from simulator.publisher import EventPublisher
from simulator.request import FINISH, SimRequest
from simulator.settings import SimSettings
from simulator.tasks import cancel_and_wait

log = logging.getLogger("kvroute.sim")

MAX_BODY_BYTES = 64 * 1024 * 1024
VLLM_VERSION = "0.33.0"   # what /version answers and system_fingerprint names
JSON_HEADERS = [(b"content-type", b"application/json")]
KEEP_ALIVE = b": keep-alive\n\n"   # vLLM's SSE_KEEP_ALIVE_COMMENT (--sse-keep-alive-interval)
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]  # as vLLM 0.32: no cache-control


class SimulatedDrop(Exception):
    """Raised inside a response to make the server cut the connection (the drop fault, and vLLM's
    streamed retrieval of a response it kept no events of)."""


class _DropFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SimulatedDrop)


# vLLM's type for the Responses API's own errors (``create_error_response(err_type=...)`` in
# vllm/entrypoints/openai/responses/serving.py), not the status's name
RESPONSES_ERROR_TYPE = "invalid_request_error"


def response_not_found(response_id: str) -> ShapeError:
    """vLLM 0.32's ``_make_not_found_error``: an id its store does not hold (or no store at all)."""
    return ShapeError(f"Response with id '{response_id}' not found.", status=404, param="response_id",
                      err_type=RESPONSES_ERROR_TYPE)


class EventLog:
    """A background stream's events as its run sent them (vLLM's ``event_store``): the ASGI ``send``
    the run streams into, followed by the stream the POST answers and by ``GET ...?stream=true``."""

    COMPLETED = b"event: response.completed\n"

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.ended = False
        self._changed = asyncio.Event()

    async def __call__(self, message: dict) -> None:
        if message.get("body"):
            self.events.append(message["body"])
            self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """The events from index ``start`` (a negative one counts from the end, as vLLM's indexing of
        its deque does), through ``response.completed``. Where vLLM then waits forever (a run cancelled
        before that event, a start past a finished stream's end) this ends once the run has."""
        i = start
        while True:
            while i < len(self.events):
                if i < -len(self.events):   # vLLM's deque raises there: its stream fails
                    raise SimulatedDrop("starting_after before the first event")
                event = self.events[i]
                yield event
                if event.startswith(self.COMPLETED):
                    return
                i += 1
            if self.ended:
                return
            self._changed.clear()
            await self._changed.wait()


@dataclass
class StoredResponse:
    """A response as vLLM's two stores keep it: the response object (``response_store``) and the chat
    messages its prompt was rendered from (``msg_store``), with its output text; a background one's
    run until it ends, and a background stream's events."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    text: str
    run: asyncio.Task | None = None
    events: EventLog | None = None


class ResponseStore:
    """vLLM's Responses store (``VLLM_ENABLE_RESPONSES_API_STORE=1``), in memory, by response id; unlike
    vLLM's it is bounded: past ``max_entries`` the oldest stored is dropped, and a background run whose
    entry is dropped or replaced is cancelled with it, so the runs are bounded too. One per HTTP server:
    a data-parallel pod's engines share it, as they share vLLM's API server."""

    MAX_EVENT_LOGS = 256   # a stream's events are about one per output token: a bound on their memory

    def __init__(self, enabled: bool, max_entries: int):
        self.enabled = enabled
        self.max_entries = max_entries
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._runs: set[asyncio.Task] = set()
        self._logs: OrderedDict[str, None] = OrderedDict()   # the background streams whose events are kept

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id) if self.enabled else None

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        old = self._items.pop(response_id, None)   # a reused request_id replaces it, as vLLM's dict does
        if old is not None:
            self._drop(old)
        self._items[response_id] = entry
        while len(self._items) > self.max_entries:
            self._drop(self._items.popitem(last=False)[1])

    @staticmethod
    def _drop(entry: StoredResponse) -> None:
        # a run replacing its own entry with its finished response goes on
        if entry.run is not None and entry.run is not asyncio.current_task():
            entry.run.cancel()

    def run_in_background(self, response_id: str, entry: StoredResponse, work: Coroutine[Any, Any, None]) -> None:
        """Store ``entry`` and run ``work`` for it past the request that made it (vLLM's
        ``background_tasks``). The events of the last ``MAX_EVENT_LOGS`` background streams are kept
        for retrieval (an older one's retrieval is then answered as for a response with none); vLLM
        keeps them all, as long as its process lives."""
        entry.run = task = asyncio.get_running_loop().create_task(work)
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)
        self.put(response_id, entry)
        if entry.events is not None:
            self._logs[response_id] = None
            while len(self._logs) > self.MAX_EVENT_LOGS:
                old = self._items.get(self._logs.popitem(last=False)[0])
                if old is not None:
                    old.events = None

    async def stop(self) -> None:
        for task in list(self._runs):
            await cancel_and_wait(task)


class Pod:
    """One simulated vLLM pod: engine, cache, event publisher, NIXL leases, metrics, faults."""

    def __init__(self, settings: SimSettings, index: int, port: int, tokenizer: Tokenizer,
                 zmq_ctx: zmq.Context, zmq_actx: zmq.asyncio.Context, http: httpx.AsyncClient,
                 events_config: KVEventsConfig | None, rank: int = 0):
        s = self.settings = settings
        self.rank = rank  # its data-parallel rank (one Pod object per engine; see DataParallelApp)
        self.index = index
        self.port = port
        self.host = s.host
        suffix = f"-{index}" if s.count > 1 else ""
        self.name = (s.pod_name + suffix) if s.pod_name else f"{s.host}:{port}"
        self.engine_id = (s.engine_id + suffix) if s.engine_id else f"sim-{port}"
        self.model = s.model
        self.tokenizer = tokenizer
        self.http = http
        self.created = int(time.time())
        self.fingerprint = fingerprint(VLLM_VERSION, s.model, s.max_model_len, s.block_size, s.num_gpu_blocks,
                                       s.prefix_caching_hash_algo)
        # vLLM's API server adds up its engines' blocks (core_client.py, _apply_ready_response) and shows
        # that sum under every engine's label: a data-parallel pod's engines each report all of them
        cache_info = {"block_size": str(s.block_size), "num_gpu_blocks": str(s.num_gpu_blocks * s.data_parallel_size),
                      "enable_prefix_caching": "True", "cache_dtype": "auto", "prefix_caching_hash_algo": "sha256",
                      "gpu_memory_utilization": "0.9", "num_cpu_blocks": "None"}
        self.metrics = PodMetrics(s.model, str(rank), cache_info)
        self.kv_waiting = 0   # decode requests waiting for their NIXL read (vLLM: waiting, reason "deferred")
        self.faults = Faults(s.fault_status, s.fault_delay_s, s.fault_drop_after_chunks, s.fault_events_stop,
                             s.fault_slowdown, s.fault_eos_after)
        self.events_config = events_config
        self.publisher: EventPublisher | None = None
        if events_config is not None and events_config.enabled:
            self.publisher = EventPublisher(events_config, self.metrics, zmq_ctx, zmq_actx, dp_rank=rank)
            self.publisher.stopped = self.faults.events_stop
        engine_cls = SeedEngine if s.timing == "seed" else CostEngine
        self.engine = engine_cls(s, self.metrics, self.faults, self._publish,
                                 OutputTokens(lambda text: tokenizer.encode(text, add_special_tokens=False)))
        self.engine.on_release = self._lease_blocks
        self.leases = LeaseTable(self.metrics, s.nixl_lease_timeout_s)
        self.hasher = BlockHasher(s.prefix_caching_hash_algo, s.hash_seed)
        # LoRA adapters: name -> (vLLM's adapter id, path); ids count from 1 in --lora-modules order
        self.loras = {name.strip(): (i + 1, path.strip()) for i, (name, _, path) in
                      enumerate(m.partition("=") for m in s.lora_modules)}
        # an adapter loaded at run time takes the next id (vLLM's lora_id_counter: never one reused)
        self.lora_ids = itertools.count(len(self.loras) + 1)
        self.max_prompt_tokens = s.num_gpu_blocks * s.block_size
        self._ids = itertools.count()
        self._token_text: dict[int, str] = {}
        self.responses = ResponseStore(s.responses_store, s.responses_store_size)

    @property
    def merge_inline_system(self) -> bool:
        return anthropic_template_choices(self.tokenizer)[0]

    @property
    def disabled_thinking_effort(self) -> str:
        return anthropic_template_choices(self.tokenizer)[1]

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()
        self.leases.start()
        if self.publisher is not None:
            self.publisher.start()

    async def stop(self) -> None:
        await self.responses.stop()   # first: a background run waits on the engine
        await self.engine.stop()
        await self.leases.stop()
        if self.publisher is not None:
            await self.publisher.close()

    def render_metrics(self) -> bytes:
        m = self.metrics
        m.running.set(self.engine.num_running)
        # as vLLM: a request waiting for its KV counts as waiting, under reason="deferred"
        m.waiting.set(self.engine.num_waiting + self.kv_waiting)
        m.waiting_capacity.set(self.engine.num_waiting)
        m.waiting_deferred.set(self.kv_waiting)
        m.kv_usage.set(self.engine.usage())
        return m.render()

    def _publish(self, events: list) -> None:
        if self.publisher is not None:
            self.publisher.stopped = self.faults.events_stop
            self.publisher.publish(events)

    def _lease_blocks(self, req: SimRequest) -> None:
        ids = list(req.block_ids)
        req.block_ids = []
        self.leases.add(req.request_id, ids, req.n_prompt, release=lambda: self.engine.release_blocks(ids))

    def text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def state(self) -> dict[str, Any]:
        pool = self.engine.pool
        return {"pod": self.name, "engine_id": self.engine_id, "port": self.port, "model": self.model,
                "timing": self.settings.timing, "block_size": pool.block_size, "num_gpu_blocks": pool.num_blocks,
                "cached_blocks": len(pool.cached), "free_blocks": pool.num_free,
                "running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "leases": {rid: len(lease.block_ids) for rid, lease in self.leases.leases.items()},
                "events": None if self.publisher is None or self.events_config is None else {
                    "endpoint": self.events_config.endpoint, "replay_endpoint": self.events_config.replay_endpoint,
                    "topic": self.events_config.topic, "next_seq": self.publisher.seq,
                    "stopped": self.publisher.stopped},
                "faults": self.faults.as_dict()}


_TEMPLATE_CHOICES: dict[int, tuple[Tokenizer, tuple[bool, str]]] = {}


def anthropic_template_choices(tokenizer: Tokenizer) -> tuple[bool, str]:
    """What vLLM 0.32's Messages API decides once from the pod's chat template: whether inline system
    messages are merged into the leading one, and the ``reasoning_effort`` of a disabled ``thinking``
    (``indexer.messages``' probes of the template, made once per tokenizer, on the first Messages
    request); vLLM's defaults (False, "none") for a tokenizer whose template cannot be resolved."""
    hit = _TEMPLATE_CHOICES.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    if getattr(tokenizer, "resolve_template", None) is None:
        choices = (False, "none")
    else:
        choices = (merges_inline_system(tokenizer), disabled_thinking_effort(tokenizer))
    _TEMPLATE_CHOICES[id(tokenizer)] = (tokenizer, choices)
    return choices


# --- ASGI plumbing -------------------------------------------------------------------------------
Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


async def read_body(scope: dict, receive: Receive) -> bytes:
    """The request body: a ``ShapeError`` past ``MAX_BODY_BYTES`` (413), ``ConnectionResetError`` when
    the client leaves first."""
    try:
        return await asgi.read_body(scope, receive, MAX_BODY_BYTES)
    except ClientDisconnected:
        raise ConnectionResetError("client went away") from None
    except APIError as exc:
        raise ShapeError(exc.message, status=exc.status) from None


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, status: int, obj: Any, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await respond(send, status, orjson.dumps(obj), JSON_HEADERS + list(extra))


async def respond_error(send: Send, status: int, message: str, param: str | None = None,
                        extra: Sequence[tuple[bytes, bytes]] = (), err_type: str | None = None) -> None:
    body = error_body(status, message, param, err_type=err_type or ERROR_TYPES.get(status, "Error"))
    await respond(send, status, body, JSON_HEADERS + list(extra))


async def _status_fault(pod: Pod, faults: RequestFaults, send: Send, echo: list, messages: bool = False) -> bool:
    """Answer a request's status fault, if it has one (in the Messages API's shape on that route):
    whether it did."""
    if faults.status is None:
        return False
    pod.metrics.faults.labels("status").inc()
    message = f"simulated fault: status {faults.status}"
    if messages:
        await respond_messages_error(send, faults.status, message, extra=echo)
    else:
        await respond_error(send, faults.status, message, extra=echo)
    return True


async def respond_messages_error(send: Send, status: int, message: str, extra: Sequence[tuple[bytes, bytes]] = (),
                                 err_type: str | None = None) -> None:
    """An error of the Messages API after its request validation: Anthropic-shaped."""
    await respond(send, status, anthropic.error_body(status, message, err_type), JSON_HEADERS + list(extra))


def parse_json(raw: bytes) -> Any:
    """The JSON body; what FastAPI makes of a bad one in vLLM: a request-validation error ("Bad
    Request") naming ``body.<offset>`` (``json_invalid``, fastapi/routing.py) or ``body`` (none)."""
    if not raw.strip():
        raise ShapeError(validation_message({"type": "missing", "loc": "body", "msg": "Field required",
                                             "input": "None"}), param="body", err_type=VALIDATION_TYPE)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            json.loads(raw)
        except json.JSONDecodeError as exc:   # Python's message and offset, as FastAPI reports them
            msg, pos = exc.msg, exc.pos
        except ValueError as exc:
            msg, pos = str(exc), 0
        else:
            msg, pos = "Invalid JSON", 0
        raise ShapeError(validation_message({"type": "json_invalid", "loc": f"body.{pos}",
                                             "msg": "JSON decode error", "input": "<dict of 0 items>",
                                             "ctx": {"error": msg}}),
                         param=f"body.{pos}", err_type=VALIDATION_TYPE) from None


MEDIA_TYPE_MESSAGE = "Unsupported Media Type: Only 'application/json' is allowed"


def parse_json_request(scope: dict, raw: bytes) -> Any:
    """The JSON body of a request to one of vLLM's JSON routes, in FastAPI's order there: a body
    declared as JSON (or not declared) is parsed first, so bad JSON is what is reported; then vLLM's
    ``validate_json_request`` refuses any media type but ``application/json`` (a 400, "Bad Request")."""
    ctype = header(scope, b"content-type")
    media = (ctype or "").split(";", 1)[0]   # as vLLM splits it: lower-cased, not stripped
    main, _, sub = media.strip().lower().partition("/")
    body = None
    if raw and (not ctype or (main == "application" and (sub == "json" or sub.endswith("+json")))):
        body = parse_json(raw)
    if media.lower() != "application/json":   # a dependency: before the body's own validation
        raise ShapeError(validation_message(MEDIA_TYPE_MESSAGE), err_type=VALIDATION_TYPE)
    return parse_json(raw) if body is None else body


async def read_tokenizer_request(scope: dict, receive: Receive, model: str, adapters: Container[str] = ()) -> dict:
    """The JSON object body of /tokenize or /detokenize, naming this pod's model, one of its adapters or
    none (vLLM's checks)."""
    body = parse_json_request(scope, await read_body(scope, receive))
    if not isinstance(body, dict):
        raise ShapeError("request body must be a JSON object")
    name = body.get("model")
    if name not in (None, "", model) and name not in adapters:
        raise ShapeError(f"The model `{name}` does not exist. Valid aliases: {model}.", status=404, param="model")
    return body


async def read_lease_request(scope: dict, receive: Receive) -> tuple[dict, str]:
    """The JSON body of a NIXL read or release and the request id whose lease it names."""
    body = parse_json(await read_body(scope, receive))
    rid = body.get("remote_request_id") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise ShapeError("'remote_request_id' must be a string", param="remote_request_id")
    return body, rid


async def watch_disconnect(receive: Receive, on_gone: Callable[[], None]) -> None:
    await asgi.wait_for_disconnect(receive)
    on_gone()


# --- the app -------------------------------------------------------------------------------------
def runtime_lora_updating() -> bool:
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``1`` or ``true``, any case): the server then serves
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def lora_request(body: Any, load: bool) -> tuple[str, str, bool]:
    """(lora_name, lora_path, load_inplace) of a load or unload request (vLLM's
    ``LoadLoRAAdapterRequest``, ``UnloadLoRAAdapterRequest``: a field of the wrong type is the request
    model's 400). The adapter's files are not read: the simulator holds no weights."""
    if not isinstance(body, dict):
        raise ShapeError("Input should be a valid dictionary or object to extract fields from", param="body")
    fields = (("lora_name", str), ("lora_path", str), ("load_inplace", bool)) if load else (("lora_name", str),)
    for key, kind in fields:
        if key in body and not isinstance(body[key], kind):
            raise invalid(key, f"Input should be a valid {'string' if kind is str else 'boolean'}")
    if "lora_name" not in body or (load and "lora_path" not in body):
        missing = "lora_name" if "lora_name" not in body else "lora_path"
        raise invalid(missing, "Field required")
    return body["lora_name"], body.get("lora_path", ""), body.get("load_inplace", False)


def build_app(pod: Pod):
    """The ASGI app of one pod."""
    routes: dict[tuple[str, str], Callable] = {}
    # paths with one parameter ("/v1/responses/{response_id}/cancel"): (method, prefix, name, suffix, fn)
    param_routes: list[tuple[str, str, str, str, Callable]] = []

    def route(method: str, path: str):
        def deco(fn):
            if "{" in path:
                prefix, _, rest = path.partition("{")
                name, _, suffix = rest.partition("}")
                param_routes.append((method, prefix, name, suffix, fn))
            else:
                routes[(method, path)] = fn
            return fn
        return deco

    def match_param_route(method: str, path: str) -> tuple[Callable | None, dict[str, str] | None]:
        """The handler and path parameters of a parameterized route matching ``path`` (the parameter one
        non-empty segment, as Starlette's ``{name}``); handler None with parameters: only another method."""
        found = None
        for m, prefix, name, suffix, fn in param_routes:
            if not (path.startswith(prefix) and path.endswith(suffix)) or len(path) <= len(prefix) + len(suffix):
                continue
            value = path[len(prefix):len(path) - len(suffix)]
            if "/" in value:
                continue
            if m == method:
                return fn, {name: value}
            found = {name: value}
        return None, found

    @route("POST", "/v1/completions")
    async def completions(scope, receive, send):
        await generate(pod, "completion", scope, receive, send)

    @route("POST", "/v1/chat/completions")
    async def chat(scope, receive, send):
        await generate(pod, "chat", scope, receive, send)

    @route("POST", "/v1/chat/completions/batch")
    async def chat_batch(scope, receive, send):
        await generate_batch(pod, scope, receive, send)

    @route("POST", "/inference/v1/generate")
    async def generate_from_tokens(scope, receive, send):
        await generate_tokens(pod, scope, receive, send)

    @route("POST", "/v1/responses")
    async def responses_create(scope, receive, send):
        await generate(pod, "responses", scope, receive, send)

    @route("GET", "/v1/responses/{response_id}")
    async def responses_retrieve(scope, receive, send):
        rid = scope["path_params"]["response_id"]
        stream, starting_after = _retrieve_query(scope)
        entry = pod.responses.get(rid)
        if entry is None:
            raise response_not_found(rid)
        if not stream:
            await respond_json(send, 200, entry.response)
        elif entry.events is None:
            # vLLM keeps the events of background streams only: for another response its stream
            # fails once started, and the connection is cut
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            raise SimulatedDrop("no events kept for this response")
        else:
            await _send_events(pod, entry.events, 0 if starting_after is None else starting_after + 1, None,
                               send, [])

    @route("POST", "/v1/responses/{response_id}/cancel")
    async def responses_cancel(scope, receive, send):
        await read_body(scope, receive)
        rid = scope["path_params"]["response_id"]
        entry = pod.responses.get(rid)
        if entry is None:
            raise response_not_found(rid)
        if entry.response["status"] not in ("queued", "in_progress"):   # finished (or cancelled already)
            raise ShapeError("Cannot cancel a synchronous response.", param="response_id",
                             err_type=RESPONSES_ERROR_TYPE)
        entry.response["status"] = "cancelled"   # kept so: the run stores nothing over it
        await cancel_and_wait(entry.run)          # which aborts its engine request
        await respond_json(send, 200, entry.response)

    @route("POST", "/v1/messages")
    async def messages_create(scope, receive, send):
        await generate(pod, "messages", scope, receive, send)

    @route("POST", "/v1/messages/count_tokens")
    async def messages_count_tokens(scope, receive, send):
        chat = prepare_messages(pod, parse_json_request(scope, await read_body(scope, receive)), count_tokens=True)
        await respond_json(send, 200, anthropic.count_body(len(messages_prompt_ids(pod, chat))))

    @route("GET", "/v1/models")
    async def models(scope, receive, send):
        await respond_json(send, 200, models_body(pod.model, pod.settings.max_model_len, pod.created,
                                                  {n: path for n, (_, path) in pod.loras.items()}))

    @route("GET", "/health")
    async def health(scope, receive, send):
        await respond(send, 200, b"", [])

    @route("GET", "/version")
    async def version(scope, receive, send):
        await respond_json(send, 200, {"version": VLLM_VERSION})

    @route("GET", "/kv_event_sources")
    async def kv_event_sources(scope, receive, send):
        await respond_json(send, 200, event_sources([pod]))

    @route("GET", "/metrics")
    async def metrics(scope, receive, send):
        await respond(send, 200, pod.render_metrics(), [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    @route("POST", "/reset_prefix_cache")
    async def reset(scope, receive, send):
        await read_body(scope, receive)
        pod.engine.reset_prefix_cache()
        await respond(send, 200, b"", [])

    @route("POST", "/tokenize")
    async def tokenize(scope, receive, send):
        body = await read_tokenizer_request(scope, receive, pod.model, pod.loras)
        if "messages" in body:
            ids = chat_ids_of(body, pod.tokenizer, api="tokenize")
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ShapeError("'prompt' must be a string", param="prompt")
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise ShapeError("'add_special_tokens' must be a boolean", param="add_special_tokens")
            ids = pod.tokenizer.encode(prompt, add_special_tokens=add)
        out = {"count": len(ids), "max_model_len": pod.settings.max_model_len, "tokens": ids, "token_strs": None}
        if body.get("return_token_strs"):
            tok_str = getattr(pod.tokenizer, "token_str", None)
            out["token_strs"] = [tok_str(t) if tok_str else pod.text_of(t) for t in ids]
        await respond_json(send, 200, out)

    @route("POST", "/detokenize")
    async def detokenize(scope, receive, send):
        body = await read_tokenizer_request(scope, receive, pod.model, pod.loras)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise ShapeError("'tokens' must be a list of non-negative integers", param="tokens")
        await respond_json(send, 200, {"prompt": pod.tokenizer.decode(tokens)})

    if runtime_lora_updating():
        @route("POST", "/v1/load_lora_adapter")
        async def load_lora_adapter(scope, receive, send):
            name, path, inplace = lora_request(parse_json_request(scope, await read_body(scope, receive)), True)
            if not name or not path:
                raise ShapeError("Both 'lora_name' and 'lora_path' must be provided.", err_type="InvalidUserInput")
            if name == pod.model:
                raise ShapeError(f"The lora adapter '{name}' conflicts with a served base model.",
                                 err_type="InvalidUserInput")
            if name in pod.loras and not inplace:
                raise ShapeError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                 "adapter in place, set 'load_inplace' to True.", err_type="InvalidUserInput")
            pod.loras[name] = (pod.loras[name][0] if name in pod.loras else next(pod.lora_ids), path)
            await respond(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), [])

        @route("POST", "/v1/unload_lora_adapter")
        async def unload_lora_adapter(scope, receive, send):
            name, _, _ = lora_request(parse_json_request(scope, await read_body(scope, receive)), False)
            if not name:
                raise ShapeError("'lora_name' needs to be provided to unload a LoRA adapter.",
                                 err_type="InvalidUserInput")
            if name not in pod.loras:
                raise ShapeError(f"The lora adapter '{name}' cannot be found.", status=404, err_type="NotFoundError")
            del pod.loras[name]
            await respond(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), [])

    @route("GET", "/sim/faults")
    async def get_faults(scope, receive, send):
        await respond_json(send, 200, pod.faults.as_dict())

    @route("POST", "/sim/faults")
    async def set_faults(scope, receive, send):
        body = parse_json(await read_body(scope, receive))
        try:
            pod.faults.update(body)
        except FaultError as exc:
            raise ShapeError(str(exc)) from exc
        if pod.publisher is not None:
            pod.publisher.stopped = pod.faults.events_stop
            if body.get("events_restart"):
                pod.publisher.restart()
                pod.engine.forget_cache()
                pod.metrics.faults.labels("events_restart").inc()
        await respond_json(send, 200, pod.faults.as_dict())

    @route("GET", "/sim/state")
    async def state(scope, receive, send):
        await respond_json(send, 200, pod.state())

    @route("POST", "/sim/nixl/read")
    async def nixl_read(scope, receive, send):
        body, rid = await read_lease_request(scope, receive)
        if body.get("remote_engine_id") != pod.engine_id:
            raise ShapeError(f"this is engine {pod.engine_id!r}, not {body.get('remote_engine_id')!r}",
                             status=404, param="remote_engine_id")
        lease = pod.leases.get(rid)
        if lease is None:
            raise ShapeError(f"no leased blocks for request {rid!r} (read already, expired or unknown)",
                             status=404, param="remote_request_id")
        pod.metrics.nixl_reads.inc()
        await respond_json(send, 200, {"num_blocks": len(lease.block_ids), "num_tokens": lease.num_tokens,
                                       "block_size": pod.settings.block_size, "block_ids": lease.block_ids})

    @route("POST", "/sim/nixl/release")
    async def nixl_release(scope, receive, send):
        _, rid = await read_lease_request(scope, receive)
        await respond_json(send, 200, {"released": pod.leases.end(rid)})

    known_paths = {p for _, p in routes}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        handler = routes.get((scope["method"], scope["path"]))
        if handler is None and param_routes:
            handler, params = match_param_route(scope["method"], scope["path"])
            if handler is not None:
                scope = {**scope, "path_params": params}
            elif params is not None:
                await respond_json(send, 405, {"detail": "Method Not Allowed"})
                return
        if handler is None:
            if scope["path"] in known_paths:
                await respond_json(send, 405, {"detail": "Method Not Allowed"})
            else:
                await respond_json(send, 404, {"detail": "Not Found"})
            return
        try:
            await handler(scope, receive, send)
        except anthropic.MessagesError as exc:
            await respond_messages_error(send, exc.status, exc.message, err_type=exc.err_type)
        except ShapeError as exc:
            await respond_error(send, exc.status, exc.message, exc.param, err_type=exc.err_type)
        except (SimulatedDrop, ConnectionResetError):
            raise
        except Exception as exc:  # never a stack trace to the client
            log.exception("request failed")
            await respond_error(send, 500, f"internal error: {type(exc).__name__}")

    app.pod = pod  # type: ignore[attr-defined]
    return app


class MultiPodApp:
    """One ASGI app in front of several pods, picked by the local port of the connection."""

    def __init__(self, apps_by_port: dict[int, Any]):
        self.apps = apps_by_port

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            first = next(iter(self.apps.values()))
            await first(scope, receive, send)
            return
        server = scope.get("server")
        app = self.apps.get(server[1]) if server else None
        if app is None:
            app = next(iter(self.apps.values()))
        await app(scope, receive, send)


def check_rank_header(scope: dict, engines: int) -> int | None:
    """The engine a request's ``X-data-parallel-rank`` names, as vLLM 0.32 reads it: not an integer,
    none (``_get_data_parallel_rank`` in entrypoints/generate/base/serving.py); outside the engines
    the server fronts, a 400 (``InputProcessor.process_inputs``), a one-engine server included."""
    raw = next((v for k, v in scope["headers"] if k.lower() == b"x-data-parallel-rank"), None)
    if raw is None:
        return None
    try:
        rank = int(raw.decode("latin-1"))
    except ValueError:
        return None
    if not 0 <= rank < engines:
        raise ShapeError(f"data_parallel_rank {rank} is out of range [0, {engines}).")
    return rank


class DataParallelApp:
    """One pod's HTTP server in front of its data-parallel engines, as vLLM's API server with
    ``--data-parallel-size N``: a generation request goes to the rank its ``X-data-parallel-rank``
    header names (a rank out of range is a 400, a header that is not an integer is ignored), else to
    the engine vLLM's balancer would pick (``DPLBAsyncMPClient``: the least ``max(in flight, waiting +
    running)``, waiting weighed up when the KV cache is over half full, ties broken by a rotating
    start); it never looks at the cache. /metrics has every engine's samples under its ``engine``
    label; /reset_prefix_cache resets every engine; everything else is rank 0's."""

    GENERATION = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
                            "/v1/responses", "/v1/messages", "/inference/v1/generate"})

    def __init__(self, pods: list[Pod]):
        self.pods = pods
        for p in pods[1:]:  # one server: an adapter loaded at run time (on rank 0's routes) is every engine's
            p.loras, p.lora_ids = pods[0].loras, pods[0].lora_ids
        self.apps = [build_app(p) for p in pods]
        self.inflight = [0] * len(pods)
        self._start = 0

    def pick(self) -> int:
        best, best_score = 0, float("inf")
        n = len(self.pods)
        for i in range(n):
            idx = (self._start + i) % n
            e = self.pods[idx].engine
            waiting = e.num_waiting + self.pods[idx].kv_waiting
            score: float = max(self.inflight[idx], waiting + e.num_running)
            if waiting:
                score += waiting * 6.0 * max(0.0, e.usage() - 0.5)
            if score < best_score:
                best, best_score = idx, score
        self._start = (self._start + 1) % n
        return best

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.apps[0](scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path == "/metrics" and method == "GET":
            body = merge_expositions([p.render_metrics() for p in self.pods])
            await respond(send, 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])
            return
        if path == "/kv_event_sources" and method == "GET":
            await respond_json(send, 200, event_sources(self.pods))
            return
        if path == "/reset_prefix_cache" and method == "POST":
            await read_body(scope, receive)
            for p in self.pods:
                p.engine.reset_prefix_cache()
            await respond(send, 200, b"", [])
            return
        if path not in self.GENERATION or method != "POST":
            await self.apps[0](scope, receive, send)
            return
        try:
            rank = check_rank_header(scope, len(self.pods))
        except ShapeError as exc:
            if path == "/v1/messages":
                await respond_messages_error(send, 400, exc.message)
            else:
                await respond_error(send, 400, exc.message)
            return
        if rank is None:
            rank = self.pick()
        self.inflight[rank] += 1
        try:
            await self.apps[rank](scope, receive, send)
        finally:
            self.inflight[rank] -= 1


# --- generation ----------------------------------------------------------------------------------
@dataclass
class ResponsesCall:
    """What a Responses request (``POST /v1/responses``) adds to the chat generation it is."""

    response_id: str            # the body's request_id, else resp_<16 hex> (vLLM's ResponsesRequest)
    fields: dict[str, Any]      # the response's fields taken from the request (response_request_fields)
    messages: list[dict[str, Any]]   # the chat messages its prompt is rendered from
    store: bool                 # kept for GET and previous_response_id
    background: bool = False    # answered at once, run on (``_responses_background``)
    max_output_tokens: int | None = None   # the budget vLLM's SamplingParams reports (set once rendered)


_QUERY_BOOLEANS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
                   "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}


def _retrieve_query(scope: dict) -> tuple[bool, int | None]:
    """``stream`` and ``starting_after`` of ``GET /v1/responses/{id}`` as FastAPI reads them (the last
    of each; pydantic's words for a boolean), a value it cannot parse its 400."""
    from urllib.parse import parse_qs

    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)

    def refuse(kind: str, name: str, msg: str, value: str) -> ShapeError:
        return ShapeError(validation_message({"type": kind, "loc": f"query.{name}", "msg": msg,
                                              "input": error_input(value)}),
                          param=f"query.{name}", err_type=VALIDATION_TYPE)

    after = query.get("starting_after", [None])[-1]
    try:
        starting_after = None if after is None else int(after)
    except ValueError:
        raise refuse("int_parsing", "starting_after", "Input should be a valid integer, unable to parse string as "
                     "an integer", after) from None
    stream = query.get("stream", ["false"])[-1]
    if stream.lower() not in _QUERY_BOOLEANS:
        raise refuse("bool_parsing", "stream", "Input should be a valid boolean, unable to interpret input", stream)
    return _QUERY_BOOLEANS[stream.lower()], starting_after


def prepare_responses(pod: Pod, body: Any) -> tuple[dict[str, Any], ResponsesCall]:
    """A Responses request as the chat body that renders its prompt (``indexer.responses.chat_body``),
    in vLLM 0.32's order of checks: background mode (400 with ``store: false``, or without the store),
    ``previous_response_id`` (404 unless the store holds it), then the rendering (400). With a previous
    response, the messages are vLLM's ``construct_input_messages``: the new instructions as the system
    message first, the stored conversation without its system messages, the previous output as an
    assistant message (none while it is queued or once cancelled: no output), then the new input.
    Items the shared renderer cannot render (``Unrenderable``: custom tool calls, namespaced tools) are
    refused with a 400, where vLLM renders them."""
    check_object(body)
    background = bool(body.get("background"))
    if background:
        if not body.get("store", True):   # ResponsesRequest's own validator
            raise vllm_validation_error("background can only be used when `store` is true", "background")
        if not pod.responses.enabled:
            raise ShapeError("This vLLM engine does not support `store=True` and therefore does not support the "
                             "background mode. To enable these features, set the environment variable "
                             "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                             param="background", err_type=RESPONSES_ERROR_TYPE)
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise invalid("request_id", "'request_id' must be a string")
    # vLLM ignores store=True without its store
    store = (background or body.get("store", True) is True) and pod.responses.enabled
    prev_id = body.get("previous_response_id")
    prev = None
    if prev_id is not None:
        if not isinstance(prev_id, str):
            raise invalid("previous_response_id", "'previous_response_id' must be a string")
        prev = pod.responses.get(prev_id)
        if prev is None:
            raise response_not_found(prev_id)
    try:
        chat = responses_chat_body(body)
    except ChatTemplateError as exc:
        raise ShapeError(str(exc), param=exc.param) from exc
    except Unrenderable as exc:
        raise ShapeError(f"Unsupported input item: {exc} (the simulator does not render it)",
                         param="input") from exc
    if prev is not None:
        first = 1 if body.get("instructions") else 0   # chat_body's system message of the instructions
        new = chat["messages"]
        chat["messages"] = (new[:first] + [m for m in prev.messages if m.get("role") != "system"]
                            + ([{"role": "assistant", "content": prev.text}] if prev.response["output"] else [])
                            + new[first:])
    call = ResponsesCall(rid or f"resp_{uuid.uuid4().hex[:16]}", response_request_fields(body), chat["messages"],
                         store, background)
    return chat, call


def messages_prompt_ids(pod: Pod, chat: dict[str, Any]) -> list[int]:
    """The prompt of a count_tokens request's chat body, checked as vLLM's ``render_chat_request``
    checks it: the model (404), the rendering, the prompt's length; errors Anthropic-shaped."""
    name = chat.get("model")
    if name not in (None, "", pod.model) and name not in pod.loras:
        raise anthropic.MessagesError(f"The model `{name}` does not exist. Valid aliases: {pod.model}.", status=404,
                                      param="model")
    try:
        ids = chat_ids_of(chat, pod.tokenizer)
    except ShapeError as exc:
        raise anthropic.MessagesError.of(exc) from exc
    limit = pod.settings.max_model_len
    if len(ids) > limit:   # a text prompt, tokenized with truncation to max_model_len + 1: "at least" that
        raise anthropic.MessagesError(
            f"This model's maximum context length is {limit} tokens. However, your prompt contains at least "
            f"{limit + 1} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
            f"length of the input prompt. (parameter=input_tokens, value={limit + 1})", param="input_tokens")
    return ids


def prepare_messages(pod: Pod, body: Any, count_tokens: bool = False) -> dict[str, Any]:
    """A Messages (or count_tokens) request as the chat body vLLM 0.32 runs for it
    (``anthropic_shapes.to_chat``, with the pod's template choices). vLLM converts before its chat
    layer checks the model, but an empty conversation is the renderer's error, after that check: an
    unknown model is then a 404."""
    try:
        return anthropic.to_chat(body, merge_inline_system=pod.merge_inline_system,
                                 disabled_thinking_effort=pod.disabled_thinking_effort, count_tokens=count_tokens)
    except anthropic.MessagesError as exc:
        name = body.get("model") if isinstance(body, dict) else None
        if exc.message.startswith(anthropic.EMPTY_CONVERSATION) and name != pod.model and name not in pod.loras:
            raise anthropic.MessagesError(f"The model `{name}` does not exist. Valid aliases: {pod.model}.",
                                          status=404, param="model") from exc
        raise


async def _arrived(pod: Pod, scope: dict, receive: Receive) -> tuple[RequestFaults, float, Any]:
    """A generation request's faults (``x-sim-fault``), its arrival time once its body is in, and the
    body parsed, after the delay fault's wait."""
    try:
        faults = pod.faults.for_request(header(scope, b"x-sim-fault"))
    except FaultError as exc:
        raise ShapeError(str(exc)) from exc
    raw = await read_body(scope, receive)
    arrival = asyncio.get_running_loop().time()
    if faults.delay_s:
        pod.metrics.faults.labels("delay").inc()
        await asyncio.sleep(faults.delay_s)
    return faults, arrival, parse_json_request(scope, raw)


async def generate(pod: Pod, kind: str, scope: dict, receive: Receive, send: Send) -> None:
    """A generation request, ``kind`` "completion", "chat", "responses" or "messages" (chat
    generations whose chat body ``prepare_responses`` / ``prepare_messages`` makes, answered in the
    Responses / Anthropic Messages shapes)."""
    s = pod.settings
    loop = asyncio.get_running_loop()
    base_id = header(scope, b"x-request-id")
    faults, arrival, body = await _arrived(pod, scope, receive)
    call = None
    messages = kind == "messages"
    if kind == "responses":
        body, call = prepare_responses(pod, body)
    elif messages:
        body = prepare_messages(pod, body)
    try:
        gen = parse_generation(body, "completion" if kind == "completion" else "chat", pod.tokenizer,
                               model=pod.model, adapters=pod.loras, max_model_len=s.max_model_len,
                               default_max_tokens=s.default_max_tokens, max_prompt_tokens=pod.max_prompt_tokens)
        if s.data_parallel_size == 1:  # a data-parallel pod's rank was checked by DataParallelApp
            check_rank_header(scope, 1)
    except ShapeError as exc:
        if messages:   # the chat layer's errors, past the Messages request's validation
            raise anthropic.MessagesError.of(exc) from exc
        raise
    if messages:   # vLLM's random_uuid: 16 hex digits
        base_id = base_id or f"{uuid.uuid4().int & (2**64 - 1):016x}"
    base_id = base_id or (call.response_id if call is not None else gen.body_request_id) or uuid.uuid4().hex
    echo = [(b"x-request-id", base_id.encode("latin-1", "replace"))]
    if await _status_fault(pod, faults, send, echo, messages):
        return
    if call is not None:
        response_id = call.response_id   # vLLM's: the body's request_id, never the header's
        asked = body.get("max_tokens")    # max_output_tokens; SamplingParams: clamped to what fits
        room = s.max_model_len - len(gen.prompt_ids)
        call.max_output_tokens = room if asked is None else min(asked, room)
    else:
        response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{base_id}"
    req = _sim_request(pod, gen, f"{response_id}-{next(pod._ids):x}", arrival, faults,
                       reads_cache=not wants_prompt_logprobs(body, scope["path"]))
    producer = await _kv_transfer(pod, gen, req)
    pod.engine.submit(req)
    if call is not None and call.background:   # runs on whatever the client does
        await _responses_background(pod, gen, req, call, faults, send, echo)
        return
    watcher = loop.create_task(watch_disconnect(receive, lambda: pod.engine.abort(req)))
    try:
        if call is not None:
            await (_responses_stream if gen.stream else _responses_whole)(pod, gen, req, call, faults, send, echo)
        elif messages:
            await (_messages_stream if gen.stream else _messages_whole)(pod, gen, req, response_id, faults, send,
                                                                        echo, producer)
        elif gen.stream:
            await _stream(pod, gen, req, response_id, faults, send, echo)
        else:
            await _whole(pod, gen, req, response_id, faults, send, echo, producer)
    finally:
        watcher.cancel()
        if req.finish_reason is None:
            pod.engine.abort(req)


def _sim_request(pod: Pod, gen: GenRequest, request_id: str, arrival: float, faults: RequestFaults,
                 reads_cache: bool) -> SimRequest:
    """The engine request of a validated generation, with its LoRA adapter and the eos fault;
    ``reads_cache`` False for prompt logprobs: vLLM then reads no cached KV and takes no connector's
    (skip_reading_prefix_cache)."""
    req = SimRequest(request_id, gen.prompt_ids, gen.max_tokens, gen.length_capped, pod.settings.block_size,
                     pod.hasher, arrival, salt=gen.cache_salt,
                     lora=(pod.loras[gen.lora][0], gen.lora, pod.loras[gen.lora][1]) if gen.lora else None)
    req.reads_cache = reads_cache
    eos_at = None if (faults.eos_after is None or gen.ignore_eos) else max(faults.eos_after, gen.min_tokens)
    if eos_at is not None and eos_at <= req.max_tokens:
        # the model samples EOS: a 'stop' finish there
        pod.metrics.faults.labels("eos").inc()
        req.max_tokens, req.length_capped = eos_at, False
    return req


async def generate_batch(pod: Pod, scope: dict, receive: Receive, send: Send) -> None:
    """vLLM 0.32's ``POST /v1/chat/completions/batch`` (``OpenAIServingChatBatch``): each conversation
    of ``messages`` is the chat request the rest of the body makes with it, its tools not rendered, run
    as its own engine request (``<id>_<i>``), all at once; one whole ``chat.completion`` answers them,
    choice ``i`` for conversation ``i``, usage summed (no prompt details), never a stream. The body's
    KV-transfer params move no KV here. Faults apply to the batch as to one request; its only timing
    header is ``x-sim-cached-tokens``, the conversations' hits summed."""
    s = pod.settings
    loop = asyncio.get_running_loop()
    faults, arrival, body = await _arrived(pod, scope, receive)
    check_object(body)
    gens = []
    for conversation in chat_batch_conversations(body):
        # every field carried (the model keeps extra ones), tools too but not rendered: only an empty
        # list of them is refused, as the chat request built for the conversation refuses it
        chat = {k: v for k, v in body.items() if k != "tools" or v == []} | {"messages": conversation}
        try:
            gens.append(parse_generation(chat, "chat", pod.tokenizer, model=pod.model, adapters=pod.loras,
                                         max_model_len=s.max_model_len, default_max_tokens=s.default_max_tokens,
                                         max_prompt_tokens=pod.max_prompt_tokens))
        except ShapeError as exc:
            if exc.err_type == VALIDATION_TYPE and exc.param and not exc.param.startswith("body"):
                # a model validator of the chat request: the batch builds that in its serving code, so
                # the VLLMValidationError is not a request-validation error there
                raise vllm_validation_error(exc.message, exc.param, exc.value) from exc
            raise
    if s.data_parallel_size == 1:
        check_rank_header(scope, 1)
    base_id = header(scope, b"x-request-id") or gens[0].body_request_id or f"{uuid.uuid4().int & (2**64 - 1):016x}"
    echo = [(b"x-request-id", base_id.encode("latin-1", "replace"))]
    if await _status_fault(pod, faults, send, echo):
        return
    response_id = f"chatcmpl-{base_id}"
    reads_cache = not wants_prompt_logprobs(body, "/v1/chat/completions")
    reqs = [_sim_request(pod, gen, f"{response_id}_{i}-{next(pod._ids):x}", arrival, faults, reads_cache)
            for i, gen in enumerate(gens)]
    for req in reqs:
        pod.engine.submit(req)

    def abort_all() -> None:   # a client that leaves aborts every conversation's request
        for req in reqs:
            pod.engine.abort(req)
    watcher = loop.create_task(watch_disconnect(receive, abort_all))
    try:
        texts = await asyncio.gather(*(_collect(pod, req) for req in reqs))
        if any(text is None for text in texts):
            return
        choices = [chat_choice(i, text or "", req.finish_reason,
                               req.all_tokens[req.n_prompt:] if gen.return_token_ids else None)
                   for i, (gen, req, text) in enumerate(zip(gens, reqs, texts))]
        use = usage(sum(r.n_prompt for r in reqs), sum(r.num_output for r in reqs), 0, details=False)
        answer = chat_body(response_id, gens[0].lora or pod.model, "", None, use, None,
                           fingerprint=pod.fingerprint) | {"choices": choices}
        cached = str(sum(r.cached_tokens for r in reqs)).encode()
        await _send_whole(pod, None, orjson.dumps(answer), faults, send, echo + [(b"x-sim-cached-tokens", cached)])
    finally:
        watcher.cancel()
        for req in reqs:
            if req.finish_reason is None:
                pod.engine.abort(req)


async def generate_tokens(pod: Pod, scope: dict, receive: Receive, send: Send) -> None:
    """vLLM 0.32's ``POST /inference/v1/generate`` (``ServingTokens.serve_tokens``): the token ids are
    the prompt, run as they are, as the engine request of the completion with that prompt (prefix
    cache, KV events, KV transfer and faults as for any request). The answer's ``request_id`` is
    ``generate-tokens-`` and the ``X-Request-Id`` header, else the body's ``request_id``, else 16 hex
    digits. Whole: one ``GenerateTokensResponse`` (``GenerateTextResponse`` for output_mode "text"),
    its usage always there. Streamed: a chunk per token, the last one with the finish reason, the usage
    chunk with ``stream_options.include_usage``, then ``data: [DONE]``; no keep-alive comments. A prompt
    the engine refuses (``token_request``'s ``late_error``) is a 400, or in a stream that error as its
    one event before ``[DONE]``."""
    s = pod.settings
    loop = asyncio.get_running_loop()
    faults, arrival, body = await _arrived(pod, scope, receive)
    tok = token_request(body, model=pod.model, max_model_len=s.max_model_len, adapters=pod.loras)
    gen = None
    if tok.late_error is None:
        gen = parse_generation(tok.view, "completion", pod.tokenizer, model=pod.model, adapters=pod.loras,
                               max_model_len=s.max_model_len, default_max_tokens=s.default_max_tokens,
                               max_prompt_tokens=pod.max_prompt_tokens)
    if s.data_parallel_size == 1:  # a data-parallel pod's rank was checked by DataParallelApp
        check_rank_header(scope, 1)
    base_id = header(scope, b"x-request-id") or tok.request_id or f"{uuid.uuid4().int & (2**64 - 1):016x}"
    echo = [(b"x-request-id", base_id.encode("latin-1", "replace"))]
    if await _status_fault(pod, faults, send, echo):
        return
    request_id = f"generate-tokens-{base_id}"
    if gen is None:
        assert tok.late_error is not None
        if not tok.stream:
            raise ShapeError(tok.late_error)
        # the stream has started when the engine refuses: the error as an event (json.dumps' spacing)
        event = json.dumps(error_payload(400, tok.late_error, err_type=ERROR_TYPES[400]))
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + echo})
        await send({"type": "http.response.body", "body": f"data: {event}\n\ndata: [DONE]\n\n".encode()})
        return
    req = _sim_request(pod, gen, f"{request_id}-{next(pod._ids):x}", arrival, faults, reads_cache=tok.reads_cache)
    producer = await _kv_transfer(pod, gen, req)
    pod.engine.submit(req)
    watcher = loop.create_task(watch_disconnect(receive, lambda: pod.engine.abort(req)))
    try:
        if gen.stream:
            await _generate_stream(pod, gen, req, request_id, tok.text, faults, send, echo)
        else:
            text = await _collect(pod, req)
            if text is None:
                return
            answer = generate_body(request_id, gen.lora or pod.model, int(time.time()),
                                   text if tok.text else None, req.all_tokens[req.n_prompt:], req.finish_reason,
                                   _usage_of(req, gen, s.enable_prompt_tokens_details, s.block_size),
                                   req.prompt if gen.return_token_ids else None,
                                   _producer_params(pod, req) if producer else None)
            await _send_whole(pod, req, orjson.dumps(answer), faults, send, echo)
    finally:
        watcher.cancel()
        if req.finish_reason is None:
            pod.engine.abort(req)


async def _generate_stream(pod: Pod, gen: GenRequest, req: SimRequest, request_id: str, text_mode: bool,
                           faults: RequestFaults, send: Send, echo: list) -> None:
    """``serve_tokens_stream_generator``: one chunk per output token (the engine's deltas), the
    prompt's ids on the first one when ``return_token_ids``, continuous usage when asked."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + echo})
    emitter = _Emitter(pod, send, faults.drop_after_chunks)
    prompt_ids = req.prompt if gen.return_token_ids else None
    n_out = 0
    queue = req.queue
    while True:
        item = await queue.get()
        if item is FINISH:
            break
        # FINISH is queued right after the last token, once finish_reason is set
        reason = req.finish_reason if req.finish_reason is not None and queue.qsize() == 1 else None
        n_out += 1
        use = usage(req.n_prompt, n_out, 0, details=False) if gen.continuous_usage else None
        chunk = generate_chunk(request_id, pod.text_of(item) if text_mode else None, [item], reason, use, prompt_ids)
        prompt_ids = None
        await emitter(b"data: " + orjson.dumps(chunk) + b"\n\n")
    if req.finish_reason == "abort":
        return
    if gen.include_usage:
        use = _usage_of(req, gen, pod.settings.enable_prompt_tokens_details, pod.settings.block_size)
        await emitter(b"data: " + orjson.dumps(generate_usage_chunk(request_id, text_mode, use)) + b"\n\n")
    await emitter(b"data: [DONE]\n\n", more=False)


async def _kv_transfer(pod: Pod, gen: GenRequest, req: SimRequest) -> bool:
    """A request's KV-transfer params: a prefill leg's (``do_remote_decode``, True) keeps its blocks
    leased for the decoder however its one token ends (vLLM 0.32 answers kv_transfer_params on a stop as
    on a length finish); a decode leg's reads the prompt's KV from the prefill pod first."""
    kv = gen.kv_transfer_params or {}
    if kv.get("do_remote_decode"):
        req.keep_blocks = True
        return True
    if kv.get("do_remote_prefill") and req.reads_cache:
        await _remote_prefill(pod, req, kv)
    return False


async def _remote_prefill(pod: Pod, req: SimRequest, kv: dict) -> None:
    """Decode leg: read the prompt's KV from the prefill pod over the simulated link, if we can."""
    s = pod.settings
    problem = decode_params_problem(kv, s.nixl_allowed_hosts)
    if problem is not None:
        log.info("Got invalid KVTransferParams (%s); computing the prompt locally", problem)
        pod.metrics.nixl_transfers.labels("invalid").inc()
        return
    local = len(pod.engine.pool.match_prefix(req.hashes[:(req.n_prompt - 1) // s.block_size]))
    pod.kv_waiting += 1
    try:
        read = await remote_read(pod.http, kv, skip_blocks=local, block_size=s.block_size,
                                 kv_bytes_per_token=s.kv_bytes_per_token, bandwidth=s.nixl_bandwidth_bytes_per_s,
                                 latency=s.nixl_latency_s, slowdown=pod.faults.slowdown)
    finally:
        pod.kv_waiting -= 1
    if read.tokens != req.n_prompt:
        pod.metrics.nixl_transfers.labels("failed" if read.tokens == 0 else "mismatch").inc()
        pod.metrics.nixl_failed.inc()
        return
    pod.metrics.nixl_transfers.labels("ok").inc()
    pod.metrics.nixl_bytes.observe(read.bytes)
    pod.metrics.nixl_xfer_time.observe(read.seconds)
    req.remote_tokens = req.n_prompt - 1  # the last prompt token is recomputed locally for logits


def _reported_cached(req: SimRequest, kv: dict | None) -> int:
    """The ``cached_tokens`` vLLM 0.32 reports: on a decode leg whose params carry the prefill's
    ``remote_prefill_cached_tokens`` (an int), that number, the prefill pod's own hits, not the
    transferred tokens (vllm/v1/engine/output_processor.py ``RequestState.from_new_request`` and
    ``num_cached_tokens = remote_prefill_cached_tokens``); else this engine's hits."""
    if kv and kv.get("do_remote_prefill"):
        cached = kv.get("remote_prefill_cached_tokens")
        if isinstance(cached, int):
            return cached
    return req.cached_tokens


def _cache_writes(req: SimRequest, block_size: int) -> int:
    """The prompt tokens a request wrote to the prefix cache (chat's ``created_cache_tokens``, a
    response's ``cache_write_tokens``): PrefillStats.finalize, the tokens of its full blocks less its hits."""
    return max(0, min(req.n_prompt // block_size * block_size, req.n_prompt) - req.cached_tokens)


def _usage_of(req: SimRequest, gen: GenRequest, details: bool, block_size: int) -> dict:
    created = _cache_writes(req, block_size) if gen.kind == "chat" else None
    return usage(req.n_prompt, req.num_output, _reported_cached(req, gen.kv_transfer_params), details, created)


def _timing_headers(req: SimRequest) -> list[tuple[bytes, bytes]]:
    out = [(b"x-sim-cached-tokens", str(req.cached_tokens).encode()),
           (b"x-sim-prefill-compute-s", f"{req.prefill_compute_s:.6f}".encode())]
    if req.ttft is not None:
        out.append((b"x-sim-ttft-s", f"{req.ttft:.6f}".encode()))
        if req.first_token_at is not None and req.last_token_at is not None:  # both set with the first token
            out.append((b"x-sim-decode-s", f"{req.last_token_at - req.first_token_at:.6f}".encode()))
    if req.scheduled_at is not None:
        out.append((b"x-sim-queue-s", f"{max(0.0, req.scheduled_at - req.arrival):.6f}".encode()))
    return out


async def _collect(pod: Pod, req: SimRequest) -> str | None:
    """The whole output text once the request finishes; None if it was aborted."""
    parts = []
    queue = req.queue
    while True:
        item = await queue.get()
        if item is FINISH:
            break
        parts.append(pod.text_of(item))
    return None if req.finish_reason == "abort" else "".join(parts)


async def _send_whole(pod: Pod, req: SimRequest | None, body: bytes, faults: RequestFaults, send: Send,
                      echo: list) -> None:
    """A whole JSON answer with the echo headers and ``req``'s timing ones; the drop fault cuts it halfway."""
    headers = JSON_HEADERS + echo + (_timing_headers(req) if req is not None else [])
    if faults.drop_after_chunks is not None:
        pod.metrics.faults.labels("drop").inc()
        await send({"type": "http.response.start", "status": 200,
                    "headers": headers + [(b"content-length", str(len(body)).encode())]})
        if faults.drop_after_chunks > 0:
            await send({"type": "http.response.body", "body": body[:len(body) // 2], "more_body": True})
        raise SimulatedDrop("simulated connection drop")
    await respond(send, 200, body, headers)


class _Emitter:
    """The body chunks of a stream, counted: the drop fault cuts the connection before the chunk past
    its count."""

    def __init__(self, pod: Pod, send: Send, drop: int | None):
        self.pod, self.send, self.drop = pod, send, drop
        self.sent = 0

    async def __call__(self, data: bytes, more: bool = True) -> None:
        if self.drop is not None and self.sent >= self.drop:
            self.pod.metrics.faults.labels("drop").inc()
            raise SimulatedDrop("simulated connection drop")
        await self.send({"type": "http.response.body", "body": data, "more_body": more})
        self.sent += 1


def _producer_params(pod: Pod, req: SimRequest) -> dict | None:
    """The ``kv_transfer_params`` a prefill leg answers: its leased blocks, for the decoder to read."""
    lease = pod.leases.leases.get(req.request_id)
    if lease is None:
        return None
    return producer_params(block_ids=lease.block_ids, engine_id=pod.engine_id, request_id=req.request_id,
                           host=pod.settings.advertised_host, port=pod.port, num_tokens=req.n_prompt,
                           cached_tokens=req.cached_tokens)


async def _whole(pod: Pod, gen: GenRequest, req: SimRequest, response_id: str, faults: RequestFaults,
                 send: Send, echo: list, producer: bool = False) -> None:
    text = await _collect(pod, req)
    if text is None:
        return
    kv_params = _producer_params(pod, req) if producer else None
    build = chat_body if gen.kind == "chat" else completion_body
    use = _usage_of(req, gen, pod.settings.enable_prompt_tokens_details, pod.settings.block_size)
    ids = gen.return_token_ids
    body = orjson.dumps(build(response_id, gen.lora or pod.model, text, req.finish_reason, use, kv_params,
                              fingerprint=pod.fingerprint, prompt_ids=req.prompt if ids else None,
                              token_ids=req.all_tokens[req.n_prompt:] if ids else None))
    await _send_whole(pod, req, body, faults, send, echo)


async def _stream(pod: Pod, gen: GenRequest, req: SimRequest, response_id: str, faults: RequestFaults,
                  send: Send, echo: list) -> None:
    created = int(time.time())
    model = gen.lora or pod.model   # vLLM answers with the name the request used (an adapter's)
    chat = gen.kind == "chat"
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + echo})
    emitter = _Emitter(pod, send, faults.drop_after_chunks)

    async def emit(obj: dict) -> None:
        await emitter(b"data: " + orjson.dumps(obj) + b"\n\n")

    ids = gen.return_token_ids
    first = True
    n_out = 0
    queue = req.queue
    keep_alive = pod.settings.sse_keep_alive_interval
    while True:
        if keep_alive:   # vLLM's with_sse_keep_alive: a comment for each interval without an event
            try:
                item = await asyncio.wait_for(queue.get(), keep_alive)
            except TimeoutError:
                await emitter(KEEP_ALIVE)
                continue
        else:
            item = await queue.get()
        if item is FINISH:
            break
        if first and chat:
            # vLLM sends the role chunk with the first output, i.e. when the first token is out
            role = chat_role_chunk(response_id, model, created, req.prompt if ids else None)
            if gen.continuous_usage:
                role["usage"] = running_usage("chat", req.n_prompt, 0)
            await emit(role)
        text = pod.text_of(item)
        # FINISH is queued right after the last token, once finish_reason is set
        reason = req.finish_reason if req.finish_reason is not None and queue.qsize() == 1 else None
        chunk = (chat_chunk(response_id, model, created, {"content": text}, reason, [item] if ids else None)
                 if chat else
                 completion_chunk(response_id, model, created, text, reason,
                                  req.prompt if ids and first else None, [item] if ids else None))
        first = False
        n_out += 1
        if gen.continuous_usage:   # the output tokens so far, this chunk's included
            chunk["usage"] = running_usage(gen.kind, req.n_prompt, n_out)
        if reason is not None and not gen.include_usage:
            chunk["system_fingerprint"] = pod.fingerprint  # on the terminal chunk unless a usage chunk follows
        await emit(chunk)
    if req.finish_reason == "abort":
        return
    if gen.include_usage:
        await emit(usage_chunk(response_id, model, created, gen.kind,
                               _usage_of(req, gen, pod.settings.enable_prompt_tokens_details,
                                         pod.settings.block_size), pod.fingerprint))
    await emitter(b"data: [DONE]\n\n", more=False)


def _finished_response(pod: Pod, gen: GenRequest, req: SimRequest, call: ResponsesCall, created: int,
                       item_id: str, text: str) -> dict:
    """The finished response object (stored when asked, unless the entry under its id was cancelled,
    as vLLM does): status "incomplete" on a length finish."""
    use = response_usage(req.n_prompt, req.num_output, _reported_cached(req, gen.kv_transfer_params),
                         _cache_writes(req, pod.settings.block_size))
    response = response_object(call.response_id, gen.lora or pod.model, created, call.fields,
                               status="incomplete" if req.finish_reason == "length" else "completed",
                               output=[output_message(item_id, text)], use=use,
                               max_output_tokens=call.max_output_tokens)
    held = pod.responses.get(call.response_id) if call.store else None
    if call.store and (held is None or held.response["status"] != "cancelled"):
        pod.responses.put(call.response_id, StoredResponse(response, call.messages, text,
                                                           events=held.events if held is not None else None))
    return response


async def _responses_whole(pod: Pod, gen: GenRequest, req: SimRequest, call: ResponsesCall, faults: RequestFaults,
                           send: Send, echo: list) -> None:
    created = int(time.time())
    text = await _collect(pod, req)
    if text is None:
        return
    response = _finished_response(pod, gen, req, call, created, f"msg_{uuid.uuid4().hex[:16]}", text)
    await _send_whole(pod, req, orjson.dumps(response), faults, send, echo)


async def _responses_stream(pod: Pod, gen: GenRequest, req: SimRequest, call: ResponsesCall,
                            faults: RequestFaults, send: Send, echo: list, created: int | None = None) -> None:
    """vLLM 0.32's Responses stream of one text message: ``response.created`` and
    ``response.in_progress`` at once (before any token), the item and its part added with the first
    token, one ``response.output_text.delta`` per token, then the text, part and item done and
    ``response.completed`` with the whole response (a length finish's status "incomplete" included).
    Each event is ``event: <type>`` + its JSON, numbered from 0; no ``[DONE]``."""
    created = created or int(time.time())
    item_id = f"msg_{uuid.uuid4().hex[:16]}"
    seq = itertools.count()
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + echo})
    emit = _Emitter(pod, send, faults.drop_after_chunks)
    pending = response_object(call.response_id, gen.lora or pod.model, created, call.fields, status="in_progress",
                              output=[], use=None, max_output_tokens=call.max_output_tokens)
    for kind in ("response.created", "response.in_progress"):
        await emit(response_event(response_state_event(kind, pending, next(seq))))
    parts: list[str] = []
    queue = req.queue
    while True:
        item = await queue.get()
        if item is FINISH:
            break
        if not parts:
            await emit(response_event(output_item_event("response.output_item.added",
                                                        output_message(item_id, None, "in_progress"), next(seq))))
            await emit(response_event(content_part_event("response.content_part.added", item_id,
                                                         output_text_part("", []), next(seq))))
        delta = pod.text_of(item)
        parts.append(delta)
        await emit(response_event(text_delta_event(item_id, delta, next(seq))))
    if req.finish_reason == "abort":
        return
    text = "".join(parts)
    response = _finished_response(pod, gen, req, call, created, item_id, text)
    await emit(response_event(text_done_event(item_id, text, next(seq))))
    await emit(response_event(content_part_event("response.content_part.done", item_id, output_text_part(text),
                                                 next(seq))))
    await emit(response_event(output_item_event("response.output_item.done", output_message(item_id, text),
                                                 next(seq))))
    await emit(response_event(response_state_event("response.completed", response, next(seq))), more=False)


async def _responses_background(pod: Pod, gen: GenRequest, req: SimRequest, call: ResponsesCall,
                               faults: RequestFaults, send: Send, echo: list) -> None:
    """vLLM 0.32's background mode: the response is stored "queued" (no output, no usage) and its run,
    a task of the store's, goes on past this request; the entry stays "queued" (vLLM never stores
    "in_progress") until the run stores the finished response. The answer is the queued response at
    once or, streamed, the run's events as they come (which ``GET ...?stream=true`` replays)."""
    created = int(time.time())
    queued = response_object(call.response_id, gen.lora or pod.model, created, call.fields, status="queued",
                             output=[], use=None, max_output_tokens=call.max_output_tokens)
    events = EventLog() if gen.stream else None

    async def run() -> None:
        try:
            if events is not None:
                await _responses_stream(pod, gen, req, call, RequestFaults(), events, [], created)
            else:
                text = await _collect(pod, req)
                if text is not None:
                    _finished_response(pod, gen, req, call, created, f"msg_{uuid.uuid4().hex[:16]}", text)
        finally:
            if req.finish_reason is None:   # cancelled: as vLLM, the engine request is aborted
                pod.engine.abort(req)
            if events is not None:
                events.end()

    answer = orjson.dumps(queued)
    pod.responses.run_in_background(call.response_id, StoredResponse(queued, call.messages, "", events=events),
                                    run())
    if events is None:
        await _send_whole(pod, None, answer, faults, send, echo)
    else:
        await _send_events(pod, events, 0, faults.drop_after_chunks, send, echo)


async def _send_events(pod: Pod, events: EventLog, start: int, drop: int | None, send: Send, echo: list) -> None:
    """A background stream's events from index ``start`` (``EventLog.follow``), as an SSE answer."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + echo})
    emit = _Emitter(pod, send, drop)
    async for event in events.follow(start):
        await emit(event)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _messages_usage(pod: Pod, gen: GenRequest, req: SimRequest) -> dict:
    s = pod.settings
    return anthropic.usage(req.n_prompt, req.num_output, _reported_cached(req, gen.kv_transfer_params),
                           _cache_writes(req, s.block_size), s.enable_prompt_tokens_details)


async def _messages_whole(pod: Pod, gen: GenRequest, req: SimRequest, response_id: str, faults: RequestFaults,
                          send: Send, echo: list, producer: bool) -> None:
    text = await _collect(pod, req)
    if text is None:
        return
    body = anthropic.message_body(response_id, gen.lora or pod.model, text, req.finish_reason,
                                  _messages_usage(pod, gen, req), _producer_params(pod, req) if producer else None)
    await _send_whole(pod, req, orjson.dumps(body), faults, send, echo)


async def _messages_stream(pod: Pod, gen: GenRequest, req: SimRequest, response_id: str, faults: RequestFaults,
                           send: Send, echo: list, producer: bool) -> None:
    """vLLM 0.32's Messages stream of one text block: the headers at once, ``message_start`` with the
    first token (vLLM makes it from the chat stream's role chunk, sent with the first output), the
    block started with the first token that has text, one ``content_block_delta`` per token with text,
    then ``content_block_stop``, ``message_delta`` (stop reason, usage) and ``message_stop``. Each
    event is ``event: <type>`` + its JSON; no ``[DONE]``, no pings."""
    del producer   # vLLM's stream carries no kv_transfer_params
    model = gen.lora or pod.model
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + echo})
    emit = _Emitter(pod, send, faults.drop_after_chunks)
    started = block = False
    queue = req.queue
    while True:
        item = await queue.get()
        if item is FINISH:
            break
        if not started:
            await emit(anthropic.event(anthropic.message_start(response_id, model, req.n_prompt)))
            started = True
        text = pod.text_of(item)
        if not text:   # vLLM skips a delta with no text
            continue
        if not block:
            await emit(anthropic.event(anthropic.content_block_start()))
            block = True
        await emit(anthropic.event(anthropic.text_delta(text)))
    if req.finish_reason == "abort":
        return
    if not started:
        await emit(anthropic.event(anthropic.message_start(response_id, model, req.n_prompt)))
    if block:
        await emit(anthropic.event(anthropic.content_block_stop()))
    await emit(anthropic.event(anthropic.message_delta(req.finish_reason, _messages_usage(pod, gen, req))))
    await emit(anthropic.event(anthropic.MESSAGE_STOP), more=False)


# --- building and running pods ------------------------------------------------------------------
def event_sources(engines: list[Pod]) -> dict[str, Any]:
    """vLLM 0.32's ``GET /kv_event_sources``: each engine's KV-events config by its data-parallel rank
    (every field of vLLM's ``KVEventsConfig``, the endpoints as bound); {} when it publishes none."""
    return {str(e.rank): dataclasses.asdict(e.events_config) for e in engines if e.events_config is not None}


def events_config_for(settings: SimSettings) -> KVEventsConfig | None:
    if settings.kv_events_port is not None:
        return KVEventsConfig.shortcut(settings.kv_events_port, settings.data_parallel_size)
    if settings.kv_events_config is not None:
        return KVEventsConfig.from_json(settings.kv_events_config)
    return None


def bind_sockets(host: str, port: int, count: int):
    """Bind the HTTP sockets of pods 0..count-1 (port+i; port 0 = any free port for each)."""
    import socket

    socks = []
    try:
        for i in range(count):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port + i if port else 0))
            sock.listen(2048)
            sock.setblocking(False)
            socks.append(sock)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class SimFleet:
    """``count`` pods in this process, sharing a tokenizer, ZMQ contexts and an HTTP client."""

    def __init__(self, settings: SimSettings, sockets: list | None = None):
        self.settings = settings
        self.sockets = sockets if sockets is not None else bind_sockets(settings.host, settings.port, settings.count)
        self.tokenizer = load_tokenizer(settings.tokenizer)
        self.zmq_ctx = zmq.Context()
        self.zmq_actx = zmq.asyncio.Context()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), trust_env=False)
        base_events = events_config_for(settings)
        ranks = settings.data_parallel_size
        self.pods: list[Pod] = []   # every engine: ``ranks`` per HTTP port
        apps: dict[int, Any] = {}
        for i, sock in enumerate(self.sockets):
            port = sock.getsockname()[1]
            name = (settings.pod_name + (f"-{i}" if settings.count > 1 else "")) if settings.pod_name \
                else f"{settings.host}:{port}"
            cfg = base_events.for_pod(i, name, settings.model, ranks) if base_events is not None else None
            engines = [Pod(settings, i, port, self.tokenizer, self.zmq_ctx, self.zmq_actx, self.http,
                           cfg.for_rank(r) if cfg is not None else None, rank=r) for r in range(ranks)]
            for e in engines[1:]:
                e.responses = engines[0].responses   # one API server, one store
            self.pods.extend(engines)
            apps[port] = build_app(engines[0]) if ranks == 1 else DataParallelApp(engines)
        self.app = MultiPodApp(apps)

    def start(self) -> None:
        for pod in self.pods:
            pod.start()

    async def stop(self) -> None:
        for pod in self.pods:
            await pod.stop()
        await self.http.aclose()
        self.zmq_actx.term()
        self.zmq_ctx.term()

    async def serve(self, ready: asyncio.Event | None = None, should_exit: asyncio.Event | None = None) -> None:
        """Run every pod's HTTP server until cancelled (or ``should_exit`` is set)."""
        import uvicorn

        logging.getLogger("uvicorn.error").addFilter(_DropFilter())
        config = uvicorn.Config(self.app, lifespan="off", access_log=False, log_level=self.settings.log_level,
                                timeout_keep_alive=30, backlog=2048, timeout_graceful_shutdown=2,
                                log_config=None)  # the CLI configured logging (kvcommon.logs): keep it
        server = uvicorn.Server(config)
        self.start()
        watcher = None
        if should_exit is not None:
            async def _watch():
                await should_exit.wait()
                server.should_exit = True
            watcher = asyncio.get_running_loop().create_task(_watch())
        if ready is not None:
            async def _ready():
                while not server.started:
                    await asyncio.sleep(0.01)
                ready.set()
            asyncio.get_running_loop().create_task(_ready())
        try:
            await server.serve(sockets=self.sockets)
        finally:
            if watcher is not None:
                watcher.cancel()
            await self.stop()
