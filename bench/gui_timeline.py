"""Benchmark the live timeline, offscreen: pan/zoom frame rate with 100k boxes, and the
GUI thread's longest stall while a worker thread streams 2,000 events/s through the
EventBridge. Prints one JSON line.

Targets (issue 5): >= 30 fps pan/zoom at 100k boxes; longest GUI stall < 50 ms.
The stall detector is a 5 ms QTimer on the GUI thread: a stall is the gap between two
ticks beyond the interval (the time the event loop could not run). The same detector runs
once without the stream (baseline) so the two figures are compared side by side.

Usage: python bench/gui_timeline.py [--boxes 100000] [--rate 2000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from agents.protocol import TimelineEvent, TokenEvent  # noqa: E402
from gui.timeline.event_bridge import EventBridge  # noqa: E402
from gui.screens.run_monitor import RunMonitorView  # noqa: E402
from gui.timeline import TimelineView  # noqa: E402

DEVICES = ("edge-a", "edge-b", "edge-c", "edge-d")


def synthetic_events(n: int, t0: float = 0.0, seed: int = 0) -> list[TimelineEvent]:
    """``n`` plausible events: 4 lanes, compute/send/recv_wait, 4 micro-batches, steps."""
    rng = np.random.default_rng(seed)
    kinds = ("compute", "send", "recv_wait")
    events = []
    per_lane_t = [t0] * len(DEVICES)
    for i in range(n):
        lane = i % len(DEVICES)
        kind = kinds[int(rng.integers(0, 3))]
        dur = float(rng.uniform(0.0005, 0.004))
        start = per_lane_t[lane]
        per_lane_t[lane] = start + dur * (0.5 if kind == "send" else 1.0)
        step = i // 64
        events.append(TimelineEvent(
            device=DEVICES[lane], stage=lane, kind=kind, phase="prefill" if step == 0 else "decode",
            step=step, micro_batch=(i // 4) % 4, start_s=start, end_s=start + dur,
            nbytes=4096 if kind == "send" else 0, peer=DEVICES[(lane + 1) % len(DEVICES)]))
    return events


class StallDetector:
    """Longest gap between ticks of a short QTimer on the GUI thread, minus its interval."""

    def __init__(self, interval_ms: int = 5):
        self.interval_s = interval_ms / 1000
        self.gaps: list[float] = []
        self._last = None
        self._timer = QTimer()
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._on_timer_timeout)

    def start(self) -> None:
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def _on_timer_timeout(self) -> None:
        now = time.perf_counter()
        self.gaps.append(now - self._last)
        self._last = now

    def longest_stall_ms(self) -> float:
        return max(0.0, (max(self.gaps, default=0.0) - self.interval_s) * 1000)

    def p99_stall_ms(self) -> float:
        if not self.gaps:
            return 0.0
        return max(0.0, (float(np.percentile(self.gaps, 99)) - self.interval_s) * 1000)


def run_loop(app: QApplication, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        app.processEvents()
        time.sleep(0.0005)


def bench_pan_zoom(app: QApplication, n_boxes: int, frames: int) -> dict:
    view = TimelineView()
    view.resize(1600, 700)
    view.show()
    events = synthetic_events(n_boxes)
    t = time.perf_counter()
    view.append_events(events)
    view.flush()
    ingest_s = time.perf_counter() - t
    view.fit_all()
    app.processEvents()
    end = view.measured_item.max_end()
    viewport = view.plot_widget.viewport()
    # Alternate zoomed-out (every box visible) and zoomed-in pans across the run.
    schedule = []
    for i in range(frames):
        if i % 2 == 0:
            w = end * (1.0 - 0.3 * (i % 10) / 10)
            schedule.append((0.0, w))
        else:
            w = end / 50
            x0 = (end - w) * (i / frames)
            schedule.append((x0, x0 + w))
    frame_times = []
    painted_full = []
    for x0, x1 in schedule:
        t = time.perf_counter()
        view.set_x_range(x0, x1)
        viewport.repaint()
        frame_times.append(time.perf_counter() - t)
        painted_full.append(view.measured_item.painted_boxes)
    view.close()
    view.deleteLater()
    app.processEvents()
    ft = np.array(frame_times)
    zoomed_out = ft[0::2]
    return {
        "boxes": n_boxes,
        "ingest_ms": round(ingest_s * 1000, 1),
        "frames": frames,
        "fps_mean": round(float(len(ft) / ft.sum()), 1),
        "fps_zoomed_out_all_visible": round(float(len(zoomed_out) / zoomed_out.sum()), 1),
        "frame_ms_p95": round(float(np.percentile(ft, 95)) * 1000, 2),
        "frame_ms_max": round(float(ft.max()) * 1000, 2),
        "max_boxes_painted_in_a_frame": int(max(painted_full)),
    }


def bench_stream(app: QApplication, rate: int, seconds: float, preload: int, whole_monitor: bool) -> dict:
    """Stream into the bare TimelineView, or into the whole RunMonitorView of the Run
    screen (timeline + figures + tokens/s + utilisation + text, tokens at 5 % of events)."""
    bridge = EventBridge()
    if whole_monitor:
        monitor = RunMonitorView()
        monitor.resize(1600, 800)
        monitor.show()
        monitor.reset(DEVICES)
        view = monitor.timeline
        bridge.timeline_events_arrived.connect(monitor.add_timeline_events)
        bridge.token_events_arrived.connect(monitor.add_token_events)
        if preload:
            monitor.add_timeline_events(synthetic_events(preload))
            monitor.flush()
    else:
        monitor = view = TimelineView()
        view.resize(1600, 700)
        view.show()
        bridge.timeline_events_arrived.connect(view.append_events)
        if preload:
            view.append_events(synthetic_events(preload))
            view.flush()
    app.processEvents()

    baseline = StallDetector()
    baseline.start()
    run_loop(app, 1.0)
    baseline.stop()

    stream_events = synthetic_events(int(rate * seconds), t0=view.measured_item.max_end(), seed=1)
    stop = threading.Event()
    sent = [0]

    def produce() -> None:
        # Per-event callbacks, as the coordinator makes them, paced in 5 ms slices.
        chunk = max(1, rate // 200)
        t_next = time.perf_counter()
        i = 0
        while i < len(stream_events) and not stop.is_set():
            for event in stream_events[i:i + chunk]:
                bridge.on_timeline_event(event)
                if whole_monitor and event.kind == "compute" and event.device == DEVICES[-1] and i % 4 == 0:
                    bridge.on_token_event(TokenEvent(micro_batch=event.micro_batch, step=event.step,
                                                     sequence_ids=(event.micro_batch,), token_ids=(7,),
                                                     text=(" tok",), t_s=event.end_s))
            i += chunk
            sent[0] = i
            t_next += chunk / rate
            delay = t_next - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    detector = StallDetector()
    before = view.measured_item.boxes.size
    repaints = [0]
    original_paint = view.measured_item.paint

    def counting_paint(*args):
        repaints[0] += 1
        return original_paint(*args)

    view.measured_item.paint = counting_paint
    detector.start()
    producer = threading.Thread(target=produce, name="bench-producer")
    t = time.perf_counter()
    producer.start()
    while producer.is_alive():
        app.processEvents()
        time.sleep(0.0005)
    producer.join()
    elapsed = time.perf_counter() - t
    run_loop(app, 0.2)
    bridge.flush()
    view.flush()
    detector.stop()
    drawn = view.measured_item.boxes.size - before
    if whole_monitor:
        monitor.shutdown()
    monitor.close()
    monitor.deleteLater()
    app.processEvents()
    prefix = "monitor_" if whole_monitor else ""
    return {
        f"{prefix}stream_rate_achieved": round(sent[0] / elapsed, 1),
        f"{prefix}events_drawn": int(drawn),
        f"{prefix}repaints": repaints[0],
        f"{prefix}stall_ms_max": round(detector.longest_stall_ms(), 2),
        f"{prefix}stall_ms_p99": round(detector.p99_stall_ms(), 2),
        f"{prefix}baseline_stall_ms_max": round(baseline.longest_stall_ms(), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boxes", type=int, default=100_000)
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--preload", type=int, default=50_000)
    args = parser.parse_args()
    app = QApplication.instance() or QApplication([])
    result = {"bench": "gui_timeline", "platform": os.environ.get("QT_QPA_PLATFORM"),
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "load_avg_1min_at_start": round(os.getloadavg()[0], 2)}
    result.update(bench_pan_zoom(app, args.boxes, args.frames))
    result.update({"stream_rate_target": args.rate, "stream_seconds": args.seconds, "preloaded_boxes": args.preload})
    result.update(bench_stream(app, args.rate, args.seconds, args.preload, whole_monitor=False))
    result.update(bench_stream(app, args.rate, args.seconds, args.preload, whole_monitor=True))
    result["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    result["pan_zoom_ok"] = result["fps_mean"] >= 30
    result["stall_ok"] = result["stall_ms_max"] < 50 and result["monitor_stall_ms_max"] < 50
    print(json.dumps(result))


if __name__ == "__main__":
    main()
