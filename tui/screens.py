"""Modal screens: help, a one-line prompt, a yes/no confirmation."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static


def knob_assignment(text: str, example: str) -> tuple[str, str] | str:
    """`name=value` (or `name value`) typed at a knob prompt: (name, value), else the line saying how."""
    name, _, raw = text.replace("=", " ").partition(" ")
    if not raw.strip():
        return f"type name=value, e.g. {example} (got {text!r})"
    return name.strip(), raw.strip()


class HelpScreen(ModalScreen[None]):
    """The dashboard's keys that its source serves (from its BINDINGS, so it cannot go stale), then one
    line per thing the source cannot do, with why."""

    CSS_PATH = "help.tcss"
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def __init__(self, bindings, intro: str = "", cannot: list[tuple[str, str]] = ()):
        super().__init__()
        self._help_bindings = bindings
        self._intro = intro
        self._cannot = cannot

    def compose(self) -> ComposeResult:
        text = Text("batchtop — keys\n\n", style="bold")
        if self._intro:
            text.append(self._intro + "\n\n", style="bright_black")
        for binding in self._help_bindings:
            keys = binding.key_display or binding.key.replace("space", "␣")
            text.append(f"{keys:>16}  ", style="bold cyan")
            text.append(f"{binding.description}\n")
        if self._cannot:
            text.append("\nnot over this source\n", style="bold")
        for what, why in self._cannot:
            text.append(f"{what:>16}  ", style="bold bright_black")
            text.append(f"{why}\n", style="bright_black")
        text.append("\nesc / q / ? closes this help", style="bright_black")
        yield Vertical(Static(text, id="help-text"), id="help-box")

    def action_dismiss(self) -> None:
        self.dismiss(None)


class PromptScreen(ModalScreen[str | None]):
    """Ask for one line of text; dismisses with the text, or None on escape."""

    CSS_PATH = "modal.tcss"
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, question: str, value: str = "", placeholder: str = ""):
        super().__init__()
        self.question, self.value, self.placeholder = question, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(id="modal-box"):
            yield Label(self.question, id="modal-question")
            yield Input(value=self.value, placeholder=self.placeholder, id="modal-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """y / enter confirms, n / escape declines."""

    CSS_PATH = "modal.tcss"
    BINDINGS = [Binding("y,enter", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="modal-box"):
            yield Label(self.question, id="modal-question")
            yield Label("[b]y[/b] yes   [b]n[/b] no", id="modal-hint")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
