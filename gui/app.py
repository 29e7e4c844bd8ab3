"""QApplication setup: high-DPI, the light/dark theme, and remembered settings.

The theme is one stylesheet (``resources/theme/studio.qss``) filled from a colour
table per mode, plus a matching ``QPalette`` so widgets the stylesheet does not
reach (menus, scroll bars, native dialogs) agree. Views read colours through
``theme_colors()`` rather than hard-coding them, so both modes stay readable.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal

import pyqtgraph as pg
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

import resources
from gui.widgets.gui_thread_collector import install_gui_thread_collector

ThemeMode = Literal["light", "dark"]
THEME_DIR = Path(resources.__file__).resolve().parent / "theme"
ORGANIZATION = "EdgeShard"
APPLICATION = "EdgeShard Studio"
MAX_RECENT = 8

_current_mode: ThemeMode = "light"


@lru_cache(maxsize=2)
def _colors(mode: ThemeMode) -> dict:
    return json.loads((THEME_DIR / f"{mode}.json").read_text())


def theme_colors() -> dict:
    """Colours of the active theme (keys as in resources/theme/light.json)."""
    return _colors(_current_mode)


def theme_mode() -> ThemeMode:
    return _current_mode


def stage_color(index: int) -> QColor:
    palette = theme_colors()["stage_colors"]
    return QColor(palette[index % len(palette)])


def stylesheet(mode: ThemeMode) -> str:
    values = {k: v for k, v in _colors(mode).items() if isinstance(v, str)}
    return (THEME_DIR / "studio.qss").read_text().format(**values, mode=mode, theme_dir=THEME_DIR.as_posix())


def apply_theme(app: QApplication, mode: ThemeMode) -> None:
    """Switch palette, stylesheet and pyqtgraph colours; views repaint on ``paletteChanged``."""
    global _current_mode
    _current_mode = mode
    c = _colors(mode)
    pal = QPalette()
    pal.setColor(QPalette.Window, QColor(c["window"]))
    pal.setColor(QPalette.WindowText, QColor(c["text"]))
    pal.setColor(QPalette.Base, QColor(c["base"]))
    pal.setColor(QPalette.AlternateBase, QColor(c["alt_base"]))
    pal.setColor(QPalette.Text, QColor(c["text"]))
    pal.setColor(QPalette.Button, QColor(c["base"]))
    pal.setColor(QPalette.ButtonText, QColor(c["text"]))
    pal.setColor(QPalette.Highlight, QColor(c["accent"]))
    pal.setColor(QPalette.HighlightedText, QColor("#ffffff"))
    pal.setColor(QPalette.ToolTipBase, QColor(c["base"]))
    pal.setColor(QPalette.ToolTipText, QColor(c["text"]))
    pal.setColor(QPalette.PlaceholderText, QColor(c["muted"]))
    pal.setColor(QPalette.Disabled, QPalette.Text, QColor(c["muted"]))
    pal.setColor(QPalette.Disabled, QPalette.ButtonText, QColor(c["muted"]))
    app.setPalette(pal)
    app.setStyleSheet(stylesheet(mode))
    pg.setConfigOptions(background=c["plot_bg"], foreground=c["plot_fg"], antialias=True)


def settings() -> QSettings:
    """The studio's settings (window layout, theme, recent workspaces)."""
    return QSettings(ORGANIZATION, APPLICATION)


def recent_workspaces() -> list[str]:
    value = settings().value("recent_workspaces", [])
    if isinstance(value, str):
        value = [value]
    return [str(v) for v in (value or [])]


def remember_workspace(path: str) -> list[str]:
    """Put ``path`` first in the recent list (no duplicates, at most MAX_RECENT)."""
    path = str(Path(path).resolve())
    items = [path] + [p for p in recent_workspaces() if p != path]
    items = items[:MAX_RECENT]
    settings().setValue("recent_workspaces", items)
    return items


def create_app(argv: list[str] | None = None) -> QApplication:
    """The one QApplication, high-DPI aware, themed from the saved preference, its garbage collected
    on its own thread only (gui/widgets/gui_thread_collector.py: a worker's collection deleted Qt
    objects under the event loop)."""
    if QApplication.instance() is None:
        QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv[:1])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationDisplayName(APPLICATION)
    install_gui_thread_collector(app)
    app.setStyle("Fusion")  # the same look on every desktop; draws check boxes and arrows from the palette
    mode = settings().value("theme", "light")
    apply_theme(app, "dark" if mode == "dark" else "light")
    return app


def style_plot(widget) -> None:
    """Give an existing pyqtgraph widget (and its axes) the active theme's colours.

    pyqtgraph reads its config only when an item is created, so a theme switch must
    restyle widgets that outlive it.
    """
    c = theme_colors()
    widget.setBackground(c["plot_bg"])
    plot_item = widget.getPlotItem() if hasattr(widget, "getPlotItem") else None
    if plot_item is not None:
        for name in ("left", "bottom", "right", "top"):
            ax = plot_item.getAxis(name)
            ax.setPen(c["plot_fg"])
            ax.setTextPen(c["plot_fg"])
