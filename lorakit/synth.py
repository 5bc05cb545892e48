"""Shape-faithful random checkpoints and adapters: time a model's shape without downloading it.

:func:`synth_checkpoint` writes a checkpoint with the tensor names, shapes, dtype,
shards, config.json and tokenizer files of a real model (a named preset, or any
config.json mlx-lm knows), filled with random weights; :func:`synth_adapter`
writes a LoRA/DoRA adapter for it, in the mlx-lm or PEFT format, as those tools
save them. ``mlx_lm.load`` opens both and ``mlx_lm generate`` runs them, so a fuse
or a decode can be timed on a Qwen3-1.7B or an 8B shape on any machine.

How they are made:

* The tensor list comes from mlx-lm's own model class, instantiated lazily (MLX
  never evaluates the parameters, so planning an 8B model costs no memory). The
  ``hf`` layout names tensors as transformers saves them (one tensor per MoE
  expert); the ``mlx`` layout as mlx-lm saves them (experts stacked under
  ``switch_mlp``). The HF names are checked by running mlx-lm's ``sanitize`` on
  them, so they load back to exactly the model's parameters.
* Tensors are generated and written one at a time, in pieces of a few MB, through
  :class:`~lorakit.io.safetensors.SafetensorsWriter`: peak memory is a few hundred
  MB whatever the model's size.
* Matrices are drawn from N(0, std^2) (std 0.02, the usual initialiser), norm
  weights are 1 and biases 0, so activations stay finite through any depth. For
  speed a table of 65,536 normal draws, rounded once to the target dtype, is
  indexed with random 16-bit numbers (about 2 ns per element): each element is an
  exact sample of the rounded normal up to the table's own sampling noise.
* The tokenizer is byte-level BPE: 256 byte tokens, the family's special tokens at
  their real ids (Qwen's ``<|im_end|>`` = 151645, ...), and filler word tokens up
  to ``vocab_size``, so every id the model can emit decodes to text.

>>> import lorakit
>>> small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=600)
>>> ck = lorakit.synth_checkpoint("out/qwen3-small", "qwen3-1.7b", overrides=small, progress=False)
>>> lorakit.synth_adapter("out/lora", ck, rank=8, layers=2).name
'lora'
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import numerics as nm
from .errors import AdapterError, FormatError, OutputExistsError
from .io.safetensors import PlannedTensor, SafetensorsWriter

PathLike = Union[str, Path]

__all__ = ["PRESETS", "synth_checkpoint", "synth_adapter", "plan_checkpoint", "resolve_config",
           "parse_size", "DEFAULT_KEYS"]

_LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": inter,
            "max_position_embeddings": 40960, "max_window_layers": layers,
            "model_type": "qwen3", "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": tied,
            "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
            "use_sliding_window": False, "vocab_size": 151936}


def _llama3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool,
            rope_factor: float, eos: Any) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": eos,
            "head_dim": hidden // heads, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": inter,
            "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
            "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": dict(_LLAMA3_ROPE, factor=rope_factor), "rope_theta": 500000.0,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
            "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 128256}


def _qwen3_moe(layers: int, experts: int, per_tok: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
            "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
            "max_position_embeddings": 40960, "max_window_layers": layers,
            "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
            "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": experts,
            "num_experts_per_tok": per_tok, "num_hidden_layers": layers,
            "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
            "vocab_size": 151936}


#: Named shapes: the published config.json of each model (Hugging Face), verbatim
#: in every field that decides a tensor's shape. "qwen3-moe" is Qwen3-30B-A3B's
#: layer shape with 8 layers of 16 experts (1.4B parameters): the MoE code path at
#: a size that fits on a laptop.
PRESETS: Dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, True, 32.0, 128001),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, True, 32.0, 128001),
    "llama-3.1-8b": dict(_llama3(4096, 14336, 32, 32, 8, False, 8.0, 128001),
                         eos_token_id=[128001, 128008, 128009]),
    "qwen3-30b-a3b": _qwen3_moe(48, 128, 8),
    "qwen3-moe": _qwen3_moe(8, 16, 4),
}

#: Default adapter targets: the 7 projections of every transformer block.
DEFAULT_KEYS = ("q", "k", "v", "o", "gate", "up", "down")

_KEY_ALIASES: Dict[str, Tuple[str, ...]] = {
    "q": ("self_attn.q_proj",), "k": ("self_attn.k_proj",), "v": ("self_attn.v_proj",),
    "o": ("self_attn.o_proj",),
    "gate": ("mlp.gate_proj", "mlp.switch_mlp.gate_proj", "block_sparse_moe.switch_mlp.gate_proj"),
    "up": ("mlp.up_proj", "mlp.switch_mlp.up_proj", "block_sparse_moe.switch_mlp.up_proj"),
    "down": ("mlp.down_proj", "mlp.switch_mlp.down_proj",
             "block_sparse_moe.switch_mlp.down_proj"),
}
for _k in list(_KEY_ALIASES):
    if _k in ("q", "k", "v", "o", "gate", "up", "down"):
        _KEY_ALIASES[f"{_k}_proj"] = _KEY_ALIASES[_k]
_MIXTRAL = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}

# Special tokens per family, at their real ids: (id, text) in order; the first
# named "eos" in the config ends generation.
_SPECIALS = {
    "qwen": [(151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>")],
    "llama": [(128000, "<|begin_of_text|>"), (128001, "<|end_of_text|>"),
              (128006, "<|start_header_id|>"), (128007, "<|end_header_id|>"),
              (128008, "<|eom_id|>"), (128009, "<|eot_id|>")],
}
_CHAT_TEMPLATES = {
    "qwen": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
              "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
              "{% endif %}"),
}

_PIECE = 1 << 16  # elements per generated piece: the table lookups stay in cache
_WRITE_CHUNK = 1 << 22  # elements handed to the writer at a time (8 MB of bf16)
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


# -- sizes and configs --------------------------------------------------------------------
def parse_size(size: Union[int, str]) -> int:
    """Bytes from ``2000000000``, ``"2GB"`` (10**9), ``"2GiB"`` (2**30), ``"500MB"``...

    >>> parse_size("2GB"), parse_size("1GiB"), parse_size(4096)
    (2000000000, 1073741824, 4096)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise FormatError("shard size must be positive", found=str(size))
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise FormatError("cannot read a size", expected="bytes, or a number with KB/MB/GB/GiB",
                          found=repr(size))
    unit = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    base = 1024 if m.group(3) else 1000
    n = int(float(m.group(1)) * base ** unit)
    if n <= 0:
        raise FormatError("shard size must be positive", found=repr(size))
    return n


def resolve_config(preset_or_config: Union[str, PathLike, Mapping[str, Any]],
                   overrides: Optional[Mapping[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """(name, config) from a preset name, a config.json (or its directory), or a dict.

    ``overrides`` replace config fields, e.g. ``{"num_hidden_layers": 2}`` for a
    small model of a real family.
    """
    src = preset_or_config
    if isinstance(src, Mapping):
        name, config = str(src.get("model_type", "config")), json.loads(json.dumps(dict(src)))
    elif isinstance(src, str) and src.lower() in PRESETS:
        name, config = src.lower(), json.loads(json.dumps(PRESETS[src.lower()]))
    else:
        p = Path(src)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FormatError("unknown preset and no such config.json", file=p,
                              expected="a preset (" + ", ".join(PRESETS) + ") or a config.json",
                              found=repr(str(src)))
        try:
            config = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise FormatError(f"cannot read config.json: {e}", file=p) from None
        if not isinstance(config, dict):
            raise FormatError("config.json is not a JSON object", file=p)
        name = p.parent.name or str(config.get("model_type", "config"))
    config.update(dict(overrides or {}))
    if "model_type" not in config:
        raise FormatError("config has no model_type", expected='"model_type": "qwen3", ...')
    return name, config


def _model(config: Dict[str, Any]):
    """mlx-lm's model for ``config``, with lazy (never evaluated) parameters."""
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
        return model_cls(args_cls.from_dict(config))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"mlx-lm cannot build a {config.get('model_type')!r} model from this "
                          f"config: {type(e).__name__}: {e}",
                          hint="check the config fields (or the model_type) mlx-lm expects"
                          ) from None


def _hf_names(model, params: List[Tuple[str, Tuple[int, ...]]],
              model_type: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """The tensors transformers saves for this model: stacked experts split per expert."""
    out: List[Tuple[str, Tuple[int, ...]]] = []
    for name, shape in params:
        if ".switch_mlp." not in name:
            out.append((name, shape))
            continue
        head, tail = name.split(".switch_mlp.", 1)
        proj, leaf = tail.rsplit(".", 1)
        if head.endswith("block_sparse_moe"):  # mixtral names its experts w1/w2/w3
            proj = _MIXTRAL.get(proj, proj)
        for e in range(shape[0]):
            out.append((f"{head}.experts.{e}.{proj}.{leaf}", tuple(shape[1:])))
    _check_round_trip(model, params, out, model_type)
    return out


def _check_round_trip(model, params, hf, model_type: str) -> None:
    """mlx-lm's sanitize must turn the HF names back into the model's parameters."""
    import mlx.core as mx

    if not hasattr(model, "sanitize"):
        if hf != params:
            raise FormatError(f"the hf layout is not known for model_type {model_type!r}",
                              hint="use layout='mlx'")
        return
    lazy = {n: mx.zeros(s, dtype=mx.bfloat16) for n, s in hf}  # never evaluated
    try:
        back = {k: tuple(v.shape) for k, v in model.sanitize(lazy).items()}
    except Exception as e:  # sanitize of an unknown family: say so plainly
        raise FormatError(f"the hf layout is not known for model_type {model_type!r} "
                          f"({type(e).__name__}: {e})", hint="use layout='mlx'") from None
    if back != dict(params):
        diff = sorted(set(back) ^ {n for n, _ in params})[:3]
        raise FormatError(f"the hf layout is not known for model_type {model_type!r}",
                          found=f"names that do not load back: {diff}", hint="use layout='mlx'")


def plan_checkpoint(config: Mapping[str, Any], layout: str = "mlx"
                    ) -> List[Tuple[str, Tuple[int, ...]]]:
    """Every tensor (name, shape) of a checkpoint of ``config``, in save order.

    >>> plan_checkpoint(PRESETS["qwen3-1.7b"])[0]
    ('model.embed_tokens.weight', (151936, 2048))
    """
    from mlx.utils import tree_flatten

    if layout not in ("mlx", "hf"):
        raise FormatError("unknown layout", expected="mlx or hf", found=repr(layout))
    model = _model(dict(config))
    params = [(k, tuple(v.shape)) for k, v in tree_flatten(model.parameters())]
    if layout == "hf":
        return _hf_names(model, params, str(config.get("model_type")))
    return params


# -- random values ---------------------------------------------------------------------------
def _fill_kind(name: str, shape: Tuple[int, ...]) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1 and "norm" in name and leaf == "weight":
        return "ones"  # RMSNorm / LayerNorm gains: 1, so activations keep their scale
    if leaf == "bias" or leaf.endswith("_bias"):
        return "zeros"
    return "normal"


class _Sampler:
    """Fast N(0, std^2) values in a float format's storage, by table lookup."""

    def __init__(self, code: str, std: float, seed: int) -> None:
        self.code = code
        self.fmt = nm.float_format(code)
        rng = np.random.default_rng([seed, 0x5EED])
        draws = rng.standard_normal(1 << 16) * std
        if code == "F32":
            self.table = draws.astype(np.float32).view(np.uint32)
        else:
            self.table = nm.round_to_format(draws, self.fmt)
        self.one = nm.round_to_format(np.array([1.0]), self.fmt)[0]
        self.seed = seed

    def chunks(self, name: str, numel: int, kind: str) -> Iterator[np.ndarray]:
        """The tensor's storage in pieces of at most ``_WRITE_CHUNK`` elements. Each
        tensor has its own stream (seeded by its name), so values do not depend on
        which other tensors were written."""
        st = self.fmt.storage
        if kind != "normal":
            fill = self.one if kind == "ones" else 0
            for start in range(0, numel, _WRITE_CHUNK):
                yield np.full(min(_WRITE_CHUNK, numel - start), fill, dtype=st)
            return
        bitgen = np.random.PCG64(np.random.SeedSequence([self.seed, zlib.crc32(name.encode())]))
        f32 = self.code == "F32"
        # one buffer reused for every chunk: the writer has consumed a chunk before
        # the next is asked for, and fresh 8 MB arrays would cost a page fault per page
        buf = np.empty(min(_WRITE_CHUNK, numel), dtype=st)
        for start in range(0, numel, _WRITE_CHUNK):
            m = min(_WRITE_CHUNK, numel - start)
            out = buf[:m]
            words = -(-m // 2) if f32 else -(-m // 4)
            rnd = bitgen.random_raw(words).view(np.uint32 if f32 else np.uint16)
            for s in range(0, m, _PIECE):
                e = min(m, s + _PIECE)
                if f32:
                    # high half picks a normal draw; the low 13 mantissa bits are
                    # redrawn so f32 weights take more than 65,536 distinct values
                    r = rnd[s:e]
                    np.take(self.table, (r >> np.uint32(16)).astype(np.uint16), out=out[s:e])
                    out[s:e] ^= r & np.uint32(0x1FFF)
                else:
                    np.take(self.table, rnd[s:e], out=out[s:e])
            yield out


# -- tokenizer ---------------------------------------------------------------------------
def _byte_chars() -> List[str]:
    """GPT-2's byte-to-character map: byte b is token b's text in a byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _family(model_type: str) -> Optional[str]:
    if model_type.startswith("qwen"):
        return "qwen"
    if model_type.startswith("llama"):
        return "llama"
    return None


def _special_tokens(config: Dict[str, Any], vocab: int) -> List[Tuple[int, str]]:
    """Special tokens (id, text) for the config's family, at real ids when they fit the
    vocabulary, else at its top; the config's bos/eos ids are made to match."""
    fam = _family(str(config.get("model_type", "")))
    if fam is not None:
        specials = list(_SPECIALS[fam])
    else:
        specials = [(config.get("bos_token_id"), "<s>"), (config.get("eos_token_id"), "</s>")]
        specials = [(i if isinstance(i, int) else -1, t) for i, t in specials]
    ids = [i for i, _ in specials]
    if any(not 256 <= i < vocab for i in ids) or len(set(ids)) < len(ids):
        moved = {i: vocab - len(specials) + k for k, (i, _) in enumerate(specials)}
        specials = [(vocab - len(specials) + k, t) for k, (_, t) in enumerate(specials)]

        def remap(v: Any) -> Any:
            if isinstance(v, list):
                return [moved.get(x, specials[-1][0]) for x in v]
            return moved.get(v, specials[-1][0]) if v is not None else None
        for key in ("bos_token_id", "eos_token_id"):
            if key in config:
                config[key] = remap(config[key])
        if fam is None:
            config["bos_token_id"], config["eos_token_id"] = specials[0][0], specials[1][0]
    return specials


def _word(i: int) -> str:
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def write_tokenizer(path: Path, config: Dict[str, Any]) -> None:
    """A byte-level BPE tokenizer covering exactly ``config['vocab_size']`` ids.

    Updates ``config``'s bos/eos ids if the family's special tokens had to move
    (a vocabulary smaller than the real one)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab_size = int(config.get("vocab_size", 0))
    fam = _family(str(config.get("model_type", "")))
    specials = _special_tokens(config, vocab_size)
    if vocab_size < 256 + len(specials):
        raise FormatError("vocab_size too small for a byte-level tokenizer",
                          tensor="vocab_size", expected=f">= {256 + len(specials)}",
                          found=str(vocab_size))
    by_id = {i: t for i, t in specials}
    chars = _byte_chars()
    vocab: Dict[str, int] = {}
    word = 0
    for i in range(vocab_size):
        if i < 256:
            vocab[chars[i]] = i
        elif i in by_id:
            vocab[by_id[i]] = i
        else:
            vocab["\u0120" + _word(word)] = i  # "Ġ" + letters: a word after a space
            word += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    tok.save(str(path / "tokenizer.json"))

    def text_of(key: str) -> Optional[str]:
        v = config.get(key)
        v = v[0] if isinstance(v, list) and v else v
        return by_id.get(v) if isinstance(v, int) else None
    eos = text_of("eos_token_id") or specials[-1][1]
    bos = text_of("bos_token_id") if fam != "qwen" else None
    tcfg: Dict[str, Any] = {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False,
                                          "special": True} for i, t in specials},
        "bos_token": bos, "clean_up_tokenization_spaces": False, "eos_token": eos,
        "model_max_length": int(config.get("max_position_embeddings", 4096)),
        "pad_token": specials[0][1], "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    if fam in _CHAT_TEMPLATES:
        tcfg["chat_template"] = _CHAT_TEMPLATES[fam]
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    smap = {"eos_token": eos, "pad_token": specials[0][1]}
    if bos:
        smap["bos_token"] = bos
    (path / "special_tokens_map.json").write_text(json.dumps(smap, indent=2))


# -- output directories ----------------------------------------------------------------------
def _begin(path: PathLike, force: bool) -> Tuple[Path, Path]:
    out = Path(path).expanduser().resolve()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not force:
        raise OutputExistsError("output path already exists", file=out,
                                expected="a new (or empty) directory",
                                hint="pass force=True (--force) to replace it")
    if out.exists() and not out.is_dir():
        raise OutputExistsError("output path is a file, not a directory", file=out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.lorakit-synth-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return out, tmp


def _publish(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)


# -- checkpoints ----------------------------------------------------------------------------
def synth_checkpoint(path: PathLike, preset_or_config: Union[str, PathLike, Mapping[str, Any]],
                     *, layout: str = "mlx", dtype: str = "bfloat16",
                     shard_size: Union[int, str] = "2GB", seed: int = 0, std: float = 0.02,
                     overrides: Optional[Mapping[str, Any]] = None, force: bool = False,
                     progress: bool = True) -> Path:
    """Write a random checkpoint with a real model's tensor names, shapes and files.

    Args:
        path: output directory (must not exist or be empty, unless ``force``).
        preset_or_config: a name from :data:`PRESETS`, a config.json path (or its
            directory), or a config dict.
        layout: ``"mlx"`` (as mlx-lm saves: MoE experts stacked under ``switch_mlp``,
            an index even for one shard) or ``"hf"`` (as transformers saves: one
            tensor per expert, an index only for several shards).
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` for every tensor.
        shard_size: largest shard, bytes or ``"2GB"``-style; a new shard starts when
            the next tensor would pass it (mlx-lm's rule).
        seed: random seed; the same seed writes the same bytes.
        std: standard deviation of the matrices' entries (norm weights are 1).
        overrides: config fields to replace (e.g. a smaller ``num_hidden_layers``).
        force: replace an existing output.
        progress: show a progress bar.

    Returns:
        The output directory.

    >>> small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=600)
    >>> synth_checkpoint("out/qwen3-tiny", "qwen3-1.7b", overrides=small, progress=False).name
    'qwen3-tiny'
    """
    if dtype not in _DTYPES:
        raise FormatError("unsupported dtype", expected=" / ".join(_DTYPES), found=repr(dtype))
    limit = parse_size(shard_size)
    name, config = resolve_config(preset_or_config, overrides)
    plan = plan_checkpoint(config, layout)
    code = _DTYPES[dtype]
    out, tmp = _begin(path, force)
    try:
        _write_checkpoint(tmp, plan, code, limit, seed, std, layout, progress, name)
        config["torch_dtype"] = dtype
        write_tokenizer(tmp, config)  # may move bos/eos ids: before config.json
        _write_config(tmp, config, layout)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _shards(plan: Sequence[PlannedTensor], limit: int) -> List[List[PlannedTensor]]:
    shards: List[List[PlannedTensor]] = []
    size = 0
    for p in plan:
        if not shards or size + p.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _write_checkpoint(tmp: Path, plan: List[Tuple[str, Tuple[int, ...]]], code: str, limit: int,
                      seed: int, std: float, layout: str, progress: bool, name: str) -> None:
    from tqdm.auto import tqdm

    planned = [PlannedTensor(n, code, s) for n, s in plan]
    shards = _shards(planned, limit)
    files = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    sampler = _Sampler(code, std, seed)
    meta = {"format": "mlx" if layout == "mlx" else "pt", "lorakit_synth": f"{name} seed={seed}"}
    total = sum(p.nbytes for p in planned)
    weight_map: Dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="synth", disable=not progress)
    try:
        for file, shard in zip(files, shards):
            with SafetensorsWriter(tmp / file, shard, meta) as w:
                for p in shard:
                    numel = p.nbytes // nm.float_format(code).itemsize
                    w.write_chunks(p.name, _counted(sampler.chunks(p.name, numel,
                                                                   _fill_kind(p.name, p.shape)),
                                                    bar))
                    weight_map[p.name] = file
    finally:
        bar.close()
    if len(files) > 1 or layout == "mlx":  # mlx-lm writes an index even for one shard
        meta_index: Dict[str, Any] = {"total_size": total}
        if layout == "mlx":
            meta_index["total_parameters"] = total // nm.float_format(code).itemsize
        index = {"metadata": meta_index, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def _counted(chunks: Iterator[np.ndarray], bar) -> Iterator[np.ndarray]:
    for c in chunks:
        yield c
        bar.update(c.nbytes)


def _write_config(tmp: Path, config: Dict[str, Any], layout: str) -> None:
    if layout == "mlx":  # mlx-lm's save_config: keys sorted, indent 4
        (tmp / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))
        return
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    gen["transformers_version"] = config.get("transformers_version", "4.51.0")
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))


# -- adapters --------------------------------------------------------------------------------
@dataclass
class _Site:
    """One adapted module: where it is in both namings and its weight's shape."""

    module: str  # mlx-lm module path (stacked experts under switch_mlp)
    rel: str  # path inside the block, as mlx-lm's lora "keys" name it
    layer: int
    shape: Tuple[int, ...]  # (out, in), or (experts, out, in)
    expert_modules: Tuple[str, ...] = ()  # HF per-expert module paths (switch only)
    weights: Tuple[str, ...] = ()  # the checkpoint tensors holding the weight

    @property
    def switch(self) -> bool:
        return len(self.shape) == 3


def _layer_prefix(names: Sequence[str]) -> Tuple[str, int]:
    """("model.", number of layers) from tensor names like model.layers.3.xxx."""
    found: Dict[str, int] = {}
    for n in names:
        m = re.match(r"^(.*?)layers\.(\d+)\.", n)
        if m:
            found[m.group(1)] = max(found.get(m.group(1), -1), int(m.group(2)))
    if not found:
        raise FormatError("no transformer layers (…layers.N…) among the checkpoint's tensors")
    prefix = max(found, key=lambda p: found[p])
    return prefix, found[prefix] + 1


def _expert_rel(rel: str, e: int) -> str:
    head, proj = rel.split(".switch_mlp.", 1)
    if head.endswith("block_sparse_moe"):
        proj = _MIXTRAL.get(proj, proj)
    return f"{head}.experts.{e}.{proj}"


def _find_sites(ck, layers: Sequence[int], keys: Sequence[str], prefix: str) -> List[_Site]:
    from .io.naming import logical_shape

    sites: List[_Site] = []
    errors: List[str] = []
    for i in layers:
        base = f"{prefix}layers.{i}."
        for key in keys:
            site = None
            for rel in _KEY_ALIASES.get(key, (key,)):
                mod = base + rel
                if f"{mod}.weight" in ck.tensors:
                    shape = tuple(logical_shape(ck, mod))
                    experts: Tuple[str, ...] = ()
                    if len(shape) == 3:
                        experts = tuple(base + _expert_rel(rel, e) for e in range(shape[0]))
                    site = _Site(mod, rel, i, shape, experts, (f"{mod}.weight",))
                    break
                if ".switch_mlp." in rel and f"{base}{_expert_rel(rel, 0)}.weight" in ck.tensors:
                    experts = []
                    while f"{base}{_expert_rel(rel, len(experts))}.weight" in ck.tensors:
                        experts.append(base + _expert_rel(rel, len(experts)))
                    shape = (len(experts),) + tuple(logical_shape(ck, experts[0]))
                    site = _Site(mod, rel, i, shape, tuple(experts),
                                 tuple(f"{m}.weight" for m in experts))
                    break
            if site is None:
                tried = ", ".join(base + r for r in _KEY_ALIASES.get(key, (key,)))
                errors.append(f"  layer {i}: key {key!r} matches no weight (tried {tried})")
            else:
                sites.append(site)
    if errors:
        raise AdapterError(f"{len(errors)} adapter target(s) not in the checkpoint:\n"
                           + "\n".join(errors[:20]) + ("\n  ..." if len(errors) > 20 else ""),
                           file=ck.path, expected="keys among q, k, v, o, gate, up, down or "
                           "module paths inside a block (self_attn.q_proj)")
    return sites


def _row_norms(ck, site: _Site) -> np.ndarray:
    """Row norms of the base weight in f32 ((experts,) out), as DoRA's magnitude starts."""
    from .fusion.quant import dequantize_raw

    norms = []
    for t in site.weights:
        module = t[: -len(".weight")]
        info = ck.tensors[t]
        if ck.quant_params(module) is not None:
            raw, code = dequantize_raw(ck, module, "F32"), "F32"
        else:
            raw, code = ck.read(t), info.dtype
        w = nm.to_float32(raw, nm.float_format(code)) if code != "F64" else raw.astype(np.float32)
        norms.append(np.sqrt(np.einsum("...ij,...ij->...i", w, w, dtype=np.float64))
                     .astype(np.float32))
    res = np.stack(norms) if len(norms) > 1 else norms[0]
    return res[None] if site.switch and res.ndim == 1 else res


def synth_adapter(path: PathLike, checkpoint_path: PathLike, *, rank: int = 8,
                  scale: Optional[float] = None, layers: Union[int, Sequence[int]] = 16,
                  keys: Sequence[str] = DEFAULT_KEYS, kind: str = "lora",
                  format: str = "mlx-lm", seed: int = 0, delta_std: float = 1e-3,
                  force: bool = False) -> Path:
    """Write a random LoRA/DoRA adapter for a checkpoint, as ``mlx_lm lora`` or PEFT saves it.

    ``lora_a`` is drawn as the trainers initialise it (uniform in +-1/sqrt(in));
    ``lora_b`` is non-zero, drawn so that each element of ``scale * B @ A`` has
    standard deviation ``delta_std`` (1e-3 is about 5% of a 0.02-scale weight, a
    few bf16 ulps: every fused element moves). DoRA magnitudes are the base
    weight's row norms, perturbed by 1%.

    Args:
        path: output directory.
        checkpoint_path: the base checkpoint (any layout; quantized works).
        rank: LoRA rank.
        scale: multiplier of ``B @ A``; default 20.0 (``mlx_lm lora``'s) for mlx-lm,
            2.0 (lora_alpha = 2 * r) for PEFT. PEFT's lora_alpha is scale * rank.
        layers: the last N layers (mlx-lm's ``num_layers``), or a list of layer indices.
        keys: modules in each block: q, k, v, o, gate, up, down (MoE experts where
            the block has them), or paths inside a block (``self_attn.q_proj``).
        kind: ``"lora"`` or ``"dora"``.
        format: ``"mlx-lm"`` (adapters.safetensors) or ``"peft"`` (adapter_model.safetensors).
        seed: random seed.
        delta_std: standard deviation of each element of the delta.
        force: replace an existing output.

    Returns:
        The output directory.

    >>> small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=600)
    >>> ck = synth_checkpoint("out/base", "qwen3-1.7b", overrides=small, progress=False)
    >>> synth_adapter("out/lora-2", ck, rank=8, layers=2).name
    'lora-2'
    """
    from .io.checkpoint import Checkpoint

    if kind not in ("lora", "dora"):
        raise AdapterError("unknown adapter kind", expected="lora or dora", found=repr(kind))
    if format not in ("mlx-lm", "peft"):
        raise AdapterError("unknown adapter format", expected="mlx-lm or peft",
                           found=repr(format))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError("rank must be a positive integer", found=repr(rank))
    ck = Checkpoint(checkpoint_path)
    prefix, n_layers = _layer_prefix(list(ck.tensors))
    n_layers = int(ck.config.get("num_hidden_layers", n_layers))
    if isinstance(layers, int) and not isinstance(layers, bool):
        if not 0 < layers <= n_layers:
            raise AdapterError("layers out of range", expected=f"1..{n_layers} (last N layers)",
                               found=str(layers))
        layer_list = list(range(n_layers - layers, n_layers))
    else:
        layer_list = sorted({int(i) for i in layers})
        bad = [i for i in layer_list if not 0 <= i < n_layers]
        if bad or not layer_list:
            raise AdapterError("layer indices out of range", expected=f"0..{n_layers - 1}",
                               found=str(bad or "none"))
    if scale is None:
        scale = 20.0 if format == "mlx-lm" else 2.0
    dst, src = Path(path).expanduser().resolve(), ck.path.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise OutputExistsError("adapter output would overlap the checkpoint directory",
                                file=dst, expected=f"a path outside {src}")
    sites = _find_sites(ck, layer_list, list(keys), prefix)
    if kind == "dora" and format == "mlx-lm" and any(s.switch for s in sites):
        raise AdapterError("mlx-lm has no DoRA for MoE experts (SwitchLinear)",
                           expected="kind='lora', or keys without gate/up/down, "
                           "or format='peft'", found="DoRA on stacked experts")
    out, tmp = _begin(path, force)
    try:
        if format == "mlx-lm":
            _write_mlx_adapter(tmp, out, ck, sites, rank, float(scale), layer_list, n_layers,
                               kind, seed, delta_std)
        else:
            _write_peft_adapter(tmp, ck, sites, rank, float(scale), layer_list, n_layers, kind,
                                seed, delta_std)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _lora_pair(rng: np.random.Generator, n_in: int, n_out: int, rank: int, scale: float,
               delta_std: float, lead: Tuple[int, ...] = ()) -> Tuple[np.ndarray, np.ndarray]:
    """(A (…, r, in), B (…, out, r)) in f32 with std(scale * B @ A) = delta_std."""
    bound = 1.0 / math.sqrt(n_in)
    A = rng.uniform(-bound, bound, size=lead + (rank, n_in)).astype(np.float32)
    b_std = delta_std / (abs(scale) * math.sqrt(rank) * bound / math.sqrt(3.0))
    B = (rng.standard_normal(size=lead + (n_out, rank)) * b_std).astype(np.float32)
    return A, B


def _site_rng(seed: int, site: _Site) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(site.module.encode())])


def _write_tensors(file: Path, tensors: List[Tuple[str, np.ndarray]], meta: Dict[str, str]) -> None:
    plan = [PlannedTensor(n, "F32", tuple(a.shape)) for n, a in tensors]
    with SafetensorsWriter(file, plan, meta) as w:
        for n, a in tensors:
            w.write(n, np.ascontiguousarray(a, dtype=np.float32))


def _write_mlx_adapter(tmp: Path, out: Path, ck, sites: List[_Site], rank: int, scale: float,
                       layer_list: List[int], n_layers: int, kind: str, seed: int,
                       delta_std: float) -> None:
    tensors: List[Tuple[str, np.ndarray]] = []
    for site in sites:
        rng = _site_rng(seed, site)
        lead, (n_out, n_in) = tuple(site.shape[:-2]), site.shape[-2:]
        A, B = _lora_pair(rng, n_in, n_out, rank, scale, delta_std, lead)
        # mlx-lm stores Linear as lora_a (in, r), lora_b (r, out); SwitchLinear as
        # lora_a (E, r, in), lora_b (E, out, r)
        a, b = (A, B) if site.switch else (A.T, B.T)
        tensors += [(f"{site.module}.lora_a", a), (f"{site.module}.lora_b", b)]
        if kind == "dora":
            m = _row_norms(ck, site) * (1 + 0.01 * rng.standard_normal(n_out)).astype(np.float32)
            tensors.append((f"{site.module}.m", m))
    tensors.sort(key=lambda t: t[0])  # mx.save_safetensors writes keys in sorted order
    _write_tensors(tmp / "adapters.safetensors", tensors, {"format": "mlx"})
    rels = list(dict.fromkeys(s.rel for s in sites))
    cfg = {
        "adapter_path": str(out),
        "batch_size": 4, "config": None, "data": "synthetic", "fine_tune_type": kind,
        "grad_accumulation_steps": 1, "grad_checkpoint": False, "iters": 1000,
        "learning_rate": 1e-05, "lora_parameters": {"rank": rank, "dropout": 0.0,
                                                    "scale": scale, "keys": rels},
        "lr_schedule": None, "mask_prompt": False, "max_seq_length": 2048,
        "model": str(ck.path), "num_layers": n_layers - min(layer_list), "optimizer": "adam",
        "resume_adapter_file": None, "save_every": 100, "seed": seed, "steps_per_eval": 200,
        "steps_per_report": 10, "test": False, "test_batches": 500, "train": True,
        "val_batches": 25,
    }
    (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=4))


def _write_peft_adapter(tmp: Path, ck, sites: List[_Site], rank: int, scale: float,
                        layer_list: List[int], n_layers: int, kind: str, seed: int,
                        delta_std: float) -> None:
    tensors: List[Tuple[str, np.ndarray]] = []
    targets = set()
    for site in sites:
        rng = _site_rng(seed, site)
        lead, (n_out, n_in) = tuple(site.shape[:-2]), site.shape[-2:]
        A, B = _lora_pair(rng, n_in, n_out, rank, scale, delta_std, lead)
        norms = _row_norms(ck, site) if kind == "dora" else None
        modules = site.expert_modules if site.switch else (site.module,)
        for e, module in enumerate(modules):
            a, b = (A[e], B[e]) if site.switch else (A, B)
            p = "base_model.model." + module
            tensors += [(f"{p}.lora_A.weight", a), (f"{p}.lora_B.weight", b)]
            if norms is not None:
                nrm = norms[e] if site.switch else norms
                m = nrm * (1 + 0.01 * rng.standard_normal(n_out)).astype(np.float32)
                tensors.append((f"{p}.lora_magnitude_vector", m))
            targets.add(module.rsplit(".", 1)[-1])
    tensors.sort(key=lambda t: t[0])  # safetensors' save_file orders tensors by name
    _write_tensors(tmp / "adapter_model.safetensors", tensors, {"format": "pt"})
    all_layers = layer_list == list(range(n_layers))
    cfg = {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": str(ck.path),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "layer_replication": None,
        "layers_pattern": None if all_layers else "layers",
        "layers_to_transform": None if all_layers else layer_list, "loftq_config": {},
        "lora_alpha": scale * rank, "lora_bias": False, "lora_dropout": 0.0,
        "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
        "peft_type": "LORA", "r": rank, "rank_pattern": {}, "revision": None,
        "target_modules": sorted(targets), "task_type": "CAUSAL_LM", "use_dora": kind == "dora",
        "use_rslora": False,
    }
    (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))


def presets() -> List[str]:
    """Names of the built-in shapes."""
    return list(PRESETS)
