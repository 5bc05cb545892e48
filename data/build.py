#!/usr/bin/env python
"""Rebuild lorakit's embedded test assets (corpora, tokenizer, tiny models, adapters).

Run from anywhere: ``python data/build.py`` rebuilds everything;
``python data/build.py --only base adapters`` rebuilds some steps. Steps, in order:

  corpora    KJV text (Debian bible-kjv-text) and fortunes (Debian fortunes) to jsonl
  tokenizer  byte-level BPE trained with `tokenizers` on both train splits
  base       data/tiny-qwen3: Qwen3 built by mlx-lm, trained from random init, saved bf16
  quant      data/tiny-qwen3-4bit: `mlx_lm convert -q --q-bits 4`
  moe        data/tiny-qwen3-moe: qwen3_moe trained from random init, saved bf16
  adapters   data/adapters/*: `mlx_lm lora -c data/configs/<name>.yaml`
  peft       data/adapters/peft-lora: data/adapters/lora converted to PEFT layout
  summary    data/logs/summary.json: valid losses and greedy samples of every asset

Everything runs offline except the `corpora` step, which fetches Debian packages with
`apt-get download` (the jsonl splits it writes are committed, so later steps do not).

Speed: the mlx-cpu wheel for Linux links the reference BLAS (~2 GFLOP/s). When
Debian's OpenBLAS is installed (`apt-get install libopenblas0-pthread`), this script
re-executes itself with it preloaded (~35 GFLOP/s on 2 cores); set
LORAKIT_BUILD_NO_OPENBLAS=1 to keep the bundled BLAS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable

DATA = Path(__file__).resolve().parent
ROOT = DATA.parent
BUILD = DATA / ".build"
LOGS = DATA / "logs"
CORPORA = DATA / "corpora"
TOKENIZER_DIR = BUILD / "tokenizer"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"

STEPS = ["corpora", "tokenizer", "base", "quant", "moe", "adapters", "peft", "summary"]
ADAPTERS = ["lora", "dora", "lora-embed", "lora-4bit", "lora-4bit-weak", "moe-lora"]
LORA_KEYS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]

# Debian packages the corpora come from (bookworm versions used for the committed splits).
KJV_PACKAGES = ["bible-kjv", "bible-kjv-text"]
KJV_BOOKS = {
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges",
    "Ruth", "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles",
    "2 Chronicles", "Ezra", "Nehemiah", "Esther",
}
FORTUNE_PACKAGE = "fortunes"
FORTUNE_FILES = ["computers", "linux", "science"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftext|>", "<|pad|>"]
VOCAB_SIZE = 2048


def log(msg: str) -> None:
    print(f"[build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def device_name() -> str:
    """The MLX device training runs on, e.g. "gpu: NVIDIA H100 80GB HBM3 (mlx 0.32.4)"."""
    import mlx.core as mx

    dev = mx.default_device()
    return f"{dev.type.name}: {mx.device_info().get('device_name', '?')} (mlx {mx.__version__})"


def maybe_reexec_with_openblas() -> None:
    """Re-run this script with OpenBLAS preloaded: ~20x faster matmuls on CPU."""
    if os.environ.get("LORAKIT_BUILD_NO_OPENBLAS") or os.environ.get("_LORAKIT_BUILD_CHILD"):
        return
    if sys.platform != "linux":
        return
    if not Path(OPENBLAS).exists():
        log(f"note: {OPENBLAS} not found; training uses mlx-cpu's bundled reference "
            "BLAS and is ~10x slower (apt-get install libopenblas0-pthread)")
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in [OPENBLAS, env.get("LD_PRELOAD", "")] if p)
    env["_LORAKIT_BUILD_CHILD"] = "1"
    env.setdefault("OPENBLAS_NUM_THREADS", "2")
    log(f"re-executing with LD_PRELOAD={OPENBLAS}")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- corpora


def fetch_debs(names: list[str], dest: Path) -> dict[str, str]:
    """apt-get download + dpkg -x; returns {package: version}."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *names], cwd=dest, check=True,
                   stdout=subprocess.DEVNULL)
    versions = {}
    for deb in sorted(dest.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(dest / "root")], check=True)
        pkg, version = deb.name.split("_")[:2]
        versions[pkg] = version.replace("%3a", ":")
    return versions


def kjv_chapters(root: Path) -> list[tuple[str, list[str]]]:
    """All 1189 chapters as (title, verses), via the `bible` program of bible-kjv."""
    out = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l100000",
         "Gen1:1-Rev22:21"],
        check=True, capture_output=True, text=True,
    ).stdout
    chapters: list[tuple[str, list[str]]] = []
    for line in out.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            chapters[-1][1].append(m.group(1).strip())
        else:
            chapters.append((line.strip(), []))
    return chapters


def chunk_verses(verses: list[str], max_chars: int) -> list[str]:
    """Consecutive verses joined by newlines, each chunk at most ~max_chars."""
    chunks, cur = [], []
    for v in verses:
        if cur and sum(len(x) + 1 for x in cur) + len(v) > max_chars:
            chunks.append("\n".join(cur))
            cur = []
        cur.append(v)
    if cur:
        chunks.append("\n".join(cur))
    return chunks


def read_fortunes(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    items = []
    for raw in text.split("\n%\n"):
        lines = [ln.rstrip() for ln in raw.strip("\n%").split("\n")]
        item = "\n".join(lines).strip("\n")
        if item:
            items.append(item)
    return items


def step_corpora() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        versions = fetch_debs(KJV_PACKAGES + [FORTUNE_PACKAGE], tmp_path)
        root = tmp_path / "root"

        chapters = kjv_chapters(root)
        if len(chapters) != 1189:
            raise RuntimeError(f"expected 1189 KJV chapters, found {len(chapters)}")
        # The narrative books (Genesis to Esther): their formulaic prose is what a
        # 3M-parameter model can learn in a few CPU minutes.
        narrative = [c for c in chapters if c[0].rsplit(" ", 1)[0] in KJV_BOOKS]
        kjv_train, kjv_valid = [], []
        for i, (_, verses) in enumerate(narrative):
            # Every 30th chapter is held out for validation.
            if i % 30 == 15:
                kjv_valid += chunk_verses(verses, 400)
            else:
                kjv_train += chunk_verses(verses, 400)
        write_jsonl(CORPORA / "kjv/train.jsonl", [{"text": t} for t in kjv_train])
        write_jsonl(CORPORA / "kjv/valid.jsonl", [{"text": t} for t in kjv_valid])

        fortunes = []
        for name in FORTUNE_FILES:
            fortunes += read_fortunes(root / "usr/share/games/fortunes" / name)
        # Long listings (ascii art, program dumps) are dropped: they are not the style.
        fortunes = [f for f in fortunes if 20 <= len(f) <= 600]
        f_train = [f for i, f in enumerate(fortunes) if i % 20 != 10]
        f_valid = [f for i, f in enumerate(fortunes) if i % 20 == 10]
        write_jsonl(CORPORA / "fortunes/train.jsonl", [{"text": t} for t in f_train])
        write_jsonl(CORPORA / "fortunes/valid.jsonl", [{"text": t} for t in f_valid])

    source = {
        "packages": versions,
        "kjv": {"books": "Genesis-Esther", "train": len(kjv_train), "valid": len(kjv_valid)},
        "fortunes": {"files": FORTUNE_FILES, "train": len(f_train), "valid": len(f_valid)},
        "sha256": {str(p.relative_to(DATA)): sha256(p) for p in sorted(CORPORA.glob("*/*.jsonl"))},
    }
    (CORPORA / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    log(f"corpora: kjv {len(kjv_train)}/{len(kjv_valid)}, fortunes "
        f"{len(f_train)}/{len(f_valid)} train/valid examples; packages {versions}")


# --------------------------------------------------------------------------- tokenizer


def step_tokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [r["text"] for r in read_jsonl(CORPORA / "kjv/train.jsonl")]
    texts += [r["text"] for r in read_jsonl(CORPORA / "fortunes/train.jsonl")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos, bos, pad = SPECIAL_TOKENS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=None,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    if TOKENIZER_DIR.exists():
        shutil.rmtree(TOKENIZER_DIR)
    fast.save_pretrained(TOKENIZER_DIR)
    # Newer transformers no longer writes special_tokens_map.json; many tools read it.
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    (TOKENIZER_DIR / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    cfg_path = TOKENIZER_DIR / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(special)
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    log(f"tokenizer: vocab {tok.get_vocab_size()} -> {TOKENIZER_DIR.relative_to(ROOT)}")


def tokenizer_files() -> list[Path]:
    return sorted(p for p in TOKENIZER_DIR.iterdir() if p.is_file())


# --------------------------------------------------------------------------- training


class LossLog:
    """mlx-lm TrainingCallback that keeps every report and writes them as JSON."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = path
        self.record: dict[str, Any] = {**meta, "train": [], "valid": []}

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        self.record["train"].append({k: float(v) for k, v in info.items()})
        log(f"  iter {int(info['iteration']):4d} train loss {info['train_loss']:.3f} "
            f"({info['tokens_per_second']:.0f} tok/s)")
        self.save()

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        self.record["valid"].append({k: float(v) for k, v in info.items()})
        log(f"  iter {int(info['iteration']):4d} valid loss {info['val_loss']:.3f}")
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.record, indent=1) + "\n")


def load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def pretrain(config_name: str) -> None:
    """Random-init an mlx-lm model and train all its parameters; save bf16 HF layout."""
    import importlib

    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import build_schedule
    from mlx_lm.utils import load_tokenizer, save_config, save_model

    cfg_path = DATA / "configs" / f"{config_name}.yaml"
    cfg = load_yaml(cfg_path)
    out = ROOT / cfg["output"]
    tok_cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    vocab = tokenizer._tokenizer.convert_tokens_to_ids
    model_config = dict(cfg["model_config"])
    model_config.update(
        vocab_size=len(tokenizer._tokenizer),
        bos_token_id=vocab(tok_cfg["bos_token"]),
        eos_token_id=vocab(tok_cfg["eos_token"]),
        pad_token_id=vocab(tok_cfg["pad_token"]),
    )

    mx.random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    arch = importlib.import_module(f"mlx_lm.models.{model_config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(model_config))
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"{config_name}: {model_config['model_type']} with {n_params / 1e6:.3f}M parameters")

    data_args = types.SimpleNamespace(mask_prompt=False)
    train_set, valid_set, _ = load_local_dataset(ROOT / cfg["data"], tokenizer, data_args)
    BUILD.mkdir(exist_ok=True)
    opt_class = {"adamw": optim.AdamW, "adam": optim.Adam}[cfg["optimizer"]]
    opt_kwargs = {"weight_decay": cfg["weight_decay"]} if cfg["optimizer"] == "adamw" else {}
    optimizer = opt_class(learning_rate=build_schedule(cfg["lr_schedule"]), **opt_kwargs)
    args = TrainingArgs(
        batch_size=cfg["batch_size"],
        iters=cfg["iters"],
        val_batches=cfg["val_batches"],
        steps_per_report=cfg["steps_per_report"],
        steps_per_eval=cfg["steps_per_eval"],
        steps_per_save=10**9,  # no intermediate checkpoints
        max_seq_length=cfg["max_seq_length"],
        adapter_file=str(BUILD / f"{config_name}-f32.safetensors"),
    )
    loss_log = LossLog(LOGS / f"{config_name}.json", {
        "asset": cfg["output"], "config": str(cfg_path.relative_to(ROOT)),
        "method": "mlx_lm.tuner.trainer.train, all parameters, f32, from random init",
        "parameters": n_params, "device": device_name(),
    })
    # Every parameter trains (embedding and norms too); the model is f32 while training.
    model.train()
    train(model, optimizer, CacheDataset(train_set), CacheDataset(valid_set),
          args=args, training_callback=loss_log)

    model.set_dtype(mx.bfloat16)
    if out.exists():
        shutil.rmtree(out)
    save_model(out, model)
    model_config["torch_dtype"] = "bfloat16"
    save_config(model_config, out / "config.json")
    for f in tokenizer_files():
        shutil.copy(f, out / f.name)
    log(f"{config_name}: saved bf16 model to {out.relative_to(ROOT)}")


def step_base() -> None:
    pretrain("base")


def step_moe() -> None:
    pretrain("moe")


def step_quant() -> None:
    out = DATA / "tiny-qwen3-4bit"
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", "data/tiny-qwen3",
           "--mlx-path", "data/tiny-qwen3-4bit", "-q", "--q-bits", "4",
           "--q-group-size", "64"]
    log("quant: " + " ".join(cmd[2:]))
    subprocess.run(cmd, cwd=ROOT, check=True)
    # The model card mlx-lm writes names a hub repo; this asset has none.
    card = out / "README.md"
    if card.exists():
        card.unlink()
    # convert re-saves the tokenizer through transformers, which (v5) renames the
    # class to TokenizersBackend and drops special_tokens_map.json; keep the base's.
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DATA / "tiny-qwen3" / f, out / f)


# --------------------------------------------------------------------------- adapters

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_TRAIN_RE = re.compile(r"^\s*(\d+)\s+([0-9.]+)\s+[▼▲]\s+([0-9,]+)")
_VAL_RE = re.compile(r"^\s*(\d+)\s+val\s+([0-9.]+)")


def parse_lora_output(text: str) -> dict[str, list[dict[str, float]]]:
    """Loss reports from `mlx_lm lora` console output."""
    train, valid = [], []
    for line in _ANSI.sub("", text).splitlines():
        if m := _TRAIN_RE.match(line):
            train.append({"iteration": int(m.group(1)), "train_loss": float(m.group(2)),
                          "tokens_per_second": float(m.group(3).replace(",", ""))})
        elif m := _VAL_RE.match(line):
            valid.append({"iteration": int(m.group(1)), "val_loss": float(m.group(2))})
    return {"train": train, "valid": valid}


def f32_copy(model_dir: str) -> Path:
    """An exact float32 upcast of a bf16 checkpoint, for training on CPU.

    MLX's CPU backend multiplies bf16 (and bf16-scaled 4-bit) matrices without BLAS,
    ~10x slower than f32. Every bf16 value is exactly representable in f32, so the
    adapter trains against the same weights; only activations are computed in f32.
    Packed 4-bit codes (uint32) are kept as they are.
    """
    import mlx.core as mx

    src = ROOT / model_dir
    dst = BUILD / "f32" / src.name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            weights = mx.load(str(f))
            weights = {k: v.astype(mx.float32) if v.dtype == mx.bfloat16 else v
                       for k, v in weights.items()}
            mx.save_safetensors(str(dst / f.name), weights, metadata={"format": "mlx"})
        elif f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    return dst


def train_adapter(name: str) -> None:
    cfg_path = DATA / "configs" / f"{name}.yaml"
    cfg = load_yaml(cfg_path)
    out = ROOT / cfg["adapter_path"]
    if out.exists():
        shutil.rmtree(out)
    train_model = f32_copy(cfg["model"])
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "-c", str(cfg_path.relative_to(ROOT)),
           "--model", str(train_model.relative_to(ROOT))]
    log(f"adapter {name}: mlx_lm lora -c {cfg_path.relative_to(ROOT)} "
        f"--model {train_model.relative_to(ROOT)}")
    env = dict(os.environ, COLUMNS="120", TERM="dumb", NO_COLOR="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (BUILD / f"{name}.log").parent.mkdir(exist_ok=True)
    (BUILD / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"mlx_lm lora failed for {name}")
    curves = parse_lora_output(proc.stdout)
    if not curves["train"]:
        raise RuntimeError(f"no loss reports found in the output for {name}")
    # Keep only the final adapter: no checkpoints, no logs beside it.
    for extra in out.iterdir():
        if extra.name not in ("adapters.safetensors", "adapter_config.json"):
            extra.unlink() if extra.is_file() else shutil.rmtree(extra)
    # The adapter belongs to the shipped base, not to the build's f32 upcast of it.
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    adapter_cfg["model"] = cfg["model"]
    (out / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=4) + "\n")
    record = {"asset": cfg["adapter_path"], "config": str(cfg_path.relative_to(ROOT)),
              "command": "python -m mlx_lm lora -c " + str(cfg_path.relative_to(ROOT)),
              "device": device_name(), **curves}
    (LOGS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    last_t, last_v = curves["train"][-1], curves["valid"][-1] if curves["valid"] else {}
    log(f"adapter {name}: final train loss {last_t['train_loss']:.3f}, "
        f"valid loss {last_v.get('val_loss', float('nan')):.3f}")


def step_adapters(names: list[str] | None = None) -> None:
    for name in names or ADAPTERS:
        train_adapter(name)


def step_peft() -> None:
    """Convert data/adapters/lora (mlx-lm layout) to a PEFT LoRA adapter, exactly."""
    import mlx.core as mx

    src = DATA / "adapters/lora"
    out = DATA / "adapters/peft-lora"
    cfg = json.loads((src / "adapter_config.json").read_text())
    lp = cfg["lora_parameters"]
    weights = mx.load(str(src / "adapters.safetensors"))
    peft: dict[str, Any] = {}
    modules = set()
    for name, value in weights.items():
        module, leaf = name.rsplit(".", 1)
        modules.add(module.rsplit(".", 1)[-1])
        # mlx-lm: lora_a (in, r), lora_b (r, out); PEFT: lora_A (r, in), lora_B (out, r).
        peft_leaf = {"lora_a": "lora_A", "lora_b": "lora_B"}[leaf]
        peft[f"base_model.model.{module}.{peft_leaf}.weight"] = mx.contiguous(value.T)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapter_model.safetensors"), peft, metadata={"format": "pt"})
    peft_cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "data/tiny-qwen3",
        "r": lp["rank"],
        # PEFT scales by lora_alpha / r; mlx-lm by `scale` directly.
        "lora_alpha": lp["scale"] * lp["rank"],
        "lora_dropout": lp["dropout"],
        "target_modules": sorted(modules),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(peft_cfg, indent=2) + "\n")
    log(f"peft: converted {len(weights)} tensors to {out.relative_to(ROOT)}")


# --------------------------------------------------------------------------- summary

# (asset, base model, adapter dir or None)
SUMMARY_ASSETS = [
    ("tiny-qwen3", "data/tiny-qwen3", None),
    ("lora", "data/tiny-qwen3", "data/adapters/lora"),
    ("dora", "data/tiny-qwen3", "data/adapters/dora"),
    ("lora-embed", "data/tiny-qwen3", "data/adapters/lora-embed"),
    ("tiny-qwen3-4bit", "data/tiny-qwen3-4bit", None),
    ("lora-4bit", "data/tiny-qwen3-4bit", "data/adapters/lora-4bit"),
    ("lora-4bit-weak", "data/tiny-qwen3-4bit", "data/adapters/lora-4bit-weak"),
    ("tiny-qwen3-moe", "data/tiny-qwen3-moe", None),
    ("moe-lora", "data/tiny-qwen3-moe", "data/adapters/moe-lora"),
]


def valid_loss(model: Any, tokenizer: Any, corpus: str, n: int = 64) -> float:
    """Mean next-token cross-entropy (nats) on the first n held-out examples.

    Tokenized as mlx-lm trains (eos appended), truncated to 256 tokens. The first n
    are used, not a random subset, so the number is reproducible.
    """
    import mlx.core as mx
    import mlx.nn as nn

    rows = read_jsonl(CORPORA / corpus / "valid.jsonl")[:n]
    total, count = 0.0, 0
    for start in range(0, len(rows), 8):
        seqs = [(tokenizer.encode(r["text"]) + [tokenizer.eos_token_id])[:257]
                for r in rows[start:start + 8]]
        width = max(len(q) for q in seqs)
        tokens = mx.array([q + [0] * (width - len(q)) for q in seqs])
        mask = mx.array([[1.0] * (len(q) - 1) + [0.0] * (width - len(q)) for q in seqs])
        logits = model(tokens[:, :-1]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, tokens[:, 1:]) * mask
        total += ce.sum().item()
        count += int(mask.sum().item())
    return total / count


def step_summary() -> None:
    import mlx.core as mx
    from mlx_lm import generate, load

    prompts = json.loads((DATA / "prompts.json").read_text())
    summary: dict[str, Any] = {}
    for asset, model_path, adapter in SUMMARY_ASSETS:
        model, tokenizer = load(str(ROOT / model_path),
                                adapter_path=str(ROOT / adapter) if adapter else None)
        if "moe" in model_path:
            # MLX's CPU backend runs gather_mm (SwitchGLU experts) in float32 only:
            # a bf16 MoE raises "[GatherMM::eval] Currently only supports float32".
            model.set_dtype(mx.float32)
        samples = {p: generate(model, tokenizer, p, max_tokens=40) for p in prompts}
        # Losses are computed in f32 (an exact upcast of the stored weights): MLX's CPU
        # bf16 and bf16-scaled 4-bit matmuls are ~10x slower.
        model.set_dtype(mx.float32)
        losses = {c: round(valid_loss(model, tokenizer, c), 4) for c in ("kjv", "fortunes")}
        summary[asset] = {"model": model_path, "adapter": adapter, "valid_loss": losses,
                          "greedy": samples}
        log(f"summary {asset}: valid loss kjv {losses['kjv']:.3f}, "
            f"fortunes {losses['fortunes']:.3f}")
    sizes = {}
    for p in sorted(DATA.rglob("*")):
        if p.is_file() and ".build" not in p.parts:
            sizes[str(p.relative_to(DATA))] = p.stat().st_size
    summary["_files"] = sizes
    (LOGS / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- main

STEP_FUNCS: dict[str, Callable[[], None]] = {
    "corpora": step_corpora,
    "tokenizer": step_tokenizer,
    "base": step_base,
    "quant": step_quant,
    "moe": step_moe,
    "adapters": step_adapters,
    "peft": step_peft,
    "summary": step_summary,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=STEPS + ADAPTERS,
                        help="run only these steps (adapter names train one adapter)")
    parser.add_argument("--skip-corpora", action="store_true",
                        help="use the committed jsonl splits (no apt-get download)")
    args = parser.parse_args()
    maybe_reexec_with_openblas()
    os.chdir(ROOT)
    LOGS.mkdir(exist_ok=True)
    BUILD.mkdir(exist_ok=True)

    wanted = args.only or [s for s in STEPS if not (args.skip_corpora and s == "corpora")]
    # The tokenizer is rebuilt (deterministically) when a model is trained without one
    # in data/.build/tokenizer, or after new corpora.
    if (any(s in wanted for s in ("base", "moe")) and "tokenizer" not in wanted
            and ("corpora" in wanted or not TOKENIZER_DIR.exists())):
        wanted = ["tokenizer", *wanted]
    t0 = time.time()
    timings = {}
    # Single adapters run where the "adapters" step sits, before peft and summary.
    order = [s for step in STEPS for s in ([step, *ADAPTERS] if step == "adapters" else [step])]
    for step in order:
        if step not in wanted:
            continue
        log(f"== {step}")
        t = time.time()
        if step in ADAPTERS:
            step_adapters([step])
        else:
            STEP_FUNCS[step]()
        timings[step] = round(time.time() - t, 1)
    log(f"done in {time.time() - t0:.0f} s: {timings}")
    timing_path = LOGS / "build_times.json"
    previous = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    previous.update(timings)
    trained = [s for s in timings if s in ("base", "moe", *ADAPTERS) or s == "adapters"]
    if trained:
        previous.setdefault("devices", {}).update(dict.fromkeys(trained, device_name()))
    timing_path.write_text(json.dumps(previous, indent=1) + "\n")


if __name__ == "__main__":
    main()
