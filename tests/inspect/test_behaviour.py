"""Behaviour on a corpus (``lorakit.compare_outputs``, ``lorakit compare-outputs``): per-token KL,
top-1 agreement, perplexity.

Checked against an independent straightforward computation (mlx-lm's model, full
logits to numpy float64, log-softmax and KL by hand over the same windows); both
ways a verdict can go wrong are tested: identical models give exactly 0 (no false
alarm), a fused adapter is far closer than the base, and a small perturbation of
one weight is seen (no miss).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA

ROOT = Path(__file__).resolve().parents[2]
BASE, LORA = str(DATA / "tiny-qwen3"), str(DATA / "adapters" / "lora")
CORPUS = DATA / "corpora" / "fortunes" / "valid.jsonl"

pytestmark = pytest.mark.skipif(not (DATA / "adapters" / "lora" / "adapters.safetensors")
                                .exists(), reason="embedded assets not built")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(model, tokenizer) of the base, the unfused adapter (mlx-lm's load_adapters)
    and lorakit's fuse; loaded once."""
    import mlx_lm
    from mlx_lm.utils import load_adapters

    import lorakit

    out = tmp_path_factory.mktemp("behaviour") / "fused"
    lorakit.fuse(BASE, LORA, out, progress=False)
    base = mlx_lm.load(BASE)[:2]
    unfused_model, tok = mlx_lm.load(BASE)[:2]
    unfused = (load_adapters(unfused_model, LORA), tok)
    unfused[0].eval()
    fused = mlx_lm.load(str(out))[:2]
    return {"base": base, "unfused": unfused, "fused": fused, "fused_path": out}


def _independent(ref, test, text: str, tokens: int, context: int):
    """The scoring written out plainly: numpy float64 log-softmax on full logits."""
    import mlx.core as mx

    ids = ref[1].encode(text)[:tokens]
    n = len(ids) // context
    kls, agree, tied = [], [], []
    for w in range(n):
        x = mx.array(ids[w * context:(w + 1) * context])[None]
        lr = np.array(ref[0](x)[0, :-1].astype(mx.float32)).astype(np.float64)
        lt = np.array(test[0](x)[0, :-1].astype(mx.float32)).astype(np.float64)
        pr = lr - lr.max(-1, keepdims=True)
        pr -= np.log(np.exp(pr).sum(-1, keepdims=True))
        pt = lt - lt.max(-1, keepdims=True)
        pt -= np.log(np.exp(pt).sum(-1, keepdims=True))
        kls.append((np.exp(pr) * (pr - pt)).sum(-1))
        ir, it = lr.argmax(-1), lt.argmax(-1)
        rows = np.arange(len(ir))
        agree.append(ir == it)
        # one model's argmax among the other's tokens at its largest logit
        tied.append((ir == it) | (lr[rows, it] == lr.max(-1)) | (lt[rows, ir] == lt.max(-1)))
    return np.concatenate(kls), np.concatenate(agree), np.concatenate(tied)


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_fused_is_far_closer_than_base(models) -> None:
    from lorakit import compare_outputs

    fused = compare_outputs(models["unfused"], models["fused"], tokens=2048, context=256)
    base = compare_outputs(models["unfused"], models["base"], tokens=2048, context=256)
    assert fused.tokens == base.tokens == 8 * 255
    assert fused.mean_kl * 1000 <= base.mean_kl, (fused.mean_kl, base.mean_kl)
    # The issue asks >= 99.5%. Counting a model's tied top tokens (bf16 logits tie
    # exactly; argmax then takes the lower id) as its top tokens: measured 99.90% (2
    # of 2040 positions differ); argmax alone (llama.cpp's rule) 98.92%, its 20 other
    # flips all exact ties (the embedded adapter of the first build: 99.95%, 99.12%).
    assert fused.top1_agreement >= 0.995, fused.top1_agreement
    assert fused.top1_agreement_strict >= 0.985
    assert fused.top1_agreement_strict <= fused.top1_agreement
    assert base.top1_agreement < 0.9  # the adapter changes behaviour: the check can fail


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_matches_independent_computation(models) -> None:
    from lorakit import compare_outputs
    from lorakit.inspect.behaviour import read_corpus

    text = read_corpus(CORPUS)[0]
    for test in ("base", "fused"):
        rep = compare_outputs(models["unfused"], models[test], CORPUS, tokens=1024,
                              context=128)
        kl, agree, tied = _independent(models["unfused"], models[test], text, 1024, 128)
        assert rep.tokens == kl.size == 8 * 127
        assert abs(rep.mean_kl - kl.mean()) <= 1e-3 * kl.mean(), (test, rep.mean_kl, kl.mean())
        assert rep.top1_agreement_strict == pytest.approx(agree.mean(), abs=2 / kl.size)
        assert rep.top1_agreement == pytest.approx(tied.mean(), abs=2 / kl.size)
        if test == "base":  # per token too, where KL is far above float32 cancellation
            np.testing.assert_allclose(rep.arrays["kl"], kl, rtol=1e-3, atol=1e-5)


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_identical_models_give_exactly_zero(models) -> None:
    from lorakit import compare_outputs

    rep = compare_outputs(models["base"], models["base"], tokens=512, context=128)
    assert rep.mean_kl == 0 and rep.max_kl == 0 and rep.top1_agreement == 1
    assert rep.ppl_ref == rep.ppl_test
    assert np.all(rep.arrays["kl"] == 0)


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_a_small_perturbation_is_seen(models) -> None:
    """No miss: one projection of the base scaled by 1% moves KL off zero."""
    import mlx.core as mx
    import mlx_lm

    from lorakit import compare_outputs

    model, tok = mlx_lm.load(BASE)[:2]
    q = model.layers[0].self_attn.q_proj
    q.weight = (q.weight.astype(mx.float32) * 1.01).astype(q.weight.dtype)
    rep = compare_outputs(models["base"], (model, tok), tokens=512, context=128)
    assert rep.mean_kl > 0 and rep.max_kl > 1e-6


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_paths_and_adapters_load(models) -> None:
    """Path specs with an adapter attached (through attach_adapter) score like the
    loaded models; a PEFT adapter loads too."""
    from lorakit import compare_outputs

    a = compare_outputs(BASE, BASE, tokens=256, context=128, test_adapter=LORA)
    b = compare_outputs(models["base"], models["unfused"], tokens=256, context=128)
    assert a.mean_kl == pytest.approx(b.mean_kl, rel=1e-5)
    assert "lora" in a.summary["test"]
    p = compare_outputs(BASE, (BASE, str(DATA / "adapters" / "peft-lora")), tokens=256,
                        context=128)
    assert p.mean_kl > 0


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_report_keys_arrays_and_twins(models) -> None:
    from lorakit import compare_outputs

    rep = compare_outputs(models["base"], models["unfused"], tokens=512, context=128,
                          detail=100)
    d = json.loads(rep.to_json())
    for k in ("mean_kl", "median_kl", "p90_kl", "p99_kl", "p999_kl", "max_kl",
              "top1_agreement", "top1_agreement_strict", "ppl_ref", "ppl_test", "tokens",
              "context", "corpus",
              "corpus_sha256", "models"):
        assert k in d, k
    n = rep.tokens
    for k in ("kl", "ref_top1", "test_top1", "ref_nll", "test_nll", "top1_agree", "target"):
        assert rep.arrays[k].shape == (n,), k
    assert rep.arrays["ref_top_ids"].shape == (100, 5)
    assert len(rep.pieces) == 100 and len(rep.ref_top_pieces[0]) == 5
    # top candidates agree with the per-token top-1
    assert np.array_equal(rep.arrays["ref_top_ids"][:, 0], rep.arrays["ref_top1"][:100])
    assert np.array_equal(rep.arrays["test_top_ids"][:, 0], rep.arrays["test_top1"][:100])
    # perplexity from the per-token NLLs
    assert rep.ppl_ref == pytest.approx(np.exp(rep.arrays["ref_nll"].astype(float).mean()))
    assert rep.rows[0]["kl"] == pytest.approx(rep.max_kl)
    assert "mean_kl" in str(rep) and "<table" in rep._repr_html_()
    assert len(json.loads(json.dumps(rep.to_dict(per_token=True)))["per_token"]["kl"]) == n


def test_jsonl_corpus_and_text(tmp_path) -> None:
    from lorakit.errors import LorakitError
    from lorakit.inspect.behaviour import read_corpus

    j = tmp_path / "c.jsonl"
    j.write_text('{"text": "héllo"}\n\n{"text": "world", "x": 1}\n', encoding="utf-8")
    text, name, sha = read_corpus(j)
    assert text == "héllo\nworld" and name == str(j) and len(sha) == 64
    t = tmp_path / "c.txt"
    t.write_text('{"text": "a"}\n', encoding="utf-8")
    assert read_corpus(t)[0] == '{"text": "a"}\n'  # plain text is taken as it is
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(LorakitError, match="line 2"):
        read_corpus(bad)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9")
    with pytest.raises(LorakitError, match="UTF-8"):
        read_corpus(latin)
    assert read_corpus(None)[2] == read_corpus(CORPUS)[2]


def test_windows_drop_the_partial_one() -> None:
    from lorakit.errors import LorakitError
    from lorakit.inspect.behaviour import windows

    w = windows(range(10), 4)
    assert w.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert windows(range(10), 4, tokens=7).tolist() == [[0, 1, 2, 3]]
    assert windows(range(8), 4).shape == (2, 4)
    with pytest.raises(LorakitError, match="shorter than one window"):
        windows(range(3), 4)
    with pytest.raises(LorakitError, match="at least two"):
        windows(range(10), 1)


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_scored_positions_are_next_tokens(models) -> None:
    """Within each window every position but the last is scored, against the next id;
    a chunked pass (positions in pieces) gives the same numbers."""
    import lorakit.inspect.behaviour as b

    ids = models["base"][1].encode(b.read_corpus(CORPUS)[0])
    wins = b.windows(ids, 64, 300)  # 4 windows, 44 tokens dropped
    res = b.score_windows(models["base"][0], models["unfused"][0], wins)
    assert res["target"].tolist() == [t for w in range(4) for t in ids[w * 64 + 1:(w + 1) * 64]]
    old = b.CHUNK_ELEMENTS
    b.CHUNK_ELEMENTS = 2048 * 10  # 10 positions per chunk
    try:
        chunked = b.score_windows(models["base"][0], models["unfused"][0], wins)
    finally:
        b.CHUNK_ELEMENTS = old
    for k in ("kl", "ref_top1", "test_top1", "ref_nll", "test_nll"):
        np.testing.assert_allclose(chunked[k], res[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_cli_json(models) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "lorakit", "compare-outputs", BASE,
                          str(models["fused_path"]), "--ref-adapter", LORA, "--tokens",
                          "1024", "--context", "256", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["tokens"] == 4 * 255 and d["context"] == 256
    assert d["top1_agreement"] >= 0.99 and d["mean_kl"] < 1e-3
    from lorakit import compare_outputs

    rep = compare_outputs(models["unfused"], models["fused"], tokens=1024, context=256)
    assert d["mean_kl"] == pytest.approx(rep.mean_kl, rel=1e-5)
    text = subprocess.run([sys.executable, "-m", "lorakit", "compare-outputs", BASE, BASE, "--tokens",
                           "256", "--context", "128"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert text.returncode == 0 and "mean_kl: 0" in text.stdout, text.stderr


@pytest.mark.slow  # loads three models and runs them over the corpus
def test_kl_text_view(models) -> None:
    """The widget's page: one span per detailed token, shaded by KL, both models'
    candidates in the hover; identical models leave every token white."""
    from lorakit import compare_outputs
    from lorakit.widgets import KLTextView
    from lorakit.widgets.kl_view import kl_html

    rep = compare_outputs(models["base"], models["unfused"], tokens=256, context=128,
                          detail=50)
    page = kl_html(rep)
    assert page.count("<span title=") == 50 and "ref: " in page and "test: " in page
    assert page.count("background:#ffffff") < 50
    same = compare_outputs(models["base"], models["base"], tokens=256, context=128, detail=50)
    assert kl_html(same).count("background:#ffffff") == 50
    assert KLTextView(rep).widget.value == page


def test_top1_agreement_counts_exact_ties_only() -> None:
    """Rule 6: a position agrees when one model's argmax is among the other's tokens at
    its largest logit; one bf16 step apart is a disagreement (misses and false alarms
    both checked), and the strict argmax rule stays beside it."""
    import mlx.core as mx

    import lorakit.inspect.behaviour as b

    vocab, v = 8, -4.0
    # per scored position: (ref logits' top entries, test logits' top entries)
    cases = [
        ({3: 2.0, 5: 2.0}, {5: 2.0, 3: 1.9921875}),  # ref tie 3/5, test picks 5: agree
        ({3: 2.0, 5: 1.9921875}, {2: 2.0, 3: 2.0}),  # test tie 2/3, ref picks 3: agree
        ({3: 2.0, 5: 1.9921875}, {5: 2.0, 3: 1.9921875}),  # one bf16 step: disagree
        ({3: 2.0, 5: 2.0}, {7: 2.0, 3: 1.0}),  # tie in ref, test elsewhere: disagree
        ({1: 3.0}, {1: 3.0}),  # plain agreement
    ]
    ctx = len(cases) + 1

    def model_of(side: int):
        rows = []
        for c in cases + [({0: 1.0}, {0: 1.0})]:
            row = [v] * vocab
            for i, x in c[side].items():
                row[i] = x
            rows.append(row)
        logits = mx.array([rows], dtype=mx.bfloat16)
        return lambda x: logits

    res = b.score_windows(model_of(0), model_of(1), np.arange(ctx, dtype=np.int32)[None],
                          top_k=0)
    assert res["top1_agree"].tolist() == [True, True, False, False, True]
    assert (res["ref_top1"] == res["test_top1"]).tolist() == [False, False, False, False, True]


def test_unloadable_or_mismatched_models_are_one_clear_error(tmp_path) -> None:
    """A test checkpoint without a tokenizer still loads (the reference tokenizes); a
    vocabulary that differs from the reference's, a reference without a tokenizer and a
    folder that is no checkpoint are each one LorakitError naming what was found."""
    from lorakit import LorakitError, compare_outputs

    llama = ROOT / "tests" / "fixtures" / "peft" / "llama_lora_bf16" / "base"  # no tokenizer
    with pytest.raises(LorakitError, match="vocabularies differ") as e:
        compare_outputs(BASE, llama, tokens=128, context=64)
    assert "2048 logits" in str(e.value) and "256" in str(e.value)
    with pytest.raises(LorakitError, match="cannot load the reference model") as e:
        compare_outputs(llama, BASE, tokens=128, context=64)
    assert str(llama) in str(e.value)
    with pytest.raises(LorakitError, match="cannot load the test model") as e:
        compare_outputs(BASE, tmp_path, tokens=128, context=64)
    assert "config.json" in str(e.value)
