"""Exact text twins: ``str(report)`` of every report class, character for character.

Each report is built on the embedded assets in data/ (tiny-qwen3 and its adapters,
fused into a temporary folder that the test works in, so every path in a report is
the short relative one), or, where the report holds timings, constructed from fixed
numbers (``DecodeTiming.from_dict``; a real ``FuseResult`` with its seconds fixed).
The expected texts are the files in ``tests/text_twins/``; a change to any report's
text is a visible diff there. After an intended change, rewrite them with
``LORAKIT_BLESS_TWINS=1 pytest tests/project/test_text_twins.py`` and review the diff.

The HTML twin (``_repr_html_``) is checked as a smoke test only.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
from helpers import DATA

TWINS = Path(__file__).resolve().parents[1] / "text_twins"
BLESS = os.environ.get("LORAKIT_BLESS_TWINS") == "1"
BASE, LORA, DORA = "data/tiny-qwen3", "data/adapters/lora", "data/adapters/dora"

pytestmark = pytest.mark.skipif(not (DATA / "adapters" / "lora" / "adapters.safetensors")
                                .exists(), reason="embedded assets not built")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder holding a link to data/ and three fuses of the embedded LoRA."""
    import lorakit

    root = tmp_path_factory.mktemp("twins")
    (root / "data").symlink_to(DATA, target_is_directory=True)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        res = lorakit.fuse(BASE, LORA, "fused", progress=False)
        lorakit.fuse(BASE, LORA, "fused-mlx", rounding="mlx-lm", progress=False)
        lorakit.fuse(BASE, LORA, "fused-f32", dtype="promote", progress=False)
    finally:
        os.chdir(cwd)
    (root / "fuse_result").write_text(str(dataclasses.replace(
        res, output=Path("fused"), seconds=0.25,  # and the same path on every file system
        shards={"model.safetensors": "written whole: this file system cannot clone (ENOTSUP)"},
        bytes_shared=0)))
    return root


def _fuse_result(work: Path) -> str:
    return (work / "fuse_result").read_text()


def _decode_timing(work: Path) -> Any:
    from lorakit.timing.table import DecodeTiming

    dev = {"device": "cpu", "backend": "cpu", "kind": "cpu", "mlx": "0.0.0",
           "mlx_lm": "0.0.0", "python": "3.11.7"}
    common = dict(peak_source="rss", device=dev, generated=4)
    variants = [
        dict(variant="base", prefill_tps=[900.0, 1000.0, 1100.0], decode_tps=[200.0, 210.0, 190.0],
             ttft_s=[0.010, 0.012, 0.011], peak_bytes=2_000_000_000,
             weight_bytes={"BF16": 1_500_000_000}, tokens=[5, 6, 7, 8], **common),
        dict(variant="unfused", prefill_tps=[800.0, 850.0], decode_tps=[150.0, 160.0],
             ttft_s=[0.014, 0.015], peak_bytes=2_100_000_000,
             weight_bytes={"BF16": 1_500_000_000, "F32": 20_000_000}, lora_modules=28,
             tokens=[5, 9, 9, 9], **common),
        dict(variant="fused", prefill_tps=[990.0], decode_tps=[205.0], ttft_s=[0.0105],
             peak_bytes=2_000_000_000, weight_bytes={"BF16": 1_500_000_000},
             tokens=[5, 9, 9, 1], **common),
        dict(variant="promoted", prefill_tps=[700.0], decode_tps=[120.0], ttft_s=[0.02],
             peak_bytes=3_000_000_000, weight_bytes={"BF16": 900_000_000, "F32": 1_200_000_000},
             tokens=[5, 9, 9, 9], **common),
        dict(variant="mlx-lm-fused", error="mlx_lm fuse failed: out of disk"),
    ]
    settings = {"model": "models/tiny-qwen3", "adapter_path": "adapters/lora",
                "prompt_tokens": 128, "tokens": 64, "repeats": 3, "warmup": 1}
    return DecodeTiming.from_dict({"settings": settings, "variants": variants})


def _files_report(work: Path) -> Any:
    """check's files section on a fuse whose EOS id and chat template were changed."""
    import json
    import shutil

    from lorakit.inspect.check import check

    bad = work / "fused-files"
    shutil.copytree(work / "fused", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=7)))
    tok = json.loads((bad / "tokenizer_config.json").read_text())
    tok["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (bad / "tokenizer_config.json").write_text(json.dumps(tok))
    return _in(lambda: check("fused-files", BASE, LORA, check_untouched=False).files)(work)


def _in(fn: Callable[[], Any]) -> Callable[[Path], Any]:
    """``fn`` run with the work folder as the working directory."""

    def run(w: Path) -> Any:
        cwd = os.getcwd()
        os.chdir(w)
        try:
            return fn()
        finally:
            os.chdir(cwd)

    return run


def _builders() -> Dict[str, Callable[[Path], Any]]:
    import numpy as np

    from lorakit.algebra.combine import combine
    from lorakit.algebra.extract import extract, resize
    from lorakit.inspect.adapters import compare_adapters
    from lorakit.inspect.behaviour import compare_outputs
    from lorakit.inspect.check import check
    from lorakit.inspect.deltas import delta_norms
    from lorakit.inspect.diff import diff, ulp_tensors, ulp_vs_reference
    from lorakit.inspect.dtypes import dtype_map
    from lorakit.inspect.generation import compare_generations
    from lorakit.inspect.lab import LabSession, layer_effects, scale_sweep

    def lab_point():
        with LabSession(BASE, LORA, tokens=64, context=64) as lab:
            return lab.point(0.5, lab.names[:1], prompt="And it came to pass", max_tokens=8)

    return {
        "FuseResult": _fuse_result,
        "DecodeTiming": _decode_timing,
        "DtypeMap": _in(lambda: dtype_map("fused-f32")),  # flags the f32 projections
        "DiffReport": _in(lambda: diff("fused", "fused-mlx")),
        "UlpReport": _in(lambda: diff("fused", "fused-mlx").ulp_report()),
        "UlpReport-tensors": lambda w: ulp_tensors(
            np.array([0x3F80, 0x0000, 0x8001, 0x3F80], np.uint16),
            np.array([0x3F81, 0x8000, 0x0001, 0x3F90], np.uint16), "bf16"),
        "RefUlpReport": _in(lambda: ulp_vs_reference("fused-mlx", BASE, LORA)),
        "CheckReport": _in(lambda: check("fused", BASE, LORA)),
        "FilesReport": _files_report,
        "DeltaNorms": _in(lambda: delta_norms(DORA, BASE)),
        "AdapterComparison": _in(lambda: compare_adapters(LORA, DORA, BASE)),
        "ExtractReport": _in(lambda: extract(BASE, "fused", rank=8,
                                             modules=["self_attn.q_proj"], progress=False)),
        "ResizeReport": _in(lambda: resize(LORA, energy=0.9)),
        "Combination": _in(lambda: combine([LORA, "data/adapters/lora-embed"], [0.7, 0.3],
                                           method="cat")),
        "BehaviourReport": _in(lambda: compare_outputs(BASE, (BASE, LORA), tokens=256,
                                                        context=64)),
        "GenerationReport": _in(lambda: compare_generations(
            {"base": BASE, "adapter": (BASE, LORA), "fused": "fused"},
            ["And it came to pass"], max_tokens=8)),
        "ScaleSweep": _in(lambda: scale_sweep(BASE, LORA, scales=(0, 0.5, 1), tokens=128, context=64,
                                              prompt="And it came to pass", max_tokens=8)),
        "LayerEffects": _in(lambda: layer_effects(BASE, LORA, tokens=128, context=64, by="layer")),
        "LabPoint": _in(lab_point),
    }


NAMES = ["FuseResult", "DecodeTiming", "DtypeMap", "DiffReport", "UlpReport",
         "UlpReport-tensors", "RefUlpReport", "CheckReport", "FilesReport", "DeltaNorms", "AdapterComparison",
         "GenerationReport", "ExtractReport", "ResizeReport", "Combination", "BehaviourReport",
         "ScaleSweep", "LayerEffects", "LabPoint"]


@pytest.fixture(scope="module")
def built(work: Path) -> Callable[[str], Any]:
    """Each report built once for the module (its text, HTML and column tests read the
    same object; none of them changes it)."""
    cache: Dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = _builders()[name](work)
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_text_twin_is_exact(name: str, built) -> None:
    rep = built(name)
    text = rep if isinstance(rep, str) else str(rep)
    path = TWINS / f"{name}.txt"
    if BLESS:
        TWINS.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    expected = path.read_text()[:-1]  # the file ends in one newline the text lacks
    assert text == expected, f"str() of {name} changed; see {path}"


@pytest.mark.parametrize("name", [n for n in NAMES if n != "FuseResult"])
def test_html_twin_smoke(name: str, built) -> None:
    import html

    rep = built(name)
    out = rep._repr_html_()
    assert out.startswith("<div") and out.endswith("</div>") and "<table" in out
    assert html.escape(rep.title) in out


@pytest.mark.parametrize("name", [n for n in NAMES if n != "FuseResult"])
def test_every_column_is_explained(name: str, built) -> None:
    """Each column a report shows has a one-line explanation: the header's hover text
    in HTML and a line of the legend under the text table."""
    import html
    import re

    rep = built(name)
    cols = rep.cols()
    help = type(rep).column_help
    assert cols and all(help.get(c, "").strip() for c in cols), \
        f"{name}: columns without an explanation: {[c for c in cols if not help.get(c)]}"
    heads = re.findall(r"<th title='([^']*)'>([^<]*)</th>", rep._repr_html_())
    assert [h for _, h in heads] == [html.escape(c) for c in cols]
    assert all(t == html.escape(help[c], quote=True) for (t, _), c in zip(heads, cols))
    legend = str(rep).split("\n  columns:\n", 1)[1].splitlines()
    w = max(len(c) for c in cols)
    assert legend == [f"    {c.ljust(w)}  {help[c]}" for c in cols]


def test_fuse_result_html_smoke(work: Path) -> None:
    import lorakit

    cwd = os.getcwd()
    os.chdir(work)
    try:
        res = lorakit.fuse(BASE, LORA, "fused-html", progress=False)
    finally:
        os.chdir(cwd)
    out = res._repr_html_()
    assert "<table>" in out and "lora" in out and "fused-html" in out


def test_every_report_class_has_a_twin() -> None:
    """A new Report subclass needs a twin here."""
    import re

    pkg = Path(__file__).resolve().parents[2] / "lorakit"
    classes = set()
    for f in pkg.rglob("*.py"):
        classes |= set(re.findall(r"^class (\w+)\((?:\w+\.)?Report\)", f.read_text(), re.M))
    covered = {n.split("-")[0] for n in NAMES}
    assert classes - covered == set(), f"report classes without a text twin: {classes - covered}"
