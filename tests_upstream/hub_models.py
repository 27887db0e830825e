"""Local stand-ins for the hub models that vLLM's tests/v1/core names.

Those tests build a ``ModelConfig`` (and, through the scheduler's structured
output manager, a tokenizer) from a hub id. The tests only read the model's
shape (layers, heads, context length, multimodal token ids), never weights,
so a directory with the real ``config.json`` values and a small byte-level
tokenizer is enough. vLLM's own ``VLLM_MODEL_REDIRECT_PATH`` maps each hub id
to such a directory, inside the upstream test process only.

The configs repeat the public ``config.json`` fields of each model that vLLM
reads; the tokenizer is not the model's (its ids and vocabulary differ), which
none of these tests depends on: they feed token ids, not text.

The multimodal models the tests name (llava-hf/llava-1.5-7b-hf,
Qwen/Qwen2.5-VL-3B-Instruct) are not redirected: vLLM's model classes for
them import torchvision, which the CPU set-up removes (its registry wheels
are CUDA builds), so those tests stay "needing hub models".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_OPT_COMMON: dict[str, Any] = {
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "dropout": 0.1,
    "enable_bias": True,
    "eos_token_id": 2,
    "init_std": 0.02,
    "layer_norm_elementwise_affine": True,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
}

_QWEN_IDS: dict[str, Any] = {
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

#: Hub id -> config.json of that model (the fields vLLM reads).
CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        **_OPT_COMMON,
        "do_layer_norm_before": True,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "word_embed_proj_dim": 768,
    },
    "facebook/opt-350m": {
        **_OPT_COMMON,
        "do_layer_norm_before": False,
        "ffn_dim": 4096,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "word_embed_proj_dim": 512,
    },
    "Qwen/Qwen3-0.6B": {
        **_QWEN_IDS,
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}

#: Special tokens of the stand-in tokenizer (after the 256 byte tokens).
_SPECIAL_TOKENS = (
    "<unk>",
    "<pad>",
    "<s>",
    "</s>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
)


def _save_tokenizer(out_dir: Path) -> None:
    """A byte-level tokenizer (every byte one token, no merges) plus specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(alphabet))}
    for token in _SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=list(_SPECIAL_TOKENS[4:]),
    )
    fast.save_pretrained(str(out_dir))


def build(root: Path) -> Path:
    """Write one directory per hub id under ``root`` and the redirect file
    (JSON, hub id -> directory) that ``VLLM_MODEL_REDIRECT_PATH`` names.
    Returns the redirect file."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = root / "_tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        _save_tokenizer(tokenizer_dir)
    redirect: dict[str, str] = {}
    for hub_id, config in CONFIGS.items():
        model_dir = root / hub_id.replace("/", "--")
        model_dir.mkdir(exist_ok=True)
        for item in tokenizer_dir.iterdir():
            (model_dir / item.name).write_bytes(item.read_bytes())
        (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        redirect[hub_id] = str(model_dir)
    redirect_file = root / "redirect.json"
    redirect_file.write_text(json.dumps(redirect, indent=2) + "\n")
    return redirect_file
