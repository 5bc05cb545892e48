"""The public API: nine verbs and the error type, the rest in their packages, nothing heavy
on import."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import lorakit

ROOT = Path(__file__).resolve().parents[2]
VERBS = ["fuse", "check", "diff", "open", "load_adapter", "combine", "extract", "time_decode",
         "compare_outputs"]
#: package -> the verbs it exports besides the top-level ones
PACKAGE_VERBS = {"inspect": ["dtype_map", "delta_norms", "compare_adapters", "compare_generations",
                             "ulp_vs_reference", "scale_sweep", "layer_effects"],
                 "algebra": ["convert", "resize"],
                 "fusion": ["attach_adapter", "FuseOptions", "FuseResult"]}
#: names that are gone: synonyms and deprecated spellings of the verbs above
GONE = ["compare", "parity", "ulp_compare", "merge_check", "fuse_model", "Checkpoint",
        "open_checkpoint", "Adapter", "FuseResult", "synth_checkpoint", "synth_adapter",
        "dtype_map", "convert", "resize", "attach_adapter"]


def test_top_level_is_the_verbs_and_the_error_type():
    assert sorted(dir(lorakit)) == sorted(VERBS + ["LorakitError", "__version__"])
    assert "open" not in lorakit.__all__  # a star import must not shadow the builtin
    for name in VERBS:
        assert callable(getattr(lorakit, name)), name


def test_readme_lists_every_verb():
    text = (ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", text, re.M)
    assert sorted(listed) == sorted(VERBS + ["LorakitError"])


@pytest.mark.parametrize("old", GONE)
def test_old_names_are_gone(old):
    with pytest.raises(AttributeError, match=f"no attribute '{old}'"):
        getattr(lorakit, old)


@pytest.mark.parametrize("package", sorted(PACKAGE_VERBS))
def test_package_verbs(package):
    import importlib

    pkg = importlib.import_module(f"lorakit.{package}")
    assert sorted(pkg.__all__) == sorted(PACKAGE_VERBS[package])
    for name in PACKAGE_VERBS[package]:
        assert callable(getattr(pkg, name)), name
    assert getattr(lorakit, package) is pkg  # reachable as lorakit.<package>


def test_one_function_behind_each_verb():
    """A verb is one function: no second spelling of it in its module."""
    from lorakit.inspect import check, diff

    assert lorakit.check is check.check and lorakit.diff is diff.diff
    assert not hasattr(diff, "parity") and not hasattr(diff, "ulp_compare")
    assert not hasattr(check, "merge_check")


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lorakit.nope  # noqa: B018


def test_import_is_light():
    code = ("import sys, lorakit; heavy = ('numpy', 'mlx', 'matplotlib', 'ipywidgets', "
            "'jupyter_client', 'tqdm'); print([m for m in heavy if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_cli_parser_is_light():
    """``lorakit --help`` and argument errors build the whole parser, every subcommand's
    flags included, without loading an array library (start-up within ~0.1 s)."""
    code = ("import sys; from lorakit.cli.main import build_parser; build_parser(); "
            "heavy = ('numpy', 'mlx', 'matplotlib', 'ipywidgets', 'tqdm'); "
            "print([m for m in heavy if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_open_gives_one_source_face():
    ck = lorakit.open(ROOT / "data" / "tiny-qwen3")
    ad = lorakit.open(ROOT / "data" / "adapters" / "lora")
    f = lorakit.open(ROOT / "data" / "adapters" / "lora" / "adapters.safetensors")
    from lorakit.io.formats.source import TensorSource

    for src, kind in ((ck, "checkpoint"), (ad, "adapter"), (f, "file")):
        assert isinstance(src, TensorSource)
        assert src.kind == kind
        name = next(iter(src.tensors))
        assert src.read(name).shape == tuple(src.tensors[name].shape)
    assert ck.dtype == "BF16" and ad.dtype == "F32"
    with pytest.raises(lorakit.LorakitError, match="does not exist"):
        lorakit.open(ROOT / "data" / "no-such-model")


def test_fuse_takes_a_model_in_memory():
    from lorakit.errors import ArgumentError

    mlx_lm = pytest.importorskip("mlx_lm")
    model, _ = mlx_lm.load(str(ROOT / "data" / "tiny-qwen3"))
    before = model.model.layers[0].self_attn.q_proj.weight
    out = lorakit.fuse(model, ROOT / "data" / "adapters" / "lora")
    after = out.model.layers[0].self_attn.q_proj.weight
    assert out is model and after.dtype == before.dtype
    with pytest.raises(ArgumentError, match="in place"):
        lorakit.fuse(model, ROOT / "data" / "adapters" / "lora", "somewhere")
