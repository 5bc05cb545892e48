"""The adapter lab (``lorakit.inspect.scale_sweep``, ``lorakit.inspect.layer_effects``).

scale_sweep at s = 0 is the base exactly (KL 0, not small) and at s = 1 is what
``compare_outputs`` says of base + adapter; layer_effects' numbers agree with the same
computation written out by hand on mlx-lm's own LoRA layers (``load_adapters``, one
group's scale set to 0, numpy float64 log-softmax) within float32 noise.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import DATA

BASE, LORA = str(DATA / "tiny-qwen3"), str(DATA / "adapters" / "lora")
TOKENS, CONTEXT = 256, 128

pytestmark = pytest.mark.skipif(not (DATA / "adapters" / "lora" / "adapters.safetensors")
                                .exists(), reason="embedded assets not built")


@pytest.fixture(scope="module")
def sweep():
    from lorakit.inspect import scale_sweep

    return scale_sweep(BASE, LORA, scales=(0, 0.5, 1, 2), tokens=TOKENS, context=CONTEXT,
                       prompt="And it came to pass", max_tokens=8)


@pytest.fixture(scope="module")
def effects():
    from lorakit.inspect import layer_effects

    return layer_effects(BASE, LORA, tokens=TOKENS, context=CONTEXT, by="layer")


def _logits(model, wins) -> np.ndarray:
    import mlx.core as mx

    return np.concatenate([np.array(model(mx.array(w)[None])[0, :-1].astype(mx.float32),
                                    dtype=np.float64) for w in wins])


def _kl(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    def logsoftmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lr, lt = logsoftmax(ref), logsoftmax(test)
    return (np.exp(lr) * (lr - lt)).sum(-1)


@pytest.mark.slow  # four scales over 256 tokens, greedy text
def test_scale_zero_is_the_base_and_one_is_compare_outputs(sweep) -> None:
    import lorakit

    zero, one = sweep.stats[0], sweep.stats[2]
    assert zero["base"]["mean_kl"] == 0.0 and zero["base"]["max_kl"] == 0.0
    assert one["adapter"]["mean_kl"] == 0.0 and one["adapter"]["top1_agreement"] == 1.0
    rep = lorakit.compare_outputs(BASE, (BASE, LORA), tokens=TOKENS, context=CONTEXT)
    assert one["base"]["mean_kl"] == pytest.approx(rep.mean_kl, rel=1e-4)
    assert one["base"]["top1_agreement"] == pytest.approx(rep.top1_agreement, abs=2 / rep.tokens)
    assert one["base"]["ppl_test"] == pytest.approx(rep.ppl_test, rel=1e-4)
    np.testing.assert_allclose(sweep.arrays[2]["kl_base"], rep.arrays["kl"], rtol=1e-3,
                               atol=1e-5)
    # the dose-response is monotone on both sides of 1 for this adapter
    kl_base = [r["kl_base"] for r in sweep.rows]
    assert kl_base == sorted(kl_base)
    assert sweep.rows[1]["kl_adapter"] > sweep.rows[2]["kl_adapter"] < sweep.rows[3]["kl_adapter"]


@pytest.mark.slow
def test_sweep_report_views(sweep) -> None:
    assert [r["scale"] for r in sweep.rows] == [0, 0.5, 1, 2]
    assert len(sweep.texts) == 4 and sweep.texts[0] != sweep.texts[2]
    text, html = str(sweep), sweep._repr_html_()
    assert "kl_adapter" in text and "\n  0.5 " in text and "<table>" in html
    d = sweep.to_dict()
    assert d["scales"] == [0, 0.5, 1, 2] and len(d["stats"][1]["base"]["mean_kl_interval"]) == 2
    assert sweep.plot().axes


@pytest.mark.slow  # hand computation: 2 windows through mlx-lm's own LoRA layers x 4
def test_layer_effects_match_mlx_lm_by_hand(effects) -> None:
    import mlx_lm
    from mlx_lm.utils import load_adapters

    from lorakit.inspect.behaviour import windows
    from lorakit.io.formats.corpus import encode_text, read_corpus

    model, tok = mlx_lm.load(BASE)[:2]
    model = load_adapters(model, LORA)
    model.eval()
    wins = windows(encode_text(tok, read_corpus(None)[0]), CONTEXT, TOKENS)
    lora = {n: m for n, m in model.named_modules() if "lora_a" in m}
    trained = {n: m.scale for n, m in lora.items()}

    def run(keep) -> np.ndarray:
        for n, m in lora.items():
            m.scale = trained[n] if keep(n) else 0.0
        return _logits(model, wins)

    full, base = run(lambda n: True), run(lambda n: False)
    row = next(r for r in effects.rows if r["group"] == "1")
    in1 = lambda n: ".layers.1." in f".{n}."  # noqa: E731
    without = run(lambda n: not in1(n))
    alone = run(in1)
    assert row["kl_removed"] == pytest.approx(_kl(full, without).mean(), rel=2e-3)
    assert row["kl_alone"] == pytest.approx(_kl(base, alone).mean(), rel=2e-3)
    assert effects.whole["removed"]["mean_kl"] == pytest.approx(_kl(full, base).mean(), rel=2e-3)


@pytest.mark.slow
def test_layer_effects_report(effects) -> None:
    s = effects.summary
    assert [r["group"] for r in effects.rows] == ["0", "1", "2", "3"]
    assert s["gap_removed"] == pytest.approx(s["whole_removed"] - s["sum_removed"])
    assert all(r["modules"] == 7 and r["kind"] == "all" for r in effects.rows)
    labels, kinds, grid = effects.grid()
    assert labels == ["0", "1", "2", "3"] and kinds == ["all"] and grid.shape == (4, 1)
    assert "kl_removed" in str(effects) and "<table>" in effects._repr_html_()
    assert effects.to_dict()["whole"]["alone"]["mean_kl"] == s["whole_alone"]
    assert effects.plot().axes and effects.plot(key="kl_alone").axes


@pytest.mark.slow  # loads the model twice
def test_a_loaded_model_is_given_back_as_it_came() -> None:
    import mlx_lm

    from lorakit.fusion import attach_adapter
    from lorakit.inspect import layer_effects, scale_sweep

    pair = mlx_lm.load(BASE)[:2]
    scale_sweep(pair, LORA, scales=(0.5,), tokens=TOKENS, context=CONTEXT)
    assert not [n for n, m in pair[0].named_modules() if "lora_a" in m]
    attached = (attach_adapter(mlx_lm.load(BASE)[0], LORA), pair[1])
    by_kind = layer_effects(attached, None, tokens=TOKENS, context=CONTEXT, by="kind")
    assert [r["group"] for r in by_kind.rows][:3] == ["q", "k", "v"]
    scales = [m.scale for n, m in attached[0].named_modules() if "lora_a" in m]
    assert len(scales) == 28 and set(scales) == {20.0}


def test_bad_arguments_are_argument_errors() -> None:
    from lorakit.errors import ArgumentError
    from lorakit.inspect import layer_effects, scale_sweep

    with pytest.raises(ArgumentError, match="by"):
        layer_effects(BASE, LORA, by="head")
    with pytest.raises(ArgumentError, match="scales"):
        scale_sweep(BASE, LORA, scales=())


@pytest.mark.slow
def test_dora_is_refused_with_the_layer_named() -> None:
    from lorakit.errors import AdapterError
    from lorakit.inspect import scale_sweep

    with pytest.raises(AdapterError, match="DoRA") as e:
        scale_sweep(BASE, str(DATA / "adapters" / "dora"), scales=(1,), tokens=TOKENS,
                    context=CONTEXT)
    assert "layers." in str(e.value)


def test_groups_by_layer_kind_module() -> None:
    from lorakit.inspect.lab import _groups

    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj",
             "model.layers.1.self_attn.q_proj"]
    assert _groups(names, "layer") == {"0": [0, 1], "1": [2]}
    assert _groups(names, "kind") == {"q": [0, 2], "up": [1]}
    assert list(_groups(names, "module")) == names
