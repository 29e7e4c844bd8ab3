"""The agent's weights store: files by content hash, resumed at the byte they stopped,
checked by sha256 at the last byte, and refused when a name or digest is not safe."""

from __future__ import annotations

import hashlib
import os

import pytest

from agents.weights import WeightStore, WeightStoreError

DATA = os.urandom(300_000)
DIGEST = hashlib.sha256(DATA).hexdigest()


def test_a_file_sent_in_chunks_is_complete_once_its_last_byte_arrives(tmp_path):
    store = WeightStore(tmp_path)
    assert store.put(DIGEST, 0, len(DATA), DATA[:100_000]) == 100_000
    assert not store.is_complete(DIGEST)
    assert store.put(DIGEST, 100_000, len(DATA), DATA[100_000:]) == len(DATA)
    assert store.is_complete(DIGEST)
    assert (tmp_path / "blobs" / DIGEST).read_bytes() == DATA


def test_a_partial_file_is_resumed_by_a_restarted_agent_from_the_bytes_it_holds(tmp_path):
    WeightStore(tmp_path).put(DIGEST, 0, len(DATA), DATA[:123_456])
    restarted = WeightStore(tmp_path)  # no running hash: it re-reads the partial file once
    assert restarted.have(DIGEST) == 123_456
    restarted.put(DIGEST, 123_456, len(DATA), DATA[123_456:])
    assert restarted.is_complete(DIGEST)


def test_a_chunk_at_the_wrong_offset_is_refused_and_says_where_to_resume(tmp_path):
    store = WeightStore(tmp_path)
    store.put(DIGEST, 0, len(DATA), DATA[:1000])
    with pytest.raises(WeightStoreError, match="resume from 1000"):
        store.put(DIGEST, 5000, len(DATA), DATA[5000:6000])
    assert store.have(DIGEST) == 1000


def test_a_file_whose_bytes_do_not_match_its_digest_is_dropped(tmp_path):
    store = WeightStore(tmp_path)
    bad = bytearray(DATA)
    bad[7] ^= 1
    with pytest.raises(WeightStoreError, match="checksum mismatch"):
        store.put(DIGEST, 0, len(DATA), bytes(bad))
    assert store.have(DIGEST) == 0 and not store.is_complete(DIGEST)


def test_names_and_digests_that_could_leave_the_store_are_refused(tmp_path):
    store = WeightStore(tmp_path)
    with pytest.raises(WeightStoreError, match="not a sha256"):
        store.put("../../etc/passwd", 0, 3, b"abc")
    store.put(DIGEST, 0, len(DATA), DATA)
    with pytest.raises(WeightStoreError, match="bad file name"):
        store.stage_dir((("../model.safetensors", DIGEST),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs"]


def test_a_stage_directory_names_the_received_files_and_needs_them_complete(tmp_path):
    store = WeightStore(tmp_path)
    with pytest.raises(WeightStoreError, match="not been received"):
        store.stage_dir((("model.safetensors", DIGEST),))
    store.put(DIGEST, 0, len(DATA), DATA)
    stage = store.stage_dir((("model.safetensors", DIGEST),))
    assert (stage / "model.safetensors").read_bytes() == DATA
    assert store.stage_dir((("model.safetensors", DIGEST),)) == stage
