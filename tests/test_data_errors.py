"""Bad data files give one clear error naming the file and what is wrong, on every path that reads them
(the cache's preparation, streaming, prepare_data) -- not StopIteration, UnicodeDecodeError or ArrowInvalid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import transformers
from _data_helpers import DOCS, prepared, write_docs
from _dist import pythonpath

from nanolight.data import BatchGeometry, DataConfig, DataError, build_datamodule, load_tokenizer

REPO = Path(__file__).resolve().parents[1]

pytest_plugins = ["_data_helpers"]  # the tok / tok_dir fixtures


def _bad_files(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the message must say)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(os.urandom(4096).replace(b"\n", b"\xff") + b"\xff")
    not_json = tmp_path / "notjson.jsonl"
    not_json.write_text('hello world\n{"text": "x"}\n')
    array = tmp_path / "array.jsonl"
    array.write_text("[1, 2]\n")
    parquet = tmp_path / "garbage.parquet"
    parquet.write_bytes(os.urandom(3000))
    cut = write_docs(str(tmp_path / "cut.parquet"), DOCS)
    with open(cut, "r+b") as f:  # a partial download: the footer is gone
        f.truncate(os.path.getsize(cut) // 2)
    return {
        "empty": (str(empty), "is empty"),
        "blank": (str(blank), "only whitespace"),
        "binary": (str(binary), "is not UTF-8 text"),
        "notjson": (str(not_json), "first line is not JSON"),
        "array": (str(array), "JSON list, not an object"),
        "parquet": (str(parquet), "not a readable parquet file"),
        "cut": (cut, "not a readable parquet file"),
    }


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_files_are_named_by_the_training_loaders(tmp_path, tok_dir, streaming) -> None:
    for name, (path, what) in _bad_files(tmp_path).items():
        cfg = DataConfig(path=path, tokenizer=tok_dir, cache_dir=str(tmp_path / "c"), streaming=streaming)
        with pytest.raises(DataError) as err:
            build_datamodule(cfg, BatchGeometry(seq_len=8, micro_batch_size=1))
        assert path in str(err.value) and what in str(err.value), (name, str(err.value))


def test_a_bad_file_among_good_ones_is_named(tmp_path, tok_dir) -> None:
    good = write_docs(str(tmp_path / "a.jsonl"), DOCS)
    (tmp_path / "b.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"b\.jsonl is empty"):
        build_datamodule(
            DataConfig(path=str(tmp_path / "*.jsonl"), tokenizer=tok_dir),
            BatchGeometry(seq_len=8, micro_batch_size=1),
        )
    assert os.path.exists(good)


def test_bad_files_are_named_by_prepare_data(tmp_path, tok_dir) -> None:
    for name, (path, what) in _bad_files(tmp_path).items():
        with pytest.raises(DataError) as err:
            prepared(path, str(tmp_path / f"out-{name}"), tok_dir, cache_dir=str(tmp_path / "c"))
        assert path in str(err.value) and what in str(err.value), (name, str(err.value))


def test_damage_past_the_first_bytes_is_still_named(tmp_path, tok_dir) -> None:
    """A file that starts well and breaks later fails inside `datasets`; the error still names it."""
    path = tmp_path / "late.jsonl"
    path.write_text("".join(json.dumps({"text": f"a b c {i}"}) + "\n" for i in range(5000)) + "{not json\n")
    cfg = DataConfig(path=str(path), tokenizer=tok_dir, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"could not read .*late\.jsonl"):
        build_datamodule(cfg, BatchGeometry(seq_len=8, micro_batch_size=1))


def test_stream_damaged_midway_names_the_file_when_read(tmp_path, tok_dir) -> None:
    path = tmp_path / "late.jsonl"
    path.write_text("".join(json.dumps({"text": f"a b c {i}"}) + "\n" for i in range(5000)) + "{not json\n")
    cfg = DataConfig(path=str(path), tokenizer=tok_dir, cache_dir=str(tmp_path / "c"), streaming=True)
    train, _, _ = build_datamodule(cfg, BatchGeometry(seq_len=8, micro_batch_size=1))
    with pytest.raises(DataError, match=r"could not read .*late\.jsonl"):
        for _ in train:
            pass


def test_missing_data_and_tokenizers_are_one_data_error(tmp_path, tok_dir, monkeypatch) -> None:
    """No such path, a directory without data files, a tokenizer directory without a tokenizer, a
    hub tokenizer that is neither cached nor reachable: a DataError each (the recipe prints it as
    one line) -- not a FileNotFoundError/OSError traceback or a minute of hub retries."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (str(tmp_path / "nope"), str(empty)):
        with pytest.raises(DataError, match=r"data.path=.*matches no data file"):
            build_datamodule(
                DataConfig(path=path, tokenizer=tok_dir), BatchGeometry(seq_len=8, micro_batch_size=1)
            )
    with pytest.raises(DataError, match=r"holds no loadable tokenizer"):
        load_tokenizer(str(empty))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # as on a machine whose network is simply down
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.invalid")
    calls: list[dict] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):  # the hub client's retries (a minute) happen only without local_files_only
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    with pytest.raises(
        DataError, match=r"not in the local Hugging Face cache and hub.invalid is unreachable"
    ):
        load_tokenizer("nanolight-tests/no-such-tokenizer")
    assert calls == [{"local_files_only": True}]


def test_the_recipe_prints_a_missing_data_path_as_one_line(tmp_path) -> None:
    args = [
        f"data.path={tmp_path / 'nope.jsonl'}",
        f"trainer.default_root_dir={tmp_path / 'run'}",
        "logger=csv",
    ]
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO)}
    cmd = [sys.executable, str(REPO / "recipes" / "smollm.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("nanolight: error: data.path=") and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_a_prepared_directory_without_its_index_is_named_and_prepared_again(tmp_path, tok_dir) -> None:
    """Not globbed as raw data (its tokenizer/tokenizer.json blamed), and prepare_data.py rebuilds
    it instead of refusing the directory."""
    src, out = write_docs(str(tmp_path / "docs.jsonl"), DOCS), str(tmp_path / "prep")
    first = prepared(src, out, tok_dir, cache_dir=str(tmp_path / "c"))
    os.remove(os.path.join(out, "index.json"))
    with pytest.raises(DataError, match=r"holds prepared shards but no index.json .* --out") as err:
        build_datamodule(
            DataConfig(path=out, tokenizer=tok_dir), BatchGeometry(seq_len=8, micro_batch_size=1)
        )
    assert "tokenizer.json" not in str(err.value)
    again = prepared(src, out, tok_dir, cache_dir=str(tmp_path / "c"))
    assert again["shards"] == first["shards"]
    build_datamodule(DataConfig(path=out), BatchGeometry(seq_len=8, micro_batch_size=1))


def test_garbage_lines_are_one_message(tmp_path, tok_dir, capfd) -> None:
    """`datasets` logs the parse error it then raises; only nanolight's DataError says it."""
    path = tmp_path / "garbage.jsonl"
    path.write_text("".join(json.dumps({"text": f"a b c {i}"}) + "\n" for i in range(50)) + "garbage here\n")
    cfg = DataConfig(path=str(path), tokenizer=tok_dir, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"could not read .*garbage.jsonl"):
        build_datamodule(cfg, BatchGeometry(seq_len=8, micro_batch_size=1))
    out, err = capfd.readouterr()
    assert "garbage.jsonl" not in out + err, out + err


@pytest.fixture
def prep_dir(tmp_path, tok_dir) -> str:
    """A small prepared directory (a few thousand tokens)."""
    out = str(tmp_path / "prep")
    prepared(write_docs(str(tmp_path / "docs.jsonl"), DOCS), out, tok_dir, cache_dir=str(tmp_path / "c"))
    return out


def test_token_ids_past_the_vocabulary_name_the_shard(prep_dir) -> None:
    """A damaged shard's id past the vocabulary was an IndexError in the model's embedding, the file
    never named: it is found as the sample is read."""
    shard = os.path.join(prep_dir, "shard-00000.bin")
    with open(shard, "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff")  # uint16 65535: past the test tokenizer's vocabulary
    geometry = BatchGeometry(seq_len=8, micro_batch_size=1, seed=0)
    cfg = DataConfig(path=prep_dir, val_fraction=0.0)
    train, _, _ = build_datamodule(cfg, geometry)
    with pytest.raises(DataError, match=r"shard-00000\.bin holds token id 65535 .*past the .* ids"):
        for _ in train:
            pass


@pytest.mark.parametrize("mixture", [False, True], ids=["data.path", "mixture"])
def test_a_source_too_small_for_one_sample_is_a_data_error(prep_dir, mixture) -> None:
    """The messages were right but raised as ValueError: a traceback under the recipe."""
    geometry = BatchGeometry(seq_len=4096, micro_batch_size=1)
    if mixture:
        cfg = DataConfig(mixture=[{"path": prep_dir, "weight": 1}, {"path": prep_dir, "weight": 2}])
    else:
        cfg = DataConfig(path=prep_dir)
    with pytest.raises(DataError, match="no training sample of seq_len=4096|the training split has 0 blocks"):
        build_datamodule(cfg, geometry)
