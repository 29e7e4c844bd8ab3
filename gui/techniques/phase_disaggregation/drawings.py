"""What the EPD views draw: the pools (which device serves which phase, each multimodal cache's
peak fill) and a request timeline (each request's encode / transfer / queue / prefill / transfer /
decode spans), for a simulated run or one measured on the agents alike."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QWidget

from core.techniques.phase_disaggregation.simulator import CachePeak
from core.techniques.phase_disaggregation.types import PoolConfig, RequestMetrics

SPANS = (("encode", QColor("#9467bd")), ("E→P", QColor("#bab0ac")), ("queue", QColor("#f2cf5b")),
         ("prefill", QColor("#4c78a8")), ("P→D", QColor("#bab0ac")), ("decode", QColor("#54a24b")))
PHASES = ("encode", "prefill", "decode")
PHASE_COLORS = {"encode": QColor("#9467bd"), "prefill": QColor("#4c78a8"), "decode": QColor("#54a24b")}
LAYOUT_WORDS = {"epd": "EPD (a pool per phase)", "pd": "PD-only (EP coupled)", "aggregated": "aggregated (EPD on each)"}


def pools_text(cfg: PoolConfig) -> str:
    if cfg.disaggregation == "epd":
        return f"E{len(cfg.encode)} P{len(cfg.prefill)} D{len(cfg.decode)}, IRP {cfg.irp_degree}"
    if cfg.disaggregation == "pd":
        return f"EP{len(cfg.prefill)} D{len(cfg.decode)}"
    return f"EPD on each of {len(cfg.prefill)}"


class PoolsDiagram(QWidget):
    """Three columns (encode, prefill, decode), one box per device; under each encode and
    prefill device its multimodal cache's peak fill. A device serving several phases appears
    in each of them."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.config: PoolConfig | None = None
        self.caches: dict[tuple[str, str], CachePeak] = {}
        self.setMinimumSize(260, 150)

    def show_pools(self, config: PoolConfig | None, caches: Sequence[CachePeak] = ()) -> None:
        self.config = config
        self.caches = {(c.device, c.side): c for c in caches}
        self.update()

    def box_label(self, device: str) -> str:
        """A device's box text: its name, and the phases it serves when it serves several (PD-only's
        encode+prefill devices "dev0 EP", the aggregated layout's "dev0 EPD"), so that a
        device drawn in two or three columns reads as one agent, not as several."""
        cfg = self.config
        served = [ph[0].upper() for ph in PHASES if cfg is not None and device in getattr(cfg, ph)]
        return device if len(served) < 2 else f"{device} {''.join(served)}"

    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.fillRect(self.rect(), self.palette().base())
        text = self.palette().text().color()
        if self.config is None:
            p.setPen(text)
            p.drawText(self.rect(), Qt.AlignCenter | Qt.TextWordWrap, "Search to see which device serves which phase")
            return
        cfg = self.config
        cols = (("encode", cfg.encode, "encode-out"), ("prefill", cfg.prefill, "prefill-in"), ("decode", cfg.decode, ""))
        col_w = (self.width() - 16) / 3
        most = max(len(d) for _, d, _ in cols)
        box_h = max(14.0, min(34.0, (self.height() - 34) / most - 4))
        for i, (phase, devs, side) in enumerate(cols):
            x = 8 + i * col_w
            p.setPen(text)
            p.drawText(QRectF(x, 2, col_w, 18), Qt.AlignCenter, f"{phase} ({len(devs)})")
            for k, d in enumerate(devs):
                r = QRectF(x + 6, 24 + k * (box_h + 4), col_w - 12, box_h)
                p.setPen(QPen(PHASE_COLORS[phase].darker(130), 1))
                p.setBrush(PHASE_COLORS[phase].lighter(160))
                p.drawRoundedRect(r, 4, 4)
                p.setPen(QColor("#202020"))
                p.drawText(r.adjusted(4, 0, -4, 0), Qt.AlignVCenter | Qt.AlignLeft,
                           box_text(self.box_label(d), p.fontMetrics(), r.width() - 8, r.height()))
                cache = self.caches.get((d, side))
                if cache is not None:
                    frac = cache.peak_tokens / cache.capacity_tokens
                    bar = QRectF(r.left() + 3, r.bottom() - 5, (r.width() - 6) * min(1.0, frac), 3)
                    p.fillRect(bar, QColor("#e45756") if frac >= 0.999 else QColor("#202020"))
                    p.drawText(r.adjusted(4, 0, -4, 0), Qt.AlignVCenter | Qt.AlignRight, f"{frac:.0%}")
        p.setPen(text)
        p.drawText(QRectF(8, self.height() - 20, self.width() - 16, 18), Qt.AlignLeft | Qt.AlignVCenter,
                   f"{LAYOUT_WORDS.get(cfg.disaggregation, cfg.disaggregation)}"
                   + ("; %: cache peak fill" if self.caches else ""))


def box_text(label: str, metrics, width: float, height: float) -> str:
    """A pool box's text: on one line where it fits, else the device above the phases it serves
    where the box has room for two lines (at 1024x700 "local-0 EPD" read "loc…EPD"), each line
    elided in the middle only if it still does not fit."""
    lines = [label]
    if metrics.horizontalAdvance(label) > width and " " in label and height >= 2 * metrics.height():
        lines = label.split(" ", 1)
    return "\n".join(metrics.elidedText(line, Qt.ElideMiddle, int(width)) for line in lines)


def seconds_text(t: float, span: float) -> str:
    """An axis label readable at the run's scale: milliseconds for a run shorter than 2 s."""
    return f"{t * 1e3:.0f} ms" if span < 2.0 else f"{t:.1f} s"


class RequestTimeline(QWidget):
    """One row per request (the first ``MAX_ROWS``): encode, E→P, queue, prefill, P→D, decode."""

    MAX_ROWS = 40

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.metrics: list[RequestMetrics] = []
        self.placeholder = "Search to see each request's phases"
        self.setMinimumSize(300, 150)

    def show_metrics(self, metrics: Sequence[RequestMetrics]) -> None:
        self.metrics = sorted(metrics, key=lambda m: m.request_id)[:self.MAX_ROWS]
        self.update()

    @staticmethod
    def spans(m: RequestMetrics) -> list[tuple[str, float, float]]:
        """(span name, start, end) of one request, in phase order."""
        edges = [m.encode_start_s, m.encode_end_s, m.ep_transfer_end_s, m.prefill_start_s, m.prefill_end_s,
                 m.pd_transfer_end_s, m.decode_end_s]
        return [(name, a, b) for (name, _), a, b in zip(SPANS, edges, edges[1:])]

    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.fillRect(self.rect(), self.palette().base())
        text = self.palette().text().color()
        p.setPen(text)
        if not self.metrics:
            p.drawText(self.rect(), Qt.AlignCenter | Qt.TextWordWrap, self.placeholder)
            return
        left = 44
        legend = legend_layout([name for name, _ in SPANS], p.fontMetrics(), max(60, self.width() - left - 10))
        bottom = 24 + 18 * (1 + max(row for _, _, row in legend))
        t0 = min(m.arrival_s for m in self.metrics)
        t1 = max(m.decode_end_s for m in self.metrics)
        span = max(t1 - t0, 1e-9)
        width = max(10, self.width() - left - 10)
        row_h = max(2.0, (self.height() - bottom - 6) / len(self.metrics))
        x = lambda t: left + width * (t - t0) / span  # noqa: E731
        for i, m in enumerate(self.metrics):
            y = 4 + i * row_h
            if row_h >= 11:
                p.setPen(text)
                p.drawText(QRectF(0, y, left - 4, row_h), Qt.AlignVCenter | Qt.AlignRight, f"#{m.request_id}")
            p.setPen(QPen(text, 1))
            p.drawLine(int(x(m.arrival_s)), int(y + 1), int(x(m.arrival_s)), int(y + row_h - 1))
            for (name, a, b), (_, color) in zip(self.spans(m), SPANS):
                if b > a:
                    p.fillRect(QRectF(x(a), y + 1, max(1.0, x(b) - x(a)), max(1.0, row_h - 2)), color)
        y = self.height() - bottom + 4
        p.setPen(text)
        p.drawText(QRectF(left, y, width, 14), Qt.AlignLeft, seconds_text(t0, span))
        p.drawText(QRectF(left, y, width, 14), Qt.AlignRight, seconds_text(t1, span))
        for (name, color), (_, dx, row) in zip(SPANS, legend):
            ly = y + 18 + 18 * row
            p.fillRect(QRectF(left + dx, ly + 2, 12, 12), color)
            p.setPen(text)
            p.drawText(QRectF(left + dx + 16, ly, p.fontMetrics().horizontalAdvance(name) + 4, 16), Qt.AlignVCenter, name)


def legend_layout(names: Sequence[str], metrics, width: float) -> list[tuple[str, float, int]]:
    """(name, x offset, row) of each legend entry (a 12 px swatch, its name, a gap), wrapped onto
    another row where the next would pass ``width``: at 1024x700 the six spans at a fixed 86 px
    each ran past the timeline ("prefil", the transfers cut off)."""
    out, dx, row = [], 0.0, 0
    for name in names:
        w = 16 + metrics.horizontalAdvance(name) + 14
        if dx > 0 and dx + w - 14 > width:
            dx, row = 0.0, row + 1
        out.append((name, dx, row))
        dx += w
    return out


__all__ = ["LAYOUT_WORDS", "PoolsDiagram", "RequestTimeline", "pools_text", "seconds_text"]
