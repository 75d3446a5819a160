"""ParallelContext: rank layout (tp innermost, then pp, cp, dp) and the groups built from it."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from _dist import run_distributed

from nanolight.parallel import ParallelConfig, ParallelContext
from nanolight.parallel.context import FLATTENED, MESH_DIMS, coordinates, group_ranks, rank_mesh

# What each named group spans (flattened, the first named outermost), as the design says.
NAMED = {"dp": ("dp",), "cp": ("cp",), "pp": ("pp",), "tp": ("tp",),
         "batch": ("dp",), "loss": ("dp", "cp"), "replica": ("dp", "cp")}  # fmt: skip


def formula_rank(d: int, c: int, p: int, t: int, cp: int, pp: int, tp: int) -> int:
    """The documented layout, written out: dp outermost, then cp, pp, tp (innermost)."""
    return ((d * cp + c) * pp + p) * tp + t


def formula_groups(dims: tuple[str, ...], dp: int, cp: int, pp: int, tp: int) -> dict[int, list[int]]:
    """Each rank's group along `dims` (flattened, the first named outermost), by brute force: the
    ranks whose coordinates off `dims` equal its own, ordered by their coordinates along `dims`."""
    sizes = {"dp": dp, "cp": cp, "pp": pp, "tp": tp}
    points = [
        {"dp": d, "cp": c, "pp": p, "tp": t}
        for d in range(dp) for c in range(cp) for p in range(pp) for t in range(tp)
    ]  # fmt: skip
    rank = {id(x): formula_rank(x["dp"], x["cp"], x["pp"], x["tp"], cp, pp, tp) for x in points}
    out = {}
    for me in points:
        peers = [x for x in points if all(x[k] == me[k] for k in sizes if k not in dims)]
        peers.sort(key=lambda x: [x[k] for k in dims])
        out[rank[id(me)]] = [rank[id(x)] for x in peers]
    return out


def test_rank_layout_tp2_pp2_dp2() -> None:
    mesh = rank_mesh(tp=2, pp=2, dp=2)
    assert group_ranks(mesh, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(mesh, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(mesh, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        c = coordinates(mesh, rank)
        assert rank == c["dp"] * 4 + c["pp"] * 2 + c["tp"]


def test_every_rank_in_exactly_one_group_per_dim() -> None:
    mesh = rank_mesh(tp=4, pp=3, dp=2)
    for dim, size in (("tp", 4), ("pp", 3), ("dp", 2)):
        groups = group_ranks(mesh, dim)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(24))


def test_mesh_order_is_dp_cp_pp_tp() -> None:
    assert MESH_DIMS == ("dp", "cp", "pp", "tp")
    dp, cp, pp, tp = 2, 2, 3, 2
    mesh = rank_mesh(tp=tp, pp=pp, dp=dp, cp=cp)
    assert tuple(mesh.shape) == (dp, cp, pp, tp)
    for rank in range(dp * cp * pp * tp):
        c = coordinates(mesh, rank)
        assert rank == formula_rank(c["dp"], c["cp"], c["pp"], c["tp"], cp, pp, tp)


@pytest.mark.parametrize(("dp", "cp", "pp", "tp"), [(2, 1, 2, 2), (2, 2, 3, 2), (3, 2, 1, 1)])
def test_groups_and_flattened_groups_follow_the_formula(dp: int, cp: int, pp: int, tp: int) -> None:
    mesh = rank_mesh(tp=tp, pp=pp, dp=dp, cp=cp)
    assert set(NAMED) == {*MESH_DIMS, *FLATTENED}
    for name, dims in [*NAMED.items(), ("world", MESH_DIMS)]:
        expected = formula_groups(dims, dp, cp, pp, tp)
        groups = group_ranks(mesh, FLATTENED.get(name, dims))
        assert sorted(r for g in groups for r in g) == list(range(mesh.numel()))  # a partition
        for group in groups:
            for rank in group:
                assert group == expected[rank], (name, rank)
    if cp == 1:  # the loss and gradient groups are today's dp groups
        assert group_ranks(mesh, FLATTENED["loss"]) == group_ranks(mesh, "dp")
        assert group_ranks(mesh, FLATTENED["replica"]) == group_ranks(mesh, "dp")


def _check_context(rank: int, world: int, tp: int, pp: int) -> dict:
    ctx = ParallelContext(tp=tp, pp=pp, dp="auto", timeout=timedelta(seconds=30))
    seen = {}
    for dim in ("tp", "pp", "dp"):
        group = getattr(ctx, f"{dim}_group")
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, rank, group=group)  # group members exchange global ranks
        seen[dim] = members
        assert members == getattr(ctx, f"{dim}_ranks")
        assert dist.get_rank(group) == getattr(ctx, f"{dim}_rank")
    dp = world // (tp * pp)
    for name, dims in NAMED.items():
        group = ctx.group(name)
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, rank, group=group)  # the named group's members exchange ranks
        expected = formula_groups(dims, dp, 1, pp, tp)[rank]
        assert members == ctx.ranks(name) == expected, (name, members, expected)
        assert ctx.size(name) == len(expected) and ctx.rank_in(name) == dist.get_rank(group)
    assert ctx.group("loss") is ctx.dp_group and ctx.group("batch") is ctx.dp_group  # cp = 1: one group
    # ... but the gradients' and ZeRO-1's overlapped traffic has a communicator of its own
    assert ctx.group("replica") is not ctx.dp_group and ctx.ranks("replica") == ctx.dp_ranks
    assert (ctx.cp_size, ctx.cp_rank, ctx.cp_ranks) == (1, 0, [rank])
    if pp > 1:  # the tied embedding's pair: this (dp, cp, tp) coordinate at the first and last stage
        ends = [formula_rank(ctx.dp_rank, 0, stage, ctx.tp_rank, 1, pp, tp) for stage in (0, pp - 1)]
        pair = ctx.stage_pair_group(0, pp - 1)
        assert (pair is not None) == (rank in ends)
        if pair is not None:
            members = [None] * dist.get_world_size(pair)
            dist.all_gather_object(members, rank, group=pair)
            assert members == ends, (members, ends)
    mesh = ctx.device_mesh()
    assert mesh["tp"].size() == tp, mesh
    assert tuple(mesh.get_coordinate()) == (ctx.dp_rank, ctx.pp_rank, ctx.tp_rank)
    return {
        "groups": seen,
        "coords": (ctx.dp_rank, ctx.pp_rank, ctx.tp_rank),
        "neighbours": (ctx.prev_pp_rank, ctx.next_pp_rank),
        "dp_size": ctx.dp_size,
    }


def test_context_groups_tp2_pp2_dp_auto() -> None:
    out = run_distributed(_check_context, 4, 2, 2)
    assert [o["dp_size"] for o in out] == [1] * 4
    assert out[1]["groups"] == {"tp": [0, 1], "pp": [1, 3], "dp": [1]}
    assert out[1]["neighbours"] == (None, 3) and out[3]["neighbours"] == (1, None)


@pytest.mark.slow
def test_context_groups_tp2_pp2_dp2_eight_ranks() -> None:
    out = run_distributed(_check_context, 8, 2, 2, timeout=180)
    assert out[5]["coords"] == (1, 0, 1)
    assert out[5]["groups"] == {"tp": [4, 5], "pp": [5, 7], "dp": [1, 5]}
    assert out[6]["neighbours"] == (4, None)


def test_context_requires_initialised_world() -> None:
    if dist.is_initialized():
        pytest.skip("a world already exists in this process")
    with pytest.raises(RuntimeError, match="init_distributed"):
        ParallelContext(tp=1)


def _bad_world(rank: int, world: int) -> str:
    try:
        ParallelContext(tp=2, pp=1, dp=2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_context_world_mismatch_message() -> None:
    msgs = run_distributed(_bad_world, 2)
    assert "world size 2 != tp*pp*dp = 2*1*2 = 4" in msgs[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 0}, "parallel.tp=0 must be a positive integer"),
        ({"dp": "all"}, "or 'auto'"),
        ({"zero_stage": 3}, "zero_stage=3 is not supported"),
        ({"pp_schedule": "gpipe"}, "pp_schedule='gpipe' is unknown"),
        ({"pp_virtual": 0}, "pp_virtual=0 must be a positive integer"),
        ({"pp": 2, "pp_virtual": 2}, "pp_virtual=2 .* needs \\+parallel.pp_schedule=interleaved_1f1b"),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, "pp=2, pp_virtual=1; set e.g."),
        ({"pp_schedule": "interleaved_1f1b", "pp_virtual": 2}, "got pp=1, pp_virtual=2"),
        ({"cp": 0}, "parallel.cp=0 must be a positive integer"),
        ({"cp": True}, "parallel.cp=True must be a positive integer"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_config_model_checks_name_the_numbers() -> None:
    cfg = ParallelConfig(tp=4)
    cfg.check_model(num_attention_heads=8, num_key_value_heads=4, vocab_size=64)
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2 .* \[1, 2\]"):
        cfg.check_model(num_attention_heads=8, num_key_value_heads=2, vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size=49153 .* pad the model's vocab_size to 49156"):
        cfg.check_model(num_attention_heads=8, num_key_value_heads=4, vocab_size=49153)


def test_config_resolves_dp() -> None:
    assert ParallelConfig(tp=2, pp=2, dp="auto").resolve_dp(16) == 4
    with pytest.raises(ValueError, match="not a multiple of tp\\*pp = 2\\*2 = 4"):
        ParallelConfig(tp=2, pp=2, dp="auto").resolve_dp(6)


def test_config_is_a_hydra_structured_schema() -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    schema = OmegaConf.structured(ParallelConfig)
    merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(["tp=2", "dp=auto", "sequence_parallel=true"]))
    assert OmegaConf.to_object(merged) == ParallelConfig(tp=2, dp="auto", sequence_parallel=True)
    with pytest.raises(ConfigKeyError, match="tpp"):
        OmegaConf.merge(schema, OmegaConf.from_dotlist(["tpp=2"]))
