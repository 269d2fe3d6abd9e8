"""Token ids for prompts: one small interface shared by the router and the simulated pod.

A prompt's KV blocks are named by its token ids, so the router must tokenize exactly as the engine
does. Implementations:

* ``ByteTokenizer``: one token per UTF-8 byte (ids 0-255) plus a few special ids. Needs no files;
  the default for the simulated pod, demos and tests.
* ``HFTokenizer``: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) and, when it lies
  beside it, ``tokenizer_config.json`` for the chat template and special tokens.

Chat messages become text through a Jinja2 chat template (the model's own for ``HFTokenizer``, a
ChatML-style default otherwise) and then token ids, as vLLM's ``apply_chat_template`` does, so chat
prompts hash the way the engine hashes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """Messages the chat template cannot render (bad shape, or the template raised)."""


def flatten_content(content: Any) -> str:
    """OpenAI message content as text: a string, or the text parts of a content array joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ChatTemplateError("only text content parts are supported")
        return "".join(parts)
    raise ChatTemplateError("message content must be a string or a list of content parts")


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled Jinja2 chat template, rendered in a sandbox as vLLM/transformers do."""

    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, **context: Any):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source
        self._template = env.from_string(source)
        self._context = context

    def render(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        normalised = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
            normalised.append({**m, "content": flatten_content(m.get("content"))})
        try:
            return self._template.render(messages=normalised, add_generation_prompt=add_generation_prompt,
                                         **self._context, **kwargs)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


@runtime_checkable
class Tokenizer(Protocol):
    """What the router and the simulated pod need of a tokenizer."""

    name: str
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; ids 256.. are special tokens. Needs no files.

    ``encode`` adds no BOS, so a text prefix always gives a token-id prefix (what prefix caching
    needs to show). ``decode`` drops special ids and replaces invalid UTF-8.
    """

    BOS = 256
    EOS = 257
    name = "byte"

    def __init__(self, chat_template: str | None = None):
        self.vocab_size = 258
        self.eos_token_id = self.EOS
        self._template = ChatTemplate(chat_template or DEFAULT_CHAT_TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        if token_id == self.BOS:
            return "<s>"
        if token_id == self.EOS:
            return "</s>"
        return bytes([token_id]).decode("latin-1")

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self._template.render(messages, add_generation_prompt, **kwargs)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` with, if present beside it, ``tokenizer_config.json``."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tok_file}")
        self._tok = _HF.from_file(str(tok_file))
        self.name = str(tok_file.parent.name or tok_file.name)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        cfg: dict[str, Any] = {}
        cfg_file = tok_file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        template = chat_template or cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()))
        self._template = ChatTemplate(template, bos_token=bos or "", eos_token=eos or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self._template.render(messages, add_generation_prompt, **kwargs)


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def load_tokenizer(spec: str | None) -> Tokenizer:
    """``None``/``"byte"`` -> ByteTokenizer; a path to tokenizer.json (or its folder) -> HFTokenizer."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
    return HFTokenizer(spec)


class RemoteTokenizer:
    """Token ids from a pod's own ``POST /tokenize`` (vLLM applies its chat template there), cached.

    For deployments where the router has no tokenizer files: the pod's answer is exactly what the
    engine hashes. ``base_url`` comes from the router's configured fleet, never from a client.
    Results are kept in a bounded LRU (``cache_size`` entries) keyed by the request body, so a
    repeated system prompt or conversation costs one round trip. Raises ``RemoteTokenizeError``
    on a non-2xx answer or a body without a ``tokens`` list.
    """

    def __init__(self, base_url: str, model: str, client: Any, cache_size: int = 4096):
        from collections import OrderedDict

        self.base_url = base_url.rstrip("/")
        self.model = model
        self._client = client  # an httpx.AsyncClient, owned by the caller
        self.cache_size = cache_size
        self._cache: "OrderedDict[bytes, list[int]]" = OrderedDict()
        self.hits = self.misses = 0

    async def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return await self._tokenize({"model": self.model, "prompt": prompt, "add_special_tokens": add_special_tokens})

    async def encode_chat(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        return await self._tokenize({"model": self.model, "messages": messages,
                                     "add_generation_prompt": add_generation_prompt})

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        import orjson

        key = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        r = await self._client.post(f"{self.base_url}/tokenize", content=key,
                                    headers={"content-type": "application/json"})
        if r.status_code // 100 != 2:
            raise RemoteTokenizeError(f"/tokenize answered {r.status_code}: {r.text[:200]}")
        try:
            tokens = r.json().get("tokens")
        except ValueError:
            tokens = None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise RemoteTokenizeError("/tokenize answer has no 'tokens' list of ints")
        self._cache[key] = tokens
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return tokens


class RemoteTokenizeError(RuntimeError):
    """A pod's /tokenize failed or answered something unusable."""
