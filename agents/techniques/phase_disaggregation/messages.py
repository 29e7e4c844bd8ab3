"""Encode/prefill/decode disaggregation's wire: its phase requests and replies and its data kinds,
registered with ``agents.registry`` by this room (decoded by the shared total decoder)."""

from __future__ import annotations

from agents.envelope import (
    MAX_NEW_TOKENS,
    MAX_ROWS,
    Message,
    SamplingSpec,
    float_tensor_problem,
    sampling_without_history_problem,
)

MAX_RNG_STATE = 1 << 14
"""Bytes of a sampling generator's state (torch's CPU mt19937 state is 5056)."""


class EncodeTiles(Message, frozen=True, tag="encode_tiles"):
    """EPD encode (agents.techniques.phase_disaggregation.phases): run the vision tower and projector over tiles ``tiles`` of
    request ``request`` (float32 N×3×T×T, raw bytes, never pickled). Answered by ``TilesEncoded``."""

    request: int
    tiles: tuple[int, ...]
    shape: tuple[int, ...]
    data: bytes
    send_to: str = ""
    """Push the tokens to this prefill device's data socket (as piece ``piece``) instead of replying
    with them."""
    piece: int = 0

    run: str = ""
    """The run this request belongs to: its data frames carry it as their run id, and an agent drops the
    pieces other runs left in its store (a failed run's stale piece never feeds the next run's request
    of the same index). Empty: ``"epd"`` (a single probe)."""

    def problem(self) -> str:
        return _phase_problem(self)


class TilesEncoded(Message, frozen=True, tag="tiles_encoded"):
    """The tiles' multimodal tokens (float32 N×S×H), with when they ran on the agent's clock."""

    request: int
    tiles: tuple[int, ...]
    shape: tuple[int, ...]
    data: bytes
    """Empty when the tokens went to ``sent_to`` over the data plane."""
    t_start: float
    t_end: float
    sent_to: str = ""
    t_sent: float = 0.0

    def problem(self) -> str:
        return _phase_problem(self)


class PrefillPrompt(Message, frozen=True, tag="prefill_prompt"):
    """EPD prefill: ``input_ids`` with one ``<image>`` per row of ``mm`` (float32 M×H multimodal
    tokens in prompt order); build the KV cache and pick the first token. Answered by
    ``PromptPrefilled``."""

    request: int
    input_ids: tuple[int, ...]
    mm_shape: tuple[int, ...] = ()
    mm: bytes = b""
    """Empty for a text-only prompt, or when the tokens come over the data plane (``mm_pieces``)."""
    sampling: SamplingSpec = SamplingSpec()
    mm_pieces: tuple[int, ...] = ()
    """The pieces (in prompt order) whose tokens encode agents push to this agent's data socket."""
    send_to: str = ""
    """Push the KV cache to this decode device's data socket instead of replying with it."""

    run: str = ""
    """The run this request belongs to: its data frames carry it as their run id, and an agent drops the
    pieces other runs left in its store (a failed run's stale piece never feeds the next run's request
    of the same index). Empty: ``"epd"`` (a single probe)."""

    def problem(self) -> str:
        return _phase_problem(self)


class PromptPrefilled(Message, frozen=True, tag="prompt_prefilled"):
    """The first token, the KV cache (float32 [layers, 2, kv heads, tokens, head dim]) and the
    sampling generator's state after the first draw (decode goes on from it)."""

    request: int
    token: int
    kv_shape: tuple[int, ...]
    kv: bytes
    """Empty when the cache went to ``sent_to`` over the data plane."""
    rng: bytes
    t_start: float
    t_end: float
    mm_received: float = 0.0
    """When the last multimodal piece arrived over the data plane (agent clock; 0: none did)."""
    sent_to: str = ""

    def problem(self) -> str:
        return _phase_problem(self)


class DecodeTokens(Message, frozen=True, tag="decode_tokens"):
    """EPD decode: from ``kv`` and the first token, generate up to ``max_new_tokens`` in all
    (the first included), stopping after an eos. ``copies`` > 1 decodes that many copies as one
    batch (profiling). Answered by ``TokensDecoded``."""

    request: int
    first_token: int
    kv_shape: tuple[int, ...]
    kv: bytes
    max_new_tokens: int
    sampling: SamplingSpec = SamplingSpec()
    rng: bytes = b""
    eos_token_ids: tuple[int, ...] = ()
    copies: int = 1
    kv_from: str = ""
    """The KV cache (``kv_shape``; ``kv`` empty) comes over the data plane from this prefill device."""

    run: str = ""
    """The run this request belongs to: its data frames carry it as their run id, and an agent drops the
    pieces other runs left in its store (a failed run's stale piece never feeds the next run's request
    of the same index). Empty: ``"epd"`` (a single probe)."""

    def problem(self) -> str:
        return _phase_problem(self)


class TokensDecoded(Message, frozen=True, tag="tokens_decoded"):
    """The tokens after the first, and when each decode step ended on the agent's clock."""

    request: int
    tokens: tuple[int, ...]
    step_ends: tuple[float, ...]
    t_start: float
    t_end: float
    kv_received: float = 0.0
    """When the KV cache arrived over the data plane (agent clock; 0: it came with the request)."""


    def problem(self) -> str:
        return _phase_problem(self)


def _sampling_problem(s: SamplingSpec) -> str:
    return sampling_without_history_problem(
        s, "phase requests sample without a repetition penalty or n-gram ban (not supported by EPD)")


def _phase_problem(msg) -> str:
    """EPD's phase requests and replies: ids in range, every tensor's bytes match its shape."""
    if not 0 <= msg.request < 1 << 63:
        return "request must be in [0, 2**63)"
    if len(getattr(msg, "run", "")) > 64:
        return "run must be at most 64 characters"
    if isinstance(msg, (EncodeTiles, TilesEncoded)):
        if not msg.tiles or len(msg.tiles) != (msg.shape[0] if msg.shape else -1) or not all(
                0 <= t < 1 << 16 for t in msg.tiles):
            return f"tiles must name one tile index in [0, 65536) per row of the tensor, got {list(msg.tiles)[:8]}"
        sent = isinstance(msg, TilesEncoded) and msg.sent_to
        if sent:
            return "" if not msg.data and len(msg.shape) == 3 else "tokens sent over the data plane carry no bytes here"
        if isinstance(msg, EncodeTiles) and not 0 <= msg.piece < 1 << 16:
            return "piece must be in [0, 65536)"
        return float_tensor_problem("tiles" if isinstance(msg, EncodeTiles) else "tokens", msg.shape, msg.data,
                                     4 if isinstance(msg, EncodeTiles) else 3)
    if isinstance(msg, PrefillPrompt):
        if not 1 <= len(msg.input_ids) <= 1 << 16 or not all(0 <= i < 1 << 31 for i in msg.input_ids):
            return "input_ids must be 1..65536 token ids in [0, 2**31)"
        if msg.mm_pieces:
            if msg.mm or len(msg.mm_shape) != 2 or len(msg.mm_pieces) > 1 << 16 or \
                    len(set(msg.mm_pieces)) != len(msg.mm_pieces) or not all(0 <= p < 1 << 16 for p in msg.mm_pieces):
                return "mm_pieces: distinct piece ids in [0, 65536), an M×H mm_shape and no mm bytes"
            mm = ""
        else:
            mm = float_tensor_problem("mm", msg.mm_shape, msg.mm, 2) if msg.mm_shape or msg.mm else ""
        return mm or _sampling_problem(msg.sampling)
    if isinstance(msg, (PromptPrefilled, DecodeTokens)):
        token = msg.token if isinstance(msg, PromptPrefilled) else msg.first_token
        if not 0 <= token < 1 << 31 or len(msg.rng) > MAX_RNG_STATE:
            return f"token must be in [0, 2**31) and rng at most {MAX_RNG_STATE} bytes"
        moved = msg.sent_to if isinstance(msg, PromptPrefilled) else msg.kv_from
        if moved:
            ok = not msg.kv and len(msg.kv_shape) == 5 and all(1 <= d <= 1 << 20 for d in msg.kv_shape)
            problem = "" if ok else "a KV cache moved over the data plane has a 5-dim kv_shape and no kv bytes"
        else:
            problem = float_tensor_problem("kv", msg.kv_shape, msg.kv, 5)
        if problem or isinstance(msg, PromptPrefilled):
            return problem
        if not 1 <= msg.max_new_tokens <= MAX_NEW_TOKENS or not 1 <= msg.copies <= MAX_ROWS:
            return f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}] and copies in [1, {MAX_ROWS}]"
        if len(msg.eos_token_ids) > 64:
            return "at most 64 eos_token_ids"
        return _sampling_problem(msg.sampling)
    if isinstance(msg, TokensDecoded):
        if len(msg.tokens) != len(msg.step_ends) or len(msg.tokens) > MAX_NEW_TOKENS:
            return "one step end per token, at most max_new_tokens"
    return ""


PHASE_MESSAGES = (EncodeTiles, TilesEncoded, PrefillPrompt, PromptPrefilled, DecodeTokens, TokensDecoded)
PHASE_REQUESTS = (EncodeTiles, PrefillPrompt, DecodeTokens)


DATA_KINDS = ("mm", "kv")
"""``mm``: multimodal tokens, encode -> prefill (step = request, micro_batch = piece); ``kv``: a KV
cache, prefill -> decode (layers·2 × kv heads × tokens × head dim)."""
