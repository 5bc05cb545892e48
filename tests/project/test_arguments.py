"""A bad argument to a public verb is always ArgumentError, naming the argument, the value
and what is allowed, and it is refused before any work (no model is loaded here)."""
from __future__ import annotations

from pathlib import Path

import pytest

import lorakit
from lorakit.errors import ArgumentError

DATA = Path(__file__).resolve().parents[2] / "data"
MODEL, LORA = DATA / "tiny-qwen3", DATA / "adapters" / "lora"


def _fuse(tmp: Path, **kw):
    return lorakit.fuse(MODEL, LORA, tmp / "out", progress=False, **kw)


def _time_decode(tmp: Path, **kw):
    return lorakit.time_decode(MODEL, LORA, progress=False, **kw)


def _combine(tmp: Path, **kw):
    return lorakit.combine([LORA, LORA], kw.pop("weights", [0.5, 0.5]), **kw)


def _check(tmp: Path, **kw):
    return lorakit.check(MODEL, MODEL, LORA, progress=False, **kw)


def _diff(tmp: Path, **kw):
    return lorakit.diff(MODEL, MODEL, progress=False, **kw)


CASES = [  # verb, the argument named, keywords
    (_fuse, "rounding", {"rounding": "fastest"}),
    (_fuse, "dtype", {"dtype": "float8"}),
    (_fuse, "layout", {"layout": "hf"}),
    (_fuse, "quant_policy", {"quant_policy": "bits:7"}),
    (_fuse, "quant_policy", {"quant_policy": "learned:dwq"}),
    (_fuse, "quant_budget", {"quant_budget": -1.0}),
    (_time_decode, "variants", {"variants": ["base", "nope"]}),
    (_time_decode, "variants", {"variants": ["base", "base"]}),
    (_time_decode, "prompt_tokens", {"prompt_tokens": 0}),
    (_time_decode, "tokens", {"tokens": 0}),
    (_time_decode, "repeats", {"repeats": 0}),
    (_time_decode, "warmup", {"warmup": -1}),
    (_time_decode, "rounds", {"rounds": 0}),
    (_time_decode, "device", {"device": "tpu"}),
    (_time_decode, "seed", {"seed": -1}),
    (_time_decode, "timeout", {"timeout": 0}),
    (_time_decode, "behaviour", {"behaviour": 1}),
    (_combine, "method", {"method": "average"}),
    (_combine, "method", {"method": "dare_ties", "like": "peft"}),
    (_combine, "like", {"like": "mergekit"}),
    (_combine, "base_dtype", {"base_dtype": "F8"}),
    (_combine, "majority_sign_method", {"majority_sign_method": "vote"}),
    (_combine, "rank", {"method": "svd", "rank": 0}),
    (_combine, "density", {"method": "ties", "density": 1.5}),
    (_combine, "density", {"method": "ties"}),
    (_combine, "seed", {"method": "dare_linear", "density": 0.5}),
    (_combine, "svd_clamp", {"method": "svd", "svd_clamp": 0.9}),
    (_combine, "weights", {"weights": [1.0]}),
    (_check, "behaviour", {"behaviour": 1}),
    (_diff, "max_bin", {"max_bin": 4}),
]


@pytest.mark.parametrize("verb, name, kw", CASES,
                         ids=[f"{v.__name__[1:]}-{n}-{i}" for i, (v, n, _) in enumerate(CASES)])
def test_a_bad_argument_is_an_argument_error_naming_it(tmp_path, verb, name, kw):
    with pytest.raises(ArgumentError) as e:
        verb(tmp_path, **kw)
    assert e.value.message == f"bad value for {name}"
    assert e.value.expected and e.value.found is not None
    assert not (tmp_path / "out").exists()


def test_options_objects_are_the_verbs_settings():
    from lorakit.algebra.combine import CombineOptions
    from lorakit.timing.decode import DecodeOptions

    assert DecodeOptions(variants=["base"]).variants == ("base",)
    with pytest.raises(ArgumentError, match="for tokens"):
        DecodeOptions(tokens=True)
    with pytest.raises(ArgumentError, match="for seed"):
        CombineOptions(method="dare_ties", density=0.5)
    assert CombineOptions(method="dare_ties", density=0.5, seed=1).seed == 1
