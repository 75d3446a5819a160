"""scripts/prepare_data.py: token shards + index from local files, deterministic, resumable, repairable.

The reference for every token is the tokenizer run on each document alone (`expected_tokens`),
and the shards the pipeline prepares into its cache from the same files (`token_file`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _data_helpers import DOCS, expected_tokens, prepared, shard_bytes, write_docs
from _dist import pythonpath

from nanolight.data import DataConfig, DataError, PreparedData, load_tokenizer, token_file
from nanolight.data.shards import PROGRESS

REPO = Path(__file__).resolve().parents[1]
MIXED = DOCS[:60] + ["", None] + DOCS[60:]  # empty rows are skipped, in the cache's shards too

pytest_plugins = ["_data_helpers"]  # the tok / tok_dir fixtures


def stream_of(out: str) -> list[int]:
    data = PreparedData.open(out)
    return data.tokens[0 : len(data.tokens)].tolist()


@pytest.mark.parametrize("ext", [".jsonl", ".parquet", ".txt"])
def test_shards_hold_every_document_then_eos_like_the_token_file(tmp_path, tok, tok_dir, ext) -> None:
    if ext == ".txt":
        for i, d in enumerate(DOCS[:30]):
            (tmp_path / f"{i:03d}.txt").write_text(d)
        src, docs = str(tmp_path / "*.txt"), DOCS[:30]
    else:
        src, docs = write_docs(str(tmp_path / f"docs{ext}"), MIXED), MIXED
    index = prepared(src, str(tmp_path / "out"), tok_dir, shard_size_mb=0.0005)  # ~250 tokens a shard
    ref = expected_tokens(tok, docs)
    assert stream_of(str(tmp_path / "out")) == ref
    flat = token_file(DataConfig(path=src, tokenizer=tok_dir, cache_dir=str(tmp_path / "c")), tok)
    assert flat.tokens[:].tolist() == ref
    assert len(index["shards"]) >= 3 and index["num_tokens"] == len(ref)
    assert index["dtype"] == "uint16" and index["tokenizer"]["eos_token_id"] == tok.eos_token_id
    assert index["num_documents"] == sum(1 for d in docs if d) and index["source"]["num_rows"] == len(docs)
    # document boundaries are the EOS tokens: each shard ends on one, documents are never split
    # across shards, and nothing else is written per document
    for i, shard in enumerate(index["shards"]):
        toks = np.fromfile(tmp_path / "out" / f"shard-{i:05d}.bin", dtype=np.uint16)
        assert len(toks) == shard["tokens"] and toks[-1] == tok.eos_token_id
        assert (toks == tok.eos_token_id).sum() == shard["documents"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("shard-")) == [
        f"shard-{i:05d}.bin" for i in range(len(index["shards"]))
    ]
    rows = [(s["first_row"], s["end_row"]) for s in index["shards"]]
    assert (
        rows[0][0] == 0
        and rows[-1][1] == len(docs)
        and all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    )


def test_same_inputs_same_bytes_at_any_worker_count_and_chunking(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), MIXED * 3)
    prepared(src, str(tmp_path / "a"), tok_dir, shard_size_mb=0.002)
    kw = {"shard_size_mb": 0.002, "num_proc": 2, "chunk_docs": 150, "tokenize_batch_size": 5}
    prepared(src, str(tmp_path / "b"), tok_dir, **kw)
    a, b = shard_bytes(str(tmp_path / "a")), shard_bytes(str(tmp_path / "b"))
    assert a == b and "index.json" in a and any(k.startswith("tokenizer") for k in a)


def test_interrupted_preparation_resumes_where_it_stopped(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), MIXED * 3)
    kw = {"shard_size_mb": 0.001, "chunk_docs": 50}
    prepared(src, str(tmp_path / "ref"), tok_dir, **kw)

    def stop_after_200(row: int) -> None:
        if row >= 200:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepared(src, str(tmp_path / "out"), tok_dir, after_commit=stop_after_200, **kw)
    progress = json.loads((tmp_path / "out" / PROGRESS).read_text())
    assert progress["next_row"] == 200 and not (tmp_path / "out" / "index.json").exists()
    with pytest.raises(DataError, match="unfinished preparation.*run it again"):
        PreparedData.open(str(tmp_path / "out"))
    (tmp_path / "out" / f".tmp-{PROGRESS}-123").write_text("{half")  # what a kill mid-write leaves
    (tmp_path / "out" / f"{PROGRESS}.tmp-123-abcd").write_text("{half")  # and what earlier versions left
    (tmp_path / "out" / ".chunk-123_00000_of_00002.arrow").write_bytes(b"x")
    rows = []
    prepared(src, str(tmp_path / "out"), tok_dir, after_commit=rows.append, **kw)
    assert rows[0] == 250  # continued at row 200, not from the start
    assert shard_bytes(str(tmp_path / "out")) == shard_bytes(str(tmp_path / "ref"))


def test_sigkilled_cli_run_resumes_to_identical_bytes(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS * 30)  # 6000 documents, 120 chunks
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--source", src, "--tokenizer", tok_dir]
    cmd += [
        "--out",
        str(out),
        "--shard-size-mb",
        "0.02",
        "--chunk-docs",
        "50",
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        p = out / PROGRESS
        if p.exists() and json.loads(p.read_text())["next_row"] >= 500:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    done = json.loads((out / PROGRESS).read_text())["next_row"]
    assert 500 <= done < 6000
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming at document row {done:,}" in resumed.stderr
    assert "doc/s" in resumed.stderr and "tok/s" in resumed.stderr  # the progress bar
    assert "6,000 documents" in resumed.stdout
    prepared(src, str(tmp_path / "ref"), tok_dir, shard_size_mb=0.02)
    assert shard_bytes(str(out)) == shard_bytes(str(tmp_path / "ref"))


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`, from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat[1] == str(pid) and stat[0] != "Z":
            kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_sigkilled_cli_run_leaves_no_worker_behind(tmp_path, tok_dir) -> None:
    """`--num-proc 2`: SIGKILL of prepare_data.py runs no cleanup; its map's processes must end too."""
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS * 300)
    script = [sys.executable, str(REPO / "scripts" / "prepare_data.py")]
    flags = ["--source", src, "--tokenizer", tok_dir, "--out", str(tmp_path / "out"), "--num-proc", "2"]
    cmd = [*script, *flags, "--chunk-docs", "400", "--cache-dir", str(tmp_path / "c")]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "PYTHONPATH": pythonpath(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline, workers = time.time() + 120, []
    while time.time() < deadline and proc.poll() is None and len(workers) < 3:
        workers = _children(proc.pid)  # a tokenizing map at work: its 2 workers and its manager
        time.sleep(0.02)
    assert len(workers) >= 3, "no map at work seen before the run ended"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.05)
    left = [w for w in workers if _alive(w)]
    for w in left:  # do not leave them to the next test either
        os.kill(w, signal.SIGKILL)
    assert not left, f"map workers {left} outlived the killed prepare_data.py"


def test_damaged_shards_are_named_then_repaired_by_a_rerun(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS * 2)
    out = str(tmp_path / "out")
    index = prepared(src, out, tok_dir, shard_size_mb=0.002)
    assert len(index["shards"]) >= 4
    good = shard_bytes(out)
    with open(os.path.join(out, "shard-00002.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        DataError, match=r"shard-00002.bin has 100 bytes but index.json says \d+ .*same arguments"
    ):
        PreparedData.open(out)
    os.remove(os.path.join(out, "shard-00003.bin"))
    with pytest.raises(DataError, match="shard-00003.bin is missing"):
        PreparedData.open(out)
    prepared(src, out, tok_dir, shard_size_mb=0.002)
    assert shard_bytes(out) == good


def test_vocab_above_65536_ids_is_stored_as_uint32(tmp_path, tok_dir) -> None:
    big = load_tokenizer(tok_dir)
    big.add_tokens([f"<extra_{i}>" for i in range(66_000)])
    big.save_pretrained(tmp_path / "bigtok")
    docs = [d + " <extra_65999>" for d in DOCS[:20]]
    src = write_docs(str(tmp_path / "docs.jsonl"), docs)
    index = prepared(src, str(tmp_path / "out"), str(tmp_path / "bigtok"))
    assert index["dtype"] == "uint32" and index["max_token_id"] == len(big) - 1 > 2**16
    assert stream_of(str(tmp_path / "out")) == expected_tokens(big, docs)


def test_preparation_refuses_other_inputs_and_empty_sources(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS[:50])
    prepared(src, str(tmp_path / "out"), tok_dir)
    other = write_docs(str(tmp_path / "other.jsonl"), DOCS[50:90])
    with pytest.raises(DataError, match="other inputs .*differ in: source"):
        prepared(other, str(tmp_path / "out"), tok_dir)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty and holds no preparation"):
        prepared(src, str(tmp_path / "busy"), tok_dir)
    empty = write_docs(str(tmp_path / "empty.jsonl"), ["", ""])
    with pytest.raises(DataError, match="holds no text"):
        prepared(empty, str(tmp_path / "e"), tok_dir)
    with pytest.raises(DataError, match="already a prepared directory"):
        prepared(str(tmp_path / "out"), str(tmp_path / "again"), tok_dir)
