"""`lorakit inspect`, `lorakit diff` and `lorakit check` from the command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorakit.cli.main import main


@pytest.fixture(scope="module")
def paths(qwen3, qwen3_fused) -> dict:
    """The shared qwen3 base, adapter and its nearest / mlx-lm / promoted fuses."""
    return {"base": qwen3["base"], "ad": qwen3["ad"], "near": qwen3_fused["nearest"],
            "mlx": qwen3_fused["mlx-lm"], "f32": qwen3_fused["promote"]}


def run(capsys, *argv: str):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_checkpoint_and_adapter(paths: dict, capsys) -> None:
    code, out, _ = run(capsys, "inspect", paths["f32"])
    assert code == 0 and "expected dtype: BF16" in out
    assert sum(ln.startswith("!") for ln in out.splitlines()) == 6  # the promoted weights
    code, out, _ = run(capsys, "inspect", paths["f32"], "--json")
    data = json.loads(out)
    assert len(data["dtype_map"]["flagged"]) == 6
    code, out, _ = run(capsys, "inspect", paths["ad"], "--model", paths["base"], "--json")
    data = json.loads(out)
    assert set(data) == {"dtype_map", "delta_norms"}
    assert len(data["delta_norms"]["rows"]) == 6 and data["delta_norms"]["rows"][0]["rel"] > 0


def test_diff_exit_codes_and_json(paths: dict, capsys) -> None:
    code, out, _ = run(capsys, "diff", paths["near"], paths["near"])
    assert code == 0 and "identical" in out
    code, out, _ = run(capsys, "diff", paths["near"], paths["mlx"])
    assert code == 1
    table = [ln for ln in out.splitlines() if ln.startswith("! ")]
    assert len(table) == 6 and all("differs" in ln for ln in table)  # equal rows hidden
    code, out, _ = run(capsys, "diff", paths["near"], paths["f32"], "--json")
    data = json.loads(out)
    assert code == 1 and data["diff"]["summary"]["dtype mismatches"] == 6
    code, out, _ = run(capsys, "diff", paths["near"], paths["mlx"], "--adapter-path", paths["ad"],
                       "--model", paths["base"], "--json")
    data = json.loads(out)
    assert data["reference_a"]["summary"]["not correctly rounded"] == 0
    assert data["reference_b"]["summary"]["not correctly rounded"] == \
        data["diff"]["summary"]["elements differing"]


def test_check(paths: dict, capsys) -> None:
    code, out, _ = run(capsys, "check", "--model", paths["base"], "--adapter-path", paths["ad"],
                       "--save-path", paths["near"])
    assert code == 0 and "status: ok" in out and "exit code: 0" in out
    code, out, _ = run(capsys, "check", "--model", paths["base"], "--adapter-path", paths["ad"],
                       "--save-path", paths["base"], "--json")
    assert code == 1
    rows = json.loads(out)["check"]["rows"]
    assert {r["verdict"] for r in rows} == {"not applied"}


def test_check_takes_fuse_s_flag_names(paths: dict, capsys) -> None:
    """One vocabulary: check reads --model / --adapter-path / --save-path like fuse."""
    code, out, _ = run(capsys, "check", "--model", paths["base"], "--adapter-path", paths["ad"],
                       "--save-path", paths["near"])
    assert code == 0 and "status: ok" in out
    code, _, _ = run(capsys, "check", "--model", paths["base"], "--adapter-path", paths["ad"],
                     "--save-path", paths["base"])
    assert code == 1


def test_errors_are_one_message(paths: dict, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "lorakit", "diff", str(paths["near"]),
                           str(tmp_path / "missing")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("lorakit diff: error:") and "Traceback" not in proc.stderr


def test_inspect_and_diff_take_fuse_s_flag_names(paths: dict, capsys) -> None:
    """One vocabulary across subcommands: inspect, diff and check read --model /
    --adapter-path / --save-path as fuse does; the old spellings are gone."""
    new = run(capsys, "inspect", paths["ad"], "--model", paths["base"], "--json")
    assert new[0] == 0 and "delta_norms" in json.loads(new[1])
    new = run(capsys, "diff", paths["near"], paths["mlx"], "--adapter-path", paths["ad"],
              "--model", paths["base"], "--json")
    assert new[0] == 1 and "reference_a" in json.loads(new[1])
    for argv in (("inspect", paths["ad"], "--base", paths["base"]),
                 ("diff", paths["near"], paths["mlx"], "--adapter", paths["ad"]),
                 ("check", "--fused", paths["near"], "--model", paths["base"],
                  "--adapter-path", paths["ad"])):
        with pytest.raises(SystemExit) as e:
            run(capsys, *argv)
        assert e.value.code == 2  # argparse: unrecognized arguments
    # one without the other is refused, in the new names
    code, _, err = run(capsys, "diff", paths["near"], paths["mlx"], "--model", paths["base"])
    assert code == 2 and "--adapter-path and --model go together" in err
