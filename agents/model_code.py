"""Importing the model code (transformers) once, before a shard is loaded (see ``agents.agent``)."""

from __future__ import annotations

import threading

MODEL_CODE_IMPORTED = threading.Event()
"""Set once the model code is imported; the worker waits for it before loading or profiling,
because transformers' lazy modules break when two threads import them at once."""
MODEL_CODE_IMPORTED.set()  # an agent made in-process (tests) imports on first use, in its worker


def warm_imports() -> None:
    """Import what loading a shard needs (see the module docstring). ``modeling_utils`` too, which
    ``AutoModelForCausalLM`` imports only when a model is first built: each agent the zygote forked
    paid it again (0.86 s of CPU each) at its first profile or load."""
    import transformers.masking_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, DynamicCache  # noqa: F401

    import agents.shard  # noqa: F401


def warm_imports_in_background(on_error) -> threading.Thread:
    """``warm_imports`` on a thread; loads and profiles wait for it (MODEL_CODE_IMPORTED)."""
    MODEL_CODE_IMPORTED.clear()

    def run() -> None:
        try:
            warm_imports()
        except ImportError as err:  # reported again, precisely, when a shard is loaded
            on_error(err)
        finally:
            MODEL_CODE_IMPORTED.set()

    t = threading.Thread(target=run, name="agent-warm-imports", daemon=True)
    t.start()
    return t
