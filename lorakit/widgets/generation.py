"""GenerationCompare: the same prompts through several models, greedy text side by side
(:func:`lorakit.inspect.compare_generations`), the first token that parts from the first
model highlighted. Models are loaded once and kept."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ipywidgets as W

from ..errors import ArgumentError
from ..inspect.generation import GenerationReport, compare_generations, eos_ids, load_pair
from ..report import LEFT, Cell, Markup, escape, table
from ._base import ErrorBox, FigureView, button, choice, hook, htmls, summary_html

__all__ = ["GenerationCompare"]

MARK_STYLE = "background:#ffd54f;font-weight:bold;border-radius:2px"
REF_MARK_STYLE = "background:#e0e0e0;border-radius:2px"
#: style of a model's text cell
TEXT_STYLE = "vertical-align:top;text-align:left;white-space:pre-wrap;max-width:24em"
#: where a model's text ended (its end-of-sequence token, e.g. ``<|endoftext|>``)
END_MARK = ("<span class='t-gen-end' title='the model ended its text here (its "
            "end-of-sequence token)' style='color:#666;border:1px solid #bbb;border-radius:"
            "3px;padding:0 3px;font-size:80%'>end</span>")


class GenerationCompare(W.VBox):
    """Greedy outputs of several models side by side, first divergent token marked.

    ``models``: label -> model directory, ``(path, adapter_path or None)`` or a loaded
    ``(model, tokenizer)``; the first is the reference. ``run``: generate at once.
    ``report`` is the last :class:`GenerationReport`; ``loaded`` the models kept."""

    def __init__(self, models: Mapping[str, Any], prompts: Sequence[str] = (),
                 max_tokens: int = 24, run: bool = False) -> None:
        if len(models) < 2:
            raise ArgumentError.bad("models", list(models), "at least two models")
        self.models = dict(models)
        self.loaded: Dict[str, Tuple[Any, Any]] = {}
        self.report: Optional[GenerationReport] = None
        size = W.Layout(width="48em", height="6em")
        area = W.Textarea("\n".join(prompts), description="prompts", layout=size,
                          placeholder="one prompt per line")
        self.prompts = hook(area, "gen-prompts")
        self.max_tokens = hook(W.IntSlider(max_tokens, min=1, max=256, description="tokens"),
                               "gen-tokens")
        self.button = button("gen-run", "Generate", "play")
        self.status, self.summary, self.table = htmls("gen", "status", "summary", "table")
        self.prompt = choice("gen-prompt", "margins of", [])
        self.figure = FigureView("gen-figure")
        self.error = ErrorBox("gen-error")
        self.button.on_click(lambda _b: self.run())
        self.prompt.observe(lambda _c: self._draw_margins(), names="value")
        row = W.HBox([self.max_tokens, self.button, self.status])
        views = [self.error, self.summary, self.table, self.prompt, self.figure]
        super().__init__([self.prompts, row] + views)
        hook(self, "generation-compare")
        if run:
            self.run()

    def prompt_list(self) -> List[str]:
        return [p for p in (line.strip() for line in self.prompts.value.splitlines()) if p]

    def run(self) -> Optional[GenerationReport]:
        """Generate with every model (what the button does)."""
        prompts = self.prompt_list()
        rep = self.error.attempt(lambda: self._generate(prompts), self.status)
        if rep is None:
            return None
        self.report = rep
        self.status.value = "done"
        self.summary.value = summary_html(rep)
        self.table.value = self.render(rep)
        self.prompt.options = [(f"{i}: {p[:40]}", i) for i, p in enumerate(prompts)]
        self.prompt.value = 0
        self._draw_margins()
        return rep

    def _generate(self, prompts: List[str]) -> GenerationReport:
        if not prompts:
            raise ArgumentError.bad("prompts", "", "enter at least one prompt")
        for label, spec in self.models.items():
            if label not in self.loaded:
                self.status.value = f"loading {escape(label)}..."
                self.loaded[label] = load_pair(label, spec)
        self.status.value = "generating..."
        return compare_generations(self.loaded, prompts, max_tokens=self.max_tokens.value)

    def _draw_margins(self) -> None:
        if self.report is not None and self.prompt.value is not None:
            self.figure.show(self.report.plot(prompt=self.prompt.value))

    def _marked(self, label: str, tokens: List[int], step: Optional[int], style: str) -> Markup:
        """A model's text with the token at ``step`` wrapped in a highlight; the text stops
        at its end-of-sequence token, shown as a readable end mark."""
        tok = self.loaded[label][1]
        eos = eos_ids(tok)
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
        body, end = tokens[:cut], END_MARK if cut < len(tokens) else ""
        if step is None or step > cut or (step == cut and not end):
            return Markup(escape(tok.decode(body)) + end)
        mark = f"<span class='t-gen-diverge' style='{style}'>"
        if step == cut:  # parts where this text ends
            return Markup(escape(tok.decode(body)) + mark + end + "</span>")
        return Markup(escape(tok.decode(body[:step])) + mark
                      + escape(tok.decode(body[step:step + 1])) + "</span>"
                      + escape(tok.decode(body[step + 1:])) + end)

    def render(self, rep: GenerationReport) -> str:
        """The side-by-side HTML table of a report."""
        labels = list(rep.generations[0]) if rep.generations else []
        ref = labels[0] if labels else ""
        body: List[List[Cell]] = []
        for p, gens in enumerate(rep.generations):
            steps = {r["model"]: r["diverges_at"] for r in rep.rows if r["prompt"] == p}
            parted = [s for m, s in steps.items() if m != ref and s is not None]
            cells = []
            for m in labels:
                if m == ref:
                    first = min(parted) if parted else None
                    text, note = self._marked(m, gens[m].tokens, first, REF_MARK_STYLE), "reference"
                else:
                    s = steps.get(m)
                    text = self._marked(m, gens[m].tokens, s, MARK_STYLE)
                    note = "same as reference" if s is None else f"parts at token {s}"
                shown = Markup(f"{text}<br><small><i>{note}</i></small>")
                cells.append(Cell(shown, style=TEXT_STYLE))
            title = f"prompt {p}: {gens[ref].prompt}"
            body += [[Cell(title, header=True, style=LEFT, colspan=len(labels))], cells]
        return table(body, head=[Cell(m, header=True, style=LEFT) for m in labels])
