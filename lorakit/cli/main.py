"""``lorakit`` command line: each subcommand parses flags and calls one library verb.
A lorakit error prints as one message with status 2 (``LORAKIT_DEBUG=1``: traceback);
stdout closing early stops quietly with 141, or 0 with a note once the output is whole."""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import List, Optional

from ..errors import LorakitError
from .written import written, wrote

__all__ = ["main"]


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed memory for reuse: a fuse frees and reallocates tensor-sized
    buffers, each otherwise a fresh mapping faulted in page by page (CLI only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD
        libc.mallopt(-2, 1 << 28)  # M_TOP_PAD
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        pass


def _fuse(args: argparse.Namespace) -> int:
    from ..fusion.fuse import fuse

    _keep_freed_memory()

    from ..io.outputs.export import check_upload, upload

    if args.upload_repo is not None:
        check_upload(args.upload_repo)
    from .algebra_cmds import fuse_adapter

    adapter = fuse_adapter(args)  # first: --like peft sets the rounding
    names = ("rounding", "dtype", "dequantize", "force", "quant_policy", "quant_budget")
    kw = {k: getattr(args, k) for k in names + ("float_base", "layout", "initial_adapter")}
    result = fuse(args.model, adapter, args.save_path, progress=not args.quiet,
                  export_gguf=args.gguf_path if args.export_gguf else None, **kw)
    if args.upload_repo is None:
        wrote(args, result.output)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    if args.upload_repo is not None:
        url = upload(result.output, args.upload_repo)
        wrote(args, result.output)  # asked for an upload: done only once it is
        print(f"uploaded to {url}")
    return 0


def _add_fuse(sub) -> None:
    from ..fusion.options import DTYPE_POLICIES, LAYOUT_HELP, LAYOUTS, ROUNDING_HELP, ROUNDINGS

    p = sub.add_parser("fuse", help="fuse an adapter into a base checkpoint",
                       description="Fuse a LoRA/DoRA adapter (mlx-lm or PEFT format) into a base "
                       "checkpoint, one tensor in memory at a time, keeping dtypes.")
    p.add_argument("--model", default="mlx_model", help="base model directory or hub repo id "
                   "(default, as mlx_lm fuse: mlx_model)")
    p.add_argument("--adapter-path", action="append",
                   help="adapter directory, mlx-lm or PEFT format (default: adapters); repeat it "
                   "to fuse a combination (--weights, --combine)")
    p.add_argument("--save-path", default="fused_model",
                   help="output directory, must not exist (default: fused_model)")
    rounding = "; ".join(f"{k}: {v}" for k, v in ROUNDING_HELP.items())
    p.add_argument("--rounding", choices=ROUNDINGS, default="nearest",
                   help=rounding + " (default: nearest)")
    p.add_argument("--dtype", choices=DTYPE_POLICIES, default="preserve", help="dtype of fused "
                   "weights (promote = float32, as a fuse that forgets the cast writes)")
    p.add_argument("--dequantize", action="store_true",
                   help="quantized base: write float weights instead of re-quantizing")
    p.add_argument("--quant-policy", default="requant", metavar="POLICY",
                   help="quantized base: requant (default, as mlx_lm fuse), same-grid, bits:N, "
                   "float, auto, learned (mlx-lm's GPTQ on calibration text)")
    p.add_argument("--quant-budget", type=float, metavar="X",
                   help="auto: at most X times the quantized base's bytes (default 1.15)")
    p.add_argument("--float-base", metavar="PATH", help="fuse a QLoRA adapter of the quantized "
                   "--model into this float original of it instead (float weights written)")
    p.add_argument("--initial-adapter", metavar="DIR",
                   help="a PEFT adapter made on a changed base (init_lora_weights pissa, olora, "
                   "corda, lora_ga): the adapter saved before training; the trained one is "
                   "converted as PEFT's path_initial_model_for_weight_conversion does and fused "
                   "exactly")
    layout = "; ".join(f"{k}: {v}" for k, v in LAYOUT_HELP.items())
    p.add_argument("--layout", choices=LAYOUTS, default="mlx-lm",
                   help=f"a MoE model's experts: {layout} (default: mlx-lm)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output, but only an empty directory or a previous "
                   "lorakit output (every file listed, unchanged, in its lorakit.json); anything "
                   "else is refused and kept. The new output is complete before the old one is "
                   "swapped out")
    p.add_argument("--export-gguf", action="store_true",
                   help="also write a GGUF file llama.cpp loads into the output (llama, mistral, "
                   "mixtral, qwen2, qwen3, qwen3_moe; float weights in the checkpoint's dtype, "
                   "norms F32). The base alone as GGUF, for convert --to gguf-lora: add "
                   "--weights 0 (the adapter scaled to nothing)")
    p.add_argument("--gguf-path", default="ggml-model-f16.gguf",
                   help="the GGUF file's name inside the output (default: ggml-model-f16.gguf)")
    p.add_argument("--upload-repo", metavar="OWNER/NAME", help="upload the finished output to "
                   "this Hugging Face repo (huggingface_hub; needs a login and the network)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted as mlx_lm fuse accepts it; lorakit's fuse reads tensors and "
                   "never runs a model's code, so it changes nothing here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    from .algebra_cmds import add_combination_flags
    add_combination_flags(p, "--combine")
    p.set_defaults(run=_fuse)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from . import (
        algebra_cmds,
        behaviour_cmd,
        extract_cmds,
        inspect_cmds,
        lab_cmd,
        synth_cmd,
        timing_cmd,
    )

    parser = argparse.ArgumentParser(
        prog="lorakit", description="Fuse, inspect, compare and time LoRA adapters for MLX.")
    parser.add_argument("--version", action="version", version=f"lorakit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_fuse(sub)
    for m in (inspect_cmds, timing_cmd, synth_cmd, extract_cmds, algebra_cmds, behaviour_cmd,
              lab_cmd):
        m.add(sub)
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Turn off argparse's prefix matching (``--adapter``) in every subcommand."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                _no_abbreviations(p)


def _one_line_warnings(command: str) -> None:
    """lorakit's own warnings as one line on stderr ("lorakit fuse: warning: ...")."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        from ..io.outputs.directory import OutputWarning  # here: most commands never warn

        if issubclass(category, OutputWarning):
            print(f"{command}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


#: exit status when the reader of stdout goes away (``... | head``): 128 + SIGPIPE, as a shell says
EXIT_BROKEN_PIPE = 141


def _quiet_broken_pipe() -> int:
    """Stop quietly after the reader of stdout went away: stdout points at /dev/null so the
    final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a real file
        pass
    return EXIT_BROKEN_PIPE


def _wrote_but_stdout_closed(command: str, path) -> int:
    """Only the summary was lost: say so on stderr and exit 0 (the output is whole)."""
    _quiet_broken_pipe()
    try:
        print(f"{command}: note: stdout was closed before the summary was printed; the "
              f"output is complete at {path}", file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr gone too: nothing to tell
        pass
    return 0


def _flush() -> None:
    """Flush stdout; a process started with stdout closed (``>&-``) has none to flush."""
    if sys.stdout is not None:
        sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command. Exit status: 0 success (1 "differs" for ``diff`` / ``check``), 2 a
    lorakit error, 130 interrupted, 141 stdout closed early."""
    command = "lorakit"
    args: Optional[argparse.Namespace] = None
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help, --version, usage errors: their text is out now
            _flush()
            raise
        command = f"lorakit {args.command}"
        _one_line_warnings(command)
        try:
            code = int(args.run(args) or 0)
            _flush()  # a closed pipe shows here, not at interpreter exit
            return code
        except LorakitError as e:
            if os.environ.get("LORAKIT_DEBUG"):
                raise
            print(f"{command}: error: {e}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            raise
        except OSError as e:  # the system refused a path lorakit had not checked itself
            if os.environ.get("LORAKIT_DEBUG"):
                raise
            where = str(e.filename) if e.filename is not None else "a file"
            if len(where) > 240:  # a 4000-byte name would drown the message
                where = f"{where[:120]}...{where[-60:]} ({len(where)} characters)"
            print(f"{command}: error: cannot use {where}: {e.strerror or e}\n"
                  f"  found: {type(e).__name__}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{command}: interrupted", file=sys.stderr)
            return 130
    except BrokenPipeError:
        done = written(args)
        return _quiet_broken_pipe() if done is None else _wrote_but_stdout_closed(command, done)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
