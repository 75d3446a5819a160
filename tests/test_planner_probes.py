"""The planner's probes of the hardware at hand (`planner/probes.py`) run the model's own code at
the layout's shapes: in this process for a block and the head, in forked gloo ranks computing at
once for a layout of several ranks (tp's block with its collectives). No timing is asserted (the machine is shared); what
runs is."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from nanolight.models.llama import DecoderLayer
from nanolight.models.llama_config import LlamaConfig
from nanolight.planner import probes

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
TINY = LlamaConfig(**SIZES, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)


@pytest.fixture
def few_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two timed runs per probe (and the warm-up), whatever they take."""
    monkeypatch.setattr(probes, "REPEATS", 2)
    monkeypatch.setattr(probes, "BUDGET_S", 0.0)
    probes.forget_probes()
    yield
    probes.forget_probes()


def _record_forwards(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Every block forward appends its rank's q/k/v width and input shape to `log` (forked ranks
    inherit the patch and write to the same file)."""
    plain = DecoderLayer.forward

    def counted(block: DecoderLayer, x: torch.Tensor, *args: object) -> torch.Tensor:
        with log.open("a") as f:
            f.write(f"{block.self_attn.qkv_proj.weight.shape[0]} {tuple(x.shape)}\n")
        return plain(block, x, *args)

    monkeypatch.setattr(DecoderLayer, "forward", counted)


def test_block_probe_runs_the_recompute_mode(
    few_runs: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward per run (a warm-up and two timed runs), and again in backward when the block
    recomputes; the whole block (its q/k/v width) on the layout's tokens. Fails if the mode is
    not applied."""
    log = tmp_path / "forwards"
    _record_forwards(monkeypatch, log)
    qkv = (4 + 2 * 2) * TINY.head_dim
    for mode, runs in (("none", 3), ("full", 6), ("selective", 6)):
        log.unlink(missing_ok=True)
        assert 0 < probes.block_seconds(TINY, 2, 16, mode, "32-true") < 60
        assert log.read_text().splitlines() == [f"{qkv} (2, 16, 32)"] * runs, mode
    assert 0 < probes.head_seconds(TINY, 32, 2, "bf16-mixed") < 60


def test_block_probe_in_ranks_runs_the_shard_with_its_collectives(
    few_runs: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe in ranks runs the block in `ranks` forked processes at once: under tp each rank
    its shard (2 of 4 query heads, 1 of 2 kv heads), under sequence parallelism on T/tp tokens (the
    block's entry gathers them), its recompute mode's extra forwards; without tp the whole block.
    The ranks stay up for the search, until it stops them; a probe that fails in a rank is one
    error, not a hang."""
    log = tmp_path / "forwards"
    _record_forwards(monkeypatch, log)
    shard = (2 + 2 * 1) * TINY.head_dim
    assert 0 < probes.rank_block_seconds(TINY, 2, 16, 2, False, "none", "32-true", 2) < 60
    assert sorted(log.read_text().splitlines()) == [f"{shard} (2, 16, 32)"] * 6  # 2 ranks x 3 runs
    log.unlink()
    assert 0 < probes.rank_block_seconds(TINY, 2, 16, 2, True, "full", "32-true", 4) < 60
    # 4 ranks (two tp groups at once) x 3 runs x 2 forwards; the block sees 8 of 16 tokens
    assert sorted(log.read_text().splitlines()) == [f"{shard} (2, 8, 32)"] * 24
    # kept: asked again, nothing runs
    log.unlink()
    probes.rank_block_seconds(TINY, 2, 16, 2, True, "full", "32-true", 4)
    assert not log.exists()
    # no tp: two ranks (of dp, or pp stages) each time the whole block
    assert 0 < probes.rank_block_seconds(TINY, 2, 16, 1, False, "none", "32-true", 2) < 60
    assert log.read_text().splitlines() == [f"{(4 + 2 * 2) * TINY.head_dim} (2, 16, 32)"] * 6
    # the ranks stay up for the search (2 + 4 + 2), and stop when it is over
    assert len(multiprocessing.active_children()) == 8
    probes.stop_probe_ranks()
    assert multiprocessing.active_children() == []
    # 4 query heads do not split over 3 ranks: the ranks' error comes back as one line
    with pytest.raises(RuntimeError, match="the block probe in ranks failed: rank .*"):
        probes.rank_block_seconds(TINY, 2, 16, 3, False, "none", "32-true", 3)


def test_in_process_probes_take_the_fastest_run_and_ranks_the_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe in this process counts its fastest run (another process's load only ever adds
    time); a probe in ranks the median run, since a collective's wait for the slower rank is paid
    at every collective of a training run. Runs that take 3, 1, 5 and 2 s on a fake clock (forked
    ranks inherit it, and each rank's reads the same): 1 s alone, 2.5 s in ranks. Fails if either
    probe picks the other's run."""
    durations = [3.0, 1.0, 5.0, 2.0]

    class Clock:
        """perf_counter as the probes read it: a start, then an end `durations[i]` later."""

        def __init__(self) -> None:
            self.now, self.reads = 0.0, 0

        def perf_counter(self) -> float:
            if self.reads % 2:
                self.now += durations[(self.reads // 2) % len(durations)]
            self.reads += 1
            return self.now

        monotonic = staticmethod(time.monotonic)  # the parent's wait for its ranks

    monkeypatch.setattr(probes, "REPEATS", len(durations))
    monkeypatch.setattr(probes, "BUDGET_S", 1e9)
    probes.forget_probes()
    try:
        monkeypatch.setattr(probes, "time", Clock())
        assert probes.block_seconds(TINY, 2, 16, "none", "32-true") == 1.0
        monkeypatch.setattr(probes, "time", Clock())
        assert probes.rank_block_seconds(TINY, 2, 16, 2, False, "none", "32-true", 2) == 2.5
    finally:
        probes.forget_probes()
