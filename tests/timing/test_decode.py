"""Decode timing machinery (not speed): variants differ where they should, the unfused
variant runs the adapter, numbers are sane, results serialise, live hooks work."""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
from model_factory import make_adapter, make_model

from lorakit.errors import ArgumentError
from lorakit.io.formats.safetensors import read_header
from lorakit.timing.decode import time_decode
from lorakit.timing.table import VARIANTS, DecodeTiming, VariantTiming

KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPT, TOKENS, REPEATS = 12, 16, 2


DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The embedded trained model and adapter when present, else a random pair."""
    model, adapter = DATA / "tiny-qwen3", DATA / "adapters" / "lora"
    if not (model / "config.json").exists() or not (adapter / "adapters.safetensors").exists():
        root = tmp_path_factory.mktemp("timing")
        model = make_model(root / "model", "qwen3")
        # a strong adapter, so greedy tokens show whether it ran
        adapter = make_adapter(model, root / "adapter", keys=KEYS, rank=8, scale=4.0,
                               b_std=0.5)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["lora_parameters"]["keys"] == list(KEYS)
    return model, adapter, int(cfg["num_layers"]) * len(KEYS)


@pytest.fixture(scope="module")
def timing(assets):
    model, adapter, _ = assets
    seen = []
    t = time_decode(model, adapter, prompt_tokens=PROMPT, tokens=TOKENS, repeats=REPEATS,
                    rounds=2, device="cpu", progress=False, on_result=seen.append)
    return t, seen


@pytest.mark.slow  # runs decode timing workers
def test_every_variant_ran_and_hook_saw_each(timing):
    t, seen = timing
    assert [v.variant for v in t.variants] == list(VARIANTS)
    assert [v.variant for v in seen] == list(VARIANTS) + list(VARIANTS[1:]) + [VARIANTS[0]]
    assert all(v.ok for v in t.variants), [v.error for v in t.variants]


@pytest.mark.slow  # runs decode timing workers
def test_numbers_positive_and_finite(timing):
    t, _ = timing
    for v in t.variants:
        for xs in (v.prefill_tps, v.decode_tps, v.ttft_s):
            assert len(xs) == REPEATS * 2  # two rounds pooled
            assert all(math.isfinite(x) and x > 0 for x in xs), (v.variant, xs)
        assert sorted(set(v.run_rounds)) == [0, 1] and len(v.run_rounds) == REPEATS * 2
        assert v.peak_bytes > 0 and v.rss_peak_bytes > 0
        # end-of-sequence never cuts a run short
        assert v.generated == TOKENS and len(v.tokens) == TOKENS
        assert v.device["kind"] == "cpu" and v.peak_source == "rss"
        assert v.peak_bytes == v.rss_peak_bytes
    assert t.ratio("base") == 1.0 and t.ratio("base", "peak") == 1.0
    assert math.isfinite(t.ratio("fused")) and t.ratio("fused") > 0
    lo, hi = t.interval("fused")
    assert 0 < lo <= hi and math.isfinite(hi)  # two rounds: an interval from both
    assert "paired over 2 interleaved rounds" in t.summary["noise"]
    assert "on CPU" in t.summary["on this device"] and "tiny" in t.summary["on this device"]
    assert "fused" not in [t.rows[i]["variant"] for i in t.flagged]


@pytest.mark.slow  # runs decode timing workers
def test_weight_dtypes_and_bytes_differ_by_variant(timing, assets):
    t, _ = timing
    _, adapter, _ = assets
    base, unfused = t.variant("base"), t.variant("unfused")
    promoted, fused, mlx_fused = t.variant("promoted"), t.variant("fused"), t.variant(
        "mlx-lm-fused")
    assert set(base.weight_bytes) == {"BF16"}
    # the promotion bug: fused projections stored as float32, more bytes in all
    assert promoted.weight_bytes.get("F32", 0) > 0
    assert promoted.weights_total > base.weights_total
    assert "float32" in promoted.param_bytes
    # a dtype-kept fuse has exactly the base's bytes and dtypes, as has mlx_lm fuse's
    assert fused.weight_bytes == base.weight_bytes
    assert mlx_fused.weight_bytes == base.weight_bytes
    assert set(fused.param_bytes) == {"bfloat16"}
    # unfused: base plus the f32 adapter
    adapter_bytes = sum(i.nbytes for i in read_header(adapter / "adapters.safetensors")
                        .tensors.values())
    assert unfused.weights_total == base.weights_total + adapter_bytes
    assert unfused.weight_bytes["F32"] == adapter_bytes


@pytest.mark.slow  # runs decode timing workers
def test_unfused_runs_the_adapter(timing, assets):
    t, _ = timing
    assert t.variant("unfused").lora_modules == assets[2]
    assert all(t.variant(n).lora_modules == 0 for n in VARIANTS if n != "unfused")
    assert t.variant("unfused").tokens != t.variant("base").tokens
    # a fused checkpoint decodes like the adapter, not like the base
    fused = t.variant("fused").tokens
    assert fused != t.variant("base").tokens
    assert fused[:4] == t.variant("unfused").tokens[:4]


@pytest.mark.slow  # runs decode timing workers
def test_json_round_trip(timing):
    t, _ = timing
    back = DecodeTiming.from_json(t.to_json())
    assert [v.to_dict() for v in back.variants] == [v.to_dict() for v in t.variants]
    assert str(back) == str(t)
    assert back.settings == t.settings
    d = json.loads(t.to_json())
    assert d["rows"][0]["variant"] == "base" and d["settings"]["tokens"] == TOKENS


@pytest.mark.slow  # runs decode timing workers
def test_renders_table_html_and_plot(timing):
    t, _ = timing
    text = str(t)
    for word in ("decode tok/s", "peak x base", "weight dtypes", "promoted", "mlx-lm-fused",
                 "process peak RSS", "F32"):
        assert word in text
    assert "<table>" in t._repr_html_()
    assert repr(t).startswith("<DecodeTiming:")
    fig = t.plot()
    assert len(fig.axes) == 2
    assert len(fig.axes[0].patches) == len(VARIANTS)


@pytest.mark.slow  # runs decode timing workers
def test_background_thread_and_cancel(assets):
    model, adapter, _ = assets
    cancel = threading.Event()
    seen = []

    def on_result(v: VariantTiming) -> None:
        seen.append(v.variant)
        cancel.set()  # stop after the first variant

    out = {}
    th = threading.Thread(target=lambda: out.setdefault("t", time_decode(
        model, adapter, variants=["base", "fused"], prompt_tokens=4, tokens=4, repeats=1,
        device="cpu", progress=False, on_result=on_result, cancel=cancel)))
    th.start()
    th.join(timeout=120)
    assert not th.is_alive()
    assert seen == ["base"] and [v.variant for v in out["t"].variants] == ["base"]


def test_bad_arguments(assets):
    model, adapter, _ = assets
    with pytest.raises(ArgumentError, match="variants"):
        time_decode(model, adapter, variants=["base", "nope"], progress=False)
    with pytest.raises(ArgumentError, match="adapter_path(.|\n)*need an adapter"):
        time_decode(model, None, variants=["fused"], progress=False)
    with pytest.raises(ArgumentError, match="tokens"):
        time_decode(model, adapter, tokens=0, progress=False)


def test_variant_that_cannot_be_made_is_reported(tmp_path):
    model = make_model(tmp_path / "q", "qwen3", quantize={"group_size": 32, "bits": 4})
    adapter = make_adapter(model, tmp_path / "qa", keys=("self_attn.q_proj",))
    made = []
    t = time_decode(model, adapter, variants=["promoted"], progress=False,
                    on_result=made.append)
    assert len(made) == 1  # tried once, not once per round
    v = t.variant("promoted")
    assert not v.ok and "promote" in v.error
    assert "error" in str(t)


@pytest.mark.slow  # runs decode timing workers
def test_cli_bench_json(assets, capsys):
    from lorakit.cli.main import main

    model, _, _ = assets
    rc = main(["time-decode", "--model", str(model), "--variants", "base", "--prompt-tokens", "4",
               "--tokens", "4", "--repeats", "1", "--rounds", "1", "--device", "cpu", "--json",
               "-q"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    (v,) = d["variants"]
    assert v["variant"] == "base" and len(v["decode_tps"]) == 1 and v["generated"] == 4


@pytest.mark.slow  # runs decode timing workers
def test_rounds_rotate_and_pool(assets, monkeypatch):
    """rounds=3: every variant runs once per round, in rotated orders, in a fresh
    process each time; runs are pooled; the fused checkpoint is made once."""
    import lorakit.timing.decode as dec

    model, adapter, _ = assets
    order, made = [], []
    real_worker, real_prepare = dec._run_worker, dec._prepare

    def worker(spec, *a, **k):
        order.append(Path(spec["model"]).name)
        return real_worker(spec, *a, **k)

    def prepare(variant, *a, **k):
        made.append(variant)
        return real_prepare(variant, *a, **k)

    monkeypatch.setattr(dec, "_run_worker", worker)
    monkeypatch.setattr(dec, "_prepare", prepare)
    seen = []
    t = time_decode(model, adapter, variants=["base", "fused"], prompt_tokens=4, tokens=4,
                    repeats=2, rounds=3, device="cpu", progress=False,
                    on_result=seen.append)
    base = Path(model).name
    assert order == [base, "fused", "fused", base, base, "fused"]
    assert made == ["fused"]  # kept between rounds, removed at the end
    assert [v.variant for v in t.variants] == ["base", "fused"]
    for v in t.variants:
        assert v.ok and len(v.decode_tps) == len(v.prefill_tps) == len(v.ttft_s) == 6
    assert len(seen) == 6 and seen[-1].variant == "fused" and len(seen[-1].decode_tps) == 6
    assert t.settings["rounds"] == 3
    with pytest.raises(ArgumentError, match="rounds"):
        time_decode(model, adapter, variants=["base"], rounds=0, progress=False)


# -- the noise-aware verdict: false-alarm and miss rates on simulated timings --------------
def _simulated(effect, rng, rounds=3, reps=3, s_round=0.1, s_proc=0.05, s_run=0.05):
    """Decode tok/s of base and a variant ``effect`` x as fast: a slow phase of the
    machine per round (shared), a per-process factor and per-run jitter (log-normal)."""
    b, v, rb, rv = [], [], [], []
    for r in range(rounds):
        f = math.exp(rng.gauss(0, s_round))
        pb, pv = math.exp(rng.gauss(0, s_proc)), math.exp(rng.gauss(0, s_proc))
        for _ in range(reps):
            b.append(100 * f * pb * math.exp(rng.gauss(0, s_run)))
            v.append(100 * effect * f * pv * math.exp(rng.gauss(0, s_run)))
            rb.append(r)
            rv.append(r)
    return b, rb, v, rv


def _flag_rate(effect, trials=40, **noise):
    from lorakit.timing.stats import noise_band, ratio_interval, speed_verdict

    rng, flagged = __import__("random").Random(7), 0
    for i in range(trials):
        b, rb, v, rv = _simulated(effect, rng, **noise)
        ci = ratio_interval(v, rv, b, rb, resamples=200, seed=i)
        band = noise_band(b, rb, resamples=200, seed=i)
        ratio = sorted(v)[len(v) // 2] / sorted(b)[len(b) // 2]
        flagged += speed_verdict(ratio, ci, rounds=3, noise=band)[0]
    return flagged / trials


@pytest.mark.parametrize("noise", [{}, {"s_round": 0.3, "s_proc": 0.15}],
                         ids=["moderate-noise", "shared-machine-noise"])
def test_same_speed_is_not_flagged(noise):
    """False alarms: equal speeds under noise flagged in at most 1 trial in 20."""
    assert _flag_rate(1.0, **noise) <= 0.05


def test_h200_sized_slowdown_is_flagged():
    """Misses: a 0.64x variant (the seed's promoted fuse) under moderate noise is
    flagged in at least 9 trials of 10."""
    assert _flag_rate(0.64) >= 0.9


def test_verdict_words_and_threshold():
    from lorakit.timing.stats import bytes_verdict, speed_verdict

    assert speed_verdict(0.95, (0.93, 0.97), rounds=3)[0] is False  # real, but < 10%
    assert speed_verdict(0.80, (0.60, 1.05), rounds=3)[0] is False  # interval reaches 1
    assert speed_verdict(0.80, (0.75, 0.85), rounds=3)[0] is True
    # inside what the base does against itself: not flagged
    flag, words = speed_verdict(0.80, (0.75, 0.85), rounds=3, noise=(0.5, 2.0))
    assert not flag and "base against itself 0.50-2.00" in words
    assert bytes_verdict(1.0, 0) == (False, "")
    assert bytes_verdict(1.82, 9_440_000) == (True, "1.82x weight bytes (f32 9.44 MB)")


def test_too_few_rounds_never_flag_speed():
    """False alarms from two rounds: both can be slow by chance, and the interval over
    two rounds then lies below 1; a speed flag needs MIN_ROUNDS rounds."""
    from lorakit.timing.stats import MIN_ROUNDS, speed_verdict

    assert MIN_ROUNDS == 3
    for rounds in (1, 2):
        flag, words = speed_verdict(0.80, (0.75, 0.85), rounds=rounds, noise=(0.95, 1.05))
        assert flag is False and "too few rounds" in words
    assert speed_verdict(0.80, (0.75, 0.85), rounds=3, noise=(0.95, 1.05))[0] is True
