"""The log dock's text view, which keeps the newest line in sight."""

from __future__ import annotations

from PySide6.QtWidgets import QPlainTextEdit


class LogView(QPlainTextEdit):
    """Read-only log text that follows its newest line until the operator scrolls back.

    QPlainTextEdit follows only while its scroll bar is at the bottom; a dock that shrinks (the
    window fitted to a 1024x700 screen gives the log 80 px) keeps its top line, leaves the bar a
    few lines above the bottom, and every later line went unseen below the view. Following is
    decided by the operator's own scrolling instead: back to the bottom follows again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.setReadOnly(True)
        self.following = True
        # actionTriggered comes from the operator's scrolling only (wheel, drag, keys), with the
        # slider's position already where the action takes it
        self.verticalScrollBar().actionTriggered.connect(self._note_scrolled)

    def _note_scrolled(self, _action: int) -> None:
        bar = self.verticalScrollBar()
        self.following = bar.sliderPosition() >= bar.maximum()

    def append_line(self, text: str) -> None:
        self.appendPlainText(text)
        if self.following:
            self.show_newest()

    def show_newest(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.following:
            self.show_newest()
