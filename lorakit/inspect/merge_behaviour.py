"""The behaviour line of a merge check: the fused model against the base with the
adapter attached unfused, on the default corpus (a thin caller of
:func:`lorakit.compare_outputs`; the KL math lives there once).

It adds to a :class:`~lorakit.inspect.merge_check.MergeCheck` one summary line,
``fused vs unfused: mean KL 3.8e-05, top-1 99.1% (1020 tokens)``, and the numbers
under ``behaviour`` (in ``to_dict()`` / ``--json``). It never changes the verdict or
the exit code: behaviour is evidence, the per-tensor check is the verdict.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

from ..errors import LorakitError
from .behaviour import compare_outputs

__all__ = ["DEFAULT_TOKENS", "behaviour_tokens", "fused_vs_unfused", "behaviour_line"]

#: corpus tokens scored when ``behaviour=True`` / ``--kl`` has no ``--tokens``
DEFAULT_TOKENS = 1024
#: window length (shorter when fewer tokens are asked for)
CONTEXT = 256
#: the numbers kept from the behaviour report
KEYS = ("mean_kl", "median_kl", "p99_kl", "max_kl", "top1_agreement",
        "top1_agreement_strict", "ppl_ref", "ppl_test", "tokens")


def behaviour_tokens(behaviour: Union[bool, int, None]) -> Optional[int]:
    """``False``/``None``/0: no behaviour line; ``True``: :data:`DEFAULT_TOKENS`; an int:
    that many corpus tokens."""
    if behaviour is None or behaviour is False:
        return None
    if behaviour is True:
        return DEFAULT_TOKENS
    n = int(behaviour)
    if n < 2:
        raise LorakitError("behaviour needs at least two corpus tokens",
                           expected="True or a token count >= 2", found=repr(behaviour))
    return n


def _path(src: Any, role: str) -> str:
    path = getattr(src, "path", None)
    if path is None:
        raise LorakitError(f"the behaviour line needs the {role} on disk",
                           expected="a checkpoint directory", found=str(getattr(src, "label", src)),
                           hint="call compare_outputs with loaded models instead")
    return str(path)


def fused_vs_unfused(fused: Any, base: Any, adapter: Any, tokens: int, *,
                     corpus: Any = None, progress: Any = None) -> Dict[str, Any]:
    """Mean KL, top-1 agreement... of ``fused`` against ``base`` + ``adapter`` (unfused),
    as a dict of :data:`KEYS`. ``fused`` / ``base``: tensor sources or paths;
    ``adapter``: a path or a loaded Adapter (with its ``path``)."""
    ad = str(getattr(adapter, "path", adapter))
    rep = compare_outputs((_path(base, "base") if not isinstance(base, str) else base, ad),
                          _path(fused, "fused checkpoint") if not isinstance(fused, str) else fused,
                          corpus, tokens=tokens, context=min(CONTEXT, tokens),
                          detail=0, progress=progress)
    return {k: rep.stats[k] for k in KEYS}


def behaviour_line(stats: Dict[str, Any]) -> str:
    """``mean KL 3.8e-05, top-1 100% (argmax alone 99.12%; 1020 tokens)``: the second
    figure only where exact logit ties make the two rules differ."""
    top, strict = stats["top1_agreement"], stats.get("top1_agreement_strict", stats["top1_agreement"])
    alone = f"argmax alone {100 * strict:.4g}%; " if strict != top else ""
    return (f"mean KL {stats['mean_kl']:.2g}, top-1 {100 * top:.4g}% "
            f"({alone}{stats['tokens']} tokens)")


def add_behaviour(rep: Any, fused: Any, base: Any, adapter: Any, tokens: int, *,
                  progress: Any = None) -> Any:
    """Add the behaviour line and numbers to a merge check report (in place)."""
    stats = fused_vs_unfused(fused, base, adapter, tokens, progress=progress)
    rep.summary["fused vs unfused"] = behaviour_line(stats)
    rep.behaviour = stats
    return rep
