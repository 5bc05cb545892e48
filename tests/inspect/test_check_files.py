"""The folder around the tensors: ``fuse`` writes the tokenizer and chat template the
adapter ships (the base's otherwise) and says whose; ``check``'s files section finds
each defect by name (miss tests) and is silent on every correct fuse (false-alarm
tests). The cases are benchmarks/files_check.py's, run once here."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from helpers import DATA, REPO, run_cli

import lorakit
from lorakit.errors import FuseError

BASE, LORA = DATA / "tiny-qwen3", DATA / "adapters" / "lora"
spec = importlib.util.spec_from_file_location("files_bench", REPO / "benchmarks/files_check.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
CORRECT = list(bench.correct({k: Path() for k in ("base-files", "lora-tokenizer",
                                                   "lora-template", "mlx-lm")}))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def cases(root: Path) -> dict:
    return {r["case"]: r for r in bench.run(root / "bench")["cases"]}


@pytest.mark.parametrize("name", CORRECT)
def test_a_correct_fuse_is_silent(cases: dict, name: str) -> None:
    assert cases[name]["found"] == [], cases[name]


@pytest.mark.parametrize("name", list(bench.DEFECTS))
def test_each_defect_is_found_and_named(cases: dict, name: str) -> None:
    r = cases[name]
    assert tuple(r["expected"]) in r["found"] and r["exit code"] == 4, r


def test_fuse_writes_the_adapter_tokenizer_and_says_so(root: Path) -> None:
    x = bench.inputs(root / "in")
    res = lorakit.fuse(BASE, x["lora-tokenizer"], root / "tok", progress=False)
    shipped = ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json",
               "tokenizer_config.json"]
    assert res.tokenizer_files == {n: "adapter" for n in shipped}
    for n in shipped:
        assert (root / "tok" / n).read_bytes() == (x["lora-tokenizer"] / n).read_bytes()
    assert "tokenizer       the adapter's chat_template.jinja, special_tokens_map" in str(res)
    assert "the adapter&#x27;s" in res._repr_html_()
    assert json.loads(json.dumps(res.to_dict()))["tokenizer_files"] == res.tokenizer_files
    # a template alone replaces only the template: the tokenizer stays the base's
    res = lorakit.fuse(x["base-files"], x["lora-template"], root / "tpl", progress=False)
    assert res.tokenizer_files["chat_template.jinja"] == "adapter"
    assert res.tokenizer_files["tokenizer.json"] == "base"
    assert (root / "tpl" / "generation_config.json").is_file()
    # the base's alone
    res = lorakit.fuse(BASE, LORA, root / "plain", progress=False)
    assert set(res.tokenizer_files.values()) == {"base"}


def test_a_tokenizer_larger_than_the_embedding_is_refused(root: Path) -> None:
    ad = root / "big-tokenizer"
    shutil.copytree(LORA, ad)
    t = json.loads((BASE / "tokenizer.json").read_text())
    t["added_tokens"].append(dict(t["added_tokens"][-1], id=2048, content="<|new|>"))
    (ad / "tokenizer.json").write_text(json.dumps(t))
    with pytest.raises(FuseError, match="does not fit the model's embedding") as e:
        lorakit.fuse(BASE, ad, root / "big", progress=False)
    assert "2049 token ids" in str(e.value) and "at most 2048" in str(e.value)
    assert not (root / "big").exists()
    r = run_cli("fuse", "--model", BASE, "--adapter-path", ad, "--save-path", root / "big", "-q")
    assert r.returncode == 2 and "tokenizer.json" in r.stderr and not (root / "big").exists()


def test_cli_exit_status_and_report(root: Path) -> None:
    good = lorakit.fuse(BASE, LORA, root / "cli", progress=False).output
    bad = root / "cli-eos"
    shutil.copytree(good, bad)
    bench._edit(bad / "config.json", eos_token_id=7)
    args = ("--model", BASE, "--adapter-path", LORA, "--skip-untouched")
    r = run_cli("check", "--save-path", good, *args)
    assert r.returncode == 0 and "files: as they should be (4 compared" in r.stdout, r.stdout + r.stderr
    r = run_cli("check", "--save-path", bad, *args, "--json")
    assert r.returncode == 4, r.stdout + r.stderr
    d = json.loads(r.stdout)["check"]
    assert d["summary"]["exit code"] == 4 and d["summary"]["status"] == "ok"
    assert d["files"]["rows"] == [{"file": "config.json", "field": "eos_token_id",
                                   "expected": "0", "found": "7", "finding": "EOS"}]
    r = run_cli("check", "--save-path", bad, *args)
    assert "files of cli-eos" in r.stdout and "eos_token_id" in r.stdout
    # a wrong merge keeps its own status: the tensors first
    r = run_cli("check", "--save-path", bad, "--model", BASE, "--adapter-path",
                DATA / "adapters" / "dora", "--skip-untouched")
    assert r.returncode == 1 and "eos_token_id" in r.stdout


def test_no_folder_no_files_section(root: Path) -> None:
    good = lorakit.fuse(BASE, LORA, root / "one", progress=False).output
    rep = lorakit.check(good / "model.safetensors", BASE, LORA, check_untouched=False,
                        progress=False)
    assert rep.files is None and rep.summary["files"].startswith("not compared")
    assert rep.exit_code() == 0
