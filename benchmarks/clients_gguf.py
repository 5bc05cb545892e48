"""GGUF files checked in llama.cpp itself (llama-cpp-python): logits against MLX's.

1. The embedded model (data/tiny-qwen3 + data/adapters/lora) fused by ``lorakit.fuse(...,
   export_gguf=...)``, loaded by llama.cpp: its logits against MLX's logits of the same
   fused checkpoint (computed in float32 from the stored weights).
2. The base as GGUF plus the adapter as llama.cpp's LoRA GGUF (``convert(...,
   to="gguf-lora")``, applied by ``Llama(..., lora_path=...)``) against the fused GGUF.
3. A random model of each supported family (built with mlx-lm's model classes, the
   embedded byte-level BPE tokenizer) exported with ``write_model_gguf``: llama.cpp's
   logits against MLX's; for llama-arch families also a LoRA on q/k (the permuted rows).

Each comparison reports max |diff| / max |reference logit| and top-1 agreement over
every position of one token sequence.

  PYTHONPATH=$PWD:/work/scratch-gguf/venv/lib/python3.11/site-packages \\
      .venv/bin/python benchmarks/clients_gguf.py --out benchmarks/results/clients_gguf.json
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "data" / "tiny-qwen3"
ADAPTER = ROOT / "data" / "adapters" / "lora"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

#: tolerances the check asserts (bf16 weights; llama.cpp's CPU bf16 dot products round
#: the activations to bf16, MLX's reference is float32 from the same stored weights)
REL_BOUND = 0.03
TOP1_BOUND = 0.95

_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=2048, max_position_embeddings=256, rope_theta=10000.0,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=0)
FAMILIES: Dict[str, dict] = {
    "llama": dict(_COMMON, model_type="llama"),
    "mistral": dict(_COMMON, model_type="mistral"),
    "mixtral": dict(_COMMON, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(_COMMON, model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(_COMMON, model_type="qwen3", head_dim=32, rms_norm_eps=1e-6),
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", head_dim=16, moe_intermediate_size=64,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True),
}


def tokens(n: int = 48) -> List[int]:
    from tokenizers import Tokenizer

    text = next((ROOT / "data" / "corpora").rglob("*.jsonl")).read_text(encoding="utf-8")
    ids = Tokenizer.from_file(str(BASE / "tokenizer.json")).encode(text[:4000]).ids
    return ids[:n]


def family_model(path: Path, family: str, seed: int = 0) -> Path:
    """A random ``family`` model saved with mlx-lm, with the embedded BPE tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = dict(FAMILIES[family])
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    params = []
    for k, v in tree_flatten(model.parameters()):
        x = mx.random.normal(v.shape) * 0.05
        if k.endswith("norm.weight"):
            x = 1 + x
        params.append((k, x.astype(mx.bfloat16)))
    model.load_weights(params)
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(BASE / f, path / f)
    return path


def family_adapter(model_path: Path, path: Path, seed: int = 1) -> Path:
    """A rank-4 LoRA on q/k/v/o and down_proj, saved as mlx_lm lora does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    model.freeze()
    cfg = {"rank": 4, "scale": 2.0, "dropout": 0.0,
           "keys": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "self_attn.o_proj"]}
    mx.random.seed(seed)
    linear_to_lora_layers(model, len(model.layers), cfg)
    new = {k: (mx.random.normal(v.shape) * 0.05 if k.endswith("lora_b") else v)
           .astype(mx.float32) for k, v in tree_flatten(model.trainable_parameters())}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), new)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": cfg,
         "model": str(model_path)}))
    return path


def mlx_logits(model_dir: Path, ids: List[int], adapter: Optional[Path] = None):
    """MLX's logits of ``ids`` in float32 from the stored weights (unfused adapter
    attached when given)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    if adapter is not None:
        from mlx_lm.tuner.utils import load_adapters
        model = load_adapters(model, str(adapter))
    model.set_dtype(mx.float32)
    out = model(mx.array([ids]))[0]
    return np.array(out.astype(mx.float32))


def llama_logits(gguf: Path, ids: List[int], lora: Optional[Path] = None):
    import numpy as np
    from llama_cpp import Llama

    kw: Dict[str, Any] = dict(model_path=str(gguf), n_ctx=max(64, len(ids) + 8),
                              logits_all=True, verbose=False, n_threads=2, seed=0)
    if lora is not None:
        kw["lora_path"] = str(lora)
    llm = Llama(**kw)
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)
    llm.close() if hasattr(llm, "close") else None
    return out


def compare(ref, got) -> Dict[str, float]:
    import numpy as np
    scale = float(np.abs(ref).max())
    return {"max_abs_diff": float(np.abs(ref - got).max()), "ref_scale": scale,
            "rel_max_diff": float(np.abs(ref - got).max() / scale),
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "positions": int(ref.shape[0])}


def run(work: Path, families=tuple(FAMILIES)) -> Dict[str, Any]:
    import lorakit
    from lorakit.algebra import convert
    from lorakit.io.gguf import write_model_gguf

    ids = tokens()
    res: Dict[str, Any] = {"tokens": len(ids), "rel_bound": REL_BOUND, "top1_bound": TOP1_BOUND}
    fused = lorakit.fuse(BASE, ADAPTER, work / "fused", export_gguf="model.gguf",
                         progress=False).output
    ref = mlx_logits(fused, ids)
    res["fused_vs_mlx"] = compare(ref, llama_logits(fused / "model.gguf", ids))
    base_gguf = write_model_gguf(BASE, work / "base.gguf")
    lora = convert(ADAPTER, work / "lora.gguf", to="gguf-lora", base=BASE)
    with_lora = llama_logits(base_gguf, ids, lora)
    res["lora_vs_fused_gguf"] = compare(llama_logits(fused / "model.gguf", ids), with_lora)
    res["lora_vs_mlx_unfused"] = compare(mlx_logits(BASE, ids, ADAPTER), with_lora)
    res["families"] = {}
    for fam in families:
        m = family_model(work / fam, fam)
        g = write_model_gguf(m, work / f"{fam}.gguf")
        row = {"model": compare(mlx_logits(m, ids), llama_logits(g, ids))}
        ad = family_adapter(m, work / f"{fam}-ad")
        lg = convert(ad, work / f"{fam}-lora.gguf", to="gguf-lora")
        row["lora"] = compare(mlx_logits(m, ids, ad), llama_logits(g, ids, lg))
        res["families"][fam] = row
    return res


def failures(res: Dict[str, Any]) -> List[str]:
    rows = {"fused_vs_mlx": res["fused_vs_mlx"], "lora_vs_fused_gguf": res["lora_vs_fused_gguf"],
            "lora_vs_mlx_unfused": res["lora_vs_mlx_unfused"]}
    for fam, r in res["families"].items():
        rows.update({f"{fam}/{k}": v for k, v in r.items()})
    return [f"{k}: rel {v['rel_max_diff']:.4f} top-1 {v['top1_agreement']:.3f}"
            for k, v in rows.items()
            if v["rel_max_diff"] > REL_BOUND or v["top1_agreement"] < TOP1_BOUND]


def markdown(res: Dict[str, Any]) -> str:
    """The table BENCHMARKS.md shows (tests/docs/test_gguf_benchmarks.py checks it)."""
    rows = [("fused GGUF vs MLX", res["fused_vs_mlx"]),
            ("base GGUF + GGUF-LoRA vs fused GGUF", res["lora_vs_fused_gguf"]),
            ("base GGUF + GGUF-LoRA vs MLX unfused", res["lora_vs_mlx_unfused"])]
    for fam, r in res["families"].items():
        rows += [(f"{fam} random model", r["model"]), (f"{fam} + q/k/v/o LoRA", r["lora"])]
    out = ["| llama.cpp run vs reference | max abs diff | / max abs logit | top-1 agreement |",
           "| --- | --- | --- | --- |"]
    out += [f"| {k} | {v['max_abs_diff']:.4f} | {v['rel_max_diff']:.5f} | "
            f"{100 * v['top1_agreement']:.1f}% |" for k, v in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--markdown", help="print the BENCHMARKS.md table of this JSON and exit")
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown(json.loads(Path(a.markdown).read_text())))
        return 0
    import llama_cpp
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    with tempfile.TemporaryDirectory() as d:
        res = run(Path(d))
    res["llama_cpp_python"] = llama_cpp.__version__
    res["machine"] = f"{platform.machine()} {platform.system()}, shared 2-core CPU"
    res["command"] = ("python benchmarks/clients_gguf.py --out "
                      "benchmarks/results/clients_gguf.json")
    bad = failures(res)
    res["failures"] = bad
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
