#!/usr/bin/env python3
"""Make tiny random-weight MoE fixtures in the MLX community format, plus mlx-lm goldens.

Requires: pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2   (CPU only, no network: HF_HUB_OFFLINE=1)

For each architecture this builds a random bf16 model with mlx-lm's own model classes, converts it with
`mlx_lm.convert` at several quantizations, and records mlx-lm's output on a fixed prompt:
  * `logits`: all prompt positions, computed in float32 (packed weights kept, every float parameter and
    every scale/bias upcast to f32, because MLX's CPU bf16 quantized kernels are not accurate on x86);
  * `greedy`: the first 32 greedy tokens after the prompt (KV-cached decode, float32);
  * `chat_ids`: Hugging Face `apply_chat_template` token ids for a fixed conversation;
  * `logits_top1`: last-position logits with the experts per token forced to 1 (tests `--top-k`).
Derived fixtures exercise loader paths `mlx_lm.convert` does not write: `-overrides` has a `false` override and a
null-group override (mlx-lm computes its goldens); `-overrides-vlm-sharded` nests it VLM-style with `language_model.`
prefixes, two shards and `rope_parameters`, and reuses those goldens (same weights).

Usage: python scripts/make_fixtures.py [OUT_DIR] [--only=arch,arch]   (default: fixtures/, every architecture)
"""

import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm import convert, load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Café 日本語 🚀"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a fox. Café? 日本語 🚀"},
]
N_GREEDY = 32
VOCAB = 384

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "Mixture of experts models route each token to a few experts.",
    "Streaming weights from the disk lets a small machine serve a large model.",
    "Café crème, naïve façade, smörgåsbord, jalapeño, über.",
    "日本語のテキストと中文文本 and 한국어 text mixed with English.",
    "Emoji: 🚀 🦊 🐶 ✨ 🎉 — dashes, “quotes”, and ellipses…",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
]


def make_tokenizer(path: Path):
    """A byte-level BPE tokenizer, trained offline on a tiny corpus, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def base_configs():
    qwen = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        "norm_topk_prob": True,
        "bos_token_id": None,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    # Tied embeddings, a dense layer between MoE layers, no top-k renormalisation.
    qwen_tied = dict(qwen)
    qwen_tied.update(
        {
            "num_hidden_layers": 3,
            "tie_word_embeddings": True,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
            "num_experts_per_tok": 2,
            "rope_theta": 10000.0,
            "eos_token_id": [2, 0],
        }
    )
    mixtral = {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    # Qwen3.5-MoE, VLM-style (`text_config`, `language_model.` weights) as the hub ships it: 3 Gated DeltaNet
    # layers then one gated full-attention layer, partial rotary, shared expert with its sigmoid gate.
    qwen35_text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "eos_token_id": 2,
    }
    qwen35 = {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": qwen35_text,
        "vision_config": {"depth": 1, "hidden_size": 32},
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    # Qwen3-Next: flat config, grouped qkvz/ba projections, a dense layer (mlp_only_layers), 8 layers so two
    # full-attention layers see each other's residual stream.
    qwen3_next = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "intermediate_size": 192,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [2],
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_theta": 5000000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 1024,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    # Dense Qwen3.5 (Qwen3.5-27B's layout): the same hybrid stack with a SwiGLU MLP in every layer.
    qwen35_dense_text = {
        k: v
        for k, v in qwen35_text.items()
        if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    }
    qwen35_dense_text.update({"model_type": "qwen3_5_text", "intermediate_size": 192, "tie_word_embeddings": True})
    qwen35_dense = dict(qwen35)
    qwen35_dense.update(
        {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": qwen35_dense_text,
            "tie_word_embeddings": True,
        }
    )
    return {
        "qwen3_moe": qwen,
        "qwen3_moe_tied": qwen_tied,
        "mixtral": mixtral,
        "qwen3_5_moe": qwen35,
        "qwen3_next": qwen3_next,
        "qwen3_5": qwen35_dense,
    }


HYBRID = {"qwen3_5_moe", "qwen3_next", "qwen3_5"}


# (suffix, convert kwargs). Every quantized fixture of every architecture; bf16 is unquantized.
VARIANTS = [
    ("q4g64", dict(quantize=True, q_bits=4, q_group_size=64)),
    ("q8g32", dict(quantize=True, q_bits=8, q_group_size=32)),
    ("q3g32", dict(quantize=True, q_bits=3, q_group_size=32)),
    ("q6g64", dict(quantize=True, q_bits=6, q_group_size=64)),
    ("q2g128", dict(quantize=True, q_bits=2, q_group_size=128)),
    ("q5g64", dict(quantize=True, q_bits=5, q_group_size=64)),
    ("mixed36", dict(quantize=True, q_group_size=64, quant_predicate="mixed_3_6")),
    ("bf16", dict(quantize=False, dtype="bfloat16")),
]

# Which variants each architecture gets (keeps the committed size small).
PLAN = {
    "qwen3_moe": ["q4g64", "q8g32", "q3g32", "q6g64", "q2g128", "q5g64", "mixed36", "bf16"],
    "qwen3_moe_tied": ["q4g64", "q8g32"],
    "mixtral": ["q4g64", "q8g32", "q6g64", "mixed36", "bf16"],
    "qwen3_5_moe": ["q4g64", "q8g32", "q3g32", "bf16"],
    "qwen3_next": ["q4g64", "q8g32", "bf16"],
    "qwen3_5": ["q4g64"],
}


def build_random_model(cfg: dict, out: Path, seed: int):
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    # Larger-than-default init so that routing and logits are far from ties.
    params = tree_map(lambda p: (p * 2.0).astype(mx.bfloat16), model.parameters())
    model.update(params)
    flat = dict(tree_flatten(model.parameters()))
    if cfg["model_type"] in HYBRID:
        flat = hybrid_realistic(flat)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), flat, metadata={"format": "mlx"})
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    make_tokenizer(out)


NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def hybrid_realistic(flat: dict) -> dict:
    """Gated DeltaNet parameters in a realistic range, so the recurrent state carries over many tokens
    (the default init decays it to ~0 every step, which would hide state bugs), and (1+w) norms that are
    not all equal (so a missing or doubled +1 shows). Norm values lie in [1, 2) so `w - 1` is exact in bf16
    and the Hugging Face variant below round-trips bit for bit."""
    out = {}
    for k, v in flat.items():
        if k.endswith("A_log"):
            v = mx.log(mx.random.uniform(0.3, 3.0, v.shape)).astype(mx.float32)
        elif k.endswith("dt_bias"):
            v = mx.random.uniform(-3.0, -0.5, v.shape).astype(mx.bfloat16)
        elif k.endswith(NORM_SUFFIXES) or k.endswith("linear_attn.norm.weight"):
            v = mx.random.uniform(1.0, 1.98, v.shape).astype(mx.bfloat16)
        out[k] = v
    return out


def derive_hf_qwen35(raw: Path, dst: Path):
    """The Hugging Face layout of a Qwen3.5-MoE checkpoint, from the raw (unquantized, MLX-named) model:
    `model.language_model.` prefixes, fused `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` without a
    `.weight` suffix, zero-centred norms (stored w - 1), PyTorch conv1d layout [C, 1, K], plus vision and MTP
    tensors the loader must ignore, and a transformers-5 style config (`layer_types`, `rope_parameters`).
    mlx-lm's own sanitize loads it, so its goldens are mlx-lm's."""
    shutil.copytree(raw, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    os.remove(dst / "model.safetensors")
    hf = {}
    for k, v in weights.items():
        if k.endswith(NORM_SUFFIXES):
            v = (v.astype(mx.float32) - 1.0).astype(mx.bfloat16)
        if k.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model.") :]
        elif k.startswith("language_model."):
            k = k[len("language_model.") :]
        hf[k] = v
    for k in [k for k in hf if k.endswith("switch_mlp.gate_proj.weight")]:
        pre = k[: -len("switch_mlp.gate_proj.weight")]
        gate, up = hf.pop(k), hf.pop(pre + "switch_mlp.up_proj.weight")
        hf[pre + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        hf[pre + "experts.down_proj"] = hf.pop(pre + "switch_mlp.down_proj.weight")
    hf["model.visual.patch_embed.proj.weight"] = mx.random.normal((32, 3, 2, 2)).astype(mx.bfloat16)
    hf["mtp.fc.weight"] = mx.random.normal((128, 256)).astype(mx.bfloat16)
    mx.save_safetensors(str(dst / "model.safetensors"), hf, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    t = cfg["text_config"]
    interval = t.pop("full_attention_interval")
    t["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(t["num_hidden_layers"])
    ]
    t["mamba_ssm_dtype"] = "float32"
    t["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def long_text(n_tokens: int, tok) -> list:
    ids = []
    i = 0
    while len(ids) < n_tokens:
        ids += tok.encode(CORPUS[i % len(CORPUS)] + " ")
        i += 1
    return ids[:n_tokens]


def hybrid_extras(model, tok):
    """Prompts of 1, 3 and 200 tokens (longer than any prefill chunk): logits at first/middle/last position of
    one uncached forward, and 8 greedy tokens decoded with mlx-lm's cache after a cached prefill."""
    base = tok.encode(PROMPT)
    cases = []
    for ids in ([base[0]], base[:3], long_text(200, tok)):
        x = mx.array([ids])
        logits = model(x).astype(mx.float32)
        mx.eval(logits)
        positions = sorted({0, len(ids) // 2, len(ids) - 1})
        cache = make_prompt_cache(model)
        step = model(x, cache=cache)
        greedy = []
        for _ in range(8):
            nxt = int(mx.argmax(step[0, -1]).item())
            greedy.append(nxt)
            step = model(mx.array([[nxt]]), cache=cache)
        cases.append(
            {
                "ids": ids,
                "logit_positions": positions,
                "logits": [logits[0, p].tolist() for p in positions],
                "greedy": greedy,
            }
        )
    return cases


def to_f32(model):
    def up(p):
        return p.astype(mx.float32) if p.dtype in (mx.bfloat16, mx.float16) else p

    model.update(tree_map(up, model.parameters()))
    return model


def goldens(model_dir: Path):
    model, tok = load(str(model_dir))
    to_f32(model)
    ids = tok.encode(PROMPT)
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict):  # newer transformers return a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    x = mx.array([ids])
    logits = model(x).astype(mx.float32)
    mx.eval(logits)
    cache = make_prompt_cache(model)
    step = model(x, cache=cache)
    out = []
    nxt = int(mx.argmax(step[0, -1]).item())
    for _ in range(N_GREEDY):
        out.append(nxt)
        step = model(mx.array([[nxt]]), cache=cache)
        nxt = int(mx.argmax(step[0, -1]).item())

    # Reduced top-k: the same checkpoint with num_experts_per_tok = 1, loaded by mlx-lm itself.
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td) / "m"
        shutil.copytree(model_dir, tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.get("text_config", cfg)["num_experts_per_tok"] = 1
        (tmp / "config.json").write_text(json.dumps(cfg))
        m1, _ = load(str(tmp))
        to_f32(m1)
        l1 = m1(x).astype(mx.float32)[0, -1]
        mx.eval(l1)

    t = len(ids)
    positions = sorted({0, t // 2, t - 1})
    extras = hybrid_extras(model, tok) if getattr(model, "model_type", "") in HYBRID else []
    return {
        "extra_prompts": extras,
        "prompt": PROMPT,
        "prompt_ids": ids,
        "chat": CHAT,
        "chat_ids": list(chat_ids),
        "logit_positions": positions,
        "logits": [logits[0, p].tolist() for p in positions],
        "greedy": out,
        "logits_top1": l1.tolist(),
        "tolerance_note": "float32 throughout; compare with an absolute tolerance",
        "mlx_version": mx.__version__,
    }


def derive_flat_overrides(src: Path, dst: Path):
    """A `false` override (one module dequantized to f32 and left unquantized) and a null-group override,
    in a layout mlx-lm itself loads, so it can compute this variant's goldens."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    weights = mx.load(str(dst / "model.safetensors"))
    p = "model.layers.1.self_attn.o_proj"
    q = cfg["quantization"]
    spec = q.get(p, q)
    w = mx.dequantize(
        weights.pop(p + ".weight"),
        weights.pop(p + ".scales").astype(mx.float32),
        weights.pop(p + ".biases").astype(mx.float32),
        group_size=spec["group_size"],
        bits=spec["bits"],
    )
    weights[p + ".weight"] = w.astype(mx.float32)
    q[p] = False
    q["model.layers.0.mlp.gate"] = {"group_size": None, "bits": 8}
    cfg["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)


def derive_vlm_sharded(src: Path, dst: Path):
    """VLM-style nesting, `language_model.` weight prefixes, two shards with an index, `rope_parameters`
    spelling, and the chat template inside tokenizer_config.json. Same weights and goldens as `src`."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    weights = mx.load(str(dst / "model.safetensors"))
    os.remove(dst / "model.safetensors")
    q = cfg["quantization"]
    text = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config")}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta")}
    quant = {k: v for k, v in q.items()}
    for k in list(quant):
        if k.startswith("model."):
            quant["language_model." + k] = quant.pop(k)
    new_cfg = {
        "model_type": text["model_type"],
        "architectures": ["Qwen3MoeForConditionalGeneration"],
        "text_config": text,
        "quantization": quant,
        "quantization_config": quant,
    }
    (dst / "config.json").write_text(json.dumps(new_cfg, indent=2))

    # The chat template inside tokenizer_config.json (the older layout) instead of chat_template.jinja.
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    tc["chat_template"] = (dst / "chat_template.jinja").read_text()
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    os.remove(dst / "chat_template.jinja")

    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        mx.save_safetensors(
            str(dst / fname), {"language_model." + k: weights[k] for k in keys}, metadata={"format": "mlx"}
        )
        for k in keys:
            weight_map["language_model." + k] = fname
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2)
    )

def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--only=")]
    only = [a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")]
    only = only[0] if only else None
    out_root = Path(args[0] if args else "fixtures")
    out_root.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        for seed, (arch, cfg) in enumerate(base_configs().items()):
            if only and arch not in only:
                continue
            raw = Path(td) / arch
            build_random_model(cfg, raw, seed + 1)
            for suffix in PLAN[arch]:
                kwargs = dict(VARIANTS)[suffix]
                dst = out_root / f"{arch}-{suffix}"
                if dst.exists():
                    shutil.rmtree(dst)
                convert(str(raw), str(dst), **kwargs)
                (dst / "README.md").unlink(missing_ok=True)
                g = goldens(dst)
                (dst / "golden.json").write_text(json.dumps(g))
                print(f"{dst}: prompt {len(g['prompt_ids'])} tokens, greedy {g['greedy'][:8]}...")
            if arch == "qwen3_5_moe":
                dst = out_root / "qwen3_5_moe-hf-bf16"
                if dst.exists():
                    shutil.rmtree(dst)
                derive_hf_qwen35(raw, dst)
                (dst / "golden.json").write_text(json.dumps(goldens(dst)))
                print(f"{dst}: Hugging Face layout of the same weights")
    if only and "qwen3_moe" not in only:
        return
    flat = out_root / "qwen3_moe-q4g64-overrides"
    vlm = out_root / "qwen3_moe-q4g64-overrides-vlm-sharded"
    for d in (flat, vlm):
        if d.exists():
            shutil.rmtree(d)
    derive_flat_overrides(out_root / "qwen3_moe-q4g64", flat)
    (flat / "golden.json").write_text(json.dumps(goldens(flat)))
    derive_vlm_sharded(flat, vlm)
    print(f"{flat}, {vlm}: derived from qwen3_moe-q4g64")


if __name__ == "__main__":
    main()
