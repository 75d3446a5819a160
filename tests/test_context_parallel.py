"""Context parallelism (cp): each rank of a cp group holds 1/cp of every sequence's tokens (zigzag
chunks) and ring attention joins them. The reference is one process at the same global batch:
losses, gradient norms and the weights after the run equal it to 1e-6 (fp32), on the hard data of
`test_token_mean` (many short packed documents with document masking, so the ranks' shares hold
different numbers of valid targets and attention crosses chunk boundaries inside a document).
Also: the checkpoint a cp run writes is the one-process model, the step's global batch does not
depend on cp, and bad input is one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_token_mean import _check_layout

from nanolight.errors import UsageError
from nanolight.parallel.config import ParallelConfig
from nanolight.parallel.ring_attention import zigzag_shard, zigzag_unshard


def test_cp2_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=1, pp=1, dp=1, micro=1, cp=2)


@pytest.mark.slow
def test_dp2_cp2_zero1_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=1, pp=1, dp=2, micro=1, cp=2, zero_stage=1)


@pytest.mark.slow
def test_tp2_cp2_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=2, pp=1, dp=1, micro=1, cp=2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_pp2_cp2_equals_one_process(tmp_path: Path, schedule: str) -> None:
    _check_layout(tmp_path, tp=1, pp=2, dp=1, micro=2, cp=2, schedule=schedule)


def test_zigzag_shards_put_back_together() -> None:
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3):
        parts = [zigzag_shard(x, r, cp) for r in range(cp)]
        assert torch.equal(zigzag_unshard(parts), x)
    assert zigzag_shard(x, 0, 2)[0].tolist() == [0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23]


def test_bad_cp_input_is_one_line() -> None:
    with pytest.raises(UsageError, match=r"trainer.seq_len=30 is not divisible by 4"):
        ParallelConfig(cp=2).check_sequence(30)
    with pytest.raises(UsageError, match=r"each rank's 12 tokens .* over tp=8"):
        ParallelConfig(cp=2, tp=8, sequence_parallel=True).check_sequence(24)
    with pytest.raises(UsageError, match=r"parallel.cp=0 must be a positive integer"):
        ParallelConfig(cp=0)
    with pytest.raises(UsageError, match=r"world size 6 != tp\*pp\*cp\*dp = 1\*1\*2\*2 = 4"):
        ParallelConfig(cp=2, dp=2).check_world_size(6)
