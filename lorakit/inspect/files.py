"""The folder around the tensors: a fused folder's other files against what they should be.

What they should be is what :func:`lorakit.fuse` writes
(:func:`lorakit.io.outputs.sidecars.plan_sidecars`): the base's files, with the tokenizer
and chat template the adapter folder ships in place of the base's. Every JSON file is
compared field by field (where and by which transformers it was written aside; a field
left out agrees with null, false, empty or GenerationConfig's default), any other file
byte for byte; ``config.json`` likewise, less its dtype and quantization blocks and the
fields only the fused one has (a writer's defaults filled in); a ``quantization`` block
over float weights is stale. A finding names the file, the field, what was expected and what was
found; any finding makes :meth:`CheckReport.exit_code` :data:`FILES_EXIT` when the
tensors pass.

>>> import lorakit
>>> _ = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
>>> lorakit.check("fused", "data/tiny-qwen3", "data/adapters/lora").files.rows
[]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..io.formats.checkpoint import INDEX_NAME
from ..io.outputs.model_card import CARD_NAME
from ..io.outputs.provenance import PROVENANCE
from ..io.outputs.sidecars import TOKENIZER_FILES, plan_sidecars, tokenizer_origin
from ..report import Report

__all__ = ["FilesReport", "check_files", "FILES_EXIT"]

#: exit status of ``lorakit check`` when the tensors pass and a file does not
FILES_EXIT = 4
_IGNORED = ("transformers_version", "_name_or_path", "is_local", "local_files_only")  # how loaded
_QUANT = ("quantization", "quantization_config")
_WEIGHTS = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_PER_FILE = 12  # differences listed per file before one row counts the rest
_ABSENT = "(absent)"
#: transformers 5 saves a fast tokenizer's class under a new name: the same tokenizer
_SAME_CLASS = {"PreTrainedTokenizerFast", "TokenizersBackend"}


#: transformers' GenerationConfig defaults (its writer leaves out a field holding one)
_GENERATION = {"use_cache": True, "num_beams": 1, "do_sample": False, "temperature": 1.0,
               "top_k": 50, "top_p": 1.0, "max_length": 20, "repetition_penalty": 1.0,
               "num_return_sequences": 1}


def _unset(k: str, v: Any, defaults: Dict[str, Any]) -> bool:
    """A value that means the default: a field holding it and a field left out agree."""
    return v is None or v is False or v in ("", [], {}) or (k in defaults and v == defaults[k])


@dataclass(repr=False)
class FilesReport(Report):
    """One row per finding (none on a right fuse): ``file``, ``field``, ``expected``,
    ``found`` and ``finding`` (missing, extra, stale quantization, chat template, EOS,
    special token, tokenizer, generation config, config)."""

    column_help = {"file": "the file in the fused folder",
                   "field": "the JSON field (dotted path) that differs, if any",
                   "expected": "what it should be (the base's, or the adapter's tokenizer)",
                   "found": "what the fused folder holds",
                   "finding": "what kind of difference it is"}


def check_files(fused: Path, base: Any, adapter_dir: Optional[Path],
                quantized: bool) -> FilesReport:
    """The files of ``fused`` (a folder) against those a fuse of ``base`` (a Checkpoint)
    with the adapter in ``adapter_dir`` writes; ``quantized``: whether the fused folder's
    weights are quantized (a ``quantization`` block over float ones is stale)."""
    plan = plan_sidecars(base.extra_files() + [p for p, _ in base.links_outside()],
                         adapter_dir)
    rows: List[Dict[str, Any]] = []
    notes: List[str] = []
    for name, src in plan.items():
        got = fused / name
        if not got.is_file() and name == "special_tokens_map.json" and \
                (fused / "tokenizer_config.json").is_file():  # transformers 5 keeps
            rows += _tokens_moved(src, fused / "tokenizer_config.json")  # them there
            notes.append("special tokens in tokenizer_config.json only (transformers 5)")
        elif not got.is_file():
            rows.append(_row(name, "", "present", "missing", "missing"))
        else:
            rows += _compare(name, src, got)
    own = set(plan) | {"config.json", CARD_NAME, PROVENANCE, INDEX_NAME}
    for p in sorted(fused.iterdir()):
        if p.is_file() and p.name not in own and not p.name.startswith(".") \
                and not p.name.endswith(_WEIGHTS):
            rows.append(_row(p.name, "", _ABSENT, "present", "extra"))
    rows += _config_rows(base.path / "config.json", fused / "config.json", quantized)
    origin = tokenizer_origin(plan, adapter_dir)
    rep = FilesReport(title=f"files of {fused.name}", rows=rows,
                      columns=["file", "field", "expected", "found", "finding"],
                      flagged=list(range(len(rows))))
    rep.summary = {"compared": len(plan) + 1, "findings": len(rows),
                   "tokenizer from": "the adapter" if "adapter" in origin.values()
                   else "the base"}
    if notes:
        rep.summary["re-saved"] = "; ".join(notes)
    return rep


def _tokens_moved(want: Path, config: Path) -> List[Dict[str, Any]]:
    """special_tokens_map.json left out (transformers 5 writes none): each of its tokens
    must be in ``config`` (tokenizer_config.json) as it was."""
    def content(v: Any) -> Any:
        return v.get("content", v) if isinstance(v, dict) else v

    have = json.loads(config.read_text())
    return [_row("special_tokens_map.json", k, *_shown(content(v), content(have.get(k, _ABSENT))),
                 _kind("special_tokens_map.json", k))
            for k, v in json.loads(want.read_text()).items() if content(v) != content(have.get(k))]


def _row(file: str, fld: str, expected: Any, found: Any, finding: str) -> Dict[str, Any]:
    return {"file": file, "field": fld, "expected": expected, "found": found,
            "finding": finding}


def _kind(file: str, fld: str) -> str:
    last = fld.rsplit(".", 1)[-1]
    if "chat_template" in file or "chat_template" in last:
        return "chat template"
    if "eos" in last:
        return "EOS"
    if last.endswith("_token") or last.endswith("special_tokens"):
        return "special token"
    if file in TOKENIZER_FILES:
        return "tokenizer"
    return file.rsplit(".", 1)[0].replace("_", " ")


def _compare(name: str, want: Path, got: Path) -> List[Dict[str, Any]]:
    """The differences of one file: JSON field by field, anything else whole."""
    a, b = want.read_bytes(), got.read_bytes()
    if a == b:
        return []
    if name.endswith(".json"):
        try:
            gen = _GENERATION if name == "generation_config.json" else {}
            diffs = list(_diffs(json.loads(a), json.loads(b), "", defaults=gen))
        except (ValueError, UnicodeDecodeError) as e:
            return [_row(name, "", "valid JSON", f"unreadable: {e}", "unreadable")]
    else:
        diffs = [("", a.decode(errors="replace"), b.decode(errors="replace"))]
    rows = [_row(name, f, *_shown(x, y), _kind(name, f)) for f, x, y in diffs[:_PER_FILE]]
    if len(diffs) > _PER_FILE:
        rows.append(_row(name, "...", "", f"{len(diffs) - _PER_FILE} more differences",
                         _kind(name, "")))
    return rows


def _diffs(a: Any, b: Any, path: str, added: bool = True,
           defaults: Dict[str, Any] = {}) -> Iterator[Tuple[str, Any, Any]]:
    """(dotted field, expected, found) for each leaf where two JSON values differ; a field
    on one side only counts unless it holds a default (``added=False``: unless it is the
    found side's: a writer filling in its defaults)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            x, y = a.get(k, _ABSENT), b.get(k, _ABSENT)
            if k in _IGNORED or (x is _ABSENT and (_unset(k, y, defaults) or not added)) or \
                    (y is _ABSENT and _unset(k, x, defaults)):
                continue
            yield from _diffs(x, y, f"{path}.{k}" if path else k, added, defaults)
    elif a != b and not (isinstance(a, str) and isinstance(b, str) and {a, b} == _SAME_CLASS):
        yield path, a, b


def _shown(a: Any, b: Any, width: int = 60) -> Tuple[str, str]:
    """Both sides short enough for a table cell; long texts from where they first differ."""
    sa, sb = (x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in (a, b))
    if max(len(sa), len(sb)) <= width:
        return sa, sb
    i = next((k for k, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
    i = max(0, i - 10)

    def cut(s: str) -> str:
        part = s[i:i + width]
        return f"{len(s)} chars, from {i}: {part!r}" if i or len(s) > width else part

    return cut(sa), cut(sb)


def _config_rows(want: Path, got: Path, quantized: bool) -> List[Dict[str, Any]]:
    """config.json: every field but the dtype and quantization; a quantization block over
    float weights is stale (quantized weights without one do not open: a FormatError)."""
    if not got.is_file():
        return [_row("config.json", "", "present", "missing", "missing")]
    a, b = (json.loads(p.read_text()) if p.is_file() else {} for p in (want, got))
    rows = [_row("config.json", k, "absent: the weights are float", json.dumps(b[k])[:60],
                 "stale quantization") for k in _QUANT if k in b and not quantized]
    skip = set(_QUANT) | {"torch_dtype", "dtype"}
    a, b = ({k: v for k, v in c.items() if k not in skip} for c in (a, b))
    return rows + [_row("config.json", f, *_shown(x, y), _kind("config.json", f))
                   for f, x, y in _diffs(a, b, "", added=False)]
