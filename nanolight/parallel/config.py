"""`ParallelConfig`: the validated parallel degrees (the Hydra schema behind `+parallel.*`).

Why a dataclass that validates itself: a bad layout should fail on the command line, before a
single process is spawned, with a message that names the numbers and says how to fix them —
not as a shape error deep inside a collective on rank 5.

Vocabulary and tensor parallelism: tp must divide `vocab_size`. We do not pad the vocabulary
silently, because a padded vocabulary changes the checkpoint's tensor shapes and the softmax
denominators; the fix-it message names the next multiple of tp to put in the model config
instead (SmolLM's 49152 is divisible by every power of two up to 2**14).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from nanolight.errors import UsageError

PP_SCHEDULES = (
    "1f1b",
    "afab",
    "interleaved_1f1b",
)  # 1F1B, all-forward-all-backward, 1F1B over virtual stages
ZERO_STAGES = (0, 1)


@dataclass
class ParallelConfig:
    """Parallel degrees and options. `dp="auto"` fills the world: dp = world_size // (tp * pp * cp).

    `dp` is typed `Any` (an int or the string "auto") because OmegaConf structured configs do
    not support `int | str` unions.
    """

    tp: int = 1
    pp: int = 1
    dp: Any = 1
    zero_stage: int = 0
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = False
    timeout_s: int = 600  # how long a rank waits for its peers (joining, or any collective)
    pp_virtual: int = 1  # chunks (virtual stages) per pipeline rank: interleaved_1f1b only
    cp: int = 1  # context parallelism: a ring of cp ranks splitting each sequence (ring attention)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The fields that shape the layout (what `+parallel=auto` picks and a command line pins):
        all but `timeout_s`."""
        return tuple(f.name for f in fields(ParallelConfig) if f.name != "timeout_s")

    def validate(self) -> None:
        """Check each field alone; raises ValueError with a fix-it message."""
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(
                    f"parallel.{name}={value!r} must be a positive integer, e.g. +parallel.{name}=2"
                )
        if self.dp != "auto" and (isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1):
            raise UsageError(
                f"parallel.dp={self.dp!r} must be a positive integer or 'auto' (fill the world: "
                "dp = world_size // (tp * pp * cp)), e.g. +parallel.dp=auto"
            )
        if self.zero_stage not in ZERO_STAGES:
            raise UsageError(
                f"parallel.zero_stage={self.zero_stage!r} is not supported; choose one of {ZERO_STAGES} "
                "(1 shards optimizer state and fp32 master weights over dp)"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise UsageError(
                f"parallel.pp_schedule={self.pp_schedule!r} is unknown; choose one of {PP_SCHEDULES} "
                "('1f1b' = one-forward-one-backward, 'afab' = all-forward-all-backward, "
                "'interleaved_1f1b' = 1F1B over +parallel.pp_virtual chunks per rank)"
            )
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise UsageError(
                f"parallel.cp={self.cp!r} must be a positive integer (ranks splitting each sequence), "
                "e.g. +parallel.cp=2"
            )
        v = self.pp_virtual
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(
                f"parallel.pp_virtual={v!r} must be a positive integer, e.g. +parallel.pp_virtual=2"
            )
        if self.pp_schedule == "interleaved_1f1b" and (v < 2 or self.pp < 2):
            raise UsageError(
                f"pp_schedule='interleaved_1f1b' gives each of pp >= 2 ranks pp_virtual >= 2 chunks of layers, got "
                f"pp={self.pp}, pp_virtual={v}; set e.g. +parallel.pp=2 +parallel.pp_virtual=2 (or use "
                "pp_schedule='1f1b')"
            )
        if v > 1 and self.pp_schedule != "interleaved_1f1b":
            raise UsageError(
                f"parallel.pp_virtual={v} (chunks per pipeline rank) needs +parallel.pp_schedule=interleaved_1f1b, "
                f"not {self.pp_schedule!r}"
            )
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise UsageError(
                f"parallel.timeout_s={self.timeout_s!r} must be a positive number of seconds: how long a rank "
                "waits for the others (to join, or in a collective) before the job ends, e.g. +parallel.timeout_s=120"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise UsageError(f"parallel.sequence_parallel={self.sequence_parallel!r} must be true or false")

    @property
    def replica_ranks(self) -> int:
        """The ranks one data-parallel replica spans: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def sequence_multiple(self) -> int:
        """Every sequence length a run takes is a multiple of this (`check_sequence`'s rule): 2*cp
        zigzag chunks under cp, then each rank's T/cp tokens over tp under sequence parallelism."""
        zigzag = 2 if self.cp > 1 else 1
        split = self.tp if self.sequence_parallel else 1
        return self.cp * math.lcm(zigzag, split)

    def _named(self, dp: Any = None) -> str:
        """The product the world is split into, spelled out: "tp*pp = 2*2" (cp only when used)."""
        degrees = {"tp": self.tp, "pp": self.pp, **({"cp": self.cp} if self.cp > 1 else {})}
        if dp is not None:
            degrees["dp"] = dp
        return f"{'*'.join(degrees)} = {'*'.join(map(str, degrees.values()))}"

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel degree for a world of `world_size` processes; checks tp*pp*cp*dp == world."""
        model_parallel = self.replica_ranks
        if self.dp == "auto":
            if world_size % model_parallel != 0:
                raise UsageError(
                    f"world size {world_size} is not a multiple of {self._named()} = "
                    f"{model_parallel}, so dp='auto' cannot fill it; launch a multiple of {model_parallel} "
                    "processes or change tp/pp/cp"
                )
            return world_size // model_parallel
        self.check_world_size(world_size)
        return int(self.dp)

    def check_sequence(self, seq_len: int) -> None:
        """Context parallelism cuts each sequence into 2*cp equal chunks (zigzag: `ring_attention.py`);
        sequence parallelism then splits each rank's T/cp tokens over tp."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise UsageError(
                f"context parallelism cp={self.cp} cuts each sequence into 2*cp = {2 * self.cp} equal chunks, "
                f"but trainer.seq_len={seq_len} is not divisible by {2 * self.cp}; choose a multiple of it"
            )
        local = seq_len // self.cp
        if self.sequence_parallel and local % self.tp:
            raise UsageError(
                f"sequence parallelism splits each rank's {local} tokens (seq_len {seq_len} / cp {self.cp}) "
                f"over tp={self.tp}; choose trainer.seq_len divisible by {self.cp * self.tp}"
            )

    def check_world_size(self, world_size: int) -> None:
        """Under torchrun/SLURM the world is given: it must equal tp*pp*cp*dp exactly."""
        if self.dp == "auto":
            self.resolve_dp(world_size)
            return
        expected = self.replica_ranks * self.dp
        if world_size != expected:
            raise UsageError(
                f"world size {world_size} != {self._named(self.dp)} = {expected}; "
                f"launch {expected} processes (e.g. torchrun --nproc-per-node={expected}) or set "
                "+parallel.dp=auto to fill the world"
            )

    def check_model(self, num_attention_heads: int, num_key_value_heads: int, vocab_size: int) -> None:
        """tp must split attention heads, kv heads and the vocabulary into whole, equal shards."""
        tp = self.tp
        checks = (
            ("num_attention_heads", num_attention_heads, "each tp rank computes whole query heads"),
            ("num_key_value_heads", num_key_value_heads, "each tp rank holds whole kv heads (GQA groups)"),
        )
        for name, value, why in checks:
            if value % tp != 0:
                divisors = [d for d in range(1, value + 1) if value % d == 0]
                raise UsageError(
                    f"tensor parallelism tp={tp} does not divide {name}={value} ({why}); "
                    f"choose tp from {divisors}"
                )
        if vocab_size % tp != 0:
            padded = -(-vocab_size // tp) * tp
            raise UsageError(
                f"tensor parallelism tp={tp} does not divide vocab_size={vocab_size} (the embedding and "
                f"lm_head are split into equal vocabulary shards); pad the model's vocab_size to "
                f"{padded} (the next multiple of {tp}) or choose another tp"
            )
