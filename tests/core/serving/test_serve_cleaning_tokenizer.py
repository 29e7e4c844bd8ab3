"""A checkpoint whose tokenizer cleans up spaces over the whole text (BERT-style WordPiece,
``clean_up_tokenization_spaces=True``) served by a real `edgeshard serve`: its stream, its whole
answer and transformers' ``decode`` of a plain torch greedy loop's tokens are the same text."""

from __future__ import annotations

import pytest

from core.models.checkpoints import train_wordpiece_tokenizer
from tests.core.serving.conftest import API_KEY, Reference, serve_files, start_server

JOINED = ("'", "s", "t", "re")
"""Pieces the clean-up joins (" ' s" -> "'s"), pushed up by a logit bias so the greedy answer is made of them."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-wordpiece")
    model, plan = serve_files(folder, chat_template=None)
    train_wordpiece_tokenizer(512).save_pretrained(model)
    srv = start_server(folder, model, plan, "--max-new-tokens", "16")
    try:
        yield srv, Reference(model)
    finally:
        if srv.process.poll() is None:
            assert srv.stop() == 0, srv.log.read_text()


def _greedy_ids(reference: Reference, prompt: str, n: int, bias: dict[int, float]) -> list[int]:
    """A plain torch greedy loop over the checkpoint's forward with OpenAI's logit bias added (stops after EOS, id 2)."""
    import torch

    ids, out = reference.tok(prompt)["input_ids"], []
    with torch.no_grad():
        while len(out) < n and (not out or out[-1] != 2):
            logits = reference.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
            for j, b in bias.items():
                logits[j] += b
            out.append(int(logits.argmax()))
    return [t for t in out if t != 2]


def test_the_stream_and_the_whole_answer_equal_transformers_decode_when_the_tokenizer_cleans_up_spaces(served):
    import openai

    server, reference = served
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    bias = {i: 30.0 for i in reference.tok.convert_tokens_to_ids(list(JOINED))}
    ids = _greedy_ids(reference, "the cat", 16, bias)
    expected = reference.tok.decode(ids, skip_special_tokens=True)
    assert expected != reference.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    ask = dict(model="tiny-llama", prompt="the cat", max_tokens=16, temperature=0,
               logit_bias={str(k): v for k, v in bias.items()})
    assert client.completions.create(**ask).choices[0].text == expected
    assert "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True)) == expected
