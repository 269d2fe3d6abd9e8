"""Chat rendering as vLLM 0.32 renders it (no engine): transformers' template environment, vLLM's
message and tool normalisation, continue_final_message, the request fields' merge, the model
folder's template files, and the /tokenize body the remote tokenizer sends. The expected values
are what vLLM 0.32 with transformers 5.19 produced for the same input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web

from indexer.tokens import (
    ByteTokenizer,
    ChatRequest,
    ChatTemplateError,
    HFTokenizer,
    RemoteTokenizer,
    ServeChatFlags,
    chat_request_ids,
    conversation,
    tokenize_chat_body,
    tool_dicts,
)
from router.errors import APIError
from router.prompts import check_chat, prompt_tokens
from simulator.openai_shapes import ShapeError, chat_ids_of, prompt_ids_of
from tests.helpers import serve_routes


def render(template: str, messages=None, **kwargs) -> str:
    return ByteTokenizer(template).apply_chat_template(messages or [{"role": "user", "content": "hi"}], **kwargs)


# ---- transformers' Jinja environment ------------------------------------------------------------

def test_tojson_is_json_dumps_without_html_escaping_or_key_sorting():
    body = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "description": "a <b> & 'c' — café"}}]}
    out = bytes(chat_request_ids(body, ByteTokenizer("{{ tools[0] | tojson }}"))).decode()
    assert out == '{"type": "function", "function": {"name": "f", "description": "a <b> & \'c\' — café", ' \
                  '"parameters": null}}'
    assert render("{{ {'z': 1, 'a': 2} | tojson }}") == '{"z": 1, "a": 2}'  # Jinja's own would sort and escape
    assert render("{{ {'z': 1, 'a': 'é'} | tojson(sort_keys=true, ensure_ascii=true) }}") == '{"a": "\\u00e9", "z": 1}'
    assert render("{{ [1, 2] | tojson(indent=2) }}") == "[\n  1,\n  2\n]"
    assert render("{{ {'a': 1} | tojson(separators=(',', ':')) }}") == '{"a":1}'


def test_environment_has_strftime_now_loop_controls_generation_and_raise_exception():
    assert len(render("{{ strftime_now('%Y-%m-%d') }}")) == 10
    assert render("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}"
                  "{% endif %}{{ i }}{% endfor %}") == "02"
    assert render("{% generation %}A{% endgeneration %}B") == "AB"
    with pytest.raises(ChatTemplateError, match="no <tools> here"):
        render("{{ raise_exception('no <tools> here') }}")


def test_a_render_with_the_globals_merged_once_is_jinjas_own_render():
    """``_render`` (the globals merged at compile time) gives what ``Template.render`` gives, for
    templates that read globals, set names at the top level and in loops, define and call macros,
    use a namespace and shadow a global with a variable, and raises what it raises."""
    import jinja2

    from indexer.tokens import _compiled, _render

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    sources = [
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
        "{% set sys = messages[0].content if messages[0].role == 'system' else '' %}{% set n = namespace(k=0) %}"
        "{% for m in messages %}{% set n.k = n.k + 1 %}{% set local = m.role | upper %}{{ n.k }}{{ local }}"
        "{% endfor %}[{{ sys }}]{{ local is defined }}",
        "{% macro turn(m) %}({{ m.role }}:{{ m.content | length }}){% endmacro %}"
        "{% for m in messages if m.role != 'system' %}{{ turn(m) }}{{ loop.index }}/{{ loop.length }}{% endfor %}"
        "{{ range(3) | list | length }}{{ namespace is defined }}",
        "{{ raise_exception is defined }}{% set range = 'shadowed' %}{{ range }}{{ tools is none }}{{ cycler }}",
        "{{ messages | map(attribute='role') | join(',') }}{{ (messages | selectattr('role', 'eq', 'user') | list)"
        " | length }}{{ strftime_now('%Y') | length }}",
    ]
    for source in sources:
        template, globals_, _, _ = _compiled(source)
        variables = {"messages": msgs, "tools": None, "documents": None, "add_generation_prompt": True,
                     "bos_token": "<s>", "eos_token": "</s>", "cycler": "a variable over a global"}
        assert _render(template, globals_, dict(variables)) == template.render(**variables)
    for source, error in [("{{ raise_exception('nope') }}", jinja2.TemplateError),
                          ("{{ messages[0].content.upper.x.y }}", jinja2.UndefinedError),
                          ("{{ 1 // 0 }}", ZeroDivisionError)]:
        template, globals_, _, _ = _compiled(source)
        with pytest.raises(error) as ours:
            _render(template, globals_, {"messages": msgs})
        with pytest.raises(error) as theirs:
            template.render(messages=msgs)
        assert str(ours.value) == str(theirs.value)


def test_the_sandbox_remembers_its_verdicts_and_still_refuses_what_it_refused():
    """The sandbox's verdict on an attribute is kept per (type, name): the same answers as jinja2's
    own sandbox, the second time as the first, for a safe method, a mutating one and an internal one."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from indexer.tokens import _ENV

    plain = ImmutableSandboxedEnvironment()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for obj, attr in [({}, "get"), ({}, "update"), ([], "append"), ("s", "upper"), ({}, "__class__"),
                      (render, "__globals__"), (int, "mro")]:
        value = getattr(obj, attr)
        for _ in range(2):
            assert _ENV.is_safe_attribute(obj, attr, value) == plain.is_safe_attribute(obj, attr, value)
    for _ in range(2):  # a template that reads with .get renders, every time
        assert render("{% for m in messages %}{{ m.get('role') }}{% endfor %}", messages) == "userassistant"
        with pytest.raises(ChatTemplateError):  # a mutation is refused, the second time too
            render("{{ messages.append(1) }}", messages)
        with pytest.raises(ChatTemplateError):
            render("{{ messages.__class__.__mro__ }}", messages)
        assert render("{{ ''.__class__ }}") == ""  # an internal attribute reads as undefined


def test_tools_and_documents_are_defined_as_none_when_absent_and_continue_final_message_is_not_a_variable():
    assert render("{{ tools is none }}{{ documents is none }}{{ continue_final_message is defined }}") == \
        "TrueTrueFalse"


# ---- vLLM's normalisation -----------------------------------------------------------------------

def test_messages_keep_only_vllms_fields_with_text_parts_joined_by_newlines():
    messages = [
        {"role": "system",
         "content": [{"type": "text", "text": "s1", "cache_control": {}}, {"type": "text", "text": "s2"}],
         "weird": 1},
        {"role": "user", "content": [{"type": "input_text", "text": "p1"}, "p2", {"type": "refusal", "refusal": "no"},
                                     {"type": "text"}], "name": "bob"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"type": "function",
                         "function": {"arguments": "{\"b\": 1, \"a\": \"<x>\"}", "name": "f", "z": 1},
                         "id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": [{"type": "text", "text": "t1"}, {"type": "text", "text": "t2"}]},
    ]
    assert conversation(messages) == [
        {"role": "system", "content": "s1\ns2"},
        {"role": "user", "content": "p1\np2\nno", "name": "bob"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "function": {"arguments": {"b": 1, "a": "<x>"}, "name": "f", "z": 1}, "type": "function"}],
         "reasoning": "hmm", "reasoning_content": "hmm"},
        {"role": "tool", "content": "t1\nt2", "tool_call_id": "c1"},
    ]
    # key order of the tool call is pydantic's (id, function{arguments, name}, type), which tojson shows
    assert list(conversation(messages)[2]["tool_calls"][0]) == ["id", "function", "type"]
    # templates that loop over content parts get them as parts (tool results still joined)
    openai = conversation(messages, "openai")
    assert openai[0]["content"] == [{"type": "text", "text": "s1", "cache_control": {}}, {"type": "text", "text": "s2"}]
    assert openai[3]["content"] == "t1\nt2"


def test_string_content_is_what_its_one_text_part_makes_and_a_systems_billing_line_goes():
    """A message's string content takes a shorter path than content parts: the same conversation either way,
    vLLM's dropped first line of a system text that starts with Claude Code's billing header included."""
    header = "x-anthropic-billing-header: cc_version=1; cc_entrypoint=cli"
    texts = ["plain", "", "two\nlines", f"{header}\nthe real system prompt", header, f"{header}\n"]
    for role in ("system", "user", "assistant", "developer", "tool"):
        for text in texts:
            as_string = conversation([{"role": role, "content": text, "name": "n"}])
            as_parts = conversation([{"role": role, "content": [{"type": "text", "text": text}], "name": "n"}])
            assert as_string == as_parts, (role, text)
    assert conversation([{"role": "system", "content": f"{header}\nthe real system prompt"}])[0]["content"] == \
        "the real system prompt"
    assert conversation([{"role": "user", "content": f"{header}\nkept"}])[0]["content"] == f"{header}\nkept"


def test_empty_text_parts_are_dropped_as_vllm_drops_them():
    """vLLM keeps a content part only if it parses to something truthy: in the "string" format an empty
    text ("" in a text, refusal, thinking part...) is left out, not joined in as an empty line (seen on
    vLLM 0.32: a user's ["", "b"] rendered "b", not "\nb", one token fewer); in the "openai" format
    the part is a dict and stays."""
    e = {"type": "text", "text": ""}
    messages = [
        {"role": "user", "content": [e, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": ""}, {"type": "text", "text": "ok"},
                                          {"type": "thinking", "thinking": ""}]},
        {"role": "tool", "tool_call_id": "c", "content": [e, {"type": "text", "text": "x"}]},
        {"role": "developer", "content": [{"type": "text", "text": "a"}, e]},
        {"role": "user", "content": [e]},
        {"role": "tool", "tool_call_id": "d", "content": [{"type": "tool_reference", "name": ""}]},
    ]
    assert [m["content"] for m in conversation(messages)] == ["b", "ok", "x", "a", "", ""]
    openai = conversation(messages, "openai")
    assert openai[0]["content"] == [e, {"type": "text", "text": "b"}]
    assert openai[2]["content"] == "\nx"  # a tool result's text parts joined after parsing, the empty one too
    assert openai[5]["content"] == [{"type": "tool_reference", "name": ""}]
    # as the template sees it: the developer message made system (the template has no developer role)
    assert render("{% for m in messages %}[{{ m.content }}]{% endfor %}", messages[3:4]) == "[a]"


@pytest.mark.parametrize("arguments,parsed", [("not json", {}), ("[1]", {}), ("", {}), (None, {}),
                                              ({"k": "v"}, {"k": "v"}), ("{\"k\": [1]}", {"k": [1]})])
def test_tool_call_arguments_become_an_object(arguments, parsed):
    msg = {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
                                                               "function": {"name": "f", "arguments": arguments}}]}
    assert conversation([msg])[0]["tool_calls"][0]["function"]["arguments"] == parsed


def test_empty_tool_calls_are_dropped_and_bad_ones_are_400s():
    assert "tool_calls" not in conversation([{"role": "assistant", "content": "x", "tool_calls": []}])[0]
    with pytest.raises(ChatTemplateError, match="type 'function'"):
        conversation([{"role": "assistant", "content": "x", "tool_calls": [{"type": "custom", "function": {}}]}])
    with pytest.raises(ChatTemplateError, match="only text content parts"):
        conversation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_tools_are_dumped_as_vllms_pydantic_model_does():
    tools = [{"function": {"parameters": {"z": 1, "a": 2}, "name": "f", "extra": 1}, "type": "function", "x": 2},
             {"type": "function", "function": {"name": "g", "strict": True}, "defer_loading": True}]
    assert tool_dicts(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"z": 1, "a": 2}}},
        {"type": "function", "function": {"name": "g", "description": None, "parameters": None, "strict": True,
                                          "defer_loading": True}, "defer_loading": True}]
    assert list(tool_dicts(tools)[0]["function"]["parameters"]) == ["z", "a"]  # the client's order, not sorted
    with pytest.raises(ChatTemplateError):
        tool_dicts([{"type": "function", "function": {"description": "no name"}}])


def test_content_format_is_detected_from_the_template():
    loops = "{% for m in messages %}{% for c in m['content'] %}[{{ c.text }}]{% endfor %}{% endfor %}"
    macro = ("{% macro show(x) %}{% for c in x %}<{{ c.text }}>{% endfor %}{% endmacro %}"
             "{% for message in messages %}{{ show(message.content) }}{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(loops, parts) == "[a][b]"
    assert render(macro, parts) == "<a><b>"
    assert render("{% for m in messages %}{{ m.content }}{% endfor %}", parts) == "a\nb"


def test_developer_messages_become_one_system_message_unless_the_template_knows_the_role():
    messages = [{"role": "developer", "content": "d1"}, {"role": "user", "content": "u"},
                {"role": "system", "content": "s2"}]
    plain = "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
    assert render(plain, messages) == "system=d1\n\ns2;user=u;"
    assert render(plain + "{# 'developer' #}", messages) == "developer=d1;user=u;system=s2;"


# ---- continue_final_message ---------------------------------------------------------------------

CHAT = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is "}]


def test_continue_final_message_cuts_right_after_the_final_message():
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    assert render(tpl, CHAT, add_generation_prompt=False, continue_final_message=True) == \
        "<user>x</user><assistant>The answer is "
    # a template that trims the message trims the trailing space too: so is the cut
    assert render("{% for m in messages %}{{ m.content | trim }}END{% endfor %}", CHAT, add_generation_prompt=False,
                  continue_final_message=True) == "xENDThe answer is"


def test_continue_final_message_refusals():
    with pytest.raises(ChatTemplateError, match="not compatible"):
        render("{{ messages[-1].content }}", CHAT, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not appear"):
        render("{% for m in messages %}{{ m.role }}{% endfor %}{# content #}", CHAT, add_generation_prompt=False,
               continue_final_message=True)
    # in a request, leaving add_generation_prompt at its default (true) is refused as vLLM refuses it
    with pytest.raises(ChatTemplateError, match="not compatible"):
        ChatRequest.from_body({"messages": CHAT, "continue_final_message": True})
    with pytest.raises(ChatTemplateError, match="Cannot set both"):
        ChatRequest.from_body({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True})


# ---- request fields -----------------------------------------------------------------------------

VARS = "{{ enable_thinking }}|{{ reasoning_effort }}|{{ documents | tojson }}|{{ add_generation_prompt }}|{{ foo }}"


def test_request_fields_merge_as_vllm_merges_them():
    tok = ByteTokenizer(VARS)
    body = {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none",
            "chat_template_kwargs": {"documents": [{"title": "k", "text": "v"}], "add_generation_prompt": False,
                                     "foo": None, "bar": 1},
            "documents": [{"title": "top", "text": "wins"}]}
    text = bytes(chat_request_ids(body, tok)).decode()
    # reasoning_effort sets enable_thinking; top-level documents and add_generation_prompt win; None is unset
    assert text == 'False|none|[{"title": "top", "text": "wins"}]|True|'
    kw = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    assert bytes(chat_request_ids(kw, tok)).decode().startswith("True|none|")
    # /tokenize's chat form has no documents or reasoning_effort
    assert bytes(chat_request_ids(body, tok, api="tokenize")).decode() == \
        '||[{"title": "k", "text": "v"}]|True|'  # undefined: empty


def test_tokenize_endpoint_drops_reasoning_content_the_chat_endpoint_renames():
    """vLLM 0.32's chat request model renames an assistant's ``reasoning_content`` to ``reasoning``
    (the template sees both); /tokenize's chat form has no such step, so the field is dropped there
    (seen on vLLM 0.32 with a template printing the messages)."""
    tok = ByteTokenizer("{% for m in messages %}{{ m | tojson }}{% endfor %}")
    body = {"messages": [{"role": "user", "content": "u"},
                         {"role": "assistant", "content": "a", "reasoning_content": "r"},
                         {"role": "assistant", "content": "b", "reasoning": "kept", "reasoning_content": "gone"}]}
    chat = bytes(chat_request_ids(body, tok)).decode()
    assert '"content": "a", "reasoning": "r", "reasoning_content": "r"}' in chat
    tokenize = bytes(chat_request_ids(body, tok, api="tokenize")).decode()
    assert tokenize == ('{"role": "user", "content": "u"}{"role": "assistant", "content": "a"}'
                        '{"role": "assistant", "content": "b", "reasoning": "kept", "reasoning_content": "kept"}')
    assert body["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}  # not mutated
    # the remote path's mapping renames it, so the pod's /tokenize renders what its chat endpoint renders
    assert chat_request_ids(tokenize_chat_body(body, "m"), tok, api="tokenize") == chat_request_ids(body, tok)


def test_a_requests_own_template_is_refused_unless_trusted():
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": "R:{{ messages[0].content }}"}
    in_kwargs = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "K{{ 1 }}"}}
    # vLLM with --trust-request-chat-template renders them (the kwargs one too)
    assert bytes(chat_request_ids(body, ByteTokenizer(), trust_request_template=True)).decode() == "R:x"
    assert bytes(chat_request_ids(in_kwargs, ByteTokenizer(), trust_request_template=True)).decode() == "K1"
    # without it (vLLM's default) both are a 400; the router's local tokenizer never runs a client's template
    for b in (body, in_kwargs):
        with pytest.raises(ChatTemplateError, match="trust-request-chat-template"):
            chat_request_ids(b, ByteTokenizer())
        with pytest.raises(APIError) as err:
            prompt_tokens("chat", b, ByteTokenizer())
        assert err.value.status == 400 and err.value.param == "chat_template"
        with pytest.raises(ShapeError):
            chat_ids_of(b, ByteTokenizer())
    assert check_chat(body).chat_template == body["chat_template"]  # remote: the pod decides


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "documents": [{"title": 1}]}, "documents"),
])
def test_bad_chat_input_is_a_400_in_router_and_simulator(body, param):
    with pytest.raises(APIError) as err:
        prompt_tokens("chat", body, ByteTokenizer())
    assert err.value.status == 400 and err.value.param == param
    with pytest.raises(ShapeError) as shape:
        chat_ids_of(body, ByteTokenizer())
    assert shape.value.status == 400


def test_completion_add_special_tokens(tmp_path):
    tok = HFTokenizer(make_folder(tmp_path))
    with_bos = prompt_tokens("completion", {"prompt": "hello world"}, tok)
    without = prompt_tokens("completion", {"prompt": "hello world", "add_special_tokens": False}, tok)
    assert with_bos == [tok.encode("<s>", False)[0]] + without and len(without) == 2
    assert prompt_ids_of({"prompt": "hello world", "add_special_tokens": False}, tok) == without
    assert prompt_tokens("completion", {"prompt": [5, 6, 7], "add_special_tokens": False}, tok) == [5, 6, 7]
    with pytest.raises(APIError):
        prompt_tokens("completion", {"prompt": "x", "add_special_tokens": "no"}, tok)


# ---- the model folder ---------------------------------------------------------------------------

def make_folder(root: Path, config_template: str | None = "CONFIG {{ messages[0].content }}") -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", "hello", "world", "x", "hi"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>"])
    folder = root / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "image_token": "<img>"}
    if config_template is not None:
        cfg["chat_template"] = config_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_chat_template_jinja_beside_tokenizer_json_wins_and_named_templates_pick_tool_use(tmp_path):
    folder = make_folder(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    assert HFTokenizer(folder / "tokenizer.json").apply_chat_template(msgs) == "CONFIG hi"
    (folder / "chat_template.jinja").write_text("JINJA {{ bos_token }}{{ eos_token }}{{ image_token }} "
                                                "{{ messages[0].content }}")
    tok = HFTokenizer(folder / "tokenizer.json")
    assert tok.apply_chat_template(msgs) == "JINJA <s></s><img> hi"
    assert tok.eos_token_id == 2
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools | length }}")
    tok = HFTokenizer(folder)
    assert tok.apply_chat_template(msgs) == "JINJA <s></s><img> hi"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "f"}}]) == "TOOLS 1"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "TOOLS 0"


def test_loading_a_tokenizer_compiles_its_templates_and_a_broken_one_fails_only_its_request(tmp_path):
    from indexer.tokens import _compiled

    folder = make_folder(tmp_path)
    (folder / "chat_template.jinja").write_text("LOADED {{ messages[0].content }}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("BROKEN {% if %}")
    _compiled.cache_clear()
    tok = HFTokenizer(folder)   # the default and the named templates, compiled at load
    assert _compiled.cache_info().currsize == 1   # the broken one was tried and is not cached
    misses = _compiled.cache_info().misses
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "LOADED hi"
    assert _compiled.cache_info().misses == misses   # the first request compiled nothing
    with pytest.raises(ChatTemplateError, match="failed to compile"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[])


def test_special_tokens_map_json_fills_in_for_an_old_config(tmp_path):
    folder = make_folder(tmp_path, config_template="{{ pad_token }}{{ bos_token }}")
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": {"content": "</s>"}, "bos_token": "<s>"}))
    assert HFTokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "</s><s>"


# ---- the remote path ----------------------------------------------------------------------------

BODIES = [
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}}], "tool_choice": "none"},
    {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "u"}], "documents": [{"title": "t", "text": "x"}],
     "reasoning_effort": "low", "chat_template_kwargs": {"foo": "bar"}, "add_special_tokens": True},
]
EVERYTHING = ("{% for m in messages %}{{ m | tojson }}{% endfor %}{{ tools | tojson }}{{ documents | tojson }}"
              "{{ enable_thinking }}{{ reasoning_effort }}{{ foo }}{{ add_generation_prompt }}{# content #}")


@pytest.mark.parametrize("body", BODIES)
def test_tokenize_body_renders_what_the_chat_request_renders(body):
    tok = ByteTokenizer(EVERYTHING)
    mapped = tokenize_chat_body(body, "m")
    assert mapped["model"] == "m" and "documents" not in mapped and "reasoning_effort" not in mapped
    assert chat_request_ids(mapped, tok, api="tokenize") == chat_request_ids(body, tok)
    assert chat_ids_of(mapped, tok, api="tokenize") == chat_ids_of(body, tok)  # the simulator's /tokenize agrees


async def test_remote_tokenizer_sends_the_mapped_body_in_its_own_key_order():
    seen: list[bytes] = []

    async def tokenize(request):
        seen.append(await request.read())
        return web.json_response({"tokens": [1, 2, 3], "count": 3, "max_model_len": 100})

    import httpx

    async with serve_routes(web.post("/tokenize", tokenize)) as port, httpx.AsyncClient() as client:
        rt = RemoteTokenizer(f"http://127.0.0.1:{port}", "m", client)
        assert await rt.encode_chat_request(BODIES[0]) == [1, 2, 3]
        assert await rt.encode_chat_request(BODIES[0]) == [1, 2, 3]
        assert rt.hits == 1 and len(seen) == 1
    sent = json.loads(seen[0])
    assert list(sent["tools"][0]["function"]["parameters"]) == ["z", "a"]
    assert sent["messages"] == BODIES[0]["messages"] and sent["model"] == "m"


# ---- truncate_prompt_tokens -----------------------------------------------------------------------
# vLLM 0.32 (renderers/params.py TokenizeParams, tokenizers/registry.py): with truncation_side the
# whole tokenization is sliced ("right" keeps the first N, "left" the last N); without it a generating
# model's tokenizer truncates from the left while it encodes, keeping the special tokens it adds; -1
# means the context length. The same cases on the real-vLLM tier's tokenizer were checked offline
# against vLLM's own OnlineRenderer (render_completion / render_chat).

def test_truncate_prompt_tokens_cuts_the_prompt_as_vllm_does(tmp_path):
    from router.prompts import prompt_block_keys

    tok = HFTokenizer(make_folder(tmp_path), chat_template="{{ messages[0].content }}")
    text = "hello world x hi hello"  # <s>=1 hello=3 world=4 x=5 hi=6
    assert prompt_tokens("completion", {"prompt": text}, tok) == [1, 3, 4, 5, 6, 3]

    def cut(kind="completion", **kw):
        body = {"prompt": text} if kind == "completion" else {"messages": [{"role": "user", "content": text}]}
        return list(prompt_tokens(kind, {**body, **kw}, tok))

    assert cut(truncate_prompt_tokens=3) == [1, 6, 3]  # the tokenizer's own side: left, BOS kept
    assert cut(truncate_prompt_tokens=3, truncation_side="left") == [5, 6, 3]  # sliced: BOS gone
    assert cut(truncate_prompt_tokens=3, truncation_side="right") == [1, 3, 4]
    assert cut(truncate_prompt_tokens=3, add_special_tokens=False) == [5, 6, 3]
    assert cut(truncate_prompt_tokens=1) == [1] and cut(truncate_prompt_tokens=0) == []
    assert cut(truncate_prompt_tokens=6) == cut(truncate_prompt_tokens=-1) == cut() == [1, 3, 4, 5, 6, 3]
    # a batch's first prompt and token-id prompts (sliced from the tokenizer's side, left)
    assert cut(prompt=[text, "x"], truncate_prompt_tokens=2) == [1, 3]
    assert cut(prompt=[7, 8, 9, 10, 11], truncate_prompt_tokens=2) == [10, 11]
    assert cut(prompt=[[7, 8, 9], [1]], truncate_prompt_tokens=2, truncation_side="right") == [7, 8]
    # chat: no special tokens added by default, so the last N of the rendered prompt
    assert cut("chat", truncate_prompt_tokens=2) == [6, 3]
    assert cut("chat", truncate_prompt_tokens=2, add_special_tokens=True) == [1, 3]
    assert cut("chat", truncate_prompt_tokens=2, truncation_side="right") == [3, 4]
    # the block keys are the cut prompt's: a left-truncated prompt shares no block with its whole text
    keys = prompt_block_keys(prompt_tokens("completion", {"prompt": text, "truncate_prompt_tokens": 4}, tok),
                             2, 7, None, None)
    assert keys == prompt_block_keys([1, 5, 6, 3], 2, 7, None, None)


# ---- media content parts ------------------------------------------------------------------------

MEDIA_PARTS = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
               {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
               {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
               {"type": "image_embeds", "image_embeds": "AAAA"},
               {"type": "input_image", "image_url": "https://example.com/a.png"},
               {"image_url": {"url": "https://example.com/a.png"}},  # no type: vLLM reads the key
               {"type": "image_url", "uuid": "img-1", "image_url": None}]  # a cached image, by its uuid


@pytest.mark.parametrize("part", MEDIA_PARTS)
def test_a_chat_request_with_media_is_routed_unkeyed_on_its_texts_length(part):
    """vLLM serves these on a multimodal model (media placeholder tokens, blocks keyed with the media's
    hashes). The router cannot reproduce that: it was a 400 here before. Now the text alone stands in
    for the prompt's length and there are no block keys (nothing looked up, nothing credited)."""
    from router.prompts import Unkeyed, prompt_block_keys

    tok = ByteTokenizer()
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]}
    tokens = prompt_tokens("chat", body, tok)
    text_only = {"messages": [body["messages"][0], {"role": "user", "content": [{"type": "text",
                                                                                "text": "what is this?"}]}]}
    assert isinstance(tokens, Unkeyed) and tokens == prompt_tokens("chat", text_only, tok)
    assert prompt_block_keys(tokens, 4, 1, None, None) == [] == prompt_block_keys(tokens, 4, 1, "lora", "salt")
    assert chat_request_ids(text_only, tok)  # a text-only request is keyed as before
    assert prompt_block_keys(prompt_tokens("chat", text_only, tok), 4, 1, None, None)
    # a request that is bad apart from its media is still a 400
    with pytest.raises(APIError) as err:
        prompt_tokens("chat", {**body, "add_generation_prompt": "yes"}, tok)
    assert err.value.status == 400
    # an unknown part type, or a text part with a uuid, is vLLM's 400 as before
    for bad in ({"type": "hologram", "hologram": "x"}, {"type": "text", "text": "x", "uuid": "u"}):
        with pytest.raises(APIError):
            prompt_tokens("chat", {"messages": [{"role": "user", "content": [bad]}]}, tok)
    # a text part whose uuid is null is plain text to vLLM
    assert chat_request_ids({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "uuid": None}]}]},
                            tok) == chat_request_ids({"messages": [{"role": "user", "content": "x"}]}, tok)



def test_a_completion_of_prompt_embeds_alone_is_routed_unkeyed():
    """vLLM (with --enable-prompt-embeds) serves a completion with ``prompt_embeds`` and no
    ``prompt``; the router answered 400 ("'prompt' is required"). It routes it now, with no keys."""
    from router.prompts import Unkeyed, prompt_block_keys

    tokens = prompt_tokens("completion", {"prompt_embeds": "AAAA", "truncate_prompt_tokens": 2}, ByteTokenizer())
    assert isinstance(tokens, Unkeyed) and prompt_block_keys(tokens, 4, 1, None, "salt") == []
    with pytest.raises(APIError):
        prompt_tokens("completion", {}, ByteTokenizer())


# ---- the pods' serve flags: --default-chat-template-kwargs, --exclude-tools-when-tool-choice-none ----
# vLLM 0.32: renderers/online_renderer.py render_chat leaves the tools out when
# ``request.tool_choice == "none" and self.exclude_tools_when_tool_choice_none`` (the chat endpoint
# only: entrypoints/serve/tokenize/serving.py builds its tool_dicts without it); preprocess_chat
# merges ``merge_kwargs(default_template_kwargs, {tools, tokenize})`` and then
# ``request.build_chat_params(...).with_defaults(that)`` (renderers/params.py), which is
# ``merge_kwargs(that, merge_kwargs(request.chat_template_kwargs, switches))``: the request's own
# kwargs and switches over the defaults, a None or "auto" in them leaving the default.

FLAG_VARS = ("{{ tools | tojson }}|{{ enable_thinking }}|{{ foo }}|{{ add_generation_prompt }}|{{ reasoning_effort }}"
             "|{{ documents | tojson }}")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_DUMP = '[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}]'
MSG = [{"role": "user", "content": "x"}]
DEFAULTS = {"enable_thinking": False, "foo": "d", "add_generation_prompt": False}


@pytest.mark.parametrize(("body", "api", "want"), [
    ({"messages": MSG}, "chat", "null|False|d|True||null"),  # the request's switch beats the default
    ({"messages": MSG, "chat_template_kwargs": {"enable_thinking": True, "foo": None}}, "chat",
     "null|True|d|True||null"),  # the request's own kwargs win, but None leaves the default
    ({"messages": MSG, "chat_template_kwargs": {"foo": "auto"}, "reasoning_effort": "high"}, "chat",
     "null|True|d|True|high|null"),  # "auto" is unset too; reasoning_effort's enable_thinking beats the default
    ({"messages": MSG, "chat_template_kwargs": {"foo": "mine"}, "add_generation_prompt": False}, "chat",
     "null|False|mine|False||null"),
    ({"messages": MSG, "tools": [TOOL]}, "chat", f"{TOOL_DUMP}|False|d|True||null"),
    ({"messages": MSG, "reasoning_effort": "high"}, "tokenize", "null|False|d|True||null"),  # /tokenize: defaults too
])
def test_default_chat_template_kwargs_merge_under_the_request_as_vllm_merges_them(body, api, want):
    tok = ByteTokenizer(FLAG_VARS)
    flags = ServeChatFlags(DEFAULTS)
    assert bytes(chat_request_ids(body, tok, api, flags=flags)).decode() == want
    plain = bytes(chat_request_ids(body, tok, api)).decode()
    assert plain != want  # without the setting the defaults are not there


@pytest.mark.parametrize(("body", "api", "tools_shown"), [
    ({"messages": MSG, "tools": [TOOL], "tool_choice": "none"}, "chat", False),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": "auto"}, "chat", True),
    ({"messages": MSG, "tools": [TOOL]}, "chat", True),  # no tool_choice with tools: "auto"
    ({"messages": MSG, "tools": [TOOL], "tool_choice": None}, "chat", True),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "chat", True),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": "none"}, "tokenize", True),  # /tokenize does not apply it
])
def test_tools_are_left_out_when_tool_choice_is_none_as_vllm_leaves_them(body, api, tools_shown):
    tok = ByteTokenizer(FLAG_VARS)
    flags = ServeChatFlags(exclude_tools_when_tool_choice_none=True)
    text = bytes(chat_request_ids(body, tok, api, flags=flags)).decode()
    assert text.split("|")[0] == (TOOL_DUMP if tools_shown else "null")
    assert bytes(chat_request_ids(body, tok, api)).decode().split("|")[0] == TOOL_DUMP  # unset: always shown


def test_both_flags_together_and_defaults_tools_as_vllm_keeps_them():
    body = {"messages": MSG, "tools": [TOOL], "tool_choice": "none", "chat_template_kwargs": {"foo": "r"}}
    defaults = {"tools": [{"name": "from-defaults"}], "foo": "d", "enable_thinking": True}
    flags = ServeChatFlags(defaults, True)
    got = ChatRequest.from_body(body, flags=flags).template_kwargs
    # vLLM: the excluded tools are None, which leaves the default's tools in merge_kwargs
    assert got["tools"] == defaults["tools"] and got["foo"] == "r" and got["enable_thinking"] is True
    assert bytes(chat_request_ids(body, ByteTokenizer(FLAG_VARS), flags=flags)).decode() == \
        '[{"name": "from-defaults"}]|True|r|True||null'


def test_settings_reach_the_routers_rendering_and_unset_ones_change_nothing(tmp_path):
    from kvcommon.settings import build_settings
    from router.config import RouterSettings
    from router.prompts import serve_chat_flags
    from router.routing import Router
    from router.service import Services

    assert serve_chat_flags(RouterSettings()) is None  # the common path: no flags object, no extra work
    assert serve_chat_flags(RouterSettings(default_chat_template_kwargs={})) is None
    flags = serve_chat_flags(RouterSettings(default_chat_template_kwargs={"foo": "d"},
                                            exclude_tools_when_tool_choice_none=True))
    assert flags == ServeChatFlags({"foo": "d"}, True)
    body = {"messages": MSG, "tools": [TOOL], "tool_choice": "none", "truncate_prompt_tokens": 200}
    tok = ByteTokenizer(FLAG_VARS)
    assert bytes(prompt_tokens("chat", body, tok, None, flags)).decode() == "null||d|True||null"
    assert bytes(prompt_tokens("chat", body, tok)).decode().startswith(TOOL_DUMP + "||")
    # from the settings (YAML / env / flags) to the router's prompt and its tokenize process
    folder = make_folder(tmp_path, "{% if tools %}hello {% endif %}{% if foo %}world {% endif %}x")
    pods = [{"id": "p", "url": "http://127.0.0.1:9", "model": "m"}]
    for settings, want in (({"default_chat_template_kwargs": {"foo": 1}, "exclude_tools_when_tool_choice_none": True},
                            [4, 5]), ({}, [3, 5])):
        services = Services(build_settings(RouterSettings, {"pods": pods, "tokenizer": str(folder / "tokenizer.json"),
                                                            **settings}))
        router = Router(services.settings, services.registry, None, services.tokenizer, services.metrics)
        assert list(router.prompt("chat", body)[0]) == want
        assert services.tokenize_process is not None
        assert services.tokenize_process.chat_flags == router.chat_flags
        assert (router.chat_flags is None) == (not settings)
        services.tokenize_pool.close()


def test_the_tokenize_process_applies_the_flags_as_the_router_does(tmp_path):
    """The child is started with the flags on its command line and renders with them (in-process
    here: a unit test starts no process; tests/test_tokenize_process.py runs the real child)."""
    import orjson

    from router.prompts import prompt_block_keys
    from router.tokenize_proc import TokenizeProcess, _Child, child_args

    folder = make_folder(tmp_path, "{% if tools %}hello hello hello hello {% endif %}{% if enable_thinking %}"
                                   "world world {% endif %}{{ messages[0].content }}")
    spec = str(folder / "tokenizer.json")
    flags = ServeChatFlags({"enable_thinking": True}, True)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "none"}
    plain = HFTokenizer(spec)
    want = list(prompt_tokens("chat", body, plain, None, flags))
    assert want == [4, 4, 6] and len(prompt_tokens("chat", body, plain)) == 5  # world world hi / hello x4 hi
    for chat_flags in (flags, ServeChatFlags({"enable_thinking": True}), ServeChatFlags(None, True), None):
        command = TokenizeProcess(spec, cache_tokens=0, timeout_s=30, chat_flags=chat_flags)._command(3)
        assert command[1:3] == ["-m", "router.tokenize_proc"]
        args, parsed = child_args(command[3:])
        assert parsed == chat_flags and args.tokenizer == spec
    _, parsed = child_args(TokenizeProcess(spec, cache_tokens=0, timeout_s=30, chat_flags=flags)._command(3)[3:])
    for cache_tokens in (0, 1000):
        answer = _Child(spec, cache_tokens, False, True, parsed).tokenize(1, "chat", orjson.dumps(body), 1, 7, None,
                                                                          None, 4.0)
        assert answer.error is None and answer.count == 3
        assert answer.keys == prompt_block_keys(want, 1, 7, None, None)
    assert _Child(spec, 0, False).tokenize(1, "chat", orjson.dumps(body), 1, 7, None, None, 4.0).count == 5


# ---- the pods' --chat-template and --chat-template-content-format ----------------------------------
# vLLM 0.32 reads --chat-template with renderers/chat_utils.py load_chat_template (the file it names,
# else the value itself when it holds "{", "}" or a newline, else an error), hands it to every chat
# request as ``request.chat_template or default`` (over a chat_template in the kwargs: ChatParams's
# get_apply_chat_template_kwargs), and resolve_chat_template_content_format returns the given format
# unless it is "auto". The expected texts are what vLLM 0.32 rendered (``prompt_token_ids`` of its
# chat endpoint, detokenized) with the same template and flag.

POD_TEMPLATE = ("{%- for message in messages %}[{{ message['role'] | upper }}] {{ message['content'] }}\n"
                "{% endfor %}\n{%- if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}\n"
                "{%- if add_generation_prompt %}[ASSISTANT] {% endif %}\n")
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}S:{{ m.content }}{% else %}"
                  "{% for p in m.content %}P:{{ p.text }};{% endfor %}{% endif %}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
TURNS = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "ok"}]


def test_the_chat_template_setting_is_read_as_vllm_reads_the_flag(tmp_path):
    from pydantic import ValidationError

    from indexer.tokens import load_chat_template
    from router.config import RouterSettings
    from router.prompts import serve_chat_flags

    path = tmp_path / "pods.jinja"
    path.write_text(POD_TEMPLATE)
    assert load_chat_template(str(path)) == POD_TEMPLATE  # a file: its text
    assert load_chat_template(PARTS_TEMPLATE) == PARTS_TEMPLATE  # no such file, Jinja characters: the template
    assert load_chat_template("/no/such/{dir}/t.jinja") == "/no/such/{dir}/t.jinja"  # as vLLM: a template then
    assert serve_chat_flags(RouterSettings(chat_template=str(path))) == ServeChatFlags(None, False, POD_TEMPLATE)
    assert serve_chat_flags(RouterSettings(chat_template=PARTS_TEMPLATE, chat_template_content_format="string")) \
        == ServeChatFlags(None, False, PARTS_TEMPLATE, "string")
    assert serve_chat_flags(RouterSettings(chat_template_content_format="openai")) == \
        ServeChatFlags(None, False, None, "openai")
    assert serve_chat_flags(RouterSettings(chat_template_content_format="auto")) is None
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    for value, why in ((str(tmp_path / "missing.jinja"), "looks like a file path"),
                       ("template_chatml.jinja", "looks like a file path"),  # vLLM's built-in names: not here
                       (str(tmp_path), "looks like a file path"),  # a folder
                       ("", "looks like a file path"),
                       ("{% for m in messages %}{{ m.content }}", "failed to compile"),
                       (str(broken), "failed to compile")):
        with pytest.raises(ChatTemplateError, match=why):
            load_chat_template(value)
        with pytest.raises(ValidationError, match=why) as err:  # at start, not on every chat request
            RouterSettings(chat_template=value)
        assert err.value.errors()[0]["loc"] == ("chat_template",)
    with pytest.raises(ValidationError):
        RouterSettings(chat_template_content_format="strings")


@pytest.mark.parametrize(("template", "content_format", "messages", "generation", "want"), [
    # engine: --chat-template <file of POD_TEMPLATE> --chat-template-content-format openai
    (POD_TEMPLATE, "openai", TWO_PARTS, True,
     "[USER] [{'type': 'text', 'text': 'one'}, {'type': 'text', 'text': 'two'}]\n[ASSISTANT] "),
    (POD_TEMPLATE, "openai", TURNS, False,
     "[SYSTEM] [{'type': 'text', 'text': 'be terse'}]\n[USER] [{'type': 'text', 'text': 'hi'}]\n"
     "[ASSISTANT] [{'type': 'text', 'text': 'ok'}]\n"),
    (POD_TEMPLATE, "auto", TWO_PARTS, True, "[USER] one\ntwo\n[ASSISTANT] "),  # detected: "string"
    # engine: --chat-template '<PARTS_TEMPLATE>' (inline) --chat-template-content-format string
    (PARTS_TEMPLATE, "string", TWO_PARTS, True, "<user>S:one\ntwo<assistant>"),
    (PARTS_TEMPLATE, "string", TURNS[:2], False, "<system>S:be terse<user>S:hi"),
    (PARTS_TEMPLATE, "auto", TWO_PARTS, True, "<user>P:one;P:two;<assistant>"),  # detected: "openai"
])
def test_the_pods_template_and_content_format_render_as_vllm_renders_them(template, content_format, messages,
                                                                           generation, want):
    tok = ByteTokenizer()  # the tokenizer's own template (DEFAULT_CHAT_TEMPLATE) is not the pods'
    flags = ServeChatFlags(chat_template=template, chat_template_content_format=content_format)
    body = {"messages": messages, "add_generation_prompt": generation}
    for api in ("chat", "tokenize"):  # vLLM's /tokenize applies both flags too
        assert bytes(chat_request_ids(body, tok, api, flags=flags)).decode() == want
    assert bytes(prompt_tokens("chat", body, tok, None, flags)).decode() == want
    assert bytes(chat_request_ids(body, tok)).decode() != want  # unset: the tokenizer's template
    # a folder's own (named) templates are replaced too
    assert bytes(chat_request_ids(body, ByteTokenizer({"default": "D", "tool_use": "T"}), flags=flags)).decode() \
        == want


def test_the_pods_template_yields_to_a_trusted_requests_own_but_not_to_one_in_its_kwargs():
    flags = ServeChatFlags(chat_template="POD {{ messages[0].content }}")
    own = {"messages": MSG, "chat_template": "OWN {{ messages[0].content }}"}
    in_kwargs = {"messages": MSG, "chat_template_kwargs": {"chat_template": "KW {{ messages[0].content }}"}}
    tok = ByteTokenizer()
    assert bytes(chat_request_ids(own, tok, trust_request_template=True, flags=flags)).decode() == "OWN x"
    assert bytes(chat_request_ids(in_kwargs, tok, trust_request_template=True, flags=flags)).decode() == "POD x"
    assert bytes(chat_request_ids(in_kwargs, tok, trust_request_template=True)).decode() == "KW x"  # unset
    with pytest.raises(ChatTemplateError, match="trust-request-chat-template"):  # untrusted: refused as before
        chat_request_ids(own, tok, flags=flags)
    defaults = ServeChatFlags({"chat_template": "DEF {{ messages[0].content }}"}, False,
                              "POD {{ messages[0].content }}")
    assert bytes(chat_request_ids({"messages": MSG}, tok, flags=defaults)).decode() == "POD x"


def test_a_content_format_kwarg_of_a_request_is_a_template_variable_not_the_format():
    tok = ByteTokenizer("{{ messages[0].content }}|{{ content_format }}")
    body = {"messages": TWO_PARTS, "chat_template_kwargs": {"content_format": "openai"}}
    assert bytes(chat_request_ids(body, tok)).decode() == "one\ntwo|openai"
    flags = ServeChatFlags(chat_template_content_format="openai")
    assert bytes(chat_request_ids(body, tok, flags=flags)).decode() == \
        "[{'type': 'text', 'text': 'one'}, {'type': 'text', 'text': 'two'}]|openai"


def test_the_template_settings_reach_the_router_and_its_tokenize_process(tmp_path):
    import orjson

    from kvcommon.settings import build_settings
    from router.config import RouterSettings
    from router.prompts import prompt_block_keys
    from router.routing import Router
    from router.service import Services
    from router.tokenize_proc import TokenizeProcess, _Child, child_args

    folder = make_folder(tmp_path, "hello {{ messages[0].content }}")
    spec = str(folder / "tokenizer.json")
    path = tmp_path / "pods.jinja"
    path.write_text("{% for m in messages %}world {{ m.content }} {% endfor %}")
    pods = [{"id": "p", "url": "http://127.0.0.1:9", "model": "m"}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}]}
    for settings, want in (({"chat_template": str(path)}, [4, 6, 4, 5]), ({}, [3, 6])):
        services = Services(build_settings(RouterSettings, {"pods": pods, "tokenizer": spec, **settings}))
        router = Router(services.settings, services.registry, None, services.tokenizer, services.metrics)
        assert list(router.prompt("chat", body)[0]) == want
        assert services.tokenize_process is not None
        assert services.tokenize_process.chat_flags == router.chat_flags
        services.tokenize_pool.close()
    # the child gets the text the router read (a template starting with "-", with newlines and quotes)
    # and the format on its command line, and renders with them
    flags = ServeChatFlags(None, False, "-{% for m in messages %}\n{{ m.content }} 'x' \"hi\"{% endfor %}", "openai")
    for chat_flags in (flags, ServeChatFlags(chat_template="{{ messages }}"),
                       ServeChatFlags(chat_template_content_format="string"), None):
        command = TokenizeProcess(spec, cache_tokens=0, timeout_s=30, chat_flags=chat_flags)._command(3)
        _, parsed = child_args(command[3:])
        assert parsed == chat_flags
    _, parsed = child_args(TokenizeProcess(spec, cache_tokens=0, timeout_s=30, chat_flags=flags)._command(3)[3:])
    want = list(prompt_tokens("chat", body, HFTokenizer(spec), None, flags))
    text = "-[{'type': 'text', 'text': 'hi'}] 'x' \"hi\"[{'type': 'text', 'text': 'x'}] 'x' \"hi\""
    assert want == HFTokenizer(spec).encode(text, add_special_tokens=False)  # the parts' list, as "openai" gives
    answer = _Child(spec, 0, False, True, parsed).tokenize(1, "chat", orjson.dumps(body), 1, 7, None, None, 4.0)
    assert answer.error is None and answer.keys == prompt_block_keys(want, 1, 7, None, None)
