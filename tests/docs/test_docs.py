"""The README and docs/ as a newcomer reads them: the README is short and links every
page, links and anchors resolve, the CLI reference names every subcommand and flag of the
real parser (and no other), the docs use one name per verb, and they speak of the
project only. The numbers the pages state are checked where they are measured (the
claims tests beside it, test_readme.py, inspect/test_check_verdicts.py, fusion/test_quant.py)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
#: what a newcomer reads (ARCHITECTURE.md is linked from here too)
READ = [ROOT / "README.md", *PAGES, ROOT / "BENCHMARKS.md", ROOT / "SECURITY.md"]
README_LIMIT = 8 * 1024


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_readme_is_short_and_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < README_LIMIT, len(readme.encode())
    assert PAGES, "docs/ has pages"
    for page in PAGES:
        assert f"](docs/{page.name})" in readme, page.name
    for doc in ("BENCHMARKS.md", "ARCHITECTURE.md"):
        assert f"]({doc})" in readme, doc
    assert "bash tools/walkthrough.sh" in readme and "bash tools/test.sh" in readme
    assert "bash tools/test.sh" in (ROOT / ".ci" / "run").read_text()  # what CI runs


# -- links and anchors -------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> Set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def _links(path: Path) -> Iterator[Tuple[str, str]]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            file, _, anchor = target.partition("#")
            yield file, anchor


@pytest.mark.parametrize("path", READ, ids=_rel)
def test_links_and_anchors_resolve(path: Path) -> None:
    for file, anchor in _links(path):
        target = (path.parent / file).resolve() if file else path
        assert target.exists(), f"{_rel(path)}: no {file}"
        if anchor:
            assert anchor in _anchors(target), f"{_rel(path)}: no #{anchor} in {file or 'itself'}"


# -- the CLI reference -------------------------------------------------------------------
def _commands(parser: argparse.ArgumentParser, path: str = "") -> Iterator[Tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _commands(sub, f"{path} {name}".strip())


def _arguments(parser: argparse.ArgumentParser) -> Set[str]:
    """Every option string (``-h``/``--help`` aside) and positional name of ``parser``."""
    out: Set[str] = set()
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        out |= set(a.option_strings) if a.option_strings else {a.metavar or a.dest}
    return out


def _cli_sections() -> Dict[str, List[str]]:
    """docs/cli.md's ``## `lorakit CMD` `` sections: the arguments each one's table names
    (first cell, every spelling before its metavar)."""
    text = (DOCS / "cli.md").read_text()
    out: Dict[str, List[str]] = {}
    for part in re.split(r"(?m)^(?=## )", text)[1:]:
        m = re.match(r"## `lorakit ?([^`]*)`\n", part)
        assert m, f"docs/cli.md: a section that is no command: {part.splitlines()[0]}"
        names: List[str] = []
        for cell in re.findall(r"^\| `([^`]+)` \|", part, re.M):
            names += [spelling.split()[0] for spelling in cell.split(", ")]
        out[m.group(1)] = names
    return out


def test_cli_reference_names_every_subcommand_and_flag() -> None:
    """Every subcommand of the real parser (nested ones included) has its section in
    docs/cli.md, and each section names exactly that command's flags and positionals:
    none missing, none the parser does not have (a removed flag cannot linger)."""
    from lorakit.cli.main import build_parser

    sections = _cli_sections()
    commands = dict(_commands(build_parser()))
    assert sorted(sections) == sorted(commands), "docs/cli.md's sections are not the commands"
    for path, parser in commands.items():
        documented = sections[path]
        assert len(documented) == len(set(documented)), (path, documented)
        assert set(documented) == _arguments(parser), (
            f"lorakit {path}: missing {sorted(_arguments(parser) - set(documented))}, "
            f"not in the parser {sorted(set(documented) - _arguments(parser))}")


def test_cli_reference_is_what_tools_cli_doc_writes() -> None:
    """The sections' text is the parser's own --help text (tools/cli_doc.py writes them;
    run it after a change to the CLI)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cli_doc", ROOT / "tools" / "cli_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    current = (DOCS / "cli.md").read_text()
    assert mod.render(current) == current, "docs/cli.md is stale: run python tools/cli_doc.py"


def test_where_things_live_names_existing_files() -> None:
    """Each page's "Where things live" names files that exist: a bare ``name.py`` is in
    the folder named before it."""
    for page in PAGES:
        text = page.read_text()
        if "## Where things live" not in text:
            continue
        folder = None
        for tok in re.findall(r"`([^`]+)`", text.split("## Where things live", 1)[1]):
            if re.fullmatch(r"(lorakit|notebooks|tests|benchmarks|data)/[\w/.-]*", tok):
                assert (ROOT / tok).exists(), f"{page.name}: no {tok}"
                folder = tok if tok.endswith("/") else str(Path(tok).parent) + "/"
            elif re.fullmatch(r"[\w.]+\.(py|c)", tok):
                assert folder and (ROOT / folder / tok).exists(), f"{page.name}: no {folder}{tok}"


def test_synth_example_size_is_the_preset_s() -> None:
    """docs/timing.md's `synth checkpoint` line states the size it writes."""
    import math

    pytest.importorskip("mlx.core")
    from lorakit.synth import PRESETS, plan_checkpoint

    text = (DOCS / "timing.md").read_text()
    m = re.search(r"lorakit synth checkpoint --preset (\S+) .*# ([\d.]+) GB of random bf16", text)
    assert m, "docs/timing.md: the synth checkpoint example"
    elements = sum(math.prod(shape) for _, shape in plan_checkpoint(PRESETS[m.group(1)]))
    assert f"{2 * elements / 1e9:.1f}" == m.group(2)


# -- one name per verb, and the project only --------------------------------------------
#: spellings that are gone: synonyms of the verbs, old top-level names, the CLI's old
#: subcommands and flag aliases
GONE = [r"lorakit\.(compare|parity|ulp_compare|merge_check|fuse_model|open_checkpoint|"
        r"open_source|Checkpoint|Adapter|FuseResult|synth_checkpoint|synth_adapter|"
        r"dtype_map|delta_norms|compare_adapters|compare_generations|attach_adapter|"
        r"convert|resize)\b", r"\bParityReport\b", r"\bMergeCheck\b",
        r"lorakit (kl|bench)\b", r"--fused\b"]


@pytest.mark.parametrize("path", READ, ids=_rel)
def test_docs_use_the_verbs_names(path: Path) -> None:
    text = path.read_text()
    for pattern in GONE:
        found = re.search(pattern, text)
        assert not found, f"{_rel(path)}: {found.group(0)!r}"
    for line in text.splitlines():  # check, diff and inspect read fuse's flag names
        if re.search(r"lorakit (check|diff|inspect)\b", line):
            for flag in ("--base", "--adapter"):
                assert not re.search(rf"{flag}(?![\w-])", line), (_rel(path), line)


@pytest.mark.parametrize("path", READ, ids=_rel)
def test_docs_speak_of_the_project_only(path: Path) -> None:
    """No work history: sessions, agents, this project's issue numbers (other projects'
    issues, named with their project, are references)."""
    text = path.read_text()
    for pattern in (r"(?i)\bsessions?\b", r"(?i)\bagents?\b", r"(?i)\bengineers?\b",
                    r"(?i)(?<!mlx-lm )(?<!PEFT )\bissue \d+", r"\b[Rr]ound [A-G]\b"):
        found = re.search(pattern, text)
        assert not found, f"{_rel(path)}: {text[max(0, found.start() - 40):found.end() + 40]!r}"


def test_named_test_files_exist() -> None:
    """Every ``tests/...py`` a page, a docstring or a C comment names is a real file: test
    files move with the package's layout, and the prose follows them. (Another
    repository's file is named with its folder: ``mlx-lm/tests/test_models.py``.)"""
    texts = [ROOT / n for n in ("README.md", "BENCHMARKS.md", "ARCHITECTURE.md", "SECURITY.md")]
    texts += PAGES + sorted((ROOT / "lorakit").rglob("*.py")) + sorted((ROOT / "lorakit").rglob("*.c"))
    missing = []
    for path in texts:
        for ref in re.findall(r"(?<![\w/-])tests/[\w/]*test_\w+\.py", path.read_text()):
            if not (ROOT / ref).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert missing == []
