"""What an EPD run's timeline boxes mean in its replay and Compare: a colour per request, hatched its
encode and prefill, solid its decode (``runtime._event`` records a request as the micro-batch and both
first phases as prefill)."""

from __future__ import annotations

EPD_COLOUR_WORD = "req "
"""Each colour's name: "req 3", the request (the live timeline's micro-batch colours)."""
EPD_LEGEND_TERMS = (("▨", "encode / prefill"), ("■", "decode"), ("<span style='color:gray'>■</span>", "waiting"))
EPD_LEGEND_TOOLTIP = ("Colour = request; hatched = its encode (E lane) and prefill (P lane); solid = its decode; "
                      "thin lower box = its transfer between pools; grey = waiting for input")

__all__ = ["EPD_COLOUR_WORD", "EPD_LEGEND_TERMS", "EPD_LEGEND_TOOLTIP"]
