"""Writes a tiny Llama model folder that real vLLM can serve, offline, from fixed seeds.

Run with the real-vLLM venv's Python (it needs torch, transformers and tokenizers):

    <venv>/bin/python realvllm/tiny_model.py OUT_DIR

No weights can be downloaded here, so the model is made: a Llama config of 2 layers (hidden 128,
4 heads, 2 KV heads, head_dim 32), random bfloat16 weights (about 3 MB), and a byte-level BPE
tokenizer trained on generated text (asked for 4,096 tokens; the corpus yields 2,824). The
tokenizer adds a BOS token to plain prompts (as Llama's does), so ``add_special_tokens`` matters,
and its chat template renders a system prompt, ``tools`` in the system preamble (as real templates
do), ``documents``, tool calls and results, multi-turn history, ``add_generation_prompt`` and one
``chat_template_kwargs`` switch (``enable_thinking``). Beside it, in ``lora-sql/``, a LoRA adapter
(rank 8 on q_proj and v_proj) for ``--lora-modules``. Its output is gibberish; what matters is that
the engine, its KV cache and its events are real. Two runs write byte-identical files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 4096
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# Rendered by vLLM through transformers' sandboxed Jinja (tojson = json.dumps without HTML escaping,
# trim_blocks and lstrip_blocks on), and by kvroute's own renderer, which must give the same text.
CHAT_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if system_message or tools or documents %}
<|im_start|>system
{{ system_message }}
{%- if tools %}

# Tools
You may call one or more of these functions, one JSON object per <tool_call></tool_call>:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
{%- endif %}
{%- if documents %}

# Documents
{%- for doc in documents %}
[{{ loop.index }}] {{ doc['title'] }}: {{ doc['text'] }}
{%- endfor %}
{%- endif %}<|im_end|>
{% endif %}
{%- for message in loop_messages %}
{%- if message['role'] == 'tool' %}
<|im_start|>tool
{{ message['content'] }}<|im_end|>
{% else %}
<|im_start|>{{ message['role'] }}
{%- if message['content'] is string and message['content'] %}

{{ message['content'] }}
{%- endif %}
{%- if message.get('tool_calls') %}
{%- for call in message['tool_calls'] %}

<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>
{%- endfor %}
{%- endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- if enable_thinking is defined and not enable_thinking %}
<think></think>
{%- endif %}

{% endif %}"""

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think say help low line "
    "router cache prefix token block engine request prompt decode prefill latency queue pod fleet event hash "
    "function weather city temperature forecast tool call result document search query answer question user "
    "assistant system json name arguments description parameters type object string number array required"
).split()


def corpus(seed: int = 0, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        if rng.random() < 0.2:
            words.append(json.dumps({"name": rng.choice(WORDS), "arguments": {rng.choice(WORDS): rng.randint(0, 99)}}))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ":", ","]))
    return out


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}, indent=2, sort_keys=True) + "\n")
    return tok.get_vocab_size()


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False,
                         rope_theta=10000.0, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


LORA_NAME = "sql"
LORA_RANK = 8


def build_lora(model_dir: Path, out: Path) -> None:
    """A LoRA adapter for the tiny model, in PEFT's layout (``adapter_config.json`` and
    ``adapter_model.safetensors``): rank 8 on every layer's q_proj and v_proj, random weights from a
    fixed seed (B not zero, so the adapter changes the answers)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    torch.manual_seed(1)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, width in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(LORA_RANK, hidden) * 0.05).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(width, LORA_RANK) * 0.05).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": sorted(outs), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": str(model_dir), "modules_to_save": None}, indent=2, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    build_model(out, vocab)
    build_lora(out, out / f"lora-{LORA_NAME}")
    print(f"tiny model written to {out} (vocab {vocab}; LoRA adapter {LORA_NAME!r})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
