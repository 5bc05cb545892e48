"""AdapterMixer without a browser: move sliders, click, assert on state.

The live numbers are checked against deltas formed here in float64 (the widget never
forms them); the mix it would generate and write is the exact weighted sum."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ipywidgets")

from helpers import DATA  # noqa: E402

import lorakit  # noqa: E402
from lorakit.widgets import AdapterMixer  # noqa: E402

ADS = {"lora": DATA / "adapters" / "lora", "embed": DATA / "adapters" / "lora-embed",
       "peft": DATA / "adapters" / "peft-lora"}


def _deltas(path) -> dict:
    return {t.module: t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64))
            for t in lorakit.load_adapter(path).targets}


def _mix(weights) -> dict:
    out: dict = {}
    for w, path in zip(weights, ADS.values()):
        for m, d in _deltas(path).items():
            out[m] = out.get(m, 0) + w * d
    return out


@pytest.fixture(scope="module")
def mixer():
    return AdapterMixer(ADS, base=DATA / "tiny-qwen3", weights=[0.5, 0.25, 0.25])


def test_live_norms_match_the_formed_deltas(mixer):
    for weights in ([0.5, 0.25, 0.25], [1.0, -0.5, 0.0], [0.0, 0.0, 2.0]):
        mixer.set_weights(weights)
        assert mixer.weights == weights
        mix = _mix(weights)
        total = np.sqrt(sum(float(np.sum(d * d)) for d in mix.values()))
        assert mixer.stats["total"] == pytest.approx(total, rel=1e-9)
        rows = {r["module"]: r["mix"] for r in mixer.stats["rows"]}
        for m, d in mix.items():
            assert rows[m] == pytest.approx(float(np.linalg.norm(d)), rel=1e-9, abs=1e-12)
        parent = _deltas(ADS["embed"])
        dist = np.sqrt(sum(float(np.sum((mix[m] - parent.get(m, 0)) ** 2)) for m in mix))
        assert mixer.stats["distance"]["embed"] == pytest.approx(dist, rel=1e-9)


def test_a_slider_move_refreshes_the_view(mixer):
    mixer.set_weights([0.5, 0.25, 0.25])
    before = mixer.summary.value
    mixer.sliders[0].value = 1.0
    assert mixer.summary.value != before
    assert mixer.stats["total"] == pytest.approx(
        np.sqrt(sum(float(np.sum(d * d)) for d in _mix([1.0, 0.25, 0.25]).values())), rel=1e-9)


def test_one_parent_alone_is_that_parent(mixer):
    mixer.set_weights([0.0, 1.0, 0.0])
    assert mixer.stats["cosine"]["embed"] == pytest.approx(1.0, abs=1e-12)
    assert mixer.stats["distance"]["embed"] == pytest.approx(0.0, abs=1e-6)
    assert mixer.stats["cosine"]["lora"] < 1.0 - 1e-3  # a different adapter is not


def test_the_mix_is_the_weighted_sum(mixer):
    mixer.set_weights([0.7, 0.3, -0.2])
    got = {t.module: t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64))
           for t in mixer.mix().targets}
    want = _mix([0.7, 0.3, -0.2])
    assert set(got) == set(want)
    for m in want:
        assert np.abs(got[m] - want[m]).max() <= 1e-6 * np.abs(want[m]).max()


def test_write_without_a_path_shows_an_error(mixer, tmp_path):
    mixer.save_path.value = ""
    mixer.write_button.click()
    assert "ArgumentError" in mixer.error.value and "output directory" in mixer.error.value
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_greedy_text_of_base_mix_and_parents(mixer):
    mixer.set_weights([1.0, 0.0, 0.0])
    mixer.prompt.value = "And it came to pass"
    mixer.generate_button.click()
    rep = mixer.generations
    assert rep is not None and mixer.error.value == ""
    assert [r["model"] for r in rep.rows] == ["base", "mix", "lora", "embed", "peft"]
    text = {r["model"]: r["text"] for r in rep.rows}
    assert text["mix"] == text["lora"]  # weight 1 on lora alone is lora
