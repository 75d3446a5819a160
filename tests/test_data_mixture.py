"""`data.mixture`: the weights hold exactly over every window of global batches, the same global batch
at every layout, O(1) resume equal to an uninterrupted run, repeat/stop, and fix-it errors."""

from __future__ import annotations

import io
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch
from _data_helpers import DOCS, prepared, write_docs
from hydra import compose, initialize_config_dir

from nanolight.data import BatchGeometry, DataConfig, DataError, MixtureSchedule, build_datamodule
from nanolight.data.tokenizer import train_bpe_tokenizer
from nanolight.pretrain.config import ConfigError, load_config

T = 16
WEIGHTS = [0.7, 0.2, 0.1]
CONF = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")

pytest_plugins = ["_data_helpers"]  # the tok / tok_dir fixtures


def greedy(weights: list[Fraction], n: int) -> list[int]:
    """Independent reference: sample k goes to the source furthest behind weight * (k + 1) (exact
    arithmetic; ties to the lower source)."""
    taken, out = [0] * len(weights), []
    for k in range(n):
        i = max(range(len(weights)), key=lambda s: (weights[s] * (k + 1) - taken[s], -s))
        taken[i] += 1
        out.append(i)
    return out


@pytest.mark.parametrize("weights", [WEIGHTS, [1, 1, 1], [3, 1], [0.123, 0.877], [0.01, 0.99], [5, 3, 2, 1]])
def test_schedule_holds_the_weights_over_every_window(weights) -> None:
    sched = MixtureSchedule(weights)
    w = np.array(weights) / sum(weights)
    n = max(3 * sched.period, 300)
    src, local = sched.locate(np.arange(n))
    exact = [Fraction(int(c), sched.period) for c in sched.counts]
    assert src.tolist() == greedy(exact, n)  # the closed form == the greedy rule replayed sample by sample
    onehot = np.eye(len(w))[src]
    cum = np.vstack([np.zeros(len(w)), np.cumsum(onehot, axis=0)])
    assert np.abs(cum - np.outer(np.arange(n + 1), w)).max() < 1  # every prefix within one sample
    for g in (8, 10, 64):  # every window of whole global batches: within two samples per source
        for a in range(0, n - g, g):
            for b in range(a + g, min(n, a + 10 * g) + 1, g):
                assert np.abs(cum[b] - cum[a] - (b - a) * w).max() < 2
    for s in range(len(w)):  # within a source, its samples come in order 0, 1, 2, ...
        assert local[src == s].tolist() == list(range(int((src == s).sum())))
        first = np.flatnonzero(src == s)[:5].tolist()
        assert [sched.position_of(s, j) for j in range(len(first))] == first
        assert sched.count(s, n) == (src == s).sum()
    assert sched.locate(np.array([10**12]))[1][0] >= 0  # any position, in closed form


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tok_dir) -> list[str]:
    """Three prepared directories of unrelated documents, of very different sizes."""
    root = tmp_path_factory.mktemp("mix")
    out = []
    styles = [str.upper, lambda d: d[::-1], lambda d: " ".join(str(ord(c)) for c in d[:30])]
    for i, n in enumerate((400, 160, 32)):  # texts that share no 16-token block across sources
        docs = [styles[i](f"{d} {j}") for j, d in enumerate(DOCS * 2)][:n]
        src = write_docs(str(root / f"s{i}.jsonl"), docs)
        prepared(src, str(root / f"p{i}"), tok_dir)
        out.append(str(root / f"p{i}"))
    return out


def mix_cfg(paths: list[str], weights=WEIGHTS, **kw) -> DataConfig:
    return DataConfig(mixture=[{"path": p, "weight": w} for p, w in zip(paths, weights, strict=True)], **kw)


def run(cfg: DataConfig, dp: int, mbs: int, acc: int, n: int, state=None) -> list[list[tuple[int, ...]]]:
    loaders = [
        build_datamodule(cfg, BatchGeometry(T, mbs, acc, r, dp, seed=9)).train_loader for r in range(dp)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    return [
        [tuple(row) for it in its for _ in range(acc) for row in next(it)["input_ids"].tolist()]
        for _ in range(n)
    ]


def source_of(sources: list[str], cfg: DataConfig) -> dict[tuple[int, ...], int]:
    """Which source each training row belongs to (asserting that no row is in two sources)."""
    rows: dict[tuple[int, ...], int] = {}
    for i, p in enumerate(sources):
        train = build_datamodule(
            DataConfig(path=p, val_fraction=cfg.val_fraction), BatchGeometry(T, 1)
        ).train_loader.source.dataset
        for row in train.rows(np.arange(len(train))).tolist():
            assert rows.setdefault(tuple(row), i) == i
    return rows


@pytest.mark.filterwarnings("ignore:data.mixture.* ran out of samples")
def test_every_global_batch_holds_the_weights_at_every_layout(sources) -> None:
    cfg = mix_cfg(sources, val_fraction=0.05)
    ref = run(cfg, 1, 10, 1, 40)
    assert run(cfg, 2, 5, 1, 40) == ref and run(cfg, 2, 1, 5, 40) == ref and run(cfg, 5, 2, 1, 40) == ref
    owner = source_of(sources, cfg)
    for batch in ref:  # G = 10 with 0.7/0.2/0.1: exactly 7, 2 and 1 samples of each step
        assert np.bincount([owner[row] for row in batch], minlength=3).tolist() == [7, 2, 1]
    # the smallest source runs out first: a whole pass over it, then a new order of the same samples
    small = [row for batch in run(cfg, 1, 10, 1, 130) for row in batch if owner[row] == 2]
    train2 = build_datamodule(
        DataConfig(path=sources[2], val_fraction=0.05), BatchGeometry(T, 1)
    ).train_loader.source.dataset
    every = Counter(tuple(r) for r in train2.rows(np.arange(len(train2))).tolist())
    n = len(train2)
    assert Counter(small[:n]) == every == Counter(small[n : 2 * n]) and small[:n] != small[n : 2 * n]


@pytest.mark.parametrize("stop,dp", [(3, 1), (11, 2), (17, 5)])
def test_resume_equals_the_uninterrupted_run_at_any_dp(sources, stop, dp) -> None:
    cfg = mix_cfg(sources)
    ref = run(cfg, 1, 10, 1, 25)
    first = build_datamodule(cfg, BatchGeometry(T, 10, 1, seed=9)).train_loader
    it = iter(first)
    for _ in range(stop):
        next(it)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert run(cfg, dp, 10 // dp, 1, 25 - stop, state=state) == ref[stop:]


def test_repeat_warns_and_stop_ends_the_epoch(sources) -> None:
    with pytest.warns(UserWarning, match=r"data.mixture\[2\] .* ran out of samples at step 6\d .* repeating"):
        run(mix_cfg(sources), 1, 10, 1, 70)
    stop = build_datamodule(
        mix_cfg(sources, mixture_exhausted="stop"), BatchGeometry(T, 10, seed=9)
    ).train_loader
    epoch0 = [b["input_ids"].tolist() for b in stop]
    n_small = len(stop.source.sources[2])
    assert len(epoch0) == len(stop) == n_small * 10 // 10 and len(epoch0) > 0  # 1 of 10 is source 2
    epoch1 = [b["input_ids"].tolist() for b in stop]
    assert len(epoch1) == len(epoch0) and epoch1 != epoch0  # a new order in the next epoch


def test_mixture_errors_name_the_key(sources, tmp_path, tok_dir) -> None:
    with pytest.raises(DataError, match=r"data.mixture\[1\].path=.*not a directory"):
        build_datamodule(mix_cfg([sources[0], str(tmp_path / "nope"), sources[2]]), BatchGeometry(T, 2))
    (tmp_path / "raw").mkdir()
    with pytest.raises(DataError, match="not a directory made by scripts/prepare_data.py"):
        build_datamodule(mix_cfg([sources[0], str(tmp_path / "raw")], [1, 1]), BatchGeometry(T, 2))
    other_tok = str(tmp_path / "tok2")
    train_bpe_tokenizer(iter(DOCS), other_tok, vocab_size=300)
    prepared(write_docs(str(tmp_path / "o.jsonl"), DOCS), str(tmp_path / "other"), other_tok)
    with pytest.raises(DataError, match=r"data.mixture\[1\].path=.*other.*tokenizer"):
        build_datamodule(mix_cfg([sources[0], str(tmp_path / "other")], [1, 1]), BatchGeometry(T, 2))
    with pytest.raises(ValueError, match=r"data.mixture differs from the checkpoint's"):
        state = build_datamodule(mix_cfg(sources), BatchGeometry(T, 2)).train_loader.state_dict()
        other = build_datamodule(mix_cfg(sources, [0.5, 0.3, 0.2]), BatchGeometry(T, 2)).train_loader
        other.load_state_dict(state)


def test_mixture_from_the_command_line_and_its_config_errors() -> None:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", ["data.mixture=[{path: /d/web, weight: 0.7}, {path: /d/code, weight: 0.3}]"])
        bad = compose("config", ["data.mixture=[{path: /d/web, weight: 0.7}, {path: /d/code, weight: 0}]"])
        typo = compose("config", ["data.mixture=[{path: /d/web, wieght: 1}]"])
    data = load_config(cfg).data
    assert [(m.path, m.weight) for m in data.mixture] == [("/d/web", 0.7), ("/d/code", 0.3)]
    with pytest.raises(ConfigError, match=r"data.mixture\[1\].weight=0 must be a finite number > 0"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"unknown key `data.mixture\[0\].wieght`. Did you mean `weight`"):
        load_config(typo)
    with pytest.raises(ValueError, match="data.mixture and data.path"):
        DataConfig(path="/x", mixture=[{"path": "/d", "weight": 1}])
