"""The EPD phases' stage kinds (``LoadShard.kind``), apart from ``agents.phases`` so that the
technique registry can name them without importing torch (the studio's launch imports every
technique; torch is needed only where a phase runs)."""

KINDS = {"encode": "epd-encode", "prefill": "epd-prefill", "decode": "epd-decode"}
"""Phase → stage kind (``LoadShard.kind``)."""
