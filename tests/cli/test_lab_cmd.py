"""``lorakit scale-sweep``, ``lorakit layer-effects`` and ``compare-outputs --base``: thin
callers of the lab's verbs, their JSON the reports' ``to_dict()``."""
from __future__ import annotations

import json

import pytest
from helpers import DATA

BASE, LORA = str(DATA / "tiny-qwen3"), str(DATA / "adapters" / "lora")


@pytest.mark.slow  # three verbs over the embedded model
def test_lab_commands_json(capsys) -> None:
    from lorakit.cli.main import main

    common = ["--model", BASE, "--adapter-path", LORA, "--tokens", "128", "--json"]
    assert main(["scale-sweep", *common, "--scales", "0", "1"]) == 0
    sweep = json.loads(capsys.readouterr().out)
    assert sweep["scales"] == [0, 1] and sweep["rows"][0]["kl_base"] == 0
    assert main(["layer-effects", *common, "--by", "kind"]) == 0
    fx = json.loads(capsys.readouterr().out)
    assert fx["by"] == "kind" and [r["group"] for r in fx["rows"]][:2] == ["q", "k"]
    assert main(["compare-outputs", BASE, BASE, "--ref-adapter", LORA, "--base", BASE,
                 "--tokens", "256", "--context", "128", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["effect_kept"] == 0 and rep["base"] == BASE
