"""GGUF files checked in llama.cpp itself (llama-cpp-python): logits against MLX's.

1. The embedded model (data/tiny-qwen3 + data/adapters/lora) fused by ``lorakit.fuse(...,
   export_gguf=...)``, loaded by llama.cpp: its logits against MLX's logits of the same
   fused checkpoint (computed in float32 from the stored weights).
2. The base as GGUF plus the adapter as llama.cpp's LoRA GGUF (``convert(...,
   to="gguf-lora")``, applied by ``Llama(..., lora_path=...)``) against the fused GGUF.
3. A random model of each supported family (built with mlx-lm's model classes, the
   embedded byte-level BPE tokenizer) exported with ``write_model_gguf``: llama.cpp's
   logits against MLX's; for llama-arch families also a LoRA on q/k (the permuted rows).

4. llama.cpp's tokenization against HF tokenizers' for the three pre-tokenizers the
   writer names (GPT-2's regex, qwen2's, llama-3's).
5. Negative controls: the same comparisons with one thing wrong (q/k rows or LoRA B
   rows not permuted, rope scaling dropped, the adapter left out) must read far outside
   the bound, or the bound could not see those faults.

Each comparison reports max |diff| / max |reference logit| and top-1 agreement over
every position of one token sequence; every top-1 disagreement must be a near tie.
The random models' q/k weights have std QK_STD and MoE routers ROUTER_STD (the rest
0.05), so that attention is peaked (the q/k row order and rope decide the logits) and
expert choices are far from ties.

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
#: GGUF-LoRA vs the fused GGUF, both in llama.cpp: 4 bf16 epsilons (4 x 2**-8)
LORA_BOUND = 4 * 2.0 ** -8
#: a negative control must read at least this many bounds off
CONTROL_FACTOR = 5
QK_STD = 0.15
#: MoE routers: top-k choices far from ties (at 0.05 a router margin of 1e-3 flips
#: under bf16 rounding and moves whole positions)
ROUTER_STD = 0.5
#: a router margin under this (MLX, float32) may flip under llama.cpp's bf16 rounding:
#: such positions are left out of the MoE rows and listed (flips seen at 0.007-0.014)
ROUTER_TIE = 0.05
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
    # rope scaling, each as llama.cpp reads it: the rope_freqs tensor (llama3), the
    # rope.scaling.* keys (linear, yarn); original context 32 < the 48 positions
    "llama_rope_llama3": dict(_COMMON, model_type="llama", rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "llama_rope_linear": dict(_COMMON, model_type="llama",
                              rope_scaling=dict(type="linear", factor=4.0)),
    "qwen3_rope_yarn": dict(_COMMON, model_type="qwen3", head_dim=32, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
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
        # q/k larger than the rest: attention peaked enough that rope and the q/k
        # row order decide the logits (at 0.05 attention is near uniform)
        std = QK_STD if k.endswith(("q_proj.weight", "k_proj.weight")) else \
            ROUTER_STD if k.endswith("gate.weight") and "gate_proj" not in k else 0.05
        x = mx.random.normal(v.shape) * std
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


def mlx_logits(model_dir: Path, ids: List[int], adapter: Optional[Path] = None,
               margins: Optional[list] = None):
    """MLX's logits of ``ids`` in float32 from the stored weights (unfused adapter
    attached when given). ``margins``, a list: filled with each position's smallest
    router margin over the MoE layers (the k-th minus the (k+1)-th router logit)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    if adapter is not None:
        from mlx_lm.tuner.utils import load_adapters
        model = load_adapters(model, str(adapter))
    model.set_dtype(mx.float32)
    seen: List[Any] = []
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
        gate = getattr(moe, "gate", None)
        k = getattr(moe, "num_experts_per_tok", getattr(moe, "top_k", None))
        if gate is None or k is None:
            continue

        def hook(x, gate=gate, k=k):
            y = gate(x)
            srt = np.sort(np.array(y.astype(mx.float32))[0], -1)
            seen.append(srt[:, -k] - srt[:, -k - 1])
            return y
        moe.gate = hook
    out = model(mx.array([ids]))[0]
    if margins is not None and seen:
        margins.extend(np.min(np.stack(seen), 0).tolist())
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


def compare(ref, got, margins: Optional[list] = None) -> Dict[str, Any]:
    """max |diff| (absolute and / max |ref|) and top-1 agreement; a top-1 disagreement
    is a near tie when the reference's own margin between the two tokens is within
    2 x max |diff| (both sides' noise), and ``top1_unexplained`` counts the others.
    ``margins`` (MoE): positions whose router margin is under ROUTER_TIE, where bf16
    rounding may pick another expert, are left out and listed."""
    import numpy as np
    out: Dict[str, Any] = {}
    if margins:
        keep = np.array(margins) >= ROUTER_TIE
        out["router_ties_left_out"] = [int(i) for i in np.nonzero(~keep)[0]]
        out["all_positions_rel_max_diff"] = float(
            np.abs(ref - got).max() / np.abs(ref).max())
        ref, got = ref[keep], got[keep]
    scale = float(np.abs(ref).max())
    diff = float(np.abs(ref - got).max())
    a, b = ref.argmax(-1), got.argmax(-1)
    pos = np.nonzero(a != b)[0]
    margin = ref[pos, a[pos]] - ref[pos, b[pos]]
    return dict(out, max_abs_diff=diff, ref_scale=scale, rel_max_diff=diff / scale,
                top1_agreement=float((a == b).mean()),
                top1_unexplained=int((margin > 2 * diff).sum()), positions=int(ref.shape[0]))


#: text whose pieces the three pre-tokenizer regexes split differently (digits,
#: contractions, case, newlines, non-ASCII)
TRICKY = (" It's 12345 dollars, isn't IT'S?\n\n  tabs\tand 3.14159 ünïcode 日本語 🙂\r\n"
          "x=1000000; 'll 've DON'T\n")
#: HF split regexes with llama.cpp's pre-tokenizer of the same regex
SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
             r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def tokenizer_check(work: Path) -> Dict[str, Any]:
    """llama.cpp's tokenization of corpus text + TRICKY against HF tokenizers', for the
    embedded tokenizer (ByteLevel, GPT-2 regex) and for copies of it whose
    pre-tokenizer is a Split with qwen2's or llama-3's regex (as real Qwen and Llama-3
    tokenizers carry): the same vocabulary and merges, a different split."""
    import gguf as gg
    from llama_cpp import Llama
    from tokenizers import Tokenizer

    from lorakit.io.outputs.gguf import write_model_gguf

    text = next((ROOT / "data" / "corpora").rglob("*.jsonl")).read_text(
        encoding="utf-8")[:4000] + TRICKY
    tj = json.loads((BASE / "tokenizer.json").read_text(encoding="utf-8"))
    variants = {"ByteLevel (GPT-2 regex)": tj["pre_tokenizer"]}
    for name, rx in SPLITS.items():
        variants[f"Split ({name} regex) + ByteLevel"] = {
            "type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": False}]}
    out = {}
    for i, (label, pre) in enumerate(variants.items()):
        d = work / f"tok{i}"
        shutil.copytree(BASE, d)
        (d / "tokenizer.json").write_text(json.dumps(dict(tj, pre_tokenizer=pre)))
        g = write_model_gguf(d, work / f"tok{i}.gguf")
        hf = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
        llm = Llama(model_path=str(g), vocab_only=True, verbose=False)
        got = llm.tokenize(text.encode(), add_bos=False, special=False)
        back = llm.detokenize(got).decode("utf-8", errors="replace")
        pre_name = gg.GGUFReader(g).fields["tokenizer.ggml.pre"].contents()
        out[label] = {"pre": pre_name, "tokens": len(hf), "identical": got == hf,
                      "round_trip": back == text}
    return out


def run(work: Path, families=tuple(FAMILIES), controls: bool = True) -> Dict[str, Any]:
    import lorakit
    import lorakit.io.outputs.gguf as lg
    from lorakit.algebra import convert
    from lorakit.io.outputs.gguf import write_model_gguf

    ids = tokens()
    res: Dict[str, Any] = {"tokens": len(ids), "rel_bound": REL_BOUND,
                           "lora_bound": LORA_BOUND, "top1_bound": TOP1_BOUND,
                           "qk_std": QK_STD, "router_std": ROUTER_STD,
                           "router_tie": ROUTER_TIE, "control_factor": CONTROL_FACTOR}
    fused = lorakit.fuse(BASE, ADAPTER, work / "fused", export_gguf="model.gguf",
                         progress=False).output
    fused_gguf = fused / "model.gguf"
    fused_ll = llama_logits(fused_gguf, ids)
    res["fused_vs_mlx"] = compare(mlx_logits(fused, ids), fused_ll)
    # llama.cpp's own bf16 noise: the same fused weights written F32, run in llama.cpp
    f32_ll = llama_logits(write_model_gguf(fused, work / "fused-f32.gguf", outtype="f32"), ids)
    res["fused_bf16_vs_f32_gguf"] = compare(f32_ll, fused_ll)
    base_gguf = write_model_gguf(BASE, work / "base.gguf")
    lora = convert(ADAPTER, work / "lora.gguf", to="gguf-lora", base=BASE)
    with_lora = llama_logits(base_gguf, ids, lora)
    res["lora_vs_fused_gguf"] = compare(fused_ll, with_lora)
    res["lora_vs_mlx_unfused"] = compare(mlx_logits(BASE, ids, ADAPTER), with_lora)
    res["tokenizer"] = tokenizer_check(work)
    res["families"] = {}
    for seed, fam in enumerate(families):
        m = family_model(work / fam, fam, seed=seed)
        g = write_model_gguf(m, work / f"{fam}.gguf")
        mg: list = []
        ref = mlx_logits(m, ids, margins=mg)
        row = {"model": compare(ref, llama_logits(g, ids), mg)}
        ad = family_adapter(m, work / f"{fam}-ad", seed=100 + seed)
        lg_path = convert(ad, work / f"{fam}-lora.gguf", to="gguf-lora")
        mg_ad: list = []
        ref_ad = mlx_logits(m, ids, ad, margins=mg_ad)
        row["lora"] = compare(ref_ad, llama_logits(g, ids, lg_path), mg_ad)
        res["families"][fam] = row
        if not controls:
            continue
        # negative controls: what the same comparison reads when one thing is wrong
        c = res.setdefault("controls", {})
        if fam == "llama":
            c["llama: base GGUF without the LoRA"] = compare(ref_ad, llama_logits(g, ids))
            saved = lg._PERMUTE
            lg._PERMUTE = ()
            try:
                bad = write_model_gguf(m, work / "llama-noperm.gguf")
                bad_lora = convert(ad, work / "llama-lora-noperm.gguf", to="gguf-lora")
            finally:
                lg._PERMUTE = saved
            c["llama: q/k rows not permuted"] = compare(ref, llama_logits(bad, ids))
            c["llama: LoRA B rows not permuted"] = compare(
                ref_ad, llama_logits(g, ids, bad_lora))
        if FAMILIES[fam].get("rope_scaling"):
            d = work / f"{fam}-unscaled"
            shutil.copytree(m, d)
            cfg = json.loads((d / "config.json").read_text())
            cfg.pop("rope_scaling")
            (d / "config.json").write_text(json.dumps(cfg))
            c[f"{fam}: rope scaling dropped"] = compare(
                ref, llama_logits(write_model_gguf(d, work / f"{fam}-u.gguf"), ids))
    if controls:
        res["controls"]["embedded: base GGUF without the LoRA"] = compare(
            fused_ll, llama_logits(base_gguf, ids))
    return res


def _rows(res: Dict[str, Any]):
    """(label, comparison, bound) of every row that must pass."""
    yield "fused GGUF vs MLX", res["fused_vs_mlx"], res["rel_bound"]
    yield "fused GGUF (BF16) vs the same as F32", res["fused_bf16_vs_f32_gguf"], \
        res["lora_bound"]
    yield "base GGUF + GGUF-LoRA vs fused GGUF", res["lora_vs_fused_gguf"], res["lora_bound"]
    yield "base GGUF + GGUF-LoRA vs MLX unfused", res["lora_vs_mlx_unfused"], res["rel_bound"]
    for fam, r in res["families"].items():
        yield f"{fam} random model", r["model"], res["rel_bound"]
        yield f"{fam} + q/k/v/o LoRA", r["lora"], res["rel_bound"]


def failures(res: Dict[str, Any]) -> List[str]:
    bad = [f"{k}: rel {v['rel_max_diff']:.4f} top-1 {v['top1_agreement']:.3f}"
           for k, v, bound in _rows(res)
           if v["rel_max_diff"] > bound or v["top1_agreement"] < res["top1_bound"]
           or v["top1_unexplained"]]
    bad += [f"tokenizer {k}: {v}" for k, v in res["tokenizer"].items()
            if not (v["identical"] and v["round_trip"])]
    # each control must read far outside the bound, or the bound could not see the fault
    bad += [f"control {k} within the bound: rel {v['rel_max_diff']:.4f}"
            for k, v in res.get("controls", {}).items()
            if v["rel_max_diff"] <= res["control_factor"] * res["rel_bound"]]
    return bad


def markdown(res: Dict[str, Any]) -> str:
    """The tables BENCHMARKS.md shows (tests/docs/test_gguf_benchmarks.py checks them)."""
    out = ["| llama.cpp run vs reference | max abs diff | / max abs logit | bound | top-1 "
           "agreement |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {k} | {v['max_abs_diff']:.4f} | {v['rel_max_diff']:.5f} | {b} | "
            f"{100 * v['top1_agreement']:.1f}% |" for k, v, b in _rows(res)]
    ties = [(k, v) for k, v, _ in _rows(res) if "router_ties_left_out" in v]
    if ties:
        out += ["", f"MoE rows leave out the positions whose router margin in MLX is under "
                f"{res['router_tie']} (there bf16 rounding may choose another expert):"]
        out += [f"- {k}: {len(v['router_ties_left_out'])} of {res['tokens']} positions left "
                f"out, all positions {v['all_positions_rel_max_diff']:.5f}" for k, v in ties]
    out += ["", "| negative control (must fail) | max abs diff | / max abs logit | top-1 "
            "agreement |", "| --- | --- | --- | --- |"]
    out += [f"| {k} | {v['max_abs_diff']:.4f} | {v['rel_max_diff']:.5f} | "
            f"{100 * v['top1_agreement']:.1f}% |" for k, v in res["controls"].items()]
    out += ["", "| tokenizer.json pre-tokenizer | `tokenizer.ggml.pre` | tokens | llama.cpp "
            "ids = HF ids | detokenized = text |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {k} | `{v['pre']}` | {v['tokens']} | {'yes' if v['identical'] else 'NO'} | "
            f"{'yes' if v['round_trip'] else 'NO'} |" for k, v in res["tokenizer"].items()]
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
