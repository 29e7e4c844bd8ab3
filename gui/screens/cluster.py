"""The cluster: a topology graph (nodes sized by compute, links by bandwidth) and heatmaps.

*Show plan* draws the current plan's placement on the graph (as exo previews placements):
each device coloured by its stage with the units it holds, and each link the pipeline uses
as an arrow labelled with its predicted traffic (``core.planning.cost.link_bytes_per_token``)
and, once a run has ended, its measured traffic (``core.runs.metrics.link_traffic``).

Compute is the device's decode speed from the profile when there is one (tokens/s of
the whole model at batch 1), else its core count, so the picture is honest about
what it is drawn from; the hover text says which.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPolygonF
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QSplitter, QVBoxLayout, QWidget

from core.devices.cluster import Cluster
from core.devices.profile import Profile
from core.planning.cost import link_bytes_per_token
from core.runs.metrics import link_traffic
from gui.app import stage_color, style_plot, theme_colors
from gui.studio_state import StudioState
from gui.widgets import panel_header, say_why_disabled


def device_compute(cluster: Cluster, profile: Profile | None) -> dict[str, tuple[float, str]]:
    """Per device: (a positive compute figure, its human description)."""
    out: dict[str, tuple[float, str]] = {}
    for d in cluster.devices:
        try:
            t = profile.times_of(d.id) if profile is not None else None
        except KeyError:
            t = None
        if t is not None:
            step = sum(t.decode_time(u, 1) for u in range(len(t.decode_s)))
            speed = 1.0 / step if step > 0 else 0.0
            out[d.id] = (speed, f"{speed:.1f} tokens/s for the whole model (profiled, batch 1)")
        else:
            out[d.id] = (float(max(1, d.cores)), f"{d.cores or '?'} cores (not profiled)")
    return out


def link_matrix(cluster: Cluster) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Device ids, bandwidth (Mbit/s) and latency (ms) matrices; NaN where there is no link."""
    ids = list(cluster.device_ids())
    n = len(ids)
    bw = np.full((n, n), np.nan)
    lat = np.full((n, n), np.nan)
    idx = {d: i for i, d in enumerate(ids)}
    for link in cluster.links:
        if link.src in idx and link.dst in idx:
            bw[idx[link.src], idx[link.dst]] = link.bandwidth_mbit_s
            lat[idx[link.src], idx[link.dst]] = link.latency_ms
    return ids, bw, lat


def fmt_mbit(v: float) -> str:
    return f"{v / 1000:.1f} Gbit/s" if v >= 1000 else f"{v:.0f} Mbit/s" if v >= 10 else f"{v:.2f} Mbit/s"


def fmt_bytes(n: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def placement_of(plan, problem) -> dict[str, str]:
    """Device → what the plan puts there ("stage 1 · units 4–9"); devices without a stage are absent."""
    out: dict[str, str] = {}
    for j, st in enumerate(plan.stages):
        units = f"unit {st.start}" if st.end - st.start == 1 else f"units {st.start}–{st.end - 1}"
        text = f"stage {j} · {units}"
        out[st.device] = out[st.device] + "; " + text if st.device in out else text
    return out


def traffic_label(predicted: int | None, measured) -> str:
    """A plan link's label: predicted and (after a run) measured bytes per generated token."""
    parts = [f"{fmt_bytes(predicted)}/token predicted" if predicted is not None else "no prediction"]
    if measured is not None:
        per = measured.bytes_per_token
        parts.append(f"{fmt_bytes(per)}/token measured" if per is not None
                     else f"{fmt_bytes(measured.total_bytes)} measured (no decode step)")
    return "\n".join(parts)


LINK_LABEL_Z = 5
"""Link labels sit above the link lines (z 0) and their midpoint markers."""
PLAN_Z = 3
"""The plan's arrows above the links, below the labels."""

def _rect_hits_circle(rect: QRectF, cx: float, cy: float, r: float) -> bool:
    nx = min(max(cx, rect.left()), rect.right())
    ny = min(max(cy, rect.top()), rect.bottom())
    return (nx - cx) ** 2 + (ny - cy) ** 2 < r * r


def _rect_hits_segment(rect: QRectF, a: QPointF, b: QPointF) -> bool:
    steps = max(2, int(math.hypot(b.x() - a.x(), b.y() - a.y()) / 3))  # every ~3 px
    return any(rect.contains(QPointF(a.x() + (b.x() - a.x()) * k / steps, a.y() + (b.y() - a.y()) * k / steps))
               for k in range(steps + 1))


def place_labels(labels: list[tuple[float, float, list[QPointF]]], circles: list[tuple[QPointF, float]],
                 segments: list[tuple[QPointF, QPointF, float]], bounds: QRectF) -> list[QRectF]:
    """Pick, for each label (width, height, candidate centres in preference order; pixels), the
    candidate whose rectangle meets the least: outside ``bounds``, another label placed before it,
    a device's circle (centre, radius) or a drawn line (ends, weight: arrows weigh more than
    links). Labels are placed in the given order, each seeing the ones placed before it."""
    placed: list[QRectF] = []
    for w, h, candidates in labels:
        best, best_cost = None, math.inf
        for rank, c in enumerate(candidates):
            rect = QRectF(c.x() - w / 2, c.y() - h / 2, w, h)
            cost = (100.0 if not bounds.contains(rect) else 0.0) + 20.0 * sum(rect.intersects(o) for o in placed)
            cost += 20.0 * sum(_rect_hits_circle(rect, o.x(), o.y(), r) for o, r in circles)
            if cost + rank * 0.01 >= best_cost:
                continue
            cost += sum(weight for a, b, weight in segments if _rect_hits_segment(rect, a, b))  # the slowest test last
            if cost + rank * 0.01 < best_cost:
                best, best_cost = rect, cost + rank * 0.01
            if cost == 0.0:
                break  # the first free candidate in preference order
        placed.append(best)
    return placed


def node_label_candidates(centre: QPointF, radius: float, outward: tuple[float, float], w: float,
                          h: float, pad: float = 4.0) -> list[QPointF]:
    """Centres for a device's label just outside its circle: away from the ring's centre first
    (where the links are not), then turning either way round the device."""
    base = math.atan2(outward[1], outward[0])
    out = []
    for turn in (0, 1, -1, 2, -2, 3, -3, 4):
        a = base + turn * math.pi / 4
        dx, dy = math.cos(a), math.sin(a)
        sy = math.copysign(h / 2, dy) if abs(dy) > 0.3 else 0.0
        if abs(dx) > 0.3:
            slides = [math.copysign(w / 2, dx)]
        elif abs(outward[0]) < 0.2 * math.hypot(*outward):  # a device at the ring's top or bottom: centred
            slides = [-dx * (radius + pad)]
        else:  # above or below: reaching out of the ring first (its middle is where the links run), then centred
            slides = [math.copysign(max(0.0, w / 2 - radius), outward[0]) - dx * (radius + pad), 0.0]
        for sx in slides:
            out.append(QPointF(centre.x() + dx * (radius + pad) + sx, centre.y() + dy * (radius + pad) + sy))
    return out


def link_label_candidates(a: QPointF, b: QPointF, side: float, w: float, h: float, gap: float = 4.0) -> list[QPointF]:
    """Centres for a link's label beside the segment a→b: at its middle first, then sliding
    along it away from the devices' ends, on the ``side`` (+1/-1 of the normal) first."""
    length = math.hypot(b.x() - a.x(), b.y() - a.y()) or 1.0
    ux, uy = (b.x() - a.x()) / length, (b.y() - a.y()) / length
    nx, ny = -uy, ux
    reach = abs(nx) * w / 2 + abs(ny) * h / 2 + gap  # the label's half extent along the normal
    out = []
    for away in (0.0, h * 0.5, h, h * 1.5, h * 2):  # then farther from the line, where the devices' circles end
        for t in (0.5, 0.42, 0.58, 0.34, 0.66, 0.26, 0.74):
            for sgn in (side, -side):
                out.append(QPointF(a.x() + (b.x() - a.x()) * t + nx * (reach + away) * sgn,
                                   a.y() + (b.y() - a.y()) * t + ny * (reach + away) * sgn))
    return out


def _link_tip(tips: dict[tuple[str, str], str], x, y, data) -> str:
    """A link marker's tooltip. Given to the scatter item with the panel's dict, not as a lambda over the
    panel: an item keeping its owner's closure made a cycle the panel was never freed from (and, for the
    timeline's view box, a segfault when collected: docs/gui.md)."""
    return tips.get(tuple(data), "")


class ClusterPanel(QWidget):
    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Cluster", "Devices sized by compute, links drawn by measured bandwidth. "
                                   "Hover a device or a link's midpoint for its figures."))
        self.summary = QLabel("No cluster yet: discover devices or load a profile.")
        self.summary.setProperty("role", "subtitle")
        self.plan_check = QCheckBox("Show plan")
        self.plan_check.setAccessibleName("Show plan on the topology")
        self.plan_check.setToolTip("Draw the current plan on the graph: each device's stage and units, and each "
                                   "link's traffic per generated token, predicted by the cost model and measured "
                                   "in the last run")
        self.plan_check.toggled.connect(lambda _on: self.refresh())
        say_why_disabled({self.plan_check: "no plan yet: make one on the Plan screen (Auto-solve, Ctrl+R)"})
        row = QHBoxLayout()
        row.addWidget(self.summary, 1)
        row.addWidget(self.plan_check)
        lay.addLayout(row)
        split = QSplitter(Qt.Horizontal)
        self.graph = pg.PlotWidget()
        self.graph.setAccessibleName("Topology graph")
        self.graph.setToolTip("Devices (node size = compute) and links (line width = bandwidth)")
        self.graph.hideAxis("left")
        self.graph.hideAxis("bottom")
        self.graph.setAspectLocked(True)
        self.graph.setMenuEnabled(False)
        split.addWidget(self.graph)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        self.heatmaps = pg.GraphicsLayoutWidget()
        self.heatmaps.setAccessibleName("Bandwidth and latency heatmaps")
        self.heatmaps.setToolTip("Rows: from; columns: to")
        rl.addWidget(self.heatmaps)
        split.addWidget(right)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        lay.addWidget(split, 1)
        self.node_tips: dict[str, str] = {}
        self.link_tips: dict[tuple[str, str], str] = {}
        self.link_labels: list[pg.TextItem] = []
        """The bandwidth label of each drawn link (on a chip above the line, not struck through by it)."""
        self.placement: dict[str, str] = {}
        """Device → its stage and units, while the plan is shown."""
        self.plan_links: dict[tuple[str, str], str] = {}
        """(src, dst) → the traffic label of each link the shown plan uses."""
        self._label_specs: list[tuple] = []
        """The graph's labels to lay out, each ("node", item, centre, radius px) or ("link", item,
        a, b, mid of the link) in data coordinates; laid out again whenever the view's scale changes."""
        self._circles: list[tuple[tuple[float, float], float]] = []
        self._segments: list[tuple[tuple[float, float], tuple[float, float], float]] = []
        self.graph.getPlotItem().getViewBox().sigTransformChanged.connect(self._on_view_transformed)
        self._stale = False
        """A change came while this screen was hidden in a shown window: redraw when shown."""
        state.cluster_changed.connect(lambda _c: self._on_state_changed())
        state.profile_changed.connect(lambda _p: self._on_state_changed())
        state.plan_changed.connect(lambda _p: self._on_state_changed())
        state.last_run_changed.connect(self._on_state_changed)
        self.refresh()

    def _on_state_changed(self) -> None:
        """Redraw now, or, while another screen of a shown window is on screen, when this one is
        shown: a redraw builds the graph and two heatmaps (~0.2 s), and the demo's agents
        attaching with a kept profile changed the cluster, profile and plan four times at once."""
        if self.window().isVisible() and not self.isVisible():
            self._stale = True
            return
        self.refresh()

    def showEvent(self, event) -> None:
        if self._stale:
            self.refresh()
        super().showEvent(event)

    def refresh(self) -> None:
        self._stale = False
        self.graph.clear()
        self.heatmaps.clear()
        style_plot(self.graph)
        style_plot(self.heatmaps)
        self.node_tips.clear()
        self.link_tips.clear()
        self.link_labels.clear()
        self._label_specs, self._circles, self._segments = [], [], []
        self.placement.clear()
        self.plan_links.clear()
        self.plan_check.setEnabled(self.state.plan is not None)
        cluster = self.state.cluster
        if cluster is None or not cluster.devices:
            self.summary.setText("No cluster yet: discover devices on the Devices screen, or load a profile (Ctrl+Shift+P).")
            return
        c = theme_colors()
        ids, bw, lat = link_matrix(cluster)
        n = len(ids)
        finite = bw[np.isfinite(bw)]
        self.summary.setText(
            f"{n} device(s), {len(cluster.links)} directed link(s)"
            + (f"; bandwidth {fmt_mbit(finite.min())} – {fmt_mbit(finite.max())}" if finite.size else "; no links measured")
        )
        plan = self.state.plan if self.plan_check.isChecked() else None
        self._plan_pairs = []
        if plan is not None and self.state.problem is not None:
            self.placement.update(placement_of(plan, self.state.problem))
            self._plan_pairs = [{a, b} for a, b in link_bytes_per_token(self.state.problem, plan)]
        self._draw_graph(cluster, ids, bw, lat, c)
        if plan is not None and self.state.problem is not None:
            self._draw_plan(plan, ids, c)
        self.layout_labels()
        # the unit in the title only: a cell is ~60 px wide at 1024x700 ("1.0 Gbit/s" overran it)
        self._draw_heatmap(0, "Bandwidth (Mbit/s)", ids, bw, "viridis", lambda v: f"{v:.0f}" if v >= 10 else f"{v:.2f}")
        self._draw_heatmap(1, "Latency (ms)", ids, lat, "inferno", lambda v: f"{v:.1f}")

    def _positions(self, n: int) -> list[tuple[float, float]]:
        if n == 1:
            return [(0.0, 0.0)]
        return [(math.cos(2 * math.pi * i / n + math.pi / 2), math.sin(2 * math.pi * i / n + math.pi / 2)) for i in range(n)]

    def _draw_graph(self, cluster: Cluster, ids, bw, lat, c) -> None:
        pos = self._positions(len(ids))
        compute = device_compute(cluster, self.state.profile)
        max_c = max(v for v, _ in compute.values()) or 1.0
        finite = bw[np.isfinite(bw)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 1.0)
        mids, mid_tips = [], []
        for i in range(len(ids)):
            for j in range(i + 1, len(ids)):
                ab, ba = bw[i, j], bw[j, i]
                if not (np.isfinite(ab) or np.isfinite(ba)):
                    continue
                best = np.nanmax([ab, ba])
                frac = 0.5 if hi <= lo else (math.log(best) - math.log(lo)) / (math.log(hi) - math.log(lo))
                pen = pg.mkPen(QColor(c["muted"]), width=1.5 + 7 * frac)
                (x0, y0), (x1, y1) = pos[i], pos[j]
                self.graph.addItem(pg.PlotCurveItem([x0, x1], [y0, y1], pen=pen))
                self._segments.append(((x0, y0), (x1, y1), 3.0))
                tip = (f"{ids[i]} → {ids[j]}: {fmt_mbit(ab) if np.isfinite(ab) else 'no link'}, "
                       f"{lat[i, j]:.1f} ms\n{ids[j]} → {ids[i]}: {fmt_mbit(ba) if np.isfinite(ba) else 'no link'}, "
                       f"{lat[j, i]:.1f} ms")
                self.link_tips[(ids[i], ids[j])] = tip
                mids.append(((x0 + x1) / 2, (y0 + y1) / 2))
                mid_tips.append((ids[i], ids[j]))  # looked up on hover: the plan adds its traffic later
                if self._plan_pairs and {ids[i], ids[j]} in self._plan_pairs:
                    continue  # the plan's traffic label takes this link's midpoint (the heatmap has its bandwidth)
                # a chip of the background colour above the line: a diagonal line no longer strikes through the text
                label = pg.TextItem(fmt_mbit(best), color=c["muted"], anchor=(0.5, 0.5), fill=pg.mkBrush(c["base"]))
                label.setZValue(LINK_LABEL_Z)
                label.setPos((x0 + x1) / 2, (y0 + y1) / 2)
                self.graph.addItem(label)
                self.link_labels.append(label)
                self._label_specs.append(("link", label, (x0, y0), (x1, y1), (0.0, 0.0), False))
        if mids:
            self.graph.addItem(pg.ScatterPlotItem(
                pos=mids, size=9, brush=pg.mkBrush(c["base"]), pen=pg.mkPen(c["muted"]), data=mid_tips,
                hoverable=True, tip=functools.partial(_link_tip, self.link_tips), hoverSize=13))
        sizes, brushes, tips = [], [], []
        source = self.state.problem.source if self.state.problem else None
        stage_of = ({st.device: j for j, st in reversed(list(enumerate(self.state.plan.stages)))}
                    if self.placement and self.state.plan is not None else {})
        for i, d in enumerate(cluster.devices):
            value, desc = compute[d.id]
            sizes.append(28 + 50 * math.sqrt(value / max_c))
            if self.placement:  # coloured by stage as on the Plan screen; a device without one is grey
                brushes.append(pg.mkBrush(stage_color(stage_of[d.id]) if d.id in stage_of else QColor(c["alt_base"])))
            else:
                brushes.append(pg.mkBrush(stage_color(i)))
            tip = (f"{d.id}\n{desc}\nmemory {d.memory_bytes / 2**30:.1f} GiB"
                   + (f"\n{d.arch}" if d.arch else "") + (f", {d.accelerator}" if d.accelerator else "")
                   + ("\nprompt source" if d.id == source else "")
                   + (f"\n{self.placement.get(d.id, 'no stage in the plan')}" if self.placement else ""))
            tips.append(tip)
            self.node_tips[d.id] = tip
        self.graph.addItem(pg.ScatterPlotItem(
            pos=pos, size=sizes, brush=brushes, pen=pg.mkPen(c["text"], width=1.5), data=tips,
            hoverable=True, tip=lambda x, y, data: data))
        bold = QFont(self.font())
        bold.setBold(True)
        for (x, y), d, size in zip(pos, cluster.devices, sizes):
            name = d.id + (f"\n{self.placement.get(d.id, 'no stage')}" if self.placement else "")
            # on a chip of the background colour, placed outside its device away from the links (layout_labels)
            t = pg.TextItem(name, color=c["text"], anchor=(0.5, 0.5), fill=pg.mkBrush(c["base"]))
            t.setFont(bold)
            t.setZValue(LINK_LABEL_Z)
            t.setPos(x, y - 0.24)  # until layout_labels places it
            self.graph.addItem(t)
            self._circles.append(((x, y), size / 2 + 1))
            self._label_specs.insert(0, ("node", t, (x, y), size / 2 + 1))  # devices' labels first: fewest places
        room = 1.65 if self.placement else 1.5  # the plan's labels are two lines each: more room round the ring
        self.graph.setRange(xRange=(-1.5, 1.5), yRange=(-room, room), padding=0.05)
        self._node_pos = dict(zip(ids, pos))

    def _draw_plan(self, plan, ids, c) -> None:
        """The pipeline's links as arrows (stage j → j+1, the last back to the source), each
        labelled with its predicted and measured traffic per generated token."""
        predicted = link_bytes_per_token(self.state.problem, plan)
        measured = (link_traffic(self.state.last_run_events, self.state.last_run_tokens)
                    if self.state.last_run_events else {})
        accent = QColor(c["accent"])
        for (src, dst), nbytes in predicted.items():
            if src not in self._node_pos or dst not in self._node_pos:
                continue
            (x0, y0), (x1, y1) = self._node_pos[src], self._node_pos[dst]
            length = math.hypot(x1 - x0, y1 - y0) or 1.0
            # each direction offset to its own side, so a there-and-back pair draws two arrows
            nx, ny = -(y1 - y0) / length * 0.06, (x1 - x0) / length * 0.06
            # from the edge of one node to the next, not through their centres
            ax0, ay0 = x0 + (x1 - x0) * 0.18 + nx, y0 + (y1 - y0) * 0.18 + ny
            ax1, ay1 = x0 + (x1 - x0) * 0.82 + nx, y0 + (y1 - y0) * 0.82 + ny
            line = pg.PlotCurveItem([ax0, ax1], [ay0, ay1], pen=pg.mkPen(accent, width=3))
            line.setZValue(PLAN_Z)
            self.graph.addItem(line)
            self._segments.append(((ax0, ay0), (ax1, ay1), 10.0))
            # the head: a triangle in data coordinates (the view's aspect is locked), at the line's end
            ux, uy = (ax1 - ax0) / length, (ay1 - ay0) / length
            px, py = -uy, ux
            head = pg.QtWidgets.QGraphicsPolygonItem(QPolygonF([
                QPointF(ax1, ay1), QPointF(ax1 - ux * 0.1 + px * 0.045, ay1 - uy * 0.1 + py * 0.045),
                QPointF(ax1 - ux * 0.1 - px * 0.045, ay1 - uy * 0.1 - py * 0.045)]))
            head.setBrush(pg.mkBrush(accent))
            head.setPen(pg.mkPen(accent))
            head.setZValue(PLAN_Z)
            self.graph.addItem(head)
            text = traffic_label(nbytes, measured.get((src, dst)) if self.state.last_run_events else None)
            self.plan_links[(src, dst)] = text
            label = pg.TextItem(text, color=c["text"], anchor=(0.5, 0.5),
                                border=pg.mkPen(accent), fill=pg.mkBrush(c["base"]))
            label.setZValue(LINK_LABEL_Z + 1)
            label.setPos((x0 + x1) / 2, (y0 + y1) / 2)  # until layout_labels places it
            # beside the link, clear of its arrow (``shift`` off the link's line)
            self._label_specs.insert(len(self._circles), ("link", label, (x0, y0), (x1, y1), (nx, ny),
                                                          (dst, src) in predicted))
            pair = (src, dst) if (src, dst) in self.link_tips else (dst, src)
            if pair in self.link_tips:
                run = measured.get((src, dst))
                self.link_tips[pair] += (f"\nplan: {src} → {dst} " + text.replace("\n", ", ")
                                         + (f" ({fmt_bytes(run.total_bytes)} in the last run)" if run else ""))
            self.graph.addItem(label)

    def _on_view_transformed(self, *_) -> None:
        self.layout_labels()

    def layout_labels(self) -> None:
        """Place the graph's labels (sized in pixels) where they meet no other label, device or
        line at the view's present scale (``place_labels``): devices first (outside their circle,
        away from the ring's centre), then the plan's traffic, then the links' bandwidth chips
        (each beside its link, sliding along it or away from it where that is taken)."""
        vb = self.graph.getPlotItem().getViewBox()
        if not self._label_specs or vb.width() < 10:
            return
        to_px = vb.mapViewToScene
        circles = [(to_px(QPointF(*centre)), r) for centre, r in self._circles]
        segments = [(to_px(QPointF(*a)), to_px(QPointF(*b)), w) for a, b, w in self._segments]
        ring = to_px(QPointF(0.0, 0.0))
        labels = []
        for spec in self._label_specs:
            box = spec[1].textItem.boundingRect()
            w, h = box.width() + 2, box.height() + 2
            if spec[0] == "node":
                centre = to_px(QPointF(*spec[2]))
                outward = (centre.x() - ring.x(), centre.y() - ring.y())
                if math.hypot(*outward) < 1:
                    outward = (0.0, 1.0)  # a single device: below it
                labels.append((w, h, node_label_candidates(centre, spec[3], outward, w, h)))
            else:
                a, b = to_px(QPointF(*spec[2])), to_px(QPointF(*spec[3]))
                mid = QPointF((a.x() + b.x()) / 2, (a.y() + b.y()) / 2)
                shifted = to_px(QPointF((spec[2][0] + spec[3][0]) / 2 + spec[4][0], (spec[2][1] + spec[3][1]) / 2 + spec[4][1]))
                shift = (shifted.x() - mid.x(), shifted.y() - mid.y())
                nx, ny = -(b.y() - a.y()), b.x() - a.x()
                # away from the ring's centre (outside, where the links do not cross), or, for one of
                # a there-and-back pair of arrows, on its arrow's side of the link
                ref = shift if spec[5] else (mid.x() - ring.x(), mid.y() - ring.y())
                side = 1.0 if nx * ref[0] + ny * ref[1] >= 0 else -1.0
                labels.append((w, h, link_label_candidates(a, b, side, w, h, gap=4.0 + math.hypot(*shift) + 2.0)))
        rects = place_labels(labels, circles, segments, vb.sceneBoundingRect())
        for spec, rect in zip(self._label_specs, rects):
            spec[1].setPos(vb.mapSceneToView(rect.center()))

    def _draw_heatmap(self, row: int, title: str, ids, m: np.ndarray, cmap: str, fmt) -> None:
        c = theme_colors()
        p = self.heatmaps.addPlot(row=row, col=0, title=title)
        p.setMenuEnabled(False)
        p.setMouseEnabled(False, False)
        p.invertY(True)
        n = len(ids)
        finite = m[np.isfinite(m)]
        # the scale starts at 0 so near-equal links look equal (not min..max stretched)
        lo, hi = 0.0, (float(finite.max()) if finite.size else 1.0)
        img = pg.ImageItem(np.nan_to_num(m.T, nan=lo), levels=(lo, hi if hi > lo else lo + 1))
        img.setColorMap(pg.colormap.get(cmap))
        p.addItem(img)
        for i in range(n):
            for j in range(n):
                v = m[i, j]
                if not np.isfinite(v):
                    blank = pg.QtWidgets.QGraphicsRectItem(j, i, 1, 1)
                    blank.setBrush(pg.mkBrush(c["alt_base"]))
                    blank.setPen(pg.mkPen(None))
                    p.addItem(blank)
                txt = "—" if not np.isfinite(v) else fmt(v)
                bright = np.isfinite(v) and hi > lo and (v - lo) / (hi - lo) > 0.6
                color = "#111111" if bright else "#ffffff" if np.isfinite(v) else c["muted"]
                t = pg.TextItem(txt, color=color, anchor=(0.5, 0.5))
                t.setPos(j + 0.5, i + 0.5)
                p.addItem(t)
        ticks = [[(k + 0.5, d) for k, d in enumerate(ids)]]
        p.getAxis("bottom").setTicks(ticks)
        p.getAxis("left").setTicks(ticks)
        p.setLabel("left", "from")
        p.setLabel("bottom", "to")
        p.setRange(xRange=(0, n), yRange=(0, n), padding=0)
