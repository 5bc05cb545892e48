"""``lorakit.fuse``: one verb for a checkpoint on disk and a model in memory.

The keywords become one :class:`~lorakit.fusion.options.FuseOptions`, checked before
anything is read. A path (or hub repo id) goes through the streaming fuse
(:func:`fuse_checkpoint`: the input's shard layout and names, untouched tensors copied
byte for byte, one adapted tensor in memory at a time, built in a hidden sibling and
renamed into place); an mlx-lm model in memory is fused in place
(:func:`lorakit.fusion.model.fuse_model`). Both round through the same core; what a
fuse did is a :class:`FuseResult`.

>>> import lorakit, tempfile, os
>>> out = os.path.join(tempfile.mkdtemp(), "fused")
>>> r = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", out, progress=False)
>>> r.rounding, r.dtype_policy
('nearest', 'preserve')
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import __version__
from ..errors import ArgumentError, FuseError, LorakitError, PathLike
from ..io.adapters.base import Adapter, Replacement
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import Binding, bind, bind_replacements, bindings_by_tensor
from ..io.formats import source
from ..io.formats.checkpoint import INDEX_NAME, Checkpoint
from ..io.formats.safetensors import FLOAT_CODES, TensorInfo, TensorSpec
from ..io.outputs.directory import OutputDirectory, check_output_path
from ..io.outputs.export import check_gguf_export
from ..io.outputs.export import export_gguf as write_gguf
from ..io.outputs.hf_layout import check_layout, is_stacked, layout_note, to_transformers
from ..io.outputs.model_card import CARD_NAME, write_model_card
from ..io.outputs.safetensors_write import SafetensorsWriter
from ..io.outputs.sidecars import check_tokenizer_fits, plan_sidecars, tokenizer_origin
from ..progress import progress_bar
from ..report import Report, escape, facts_table, table
from .core import fuse_bindings as _fuse_float
from .core import output_code
from .finite import cast_raw as _cast
from .finite import replaced_raw
from .model import fuse_model
from .options import MLX_ROUNDINGS, REQUANT, ROUNDING_HELP, Choice, FuseOptions
from .quant import (
    RequantStat,
    check_float_base,
    dequantize_raw,
    module_parts,
    per_layer_config,
    plan_leaf,
    policy_summary,
    resolve,
    survival_overall,
    survival_rows,
    survival_text,
)

__all__ = ['fuse', 'FuseResult']


def fuse(model: Any, adapter_path: Union[None, PathLike, Adapter] = None,
         save_path: Optional[PathLike] = None, *, rounding: str = "nearest",
         dtype: str = "preserve", dequantize: bool = False, force: bool = False,
         export_gguf: Optional[str] = None,
         progress: Union[bool, Callable[[int, int], None]] = True,
         quant_policy: str = "requant", quant_budget: Optional[float] = None,
         float_base: Optional[PathLike] = None, layout: str = "mlx-lm",
         initial_adapter: Optional[PathLike] = None) -> Any:
    """Fuse an adapter: ``W' = W + scale * B @ A`` for every adapted weight, rounded as
    ``rounding`` says (:data:`~lorakit.fusion.options.ROUNDINGS`) and written in the
    weight's own dtype unless ``dtype`` says otherwise.

    ``model``: a checkpoint directory or hub repo id, written to ``save_path``
    (:func:`fuse_checkpoint`, a :class:`FuseResult` returned), or an mlx-lm model in memory
    fused in place (with its LoRA layers when ``adapter_path`` is None) and returned. A
    quantized base is stored as ``quant_policy`` says (:mod:`lorakit.fusion.quant`) or as
    float with ``dequantize``; ``float_base``: fuse a QLoRA adapter into the float original
    instead. ``initial_adapter``: the PEFT adapter saved before training on a changed base
    (PiSSA, OLoRA, ...), so the trained one is converted as PEFT does and fuses exactly.
    """
    options = FuseOptions(rounding, dtype, dequantize, quant_policy, quant_budget, layout)
    if initial_adapter is not None:
        if adapter_path is None or isinstance(adapter_path, Adapter):
            raise ArgumentError.bad("adapter_path", adapter_path, "an adapter directory: "
                                    "initial_adapter converts the one adapter read from it")
        adapter_path = load_adapter(adapter_path, initial_adapter)
    if hasattr(model, "parameters") and hasattr(model, "named_modules"):
        if save_path is not None:
            raise ArgumentError.bad("save_path", save_path, "None: a model in memory is fused "
                                    "in place", hint="save it with mlx_lm's save functions, "
                                    "or pass a checkpoint path to write one")
        return fuse_model(model, adapter_path, options)
    if adapter_path is None or save_path is None:
        raise ArgumentError.bad("adapter_path" if adapter_path is None else "save_path", None,
                                "a path: a checkpoint fuse needs an adapter and an output "
                                "directory (fuse(model_path, adapter_path, save_path))")
    if float_base is not None:
        model = check_float_base(model, float_base)
    kw = dict(force=force, export_gguf=export_gguf, progress=progress)
    return fuse_checkpoint(model, adapter_path, save_path, options, **kw)


@dataclass
class _Item:
    """One tensor of the output: its plan, its source and what to do (copy | cast | fuse |
    fuse-q | dequant | replace); ``payload`` is the adapter's copy, for replace."""

    name: str
    plan: TensorSpec
    source: Optional[TensorInfo]
    action: str
    module: str = ""
    payload: Optional[Replacement] = None


_FLOATS = ("BF16", "F16", "F32")


def fuse_checkpoint(model: PathLike, adapter_path: Union[PathLike, Adapter],
                    save_path: PathLike, options: Optional[FuseOptions] = None, *,
                    force: bool = False, export_gguf: Optional[str] = None,
                    progress: Union[bool, Callable[[int, int], None]] = True) -> FuseResult:
    """Fuse an adapter into a checkpoint and write a new one (:func:`fuse`'s path for
    checkpoints). ``force`` replaces only an empty directory or a previous lorakit output;
    ``export_gguf`` also writes this GGUF file (a plain name) into the output for llama.cpp;
    ``progress`` is a bar, or a callable ``progress(done_bytes, total_bytes)``."""
    t0 = time.perf_counter()
    opts = options if options is not None else FuseOptions()
    hub_id = None if isinstance(model, Path) or os.path.exists(model) else str(model)
    ck = source.open(model, checkpoint=True)
    adapter = adapter_path if isinstance(adapter_path, Adapter) else load_adapter(adapter_path)
    out = check_output_path(save_path, protected=[ck.path, adapter.path], force=force)
    quantized = ck.quantization is not None and not opts.dequantize
    if ck.quantization and opts.dtype == "promote" and not opts.dequantize:
        raise FuseError("dtype 'promote' does not apply to a quantized base",
                        file=ck.path, expected="--dequantize with promote, or preserve",
                        found="quantized weights")
    if export_gguf is not None:
        check_gguf_export(ck.config, opts.dequantize, export_gguf)
    check_layout(opts.layout, ck.config, list(ck.tensors), ck.path, quantized)
    by_tensor = bindings_by_tensor(bind(adapter, ck))
    replaced = bind_replacements(adapter, ck, opts.dequantize)
    files = plan_sidecars(ck.extra_files(), adapter.path)
    check_tokenizer_fits(files, adapter.path, ck.config)
    fz = _Fuse(ck, adapter, by_tensor, opts, replaced, resolve(ck, by_tensor, opts, progress),
               files)
    try:
        with OutputDirectory(out, force=force) as od:
            result = fz.write(od.tmp, out, progress)
            names = list(ck.tensors)  # the transformers layout: stacked experts split, bytes kept
            if opts.layout == "transformers" and any(is_stacked(n) for n in names):
                names, dtypes, size = to_transformers(od.tmp, ck.config, INDEX_NAME)
                how = "written whole: the transformers layout splits the experts"
                result.bytes_written, result.bytes_shared = size, 0
                result.shards = {k: how for k in result.shards}
                result.tensors_total, result.dtypes_written = len(names), dict(dtypes)
            result.layout, result.layout_note = opts.layout, layout_note(opts.layout, names)
            result.tokenizer_files = tokenizer_origin(files, adapter.path)
            settings = {"adapter_sha256": adapter.sha256, "adapter_format": adapter.format,
                        **opts.settings()}
            settings.update({"quant_policy": opts.quant_policy} if fz.choices else {})
            card = ck.path / CARD_NAME
            write_model_card(od.tmp, card if card.is_file() else None, hub_id,
                             f"{ck.path.name} + {adapter.path.name}", settings,
                             ROUNDING_HELP[opts.rounding])
            if export_gguf is not None:
                write_gguf(od.tmp, export_gguf)
                result.gguf = out / export_gguf
            od.commit("fuse", settings)
    except OSError as e:  # disk full, a file vanishing under us: one clear error
        raise FuseError(f"I/O error while fusing: {e.strerror or e}",
                        file=e.filename or out, expected="readable inputs and room to write",
                        found=f"{type(e).__name__} (errno {e.errno})") from e
    result.seconds = time.perf_counter() - t0
    result.__post_init__()  # the rows and summary of what was written
    return result


@dataclass
class _Fuse:
    """One checkpoint fuse: what it reads, planned shard by shard, computed and written."""

    ck: Checkpoint
    adapter: Adapter
    by_tensor: Dict[str, List[Binding]]
    opts: FuseOptions
    replaced: Dict[str, Replacement]
    choices: Dict[str, Choice]
    files: Dict[str, Path]  # the sidecar files to copy (:func:`plan_sidecars`)

    def plan(self, infos: List[TensorInfo]) -> List[_Item]:
        """What each tensor of a shard becomes (``copy`` items keep their bytes)."""
        ck, by_tensor, replaced, policy = self.ck, self.by_tensor, self.replaced, self.opts.dtype
        items: List[_Item] = []
        for info in infos:
            name, code, shape = info.name, info.dtype, info.shape
            module = name.rsplit(".", 1)[0]
            q = ck.quant_params(module) if name.endswith((".weight", ".scales", ".biases")) else None
            act, mod, payload = "copy", "", None
            if q is not None and self.opts.dequantize:
                if not name.endswith(".weight"):
                    continue  # scales / biases disappear with the dequantized weight
                code = output_code(ck.tensors[f"{module}.scales"].dtype, policy)
                shape = tuple(shape[:-1]) + (shape[-1] * 32 // q.bits,)
                act = "replace" if name in replaced else "fuse" if name in by_tensor else "dequant"
                mod, payload = module, replaced.get(name)
            elif q is not None:
                fdt = output_code(ck.tensors[f"{module}.scales"].dtype, policy)
                pl = plan_leaf(ck, module, name, self.choices.get(module), fdt, info, by_tensor)
                if pl is not None:  # a quant policy's new shapes (float, other bits)
                    items += [_Item(name, TensorSpec(name, *p), info, "fuse-q", module) for p in pl]
                    continue
                leaf = name not in by_tensor and name.endswith((".scales", ".biases")) \
                    and f"{module}.weight" in by_tensor
                if name in by_tensor or leaf:
                    act, mod = "fuse-q", module
                    if leaf and policy != "preserve" and code in _FLOATS:
                        code = output_code(code, policy)
            elif name in replaced:  # the adapter's trained copy, in the dtype the policy gives
                act, mod, payload = "replace", module, replaced[name]
                code = output_code(code, policy) if code in _FLOATS else payload.code
            elif name in by_tensor:
                act, mod, code = "fuse", module, output_code(code, policy)
            elif policy not in ("preserve", "promote") and code in _FLOATS:
                code = output_code(code, policy)
                act = "copy" if code == info.dtype else "cast"
            items.append(_Item(name, TensorSpec(name, code, shape), info, act, mod, payload))
        return items

    def compute(self, it: _Item) -> Any:
        """The work behind one planned tensor that is not a plain copy."""
        ck, rounding, policy, src = self.ck, self.opts.rounding, self.opts.dtype, it.source
        if it.action == "cast":
            return _cast(ck.read(it.name), src.dtype, it.plan.dtype, it.name)
        if it.action == "replace":  # modules_to_save's copy, or trainable tokens' rows

            def base() -> Tuple[np.ndarray, str]:  # read only for trainable tokens
                if ck.quant_params(it.module) is None:
                    return ck.read(it.name), src.dtype
                return dequantize_raw(ck, it.module, None), ck.tensors[f"{it.module}.scales"].dtype

            raw, code = replaced_raw(it.payload, base)
            return _cast(raw, code, it.plan.dtype, it.name)
        if it.action == "dequant":
            return dequantize_raw(ck, it.module, it.plan.dtype)
        if it.action == "fuse-q":  # requant unless a quant policy chose otherwise
            binds = self.by_tensor[f"{it.module}.weight"]
            choice = self.choices.get(it.module, REQUANT)
            return module_parts(ck, it.module, binds, rounding, policy, choice)
        binds = self.by_tensor[it.name]
        own = [b.target.base_weight for b in binds if b.target.base_weight is not None]
        if own:  # the adapter carries the weight it was trained on (PEFT embedding LoRA)
            raw, code = own[0]
            if tuple(raw.shape) != tuple(src.shape):
                raise FuseError("the base weight saved in the adapter has another shape",
                                file=src.file, tensor=it.name, expected=str(list(src.shape)),
                                found=str(list(raw.shape)))
        elif ck.quant_params(it.module) is not None:  # --dequantize on a quantized base
            raw = dequantize_raw(ck, it.module, None)
            code = ck.tensors[f"{it.module}.scales"].dtype
        else:
            raw, code = _read_weight(ck, it, rounding), src.dtype
        return _fuse_float(raw, code, binds, rounding, policy, it.name)[0]

    def write(self, tmp: Path, out: Path, progress: Any) -> FuseResult:
        """Write every shard into ``tmp`` (cloned from the base where it can), then the
        sidecar files; the tensors' work runs ahead of the writer in :class:`_Jobs`."""
        ck, opts, adapter = self.ck, self.opts, self.adapter
        r = FuseResult(output=out, base=ck.path, adapter=adapter.path, options=opts,
                       dequantized=opts.dequantize and ck.quantization is not None)
        dtypes: Counter = Counter()
        weight_map: Dict[str, str] = {}
        total_bytes = shared = 0
        meta_extra = {"lorakit.version": __version__, "lorakit.adapter_sha256": adapter.sha256,
                      "lorakit.adapter_format": adapter.format, "lorakit.rounding": opts.rounding,
                      "lorakit.dtype_policy": opts.dtype,
                      "lorakit.dequantize": str(opts.dequantize).lower()}
        bar = progress_bar(progress, ck.nbytes, "lorakit fuse")
        it: Optional[_Item] = None
        try:
            for shard, infos in ck.by_shard():
                items = self.plan(infos)
                md = ck.headers[shard].metadata
                meta = {**md, "format": md.get("format", "mlx"), **meta_extra}
                # re-quantized parts of the module being written, until all three are out
                pending: Dict[str, Dict[str, np.ndarray]] = {}
                plan = [i.plan for i in items]
                with SafetensorsWriter(tmp / shard, plan, meta, clone_of=ck.headers[shard]) as w, \
                        _Jobs(self.compute, items) as jobs:
                    for k, it in enumerate(items):
                        jobs.pump()
                        if it.action == "copy":
                            w.copy(it.name, it.source)
                        elif it.action != "fuse-q":
                            w.write(it.name, jobs.result(k))
                            if it.action == "fuse":
                                r.fused_names.append(it.name)
                            elif it.action == "replace":
                                r.replaced_names.append(it.name)
                        else:
                            if it.module not in pending:
                                pending[it.module], stat = jobs.result(k)
                                r.requant.append(stat)
                                r.fused_names.append(f"{it.module}.weight")
                            w.write(it.name, pending[it.module].pop(it.name.rsplit(".", 1)[1]))
                            if not pending[it.module]:
                                del pending[it.module]
                        dtypes[it.plan.dtype] += 1
                        weight_map[it.name] = shard
                        bar.update(it.source.nbytes if it.source is not None else 0)
                total_bytes += (tmp / shard).stat().st_size
                shared, r.shards[shard] = shared + w.shared, w.how
        except LorakitError as e:
            if e.file is not None or it is None:
                raise
            # the fusion core knows the tensor, not the file: name the shard it came from
            raise e.where(it.source.file if it.source else ck.path, it.name) from None
        finally:
            bar.close()
        self.sidecars(tmp, weight_map, total_bytes)
        r.not_copied = [f"{q.name} (a link to {t}, outside the model folder)"
                        for q, t in ck.links_outside()]
        r.tensors_fused, r.tensors_total = len(r.fused_names), len(weight_map)
        r.dtypes_written, r.bytes_written, r.bytes_shared = dict(dtypes), total_bytes, shared
        return r

    def sidecars(self, tmp: Path, weight_map: Dict[str, str], total_bytes: int) -> None:
        """config.json (quantization as written), the base's other files (the adapter's
        tokenizer and chat template where it ships them), the index."""
        ck, policy = self.ck, self.opts.dtype
        config = per_layer_config(json.loads(json.dumps(ck.config)), ck, self.choices)
        if self.opts.dequantize:
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        if policy in ("bfloat16", "float16", "float32"):
            config["torch_dtype"] = policy
        for name, p in self.files.items():  # the card is written anew (as mlx-lm does)
            shutil.copyfile(p, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=4))
        if len(ck.shards) > 1 or (ck.path / INDEX_NAME).exists():
            index = {"metadata": {"total_size": total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=4))


def _read_weight(ck: Checkpoint, it: _Item, rounding: str) -> Any:
    """The base weight: raw numpy storage, or for MLX's orders a lazy ``mx.load``ed
    array (no numpy copy). A shard MLX cannot open (it also holds a dtype MLX does not
    load, such as F64) is read as raw storage instead, through MLX all the same."""
    src = it.source
    if rounding in MLX_ROUNDINGS and src.dtype in FLOAT_CODES[:3] and len(src.shape) == 2:
        import mlx.core as mx  # lazy: MLX only when computing

        try:
            return mx.load(str(src.file))[it.name]
        except (RuntimeError, ValueError):  # "[safetensor] unsupported dtype F64"
            pass
    return ck.read(it.name)


_local = threading.local()
_WORKERS = max(1, min(4, os.cpu_count() or 1))


class _Jobs:
    """Computes a shard's non-copy tensors in worker threads (each with its own MLX
    stream), at most ``_WORKERS + 1`` ahead of the writer, which emits them in file
    order: memory holds a few tensors while every core stays busy. A re-quantized
    module is one job, for its first item."""

    def __init__(self, compute: Callable[[_Item], Any], items: List[_Item]) -> None:
        self.compute, self.items, seen = compute, items, set()
        self.order: List[int] = []
        for k, it in enumerate(items):
            if it.action == "copy" or (it.action == "fuse-q" and it.module in seen):
                continue
            seen.add(it.module if it.action == "fuse-q" else None)
            self.order.append(k)
        self.pool: Optional[ThreadPoolExecutor] = None
        self.futures: Dict[int, Future] = {}
        self.next = 0

    def _run(self, k: int) -> Any:
        import mlx.core as mx  # lazy: MLX only when computing

        if getattr(_local, "stream", None) is None:
            _local.stream = mx.new_stream(mx.default_device())
        with mx.stream(_local.stream):
            return self.compute(self.items[k])

    def pump(self) -> None:
        if self.order and self.pool is None:
            self.pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="lorakit-fuse")
        while self.next < len(self.order) and len(self.futures) < _WORKERS + 1:
            j = self.order[self.next]
            self.futures[j] = self.pool.submit(self._run, j)
            self.next += 1

    def result(self, k: int) -> Any:
        if k not in self.futures:  # not submitted yet (window full of later work)
            self.pump()
        return self.futures.pop(k).result()

    def __enter__(self) -> "_Jobs":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            for f in self.futures.values():
                f.cancel()
            self.pool.shutdown(wait=True)


@dataclass(repr=False)
class FuseResult(Report):
    """What a fuse did: a :class:`~lorakit.report.Report` (a table in notebooks, ``str()``
    its text twin, ``to_dict()``); ``summary`` holds the facts, ``rows`` one row per
    re-quantized tensor of a quantized base."""

    column_help = {"tensor": "the re-quantized weight",
                   "codes_changed": "fraction of its integer codes the fuse changed",
                   "survived": "fraction of the intended delta kept (projection on it)"}

    title: str = "lorakit fuse"
    output: Path = Path()
    base: Path = Path()
    adapter: Path = Path()
    options: FuseOptions = field(default_factory=FuseOptions)
    tensors_fused: int = 0
    tensors_total: int = 0
    dtypes_written: Dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    #: of those, the bytes a clone shares with the base (written: the rest)
    bytes_shared: int = 0
    #: shard -> how it was written: "clone and patch", or "written whole: why"
    shards: Dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    dequantized: bool = False
    requant: List[RequantStat] = field(default_factory=list)
    fused_names: List[str] = field(default_factory=list)
    #: tensors written from the adapter's own copies (PEFT modules_to_save; trainable
    #: tokens: the base with those rows replaced)
    replaced_names: List[str] = field(default_factory=list)
    #: the GGUF file written into the output for llama.cpp (``export_gguf``), or None
    gguf: Optional[Path] = None
    #: the experts' layout written (mlx-lm | transformers) and who reads it
    layout: str = "mlx-lm"
    layout_note: str = ""
    #: the base's sidecar files (tokenizer etc.) left out: links out of its folder,
    #: which lorakit never follows; copy them by hand if they belong with the model
    not_copied: List[str] = field(default_factory=list)
    #: each tokenizer / chat template file written -> "adapter" (shipped there) or "base"
    tokenizer_files: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.title = f"Fused {self.adapter.name} into {self.base.name}"
        self.rows = [{"tensor": r.tensor, "codes_changed": r.codes_changed,
                      "survived": r.survived} for r in self.requant]
        self.summary = dict(self._rows())

    @property
    def rounding(self) -> str:
        return self.options.rounding

    @property
    def dtype_policy(self) -> str:
        return self.options.dtype

    @property
    def quant_policy(self) -> str:
        return self.options.quant_policy

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {k: str(getattr(self, k)) for k in ("output", "base", "adapter")}
        keys = ["rounding", "dtype_policy", "tensors_fused", "tensors_total", "dtypes_written"]
        keys += ["bytes_written", "bytes_shared", "shards", "seconds", "dequantized", "requant"]
        keys += ["fused_names", "replaced_names", "quant_policy", "layout", "layout_note"]
        d.update((k, getattr(self, k)) for k in keys + ["not_copied", "tokenizer_files"])
        d["gguf"] = str(self.gguf) if self.gguf else None
        d["requant"] = [r.__dict__ for r in self.requant]
        d["survival"] = survival_overall(self.requant) if self.requant else None
        return d

    def _rows(self) -> List[Tuple[str, str]]:
        dtypes = ", ".join(f"{k}: {v}" for k, v in sorted(self.dtypes_written.items()))
        rows = [("output", str(self.output)), ("base", str(self.base)),
                ("adapter", str(self.adapter)), ("rounding", self.rounding),
                ("dtype policy", self.dtype_policy),
                ("tensors fused", f"{self.tensors_fused} of {self.tensors_total}"),
                ("dtypes written", dtypes),
                ("output size", f"{self.bytes_written / 1e9:.3f} GB"),
                ("disk writes", self._disk()),
                ("time", f"{self.seconds:.2f} s")]
        if self.layout_note:
            rows.append(("layout", self.layout_note))
        if self.tokenizer_files:
            rows.append(("tokenizer", "; ".join(
                f"the {w}'s " + ", ".join(n for n, o in self.tokenizer_files.items() if o == w)
                for w in ("adapter", "base") if w in self.tokenizer_files.values())))
        if self.requant:
            o = survival_overall(self.requant)
            codes = f"{o['codes']:,} codes ({o['tensors']} re-quantized tensors)"
            rows.append(("codes changed", f"{o['codes_changed']:.1%} of {codes}"))
            kept = "of the intended delta (projection on it, all tensors)"
            rows.append(("delta survived", f"{o['survived']:.1%} {kept}"))
            rows += policy_summary(self.quant_policy, self.requant)
        if self.gguf:
            rows.append(("gguf", f"{self.gguf} (llama.cpp)"))
        if self.replaced_names:
            rows.append(("replaced (modules_to_save, trainable tokens)",
                         ", ".join(self.replaced_names)))
        if self.not_copied:
            rows.append(("not copied", "; ".join(self.not_copied) + ": lorakit never copies "
                         "what a link out of the model folder points at; copy it by hand "
                         "if it belongs with the model"))
        if self.dequantized:
            rows.append(("quantization", "dequantized (float weights written)"))
        return rows

    def _disk(self) -> str:
        """Bytes written and shared with the base, and which path each shard took."""
        ways: Dict[str, List[str]] = {}
        for shard, how in self.shards.items():
            ways.setdefault(how, []).append(shard)
        said = "; ".join(how + (" (every shard)" if len(ways) == 1 else f" ({', '.join(n)})")
                         for how, n in ways.items())
        return (f"{(self.bytes_written - self.bytes_shared) / 1e9:.3f} GB written, "
                f"{self.bytes_shared / 1e9:.3f} GB shared with the base; {said}")

    def __str__(self) -> str:
        rows = self._rows()
        w = max(len(k) for k, _ in rows)
        lines = [f"Fused {self.adapter.name} into {self.base.name}"] + \
            [f"  {k:<{w}}  {v}" for k, v in rows]
        if self.requant:
            lines += ["  re-quantized tensors:"] + survival_text(self.requant, "    ")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        per = ""
        if self.requant:
            per = ("<details><summary>survival per re-quantized tensor</summary>" +
                   table(survival_rows(self.requant),
                         head=["tensor", "codes changed", "delta survived"]) + "</details>")
        return (f"<div><b>lorakit fuse</b>: {escape(self.adapter.name)} &rarr; "
                f"{escape(self.output.name)}{facts_table(self._rows())}{per}</div>")

    def __repr__(self) -> str:
        return (f"FuseResult({str(self.output)!r}, {self.tensors_fused} fused, "
                f"{self.rounding}, {self.dtype_policy})")
