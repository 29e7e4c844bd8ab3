"""The EPD phases' stage kinds (``LoadShard.kind``), apart from ``agents.techniques.phase_disaggregation.phases`` so that the
technique registry can name them without importing torch (the studio's launch imports every
technique; torch is needed only where a phase runs)."""

PHASES = ("encode", "prefill", "decode")

KINDS = {"encode": "epd-encode", "prefill": "epd-prefill", "decode": "epd-decode"}
"""Phase → stage kind (``LoadShard.kind``)."""

COUPLED_KINDS = {("encode", "prefill"): "epd-encode-prefill", ("encode", "prefill", "decode"): "epd-aggregated"}
"""Several phases on one agent (one text model shared by prefill and decode): PD-only's coupled
encode + prefill (DistServe-style) and the aggregated layout's all three."""


def kind_for(phases) -> str:
    """The stage kind of an agent serving ``phases``; ``ValueError`` for a set no layout uses."""
    key = tuple(p for p in PHASES if p in set(phases))
    if len(key) == 1:
        return KINDS[key[0]]
    if key in COUPLED_KINDS:
        return COUPLED_KINDS[key]
    raise ValueError(f"no EPD stage serves the phases {', '.join(key) or '(none)'} together "
                     f"(one phase, encode+prefill or all three)")
