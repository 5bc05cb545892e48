"""Real clients read every output lorakit writes: transformers, PEFT and mlx-lm, with numbers.

    PYTHONPATH=. .venv/bin/python benchmarks/clients.py [--scratch /work/scratch-clients/bin/python]

Two interpreters: this one (lorakit, MLX, mlx-lm) builds the outputs and MLX's logits;
the scratch one (``pip install torch==2.13.0 transformers peft==0.21.2 safetensors numpy``,
never a lorakit dependency: the ``clients`` extra) runs this same file with
``--torch-side DIR`` and loads them in transformers / PEFT. They exchange .npy and
safetensors files in a temporary directory. What is checked:

(a) dense fused bf16 checkpoints (the embedded tiny-qwen3 + its LoRA, a synthetic llama +
    a synthetic LoRA) load in ``AutoModelForCausalLM.from_pretrained`` with every
    parameter bf16, and their logits equal MLX's: computed in float32 over the same bf16
    weights on both sides, ``max|diff| / max|logit| <= F32_BOUND``; computed in bf16 on
    both sides, ``<= BF16_BOUND`` (a few bf16 epsilons: each side rounds every
    activation to bf16, in its own order); top-1 agreement reported.
(b) lorakit's PEFT export loads with ``PeftModel.from_pretrained``; ``merge_and_unload()``
    equals ``fuse --rounding round-once`` bit for bit on every tensor.
(c) mlx-lm's ``load(base, adapter_path=...)`` reads every mlx-lm-format adapter lorakit
    writes (convert, combine, extract, resize) and its logits equal lorakit's view of the
    adapter (fused with ``dtype="float32"``), both in float32: ``<= F32_BOUND``.
(d) the embedded MoE model fused with ``layout="transformers"`` loads in transformers
    with no missing or unexpected keys, logits within ``F32_BOUND`` of MLX's (float32:
    MLX's CPU has no bf16 GatherMM); the default stacked layout is shown beside it
    (transformers reports the experts missing and runs on random ones).

Writes benchmarks/results/clients.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
OUT = REPO / "benchmarks" / "results" / "clients.json"
SCRATCH = "/work/scratch-clients/bin/python"
#: float32 compute on both sides over the same bf16 weights: reordered f32 sums only
F32_BOUND = 1e-4
#: bf16 compute on both sides: 4 bf16 epsilons (2**-8 each) of the largest logit
BF16_EPS = 2.0 ** -8
BF16_BOUND = 4 * BF16_EPS
SEED, BATCH, LENGTH = 0, 2, 24

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=320,
             max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)


# -- the torch side (scratch interpreter: torch, transformers, peft; no lorakit) ------------
def torch_side(work: Path) -> None:
    import torch
    import transformers
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    jobs = json.loads((work / "jobs.json").read_text())
    ids = torch.tensor(np.load(work / "ids.npy"))
    done = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": __import__("peft").__version__}}
    for name, job in jobs["models"].items():
        model, info = AutoModelForCausalLM.from_pretrained(job["path"], dtype="auto",
                                                           output_loading_info=True)
        model.eval()
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        rec = {"param_dtypes": dtypes, "missing_keys": sorted(info["missing_keys"]),
               "unexpected_keys": sorted(info["unexpected_keys"]),
               "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])]}
        with torch.no_grad():
            if job.get("bf16"):
                np.save(work / f"{name}.torch-bf16.npy", model(ids).logits.float().numpy())
            model = model.float()
            np.save(work / f"{name}.torch-f32.npy", model(ids).logits.numpy())
        done[name] = rec
    p = jobs["peft"]
    base = AutoModelForCausalLM.from_pretrained(p["base"], dtype="auto")
    merged = PeftModel.from_pretrained(base, p["adapter"]).merge_and_unload()
    sd = merged.state_dict()
    if merged.config.tie_word_embeddings:  # the tied head is the embedding itself
        assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
        sd.pop("lm_head.weight")
    sd = {k: v.detach().clone().contiguous() for k, v in sd.items()}
    save_file(sd, str(work / "peft-merged.safetensors"))
    done["peft"] = {"tensors": len(sd)}
    (work / "torch.json").write_text(json.dumps(done, indent=1))


# -- the MLX side ---------------------------------------------------------------------------
def _mlx_logits(path: Path, ids: np.ndarray, f32: bool, adapter: Path = None) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(path), adapter_path=None if adapter is None else str(adapter))
    if f32:
        model.set_dtype(mx.float32)
    out = model(mx.array(ids))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def _compare(a: np.ndarray, b: np.ndarray, bound: float) -> dict:
    diff = float(np.max(np.abs(a.astype(np.float64) - b)))
    scale = float(np.max(np.abs(b)))
    top1 = int(np.sum(a.argmax(-1) == b.argmax(-1)))
    return {"max_abs_diff": diff, "max_abs_logit": scale, "rel": diff / scale,
            "bound": bound, "within": diff / scale <= bound, "top1": f"{top1}/{a.shape[0] * a.shape[1]}",
            "top1_agree": top1 == a.shape[0] * a.shape[1]}


def _raw(folder: Path) -> dict:
    from lorakit.io.formats.safetensors import read_header, read_raw

    out = {}
    for p in sorted(Path(folder).glob("*.safetensors")):
        out.update({k: (v.dtype, read_raw(v)) for k, v in read_header(p).tensors.items()})
    return out


def build(work: Path, quick: bool = False) -> dict:
    import lorakit
    from lorakit.algebra import convert, resize
    from lorakit.synth import synth_adapter, synth_checkpoint

    base, lora, peft = DATA / "tiny-qwen3", DATA / "adapters" / "lora", DATA / "adapters" / "peft-lora"
    moe, moe_lora = DATA / "tiny-qwen3-moe", DATA / "adapters" / "moe-lora"
    q = lambda *a, **k: lorakit.fuse(*a, progress=False, **k)  # noqa: E731
    q(base, lora, work / "qwen3-fused")
    models = {"qwen3": {"path": str(work / "qwen3-fused"), "bf16": True}}
    if not quick:
        llama = synth_checkpoint(work / "llama", LLAMA, seed=1, progress=False)
        llama_ad = synth_adapter(work / "llama-lora", llama, rank=4, layers=2, seed=2)
        q(llama, llama_ad, work / "llama-fused")
        models["llama"] = {"path": str(work / "llama-fused"), "bf16": True}
    models["moe-transformers"] = {"path": str(work / "moe-transformers")}
    models["moe-stacked"] = {"path": str(work / "moe-stacked")}
    q(moe, moe_lora, work / "moe-transformers", layout="transformers")
    q(moe, moe_lora, work / "moe-stacked")
    # (b) the PEFT export and the round-once fuse it must equal
    convert(lora, work / "lora-peft", to="peft")
    q(base, lora, work / "qwen3-round-once", rounding="round-once")
    # (c) every mlx-lm-format adapter lorakit writes
    adapters = {
        "convert peft -> mlx-lm": convert(peft, work / "ad-convert", to="mlx-lm"),
        "convert mlx-lm -> peft -> mlx-lm": convert(work / "lora-peft", work / "ad-roundtrip",
                                                    to="mlx-lm"),
    }
    lorakit.combine([lora, peft], [0.5, 0.5], save_path=work / "ad-combine")
    adapters["combine (exact, 0.5 + 0.5)"] = work / "ad-combine"
    resize(lora, rank=4, base=base, save_path=work / "ad-resize", format="mlx-lm")
    adapters["resize (rank 4)"] = work / "ad-resize"
    if not quick:  # the slowest writer: a truncated SVD of every adapted weight
        lorakit.extract(base, work / "qwen3-fused", rank=8, save_path=work / "ad-extract",
                        format="mlx-lm", behaviour=False, progress=False)
        adapters["extract (rank 8)"] = work / "ad-extract"
    return {"adapters": {k: str(v) for k, v in adapters.items()},
            "models": models,
            "peft": {"base": str(base), "adapter": str(work / "lora-peft")}}


def run(scratch: str, quick: bool = False) -> dict:
    """Build every output, load each in its client, compare; ``quick`` (the slow test):
    the embedded models only, without the llama and the extract."""
    import lorakit

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lorakit-clients-") as tmp:
        work = Path(tmp)
        jobs = build(work, quick)
        ids = np.random.default_rng(SEED).integers(3, 320, (BATCH, LENGTH))
        np.save(work / "ids.npy", ids)
        (work / "jobs.json").write_text(json.dumps(jobs))
        # -P: benchmarks/ off sys.path (its kernels.py would shadow the `kernels` package
        # transformers imports)
        proc = subprocess.run([scratch, "-P", __file__, "--torch-side", str(work)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"the torch side failed:\n{proc.stderr[-4000:]}")
        tj = json.loads((work / "torch.json").read_text())
        res: dict = {"command": "PYTHONPATH=. .venv/bin/python benchmarks/clients.py",
                     "versions": dict(tj["versions"], lorakit=lorakit.__version__,
                                      mlx_lm=__import__("mlx_lm").__version__),
                     "tokens": f"{BATCH} x {LENGTH} random ids (seed {SEED})",
                     "bounds": {"f32": F32_BOUND, "bf16": BF16_BOUND,
                                "bf16_words": "4 bf16 epsilons (2**-8) of the largest logit",
                                "f32_words": "float32 compute over the same bf16 weights"}}
        # (a) dense fused checkpoints in transformers
        res["transformers_dense"] = {}
        for name in [n for n in ("qwen3", "llama") if n in jobs["models"]]:
            path = Path(jobs["models"][name]["path"])
            rec = dict(tj[name])
            rec["dtypes_kept"] = rec["param_dtypes"] == ["bfloat16"]
            rec["f32"] = _compare(np.load(work / f"{name}.torch-f32.npy"),
                                  _mlx_logits(path, ids, True), F32_BOUND)
            rec["bf16"] = _compare(np.load(work / f"{name}.torch-bf16.npy"),
                                   _mlx_logits(path, ids, False), BF16_BOUND)
            res["transformers_dense"][name] = rec
        # (d) the MoE checkpoint, both layouts
        res["transformers_moe"] = {}
        mlx_moe = _mlx_logits(Path(jobs["models"]["moe-transformers"]["path"]), ids, True)
        for name in ("moe-transformers", "moe-stacked"):
            rec = dict(tj[name])
            rec["n_missing"], rec["n_unexpected"] = len(rec["missing_keys"]), \
                len(rec["unexpected_keys"])
            rec["missing_keys"] = rec["missing_keys"][:4]
            rec["unexpected_keys"] = rec["unexpected_keys"][:4]
            rec["f32"] = _compare(np.load(work / f"{name}.torch-f32.npy"), mlx_moe, F32_BOUND)
            res["transformers_moe"][name.split("-")[1]] = rec
        # (b) PEFT merge_and_unload vs round-once, every tensor's bits
        ours = _raw(work / "qwen3-round-once")
        theirs = _raw(work)  # peft-merged.safetensors
        same = [k for k in ours if k in theirs and ours[k][0] == theirs[k][0]
                and ours[k][1].tobytes() == theirs[k][1].tobytes()]
        res["peft"] = {"tensors": len(ours), "bit_identical": len(same),
                       "missing_in_peft": sorted(set(ours) - set(theirs)),
                       "extra_in_peft": sorted(set(theirs) - set(ours)),
                       "all_identical": len(same) == len(ours)}
        # (c) mlx-lm reads every adapter lorakit writes
        base = DATA / "tiny-qwen3"
        res["mlx_lm_adapters"] = {}
        for k, (label, path) in enumerate(jobs["adapters"].items()):
            fused = work / f"view-{k}"
            lorakit.fuse(base, path, fused, dtype="float32", progress=False)
            res["mlx_lm_adapters"][label] = _compare(
                _mlx_logits(base, ids, True, Path(path)), _mlx_logits(fused, ids, True),
                F32_BOUND)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", default=SCRATCH,
                    help="a Python with torch, transformers and peft (default: %(default)s)")
    ap.add_argument("--torch-side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.torch_side:
        torch_side(Path(args.torch_side))
        return 0
    res = run(args.scratch)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
