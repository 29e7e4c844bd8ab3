"""Speculative decoding (greedy, or seeded speculative sampling) over a loaded layer-sharded plan (the agents' side is
``agents.techniques.speculative``): the source drafts ``k`` tokens with a small checkpoint that
shares the target's tokenizer, the stages verify them in one trip and roll their KV caches back to
what the target accepted. Greedy tokens are plain greedy decoding's; sampled ones are distributed
as the target's (the speculative-sampling rule, ``agents.techniques.speculative.acceptance``);
fewer trips carry them.

``check_draft`` is the entrance's check (before any agent is asked); ``speculative_request`` the
run request ``Coordinator.run`` takes (one sequence, no padding)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from agents.protocol import SamplingSpec
from agents.techniques.speculative.messages import MAX_SPECULATE, ReadStageCache, SpeculativeOptions
from core.errors import EdgeShardError
from core.models.draft_distillation import SPECULATION_FILE, stored_acceptance
from core.planning.speculation import DraftFigures, choose_draft, choose_k, draft_token_s, measured_draft_token_s
from core.runs.run_stream import RunRequest

if TYPE_CHECKING:
    import torch


class DraftMismatch(EdgeShardError):
    """A draft checkpoint the target cannot verify: another vocabulary or tokenizer, or a bad ``k``."""


@dataclass(frozen=True)
class SpeculativeSettings:
    draft_dir: str
    k: int
    draft_device: str = ""
    """The plan's stage device that runs the draft ("": the source)."""


def check_draft_device(plan, device: str | None) -> str:
    """``--draft-device``'s value when the plan has a stage on it ("" for none given), else a one-line
    ``DraftMismatch``: the draft runs on an agent the plan loads (its data socket takes the source's frames)."""
    if not device:
        return ""
    devices = [s.device for s in plan.stages]
    if device not in devices:
        raise DraftMismatch(f"--draft-device {device!r} is not a device of the plan ({', '.join(devices)}): "
                            "name one of its stages' devices")
    return device


def check_draft(target_dir: str | Path, draft_dir: str | Path, k: int) -> SpeculativeSettings:
    """The settings when ``draft_dir`` can draft for ``target_dir`` with ``k`` tokens a trip: the same
    vocabulary size and the same tokenizer files' vocabulary (a token id must mean one thing to both)."""
    if not 1 <= k <= MAX_SPECULATE:
        raise DraftMismatch(f"--speculate must be in [1, {MAX_SPECULATE}], got {k}")
    target, draft = Path(target_dir), Path(draft_dir)
    if not (draft / "config.json").is_file():
        raise DraftMismatch(f"{draft}: no config.json: --draft names a checkpoint directory")
    vocab = {}
    for name, folder in (("target", target), ("draft", draft)):
        try:
            vocab[name] = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DraftMismatch(f"{folder}/config.json: cannot read vocab_size ({err})") from None
    if vocab["target"] != vocab["draft"]:
        raise DraftMismatch(f"draft {draft} has a vocabulary of {vocab['draft']} tokens, the target "
                            f"{vocab['target']}: choose a draft trained with the target's tokenizer")
    if _tokens(target) != _tokens(draft):
        raise DraftMismatch(f"draft {draft}'s tokenizer differs from the target's: "
                            "choose a draft trained with the target's tokenizer")
    return SpeculativeSettings(draft_dir=str(draft.resolve()), k=k)


def _tokens(folder: Path) -> dict[str, int] | None:
    """The tokenizer's token -> id map (None when the checkpoint ships no tokenizer.json)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DraftMismatch(f"{path}: cannot read its vocabulary ({err})") from None


def speculative_request(prompt: list[int] | tuple[int, ...], max_new_tokens: int, settings: SpeculativeSettings, *,
                        eos_token_ids: tuple[int, ...] = (), pad_token_id: int = 0,
                        sampling: SamplingSpec = SamplingSpec(), keep_cache: bool = False) -> RunRequest:
    """The run request of one speculative generation of ``prompt`` (greedy, or ``sampling``'s
    seeded speculative sampling: no repetition penalty or n-gram ban). ``keep_cache``: every stage
    keeps its KV cache over the committed tokens for ``stage_caches`` (a diagnostic)."""
    if not prompt:
        raise DraftMismatch("a speculative run needs a non-empty prompt")
    return RunRequest(input_ids=(tuple(prompt),), attention_mask=((1,) * len(prompt),), max_new_tokens=max_new_tokens,
                      mode="sequential", eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                      sampling=sampling, options=SpeculativeOptions(draft_dir=settings.draft_dir, k=settings.k,
                                                                 keep_cache=keep_cache,
                                                                 draft_device=settings.draft_device))


def speculation_problem(prompts, settings) -> str:
    """Why ``settings`` cannot run speculatively ("" when they can): one prompt, sequential, no
    repetition penalty or n-gram ban (they read each token's history, which a trip's proposals change)."""
    if len(prompts) != 1:
        return f"speculative decoding runs one prompt, got {len(prompts)}"
    if settings.repetition_penalty != 1.0 or settings.no_repeat_ngram_size:
        return "speculative decoding takes no --repetition-penalty or --no-repeat-ngram-size"
    if settings.frequency_penalty or settings.presence_penalty or settings.logit_bias:
        return "speculative decoding takes no --frequency-penalty, --presence-penalty or logit bias"
    if settings.mode != "sequential" or settings.micro_batches not in (None, 1):
        return "speculative decoding runs --mode sequential with one micro-batch"
    return ""


def speculate_k(text: str) -> int | str:
    """``--speculate``'s value: ``auto`` or a k in [1, MAX_SPECULATE]."""
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if not 1 <= k <= MAX_SPECULATE:
        raise argparse.ArgumentTypeError(f"must be auto or an integer in [1, {MAX_SPECULATE}], got {text!r}")
    return k


def draft_figures(problem, plan, draft_dir: str | Path, device: str = "") -> DraftFigures:
    """The cost model's view of a draft on ``device`` ("": the plan's source): its stored acceptance
    rate and its token's cost there as profiling timed it (``Profile.draft_times``), else by proxy
    (``core.planning.speculation.draft_token_s``)."""
    alpha = stored_acceptance(draft_dir)
    if alpha is None:
        raise DraftMismatch(f"{draft_dir} has no measured acceptance rate ({SPECULATION_FILE}): give --speculate K, "
                            "or a draft made by core.models.draft_distillation")
    try:
        layers = int(json.loads((Path(draft_dir) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DraftMismatch(f"{draft_dir}/config.json: cannot read num_hidden_layers ({err})") from None
    timed = measured_draft_token_s(problem, device or plan.stages[0].device, Path(draft_dir).name)
    if timed is not None:
        return DraftFigures(acceptance_rate=alpha, token_s=timed, measured=True, device=device)
    return DraftFigures(acceptance_rate=alpha, token_s=draft_token_s(problem, plan, layers, device), device=device)


def check_compare_draft(draft_dir: str) -> None:
    """A draft Compare can cost: a checkpoint with a stored acceptance rate (one-line ``DraftMismatch``)."""
    if not (Path(draft_dir) / "config.json").is_file():
        raise DraftMismatch(f"{draft_dir}: no config.json: --draft names a checkpoint directory")
    if stored_acceptance(draft_dir) is None:
        raise DraftMismatch(f"{draft_dir} has no measured acceptance rate ({SPECULATION_FILE}): "
                            "make the draft with core.models.draft_distillation")


def speculative_rows(problem, outcomes, draft_dir: str):
    """Per strategy with a plan that fits: (strategy, ``SpeculationChoice`` at the cost model's k,
    ``DraftFigures``): one sequence's predicted decode tokens/s plainly and with the draft. Empty
    without a draft Compare can cost (``check_compare_draft``)."""
    if not draft_dir:
        return []
    try:
        check_compare_draft(draft_dir)
    except DraftMismatch:
        return []
    rows = []
    for x in outcomes:
        if getattr(x, "plan", None) is None or getattr(x.plan, "stages", None) is None or x.status not in ("optimal", "ok"):
            continue
        figures = draft_figures(problem, x.plan, draft_dir)
        rows.append((x.strategy, choose_k(problem, x.plan, figures), figures))
    return rows


def compare_speculation(problem, outcomes, draft_dir: str) -> list[str]:
    """Compare's plain vs speculative lines (``speculative_rows``)."""
    lines = []
    for strategy, c, figures in speculative_rows(problem, outcomes, draft_dir):
        after = "plain decoding is faster" if c.k == 0 else f"{c.speculative_tokens_s:.1f} (k {c.k}, {c.speedup:.2f}x)"
        cost = "draft timed" if figures.measured else "draft by proxy"
        lines.append(f"{strategy}: {c.plain_tokens_s:.1f} -> {after}; {cost} {figures.token_s * 1e3:.1f} ms/token")
    return lines


def speculative_entrance(model_dir: str, draft: str | None, k: int | str | None, prompts, settings,
                         plan=None, problem_of=None, draft_device: str | None = None) -> SpeculativeSettings | None:
    """``edgeshard run --draft DIR --speculate K|auto [--draft-device NAME]``'s check, before any
    agent is started: the settings (None without ``--draft``, or when ``auto`` finds plain decoding
    faster), or a one-line ``DraftMismatch``. ``problem_of``: the run's planning problem, asked only
    for ``auto`` (of ``plan``); ``auto`` without ``--draft-device`` also picks the draft's device."""
    if draft is None:
        if k is not None or draft_device:
            flag = "--speculate" if k is not None else "--draft-device"
            raise DraftMismatch(f"{flag} needs --draft DIR (the draft checkpoint that proposes the tokens)")
        return None
    problem = speculation_problem(prompts, settings)
    if problem:
        raise DraftMismatch(problem)
    if draft_device and plan is None:
        raise DraftMismatch("--draft-device needs the plan (--plan) whose stage runs the draft")
    device = check_draft_device(plan, draft_device) if draft_device else ""
    if k != "auto":
        return replace(check_draft(model_dir, draft, 3 if k is None else k), draft_device=device)
    check_draft(model_dir, draft, 1)
    if problem_of is None or plan is None:
        raise DraftMismatch("--speculate auto needs the plan and its planning problem (--problem)")
    return auto_settings(problem_of(), plan, model_dir, draft, device or None)


def auto_settings(problem, plan, model_dir: str, draft: str, device: str | None = None) -> SpeculativeSettings | None:
    """``--speculate auto``: the cost model's k for ``plan`` and, without ``device``, the stage device
    the draft runs fastest on counting its hops (None: plain decoding is predicted faster)."""
    source = plan.stages[0].device
    devices = [device] if device is not None else [source, *(s.device for s in plan.stages if s.device != source)]
    figures, choice = choose_draft(problem, plan, [draft_figures(problem, plan, draft, "" if d == source else d)
                                                   for d in devices])
    return None if choice.k == 0 else replace(check_draft(model_dir, draft, choice.k), draft_device=figures.device)


def generate_speculative(coordinator, plan, model_dir: str, prompt: str, settings, speculative: SpeculativeSettings,
                         *, sink=None, reporter=None):
    """Load ``plan`` and generate for ``prompt`` (greedy or seeded sampling) with the draft proposing
    ``speculative.k`` tokens a trip: the same tokenization, stop tokens, streamed text and figures as
    ``core.runs.generation.generate`` (the draft's device reads the draft from its own disk)."""
    from core.runs.generation import generate_with, load_plan

    problem = speculation_problem([prompt], settings)
    if problem:
        raise DraftMismatch(problem)
    load_plan(coordinator, plan, model_dir, settings, reporter=reporter)  # no KV reservation: the caches grow
    coordinator.sync_clocks()
    options = SpeculativeOptions(draft_dir=speculative.draft_dir, k=speculative.k,
                                 draft_device=speculative.draft_device)
    return generate_with(lambda request, s: coordinator.run(plan, replace(request, micro_batches=1, options=options),
                                                            s, reporter), model_dir, [prompt], settings, sink=sink)


def stage_caches(coordinator, plan) -> dict[str, tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]:
    """Per stage's device, the KV cache its agent kept after a ``keep_cache`` speculative run (read
    over the wire, ``ReadStageCache``): its length and, per decoder block, keys and values."""
    import torch

    out = {}
    for stage in plan.stages:
        got = coordinator.request(stage.device, ReadStageCache())
        dtype = getattr(torch, got.dtype)
        tensors = {i: tuple(torch.frombuffer(bytearray(b), dtype=dtype).reshape(got.shape) for b in pair)
                   for i, *pair in zip(got.layers, got.keys, got.values)}
        out[stage.device] = (got.length, tensors)
    return out


def trips(result) -> int:
    """The verify trips a speculative run made: the source stage's decode-phase computes."""
    return sum(1 for e in result.events if e.stage == 0 and e.kind == "compute" and e.phase == "decode")


def acceptance_rate(result, k: int, max_new_tokens: int) -> float | None:
    """Of the draft's proposals, the share the target accepted (None without a proposal). A trip's
    tokens arrive at the source together (one time): its accepted proposals and the target's own
    token; it proposed ``min(k, tokens still allowed - 1)``. A trip cut short by EOS counts the
    proposals before it as accepted only up to the EOS."""
    times = sorted({e.t_s for e in result.token_events})
    per_trip = [sum(1 for e in result.token_events if e.t_s == t) for t in times][1:]  # [0]: the prefill's token
    made, proposed, accepted = 1, 0, 0
    for n in per_trip:
        proposed += min(k, max_new_tokens - made - 1)
        accepted += n - 1
        made += n
    return None if proposed == 0 else accepted / proposed
