"""The "KL vs unfused" column of a decode timing: each variant's mean KL against the
unfused adapter on a short corpus (:func:`lorakit.compare_outputs`), computed in the
parent process after all timing."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Union

from ..errors import ArgumentError
from ..fusion.model import attach_adapter
from ..inspect.behaviour import compare_outputs

__all__ = []

#: corpus tokens per variant when ``behaviour=True`` / ``--kl`` (two windows of 256)
DEFAULT_KL_TOKENS = 512
CONTEXT = 256


def kl_tokens(behaviour: Union[bool, int, None]) -> Optional[int]:
    """Corpus tokens of the KL column: None (no column), 512 for ``True``, or the int given."""
    if behaviour is None or behaviour is False:
        return None
    if behaviour is True:
        return DEFAULT_KL_TOKENS
    if not isinstance(behaviour, int) or behaviour < 2:
        raise ArgumentError.bad("behaviour", behaviour, "True, False or a corpus token "
                                "count >= 2 (the KL column)")
    return behaviour


def kl_vs_unfused(model: Path, adapter: Path, checkpoints: Dict[str, Path],
                  tokens: int) -> Dict[str, float]:
    """variant -> mean KL(unfused adapter || variant) over the first ``tokens`` tokens
    of the embedded corpus. ``checkpoints``: variant -> its checkpoint directory
    (``unfused`` needs none: it is the reference, 0)."""
    from mlx_lm import load  # lazy: mlx-lm is heavy

    ref_model, tok = load(str(model))[:2]
    ref = (attach_adapter(ref_model, adapter), tok)
    out: Dict[str, float] = {}
    for name, path in checkpoints.items():
        if name == "unfused":
            out[name] = 0.0
            continue
        rep = compare_outputs(ref, str(path), tokens=tokens, context=min(CONTEXT, tokens),
                              detail=0, progress=None)
        out[name] = rep.stats["mean_kl"]
    return out
