"""Write docs/cli.md's reference sections from the real ``lorakit`` parser.

    python tools/cli_doc.py           # rewrite docs/cli.md after a change to the CLI
    python tools/cli_doc.py --check   # exit 1 if docs/cli.md is not what this writes

Everything above the first ``## `lorakit` `` heading (the examples, the subcommand table)
is written by hand and kept. Below it, one section per command (nested ones included):
its description, then a table of its arguments with their ``--help`` text. Where the
parser gives no text (an argument without ``help=``, a subcommand without a
description), the text already on the page is kept, so it can be written by hand.
tests/docs/test_docs.py runs ``--check``.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
FIRST = "## `lorakit`\n"


def commands(parser: argparse.ArgumentParser, path: str = "",
             short: Optional[str] = None) -> Iterator[Tuple[str, argparse.ArgumentParser, str]]:
    """(path, parser, one-line help) of ``parser`` and every subcommand under it."""
    yield path, parser, short or ""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for name, sub in a.choices.items():
                yield from commands(sub, f"{path} {name}".strip(), helps.get(name))


def arguments(parser: argparse.ArgumentParser) -> List[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _flat(text: Optional[str]) -> str:
    return " ".join((text or "").split())


def _first_cell(a: argparse.Action) -> str:
    if not a.option_strings:
        return f"`{a.metavar or a.dest}`"
    names = ", ".join(a.option_strings)
    if a.nargs == 0:
        return f"`{names}`"
    mv = a.metavar or ("{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper())
    if isinstance(mv, tuple):
        mv = " ".join(mv)
    if a.nargs in ("+", "*"):
        mv = f"{mv} [{mv} ...]"
    return f"`{names} {mv}`"


def _help_cell(a: argparse.Action, kept: str) -> str:
    text = _flat(a.help).replace("|", "\\|")
    if a.option_strings and a.required:
        prefix = "required"
        if not text and kept.startswith(prefix):
            return kept
        text = f"{prefix}; {text}" if text else prefix
    if a.choices and a.metavar:
        text += f" (one of {', '.join(map(str, a.choices))})"
    return text or kept


def _sections(text: str) -> Dict[str, str]:
    out = {}
    for part in re.split(r"(?m)^(?=## `lorakit)", text):
        m = re.match(r"## `lorakit ?([^`]*)`\n", part)
        if m:
            out[m.group(1)] = part
    return out


def _kept_cells(section: str) -> Dict[str, str]:
    """first cell -> help cell of a section's table rows."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^\| (`[^`]+`) \| (.*) \|$", section, re.M)}


def _kept_description(section: str) -> str:
    lines = section.split("\n")[2:]
    para = []
    for ln in lines:
        if not ln.strip() or ln.startswith(("|", "```", "## ")):
            break
        para.append(ln)
    return " ".join(para)


def section(path: str, parser: argparse.ArgumentParser, short: str, old: str) -> str:
    out = [f"## `lorakit {path}`" if path else "## `lorakit`", ""]
    desc = _flat(parser.description) or _kept_description(old) or _flat(short)
    if desc:
        out += [desc, ""]
    kept = _kept_cells(old)
    args = arguments(parser)
    if args:
        out += ["| argument | what it does |", "|---|---|"]
        for a in args:
            first = _first_cell(a)
            out.append(f"| {first} | {_help_cell(a, kept.get(first, ''))} |")
        out.append("")
    if parser.epilog:
        out += ["```", parser.epilog.strip("\n"), "```", ""]
    return "\n".join(out)


def render(current: str) -> str:
    """docs/cli.md as it should be: ``current``'s hand-written head, then every command's
    section from the parser."""
    sys.path.insert(0, str(ROOT))
    from lorakit.cli.main import build_parser

    head = current[:current.index(FIRST)] if FIRST in current else current.rstrip("\n") + "\n\n"
    old = _sections(current)
    body = [section(path, p, short, old.get(path, ""))
            for path, p, short in commands(build_parser())]
    return head + "\n".join(body).rstrip("\n") + "\n"


def main(argv: List[str]) -> int:
    current = PAGE.read_text()
    new = render(current)
    if "--check" in argv:
        if new != current:
            print("docs/cli.md is not the parser's: run python tools/cli_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
