"""GGUF files llama.cpp loads, written with llama.cpp's own Python writer (``gguf``).

Both writers follow llama.cpp's converters family by family: :func:`write_model_gguf`
(``convert_hf_to_gguf.py``: its tensor names, q/k rows permuted for llama-arch models,
norms and routers F32, the tokenizer's byte-level BPE with the pre-tokenizer whose regex
is the tokenizer's own) and :func:`write_lora_gguf` (``convert_lora_to_gguf.py``:
``lora_a`` (r, in), ``lora_b`` (out, r), applied at ``alpha / r``).
"""
from __future__ import annotations

import json
import math
import os
import re
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ...errors import AdapterError, FormatError, OutputExistsError
from ...numerics import to_float32
from ..formats import source
from .directory import TMP_MARK, temp_path

__all__ = ["write_lora_gguf"]

#: config.json model_type -> llama.cpp architecture (convert_hf_to_gguf.py's classes)
GGUF_ARCHS: Dict[str, str] = {"llama": "llama", "mistral": "llama", "mixtral": "llama",
                              "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
#: architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.permute)
_PERMUTE = ("llama",)
GGUF_OUTTYPES = ("auto", "f32", "f16", "bf16")
_SUPPORTED = ", ".join(GGUF_ARCHS)


def check_gguf_model(config: Mapping[str, Any], what: str = "GGUF export") -> str:
    """The llama.cpp architecture of ``config``, or one clear refusal naming it."""
    mt = config.get("model_type")
    if mt not in GGUF_ARCHS:
        raise FormatError(f"llama.cpp {what} does not support this architecture",
                          tensor="config.json: model_type",
                          expected=f"one of {_SUPPORTED}", found=repr(mt),
                          hint="convert with llama.cpp's convert_hf_to_gguf.py, which knows "
                               "more families")
    if mt == "qwen3_moe":
        # llama.cpp's qwen3moe graph: every layer MoE, top-k weights renormalized
        if config.get("norm_topk_prob") is not True:
            raise FormatError(f"llama.cpp {what}: its qwen3moe always renormalizes the "
                              "top-k expert weights", tensor="config.json: norm_topk_prob",
                              expected="true", found=repr(config.get("norm_topk_prob")))
        sparse = int(config.get("decoder_sparse_step", 1) or 1)
        if sparse != 1 or config.get("mlp_only_layers"):
            raise FormatError(f"llama.cpp {what}: its qwen3moe has no dense layers",
                              tensor="config.json: decoder_sparse_step / mlp_only_layers",
                              expected="1 / []", found=f"{sparse} / "
                              f"{config.get('mlp_only_layers')}")
    return GGUF_ARCHS[mt]


def _gguf():
    try:
        import gguf  # lazy: llama.cpp's writer (0.5 s to import), only for a GGUF file
    except ImportError:  # pragma: no cover - a declared dependency
        raise FormatError("writing GGUF needs the gguf package (llama.cpp's writer)",
                          expected="gguf installed", found="no module named gguf",
                          hint="pip install gguf") from None
    return gguf


def _rope_scaling(config: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    rs = config.get("rope_scaling")
    if not isinstance(rs, dict):
        return None
    kind = rs.get("rope_type", rs.get("type"))
    return dict(rs, rope_type=kind)


def _llama3_rope_freqs(config: Mapping[str, Any], rs: Mapping[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the rope_freqs tensor."""
    base = float(config.get("rope_theta", 10000.0))
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(rs.get("factor", 8.0))
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    old = int(rs.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old / low, old / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _metadata(w, arch: str, config: Mapping[str, Any]) -> None:
    gguf = _gguf()
    c = config
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    w.add_context_length(int(c.get("max_position_embeddings", 4096)))
    w.add_embedding_length(int(c["hidden_size"]))
    w.add_block_count(int(c["num_hidden_layers"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(c.get("num_key_value_heads", heads)))
    w.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-5)))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(int(c["vocab_size"]))
    n_exp = c.get("num_local_experts", c.get("num_experts"))
    if n_exp:
        w.add_expert_count(int(n_exp))
        w.add_expert_used_count(int(c["num_experts_per_tok"]))
    if c.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
    rs = _rope_scaling(c)
    if rs is not None:
        kind, factor = rs.get("rope_type"), rs.get("factor")
        if kind in ("linear", "yarn") and factor:
            w.add_rope_scaling_type(gguf.RopeScalingType[kind.upper()])
            w.add_rope_scaling_factor(float(factor))
            if kind == "yarn":
                w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        elif kind not in ("llama3", "default", None):  # llama3: the rope_freqs tensor
            raise FormatError("llama.cpp GGUF export does not support this rope scaling",
                              tensor="config.json: rope_scaling", expected="linear, yarn, "
                              "llama3 or none", found=repr(kind))


def _token_id(tok: Any, vocab: Mapping[str, int]) -> Optional[int]:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return vocab.get(tok) if isinstance(tok, str) else None


#: the split regexes of HF byte-level BPE pre-tokenizers -> llama.cpp's
#: ``tokenizer.ggml.pre`` (llama-vocab.cpp's regex for that name is the same)
_PRE_REGEX = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}


def _bpe_pre(pre: Any, file: Path) -> str:
    """llama.cpp's pre-tokenizer name whose split regex is the tokenizer's own (never
    chosen from the model family), or one clear refusal."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and \
        pre.get("type") == "Sequence" else [pre]
    steps = [x for x in steps if isinstance(x, dict)]
    byte = [x for x in steps if x.get("type") == "ByteLevel"]
    split = [x for x in steps if x.get("type") == "Split"]
    others = [x.get("type") for x in steps if x.get("type") not in ("ByteLevel", "Split")]
    name = None
    if len(byte) == 1 and not others and not byte[0].get("add_prefix_space"):
        if not split and byte[0].get("use_regex", True):
            name = "gpt-2"
        elif len(split) == 1 and not byte[0].get("use_regex", True) and \
                split[0].get("behavior") == "Isolated" and not split[0].get("invert"):
            name = _PRE_REGEX.get((split[0].get("pattern") or {}).get("Regex"))
    if name is None:
        raise FormatError("llama.cpp GGUF export does not know this BPE pre-tokenizer",
                          file=file, tensor="pre_tokenizer",
                          expected="ByteLevel with the GPT-2 regex, or a Split with "
                                   "qwen2's or llama-3's regex then ByteLevel",
                          found=json.dumps(pre)[:200],
                          hint="convert with llama.cpp's convert_hf_to_gguf.py, which "
                               "recognises more tokenizers")
    return name


def _tokenizer(w, directory: Path, config: Mapping[str, Any]) -> None:
    gguf = _gguf()
    tj = directory / "tokenizer.json"
    if not tj.is_file():
        raise FormatError("llama.cpp GGUF export needs the tokenizer", file=tj,
                          expected="a tokenizer.json (byte-level BPE)", found="no such file")
    t = json.loads(tj.read_text(encoding="utf-8"))
    m = t.get("model") or {}
    pre = json.dumps(t.get("pre_tokenizer") or {})
    if m.get("type") != "BPE" or "ByteLevel" not in pre:
        raise FormatError("llama.cpp GGUF export writes byte-level BPE tokenizers only",
                          file=tj, tensor="model.type / pre_tokenizer",
                          expected="BPE with a ByteLevel pre-tokenizer (gpt2, llama-3, qwen)",
                          found=f"{m.get('type')!r}, byte_fallback={m.get('byte_fallback')}",
                          hint="SentencePiece (llama-2/mistral) vocabularies: convert with "
                               "llama.cpp's convert_hf_to_gguf.py")
    pre_name = _bpe_pre(t.get("pre_tokenizer"), tj)
    vocab: Dict[str, int] = dict(m["vocab"])
    added = {a["content"]: a for a in t.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    n = max(int(config["vocab_size"]), max(vocab.values()) + 1)
    rev = {i: s for s, i in vocab.items()}
    T = gguf.TokenType
    kinds = {s: T.CONTROL if a.get("special") else T.USER_DEFINED for s, a in added.items()}
    tokens = [rev.get(i, f"[PAD{i}]") for i in range(n)]
    types = [int(kinds.get(rev[i], T.NORMAL)) if i in rev else int(T.UNUSED) for i in range(n)]
    merges = [" ".join(x) if isinstance(x, list) else x for x in m.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_name)
    w.add_token_list(tokens)
    w.add_token_types(types)  # Python ints: INT32, as llama.cpp reads them
    w.add_token_merges(merges)
    tc_path = directory / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("pad", w.add_pad_token_id), ("unk", w.add_unk_token_id)):
        tid = _token_id(tc.get(f"{key}_token"), vocab)
        if tid is None:
            cid = config.get(f"{key}_token_id")
            tid = cid[0] if isinstance(cid, list) and cid else cid
        if isinstance(tid, int):
            add(tid)
    if "add_bos_token" in tc:
        w.add_add_bos_token(bool(tc["add_bos_token"]))
    if "add_eos_token" in tc:
        w.add_add_eos_token(bool(tc["add_eos_token"]))
    tmpl = tc.get("chat_template")
    jinja = directory / "chat_template.jinja"
    if tmpl is None and jinja.is_file():
        tmpl = jinja.read_text(encoding="utf-8")
    if isinstance(tmpl, str):
        w.add_chat_template(tmpl)


def _hf_name(name: str) -> str:
    """mlx-lm's stacked expert names as the HF merged names TensorNameMap knows."""
    return (name.replace(".block_sparse_moe.switch_mlp.", ".mlp.experts.")
            .replace(".mlp.switch_mlp.", ".mlp.experts.")
            .replace(".block_sparse_moe.gate.", ".mlp.gate."))


def gguf_tensor_name(arch: str, n_blocks: int, name: str) -> Optional[str]:
    """llama.cpp's name of checkpoint tensor ``name`` (``blk.0.attn_q.weight``), or None."""
    gguf = _gguf()
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_blocks)
    return tmap.get_name(name, try_suffixes=(".weight", ".bias"))


def _permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (rows of q/k, or of a LoRA B)."""
    return (x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def _qk_heads(name: str, config: Mapping[str, Any]) -> Optional[int]:
    heads = int(config["num_attention_heads"])
    if name.endswith(("q_proj.weight", "q_proj.bias", "q_proj")):
        return heads
    if name.endswith(("k_proj.weight", "k_proj.bias", "k_proj")):
        return int(config.get("num_key_value_heads", heads))
    return None


def _stack_experts(names: List[str]) -> Dict[str, List[str]]:
    """HF per-expert tensors (``mlp.experts.3.gate_proj.weight``, mixtral's
    ``block_sparse_moe.experts.3.w1.weight``) grouped under their merged name."""
    groups: Dict[str, List[Tuple[int, str]]] = {}
    pat = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
    ren = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    for n in names:
        mm = pat.match(n)
        if mm:
            key = f"{mm.group(1)}.mlp.experts.{ren.get(mm.group(3), mm.group(3))}.weight"
            groups.setdefault(key, []).append((int(mm.group(2)), n))
    return {k: [n for _, n in sorted(v)] for k, v in groups.items()}


_QTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


def _as_gguf(raw: np.ndarray, code: str, want: str) -> Tuple[np.ndarray, Any]:
    """Storage ``raw`` (bf16 as uint16 bits) in GGUF type ``want`` (F32/F16/BF16)."""
    gguf = _gguf()
    q = gguf.GGMLQuantizationType
    if code == want and want == "BF16":
        return np.ascontiguousarray(raw.view(np.uint16)), q.BF16
    f32 = to_float32(raw, code) if code != "F32" else raw.astype(np.float32)
    if want == "F32":
        return np.ascontiguousarray(f32, dtype=np.float32), None
    if want == "F16":
        return np.ascontiguousarray(f32.astype(np.float16)), None
    # bf16 from another float: round to nearest even, as gguf.quants does
    bits = gguf.quants.quantize(f32, q.BF16)
    return np.ascontiguousarray(bits), q.BF16


def _atomic_write(w_build, out: Path, force: bool) -> Path:
    """Build a writer into a temporary next to ``out`` and rename it there: nothing
    half-written, an existing file replaced only with ``force``."""
    if out.exists() and not force:
        raise OutputExistsError("the GGUF file already exists", file=out,
                                expected="a new path", found="an existing file",
                                hint="pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out, TMP_MARK)  # opened by the writer: the mode follows the umask
    try:
        w = w_build(tmp)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def write_model_gguf(directory: Path, out: Path, *, outtype: str = "auto",
                     force: bool = False) -> Path:
    """Write the float checkpoint in ``directory`` as a GGUF model llama.cpp loads
    (``outtype`` auto keeps each weight's dtype; norms and routers are F32 always)."""
    gguf = _gguf()
    if outtype not in GGUF_OUTTYPES:
        raise FormatError("unknown GGUF outtype", expected=", ".join(GGUF_OUTTYPES),
                          found=repr(outtype))
    src = source.open(directory)
    config = src.config
    arch = check_gguf_model(config)
    if config.get("quantization") or config.get("quantization_config"):
        raise FormatError("GGUF export needs float weights", file=directory,
                          tensor="config.json: quantization", expected="a float checkpoint",
                          found="a quantized one", hint="fuse with --dequantize")
    n_blocks = int(config["num_hidden_layers"])
    names = list(src.tensors)
    groups = _stack_experts(names)
    grouped = {n for v in groups.values() for n in v}
    tied = bool(config.get("tie_word_embeddings"))
    singles = [(_hf_name(n), [n]) for n in names if not (
        n in grouped or (tied and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq"))]
    plan: List[Tuple[str, str, List[str]]] = []  # (gguf name, first source name, members)
    for i, (key, members) in enumerate(singles + list(groups.items())):
        g = gguf_tensor_name(arch, n_blocks, key)
        if g is None:
            one = i < len(singles)
            raise FormatError("a tensor llama.cpp's names do not cover", file=directory,
                              tensor=members[0], expected=f"a {arch} tensor gguf.TensorNameMap "
                              "maps" if one else "an expert tensor",
                              found="no GGUF name" if one else "no name")
        plan.append((g, members[0], members))
    dtypes = {src.tensors[n].dtype for n in names}
    for d in dtypes:
        if d not in ("F32", "F16", "BF16"):
            raise FormatError("GGUF export writes float16/bfloat16/float32 weights",
                              file=directory, expected="F32, F16 or BF16",
                              found=d, hint="fuse with --dequantize")
    ftype_of = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                "BF16": gguf.LlamaFileType.MOSTLY_BF16}
    main = _QTYPES.get(outtype) or max(dtypes, key=lambda d: sum(
        src.tensors[n].numel for n in names if src.tensors[n].dtype == d))
    rs = _rope_scaling(config)

    def build(tmp: str):
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(Path(directory).name)
        w.add_file_type(ftype_of[main])
        _metadata(w, arch, config)
        _tokenizer(w, Path(directory), config)
        if rs is not None and rs.get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config, rs))
        for g, first, members in plan:
            code = src.tensors[first].dtype
            raws = [src.read(m) for m in members]
            raw = np.stack(raws) if len(members) > 1 else raws[0]
            heads = _qk_heads(first, config)
            if arch in _PERMUTE and heads is not None:
                raw = _permute(raw, heads)
            one_d = raw.ndim == 1 or g.endswith("ffn_gate_inp.weight")
            want = "F32" if one_d else (_QTYPES.get(outtype) or code)
            arr, qt = _as_gguf(raw, code, want)
            w.add_tensor(g, arr, raw_dtype=qt)
        return w

    return _atomic_write(build, Path(out), force)


def write_lora_gguf(adapter: Any, config: Mapping[str, Any], out: Path, *,
                    outtype: str = "f32", force: bool = False) -> Path:
    """Write the unfused LoRA ``adapter`` for a base of ``config`` as llama.cpp's LoRA GGUF:
    ``lora_a`` = A, ``lora_b`` = B, alpha = scale * r when one for every target, else each B
    times its scale and alpha 0 (applied at scale 1)."""
    gguf = _gguf()
    arch = check_gguf_model(config, "GGUF-LoRA export")
    bad = partial(AdapterError, file=adapter.path)
    if outtype not in ("f32", "f16"):
        raise FormatError("unknown GGUF-LoRA outtype", expected="f32 or f16",
                          found=repr(outtype))
    if adapter.is_dora:
        raise bad("llama.cpp's LoRA GGUF cannot hold a DoRA adapter",
                  tensor=next(t.module for t in adapter.targets if t.is_dora),
                  expected="a plain LoRA adapter", found="DoRA magnitudes",
                  hint="fuse it (lorakit fuse --export-gguf) instead")
    if adapter.replacements:
        raise bad("llama.cpp's LoRA GGUF cannot replace whole tensors",
                  tensor=adapter.replacements[0].name, expected="LoRA factors only",
                  found="modules_to_save")
    n_blocks = int(config["num_hidden_layers"])
    for t in adapter.targets:
        if t.kind != "linear":
            raise bad("llama.cpp's LoRA GGUF export covers Linear layers only", tensor=t.module,
                      expected="a Linear target", found=f"a {t.kind} target",
                      hint="fuse it (lorakit fuse --export-gguf) instead")
        if t.module.endswith("lm_head") and config.get("tie_word_embeddings"):
            raise bad("an lm_head LoRA on a tied-embedding base", tensor=t.module,
                      expected="an untied lm_head", found="tie_word_embeddings: true")
    scales = [np.asarray(t.scale, dtype=np.float64) for t in adapter.targets]
    alphas = {float(s) * t.rank for s, t in zip(scales, adapter.targets) if s.ndim == 0}
    uniform = len(alphas) == 1 and all(s.ndim == 0 for s in scales)
    alpha = alphas.pop() if uniform else 0.0
    plan = []
    for t, s in zip(adapter.targets, scales):
        g = gguf_tensor_name(arch, n_blocks, t.module + ".weight")
        if g is None:
            raise bad("a target llama.cpp's names do not cover", tensor=t.module,
                      expected=f"a {arch} Linear layer", found="no GGUF tensor name")
        A = np.asarray(t.A, dtype=np.float32)
        B = np.asarray(t.B, dtype=np.float32)
        if not uniform:
            B = (B.astype(np.float64) * s).astype(np.float32)
        heads = _qk_heads(t.module, config)
        if arch in _PERMUTE and heads is not None:
            B = _permute(B, heads)
        if outtype == "f16":
            A, B = A.astype(np.float16), B.astype(np.float16)
        plan.append((g, np.ascontiguousarray(A), np.ascontiguousarray(B)))

    def build(tmp: str):
        w = gguf.GGUFWriter(tmp, arch)
        w.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        w.add_name(Path(adapter.path).name)
        for g, A, B in plan:
            w.add_tensor(g + ".lora_a", A)
            w.add_tensor(g + ".lora_b", B)
        return w

    return _atomic_write(build, Path(out), force)
