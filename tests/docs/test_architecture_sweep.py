"""BENCHMARKS.md's "Every mlx-lm architecture" section is the committed sweep JSON
(benchmarks/results/architectures.json), and the JSON is consistent with itself: its
summary is what its rows say, every mlx-lm model module is in it, and every failure has
an owner and its error text; none is lorakit's (issue 26)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "architectures.json"
HEADING = "## Every mlx-lm architecture"


def _doc():
    return json.loads(RESULTS.read_text())


def _sweep():
    spec = importlib.util.spec_from_file_location("architectures",
                                                  ROOT / "benchmarks" / "architectures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _section() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text()
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:end if end > 0 else len(text)]


def test_benchmarks_counts_are_the_json_summary():
    summary = _doc()["summary"]
    rows = dict(re.findall(r"^\| [^|]*\(`(\w+)`\) \| (\d+) \|", _section(), re.M))
    assert rows, "no count rows in the section"
    assert {k: int(v) for k, v in rows.items()} == {k: summary[k] for k in rows}
    for key in ("tried", "built", "lora_bit_identical", "dtypes_kept", "check_0_wrong",
                "forward_runs", "failures_lorakit", "failures_mlx_lm"):
        assert key in rows, f"BENCHMARKS.md does not state {key}"


def test_benchmarks_names_the_command():
    assert "python benchmarks/architectures.py" in _section()


def test_benchmarks_section_is_what_the_json_renders():
    """The whole section, the failures table included: `python
    benchmarks/architectures.py --out benchmarks/results/architectures.json --markdown`."""
    assert _section().rstrip() == _sweep().markdown(_doc()).rstrip()


def test_readme_states_the_sweep_counts():
    """README.md's sentence of the sweep's counts is what the JSON renders (line breaks
    aside): `--readme-line` prints it."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    line = " ".join(_sweep().readme_line(_doc()).split())
    assert line in readme


def test_summary_is_what_the_rows_say():
    doc = _doc()
    assert _sweep().summarize(doc["rows"]) == doc["summary"]


def test_every_model_module_is_tried_and_no_failure_is_lorakits():
    doc = _doc()
    names = {r["module"] for r in doc["rows"]}
    assert doc["summary"]["tried"] == len(doc["rows"]) == len(names)
    assert not names & set(doc["not_models"])
    assert doc["summary"]["failures_lorakit"] == 0
    for r in doc["rows"]:
        for step, v in r["steps"].items():
            if not v["ok"]:
                assert v["owner"] in ("mlx-lm", "tiny config") and v["error"], (r["module"], step)


def test_every_module_of_the_installed_mlx_lm_is_in_the_json():
    """rows + modules without Model/ModelArgs (helpers such as cache, rope_utils) are
    exactly the files of mlx_lm/models (listed, not imported)."""
    import importlib.util as iu
    from importlib.metadata import version

    import pytest

    spec = iu.find_spec("mlx_lm")
    if spec is None:
        pytest.skip("mlx-lm is not installed")
    doc = _doc()
    if version("mlx-lm") != doc["mlx_lm"]:
        pytest.skip(f"the JSON is of mlx-lm {doc['mlx_lm']}, installed {version('mlx-lm')}")
    files = {p.stem for p in Path(spec.submodule_search_locations[0], "models").glob("*.py")
             if p.stem != "__init__"}
    assert {r["module"] for r in doc["rows"]} | set(doc["not_models"]) == files
