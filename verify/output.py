"""The one output sink of ``k3-verify``: rich tables and progress for people, JSON for machines.

Every command writes through an ``Output``. In ``--format text`` (default) it renders rich tables on
stdout and progress on stderr; in ``--format json`` it collects the command's document and prints
exactly one JSON object on stdout when the command ends (nothing else goes to stdout). Errors are
always one line on stderr (``K3_DEBUG=1`` adds the traceback). Exit codes: 0 ok/pass, 1 a check failed
or a bundle did not verify, 2 usage/config/input error.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UserError(Exception):
    """Bad input, config or usage: one line on stderr and exit code 2."""

    exit_code = EXIT_USAGE


class Output:
    def __init__(self, fmt: str = "text") -> None:
        if fmt not in ("text", "json"):
            raise UserError(f"--format must be 'text' or 'json', got {fmt!r}")
        self.fmt = fmt
        self.doc: dict[str, Any] = {}
        self._console = None
        self._err_console = None

    # -- consoles (rich imported lazily so `--help` stays instant)
    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(highlight=False, soft_wrap=True, markup=False)  # long paths stay on one line
        return self._console

    @property
    def err_console(self):
        if self._err_console is None:
            from rich.console import Console

            self._err_console = Console(stderr=True, highlight=False, markup=False)
        return self._err_console

    @property
    def is_json(self) -> bool:
        return self.fmt == "json"

    # -- structured output
    def set(self, key: str, value: Any) -> None:
        """Put ``value`` in the JSON document (text mode ignores it; use table/line for people)."""
        self.doc[key] = value

    def line(self, text: str, style: str | None = None) -> None:
        if not self.is_json:
            self.console.print(text, style=style)

    def note(self, text: str) -> None:
        """Progress and remarks for people: stderr, never stdout."""
        if not self.is_json:
            self.err_console.print(text, style="dim")

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], key: str | None = None) -> None:
        if self.is_json:
            if key:
                self.doc[key] = [dict(zip(columns, r, strict=False)) for r in rows]
            return
        from rich.table import Table
        from rich.text import Text

        # plain text everywhere: a reason such as "pip install 'k3-verify[gpu]'" is never read as markup
        t = Table(title=Text(title), title_justify="left", show_lines=False)
        for i, c in enumerate(columns):  # the first column (an id, a path) is never cut short
            width = max([len(str(c)), *(len(_cell(r[0])) for r in rows if r)]) if i == 0 else None
            t.add_column(Text(str(c)), no_wrap=i == 0, min_width=width)
        for r in rows:
            t.add_row(*[Text(_cell(v)) for v in r])
        self.console.print(t)

    @contextlib.contextmanager
    def progress(self, total: int, description: str) -> Iterator[Any]:
        """A progress bar on stderr (a no-op object in JSON mode)."""
        if self.is_json or not sys.stderr.isatty():
            yield _NullProgress()
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=self.err_console, transient=True) as p:
            task = p.add_task(description, total=total)
            yield _RichProgress(p, task)

    def finish(self) -> None:
        if self.is_json:
            sys.stdout.write(json.dumps(self.doc, indent=2, sort_keys=True, default=str) + "\n")
            sys.stdout.flush()

    @staticmethod
    def error(message: str, exc: BaseException | None = None) -> None:
        first = " ".join(str(message).split()) or "error"
        sys.stderr.write(f"k3-verify: error: {first}\n")
        if exc is not None and os.environ.get("K3_DEBUG") == "1":
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None:
        return "-"
    return str(v)


class _NullProgress:
    def advance(self, n: int = 1, description: str | None = None) -> None:
        pass


class _RichProgress:
    def __init__(self, p: Any, task: Any) -> None:
        self.p, self.task = p, task

    def advance(self, n: int = 1, description: str | None = None) -> None:
        if description:
            self.p.update(self.task, description=description)
        self.p.advance(self.task, n)
