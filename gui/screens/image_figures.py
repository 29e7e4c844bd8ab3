"""A spatial (CNN) run's figures in its own words: images, time per image, images/s.

Its recorded run keeps one "token" per classified image (the top class), so the language-model
figures (``core.runs.metrics``) are computed for it as for any run; the replay and Compare named
them TTFT, Latency / token and Tokens. These name them for what they measure on a CNN run."""

from __future__ import annotations

IMAGE_CARDS = (("First image", "Time until the first image's class reached the gateway"),
               ("Time / image", "Mean time between consecutive images' classes"),
               ("Images/s", "Images classified per second over the run"),
               ("Images", "Images classified so far"))
"""The run monitor's four cards (TTFT, latency, rate, count) for an image run."""

IMAGE_HEADINGS = ("Images per second", "Top class per image")
"""The monitor's rate plot and text headings for an image run (its "text" is each image's class)."""

IMAGE_ROWS = {"TTFT": "First image", "Latency / token": "Time / image", "Tokens/s (all)": "Images/s",
              "Tokens": "Images"}
"""Compare's language-model rows as an image run names them; "Decode tokens/s" has no meaning there."""


def class_text(index: int, labels: tuple[str, ...] | None) -> str:
    """An image's recorded top class as a presenter reads it: "class 7", its label beside it where the
    model names its classes ("class 7 (cat)"); ``labels`` None: a prediction, which classifies nothing."""
    if labels is None:
        return "not classified (a prediction)"
    label = labels[index] if 0 <= index < len(labels) else ""
    return f"class {index}" if not label or label == str(index) else f"class {index} ({label})"


def recorded_class_labels(kind: str, origin) -> tuple[str, ...] | None:
    """A recorded spatial run's class names, from its stored origin's model (none: class numbers);
    None for a predicted run, whose "classes" are the simulator's placeholders."""
    if kind == "predicted":
        return None
    from core.errors import EdgeShardError
    from core.techniques.run_origin import plan_origin

    try:
        return tuple(plan_origin(origin).problem.model.labels) if origin is not None else ()
    except (ValueError, AttributeError, EdgeShardError):  # not a spatial origin, or unreadable
        return ()


def is_image_run(settings: dict | None) -> bool:
    """Whether a recorded run classified images (the spatial technique) rather than generated tokens."""
    return (settings or {}).get("technique") == "spatial"


def image_rows(rows: list[tuple[str, str, str]], a_images: bool, b_images: bool) -> list[tuple[str, str, str]]:
    """Compare's rows with an image run's figures named as images: both runs' → image terms (no decode
    row); one of each → both names ("TTFT · first image"), the decode figure '—' on the image side."""
    if not (a_images or b_images):
        return rows
    out = []
    for name, a, b in rows:
        if name == "Decode tokens/s":
            if a_images and b_images:
                continue
            a, b = ("—" if a_images else a), ("—" if b_images else b)
        elif name in IMAGE_ROWS:
            name = IMAGE_ROWS[name] if a_images and b_images else f"{name} · {IMAGE_ROWS[name].lower()}"
        out.append((name, a, b))
    return out


__all__ = ["IMAGE_CARDS", "IMAGE_HEADINGS", "IMAGE_ROWS", "class_text", "image_rows", "is_image_run", "recorded_class_labels"]
