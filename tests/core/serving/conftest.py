"""A real `edgeshard serve` process over a local cluster (real agent processes), its checkpoint,
and transformers' own greedy ``generate`` on that checkpoint as the reference."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from core import formats
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries

ROOT = Path(__file__).resolve().parents[3]
DEVICES = ["edge-0", "edge-1"]
API_KEY = "test-key-0123456789abcdef"
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
"""A chat template of the test tokenizer's own (the server must use it rather than its plain one)."""
CONTEXT = 160


def serve_files(folder: Path, *, chat_template: str | None = CHAT_TEMPLATE,
                devices: list[str] = DEVICES, max_positions: int = CONTEXT) -> tuple[Path, Path]:
    """A tiny Llama checkpoint (a chat template in its tokenizer) and a plan over ``devices``: (model dir, plan)."""
    model = make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3,
                                   max_positions=max_positions), folder / "tiny-llama")
    if chat_template is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        tok.chat_template = chat_template
        tok.save_pretrained(model)
    plan = folder / "plan.json"
    bounds = {1: [], 2: [3], 3: [2, 4]}[len(devices)]
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, devices, bounds))
    return model, plan


def replan_problem(model: Path, devices: list[str], generated_tokens: int, batch_size: int):
    """What ``--problem`` gives the re-planner for ``serve_files``' model over ``devices``, all alike."""
    from core.models.units import load_model_spec
    from core.planning.problem import Workload
    from core.planning.scenarios import DeviceSpec, synthetic_problem

    spec = load_model_spec(str(model), "fp32", name="tiny-llama")
    return synthetic_problem([DeviceSpec(id=d, tflops=1.0, memory_bandwidth_gb_s=10.0, memory_gib=1.0)
                              for d in devices], spec,
                             workload=Workload(prompt_tokens=8, generated_tokens=generated_tokens,
                                               batch_size=batch_size))


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    workspace: Path
    model_dir: Path
    log: Path

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


def start_server(folder: Path, model: Path, plan: Path, *extra: str, key: str | None = API_KEY,
                 agents: Path | None = None) -> Server:
    """``edgeshard serve`` on a free port: over its own local agents, or over ``agents`` (an agents file)."""
    workspace = folder / "ws.sqlite"
    where = ["--agents", str(agents)] if agents is not None else ["--local"]
    argv = [sys.executable, "-m", "core.cli", "serve", "--model", str(model), "--plan", str(plan), *where,
            "--port", "0", "--workspace", str(workspace), "--threads", "1", *extra]
    if key is not None:
        (folder / "key").write_text(key + "\n")
        argv += ["--api-key-file", str(folder / "key")]
    log = folder / "serve.log"
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
    deadline = time.monotonic() + 180
    line = ""
    while "serves" not in line:
        line = proc.stdout.readline()
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"edgeshard serve did not start:\n{log.read_text()}")
    url = line.split()[2]
    return Server(proc, url, workspace, model, log)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for a module's tests; stopped with SIGTERM at the end, which must exit 0."""
    folder = tmp_path_factory.mktemp("serve")
    model, plan = serve_files(folder)
    srv = start_server(folder, model, plan, "--max-new-tokens", "8")
    try:
        yield srv
    finally:
        if srv.process.poll() is None:
            code = srv.stop()
            out = srv.process.stdout.read()
            assert code == 0, srv.log.read_text()
            assert "stopped after" in out


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


class Reference:
    """transformers' own greedy ``generate`` on the served checkpoint, the model loaded once."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def complete_ids(self, ids: list[int], max_new_tokens: int) -> str:
        import torch

        out = self.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=2)
        new = []
        for t in out[0, len(ids):].tolist():
            if t == 2:
                break
            new.append(t)
        return self.tok.decode(new, skip_special_tokens=True)

    def complete(self, prompt: str, max_new_tokens: int) -> str:
        return self.complete_ids(self.tok(prompt)["input_ids"], max_new_tokens)

    def chat(self, messages: list[dict], max_new_tokens: int) -> str:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.complete_ids(self.tok(text, add_special_tokens=False)["input_ids"], max_new_tokens)


@pytest.fixture(scope="module")
def reference(server):
    return Reference(server.model_dir)

