"""Convert a nanolight checkpoint directory into a Hugging Face LlamaForCausalLM directory.

    python scripts/convert_nanolight_to_hf.py --checkpoint-path <src> --save-path <dir> [--overwrite]

<src> is a pretrained directory (`save_pretrained`, `convert_hf_to_nanolight.py`) or a training
step directory (`<run>/checkpoints/step-N`, or `.../last`'s target) saved by Parallel3DStrategy at
any tp x pp x dp: its shards are reassembled into full tensors (`read_checkpoint`), so the HF
model is the same whatever layout trained it.

Also runs under `torchrun --nproc_per_node=1`; with more processes only rank 0 converts
(the others would write the same directory). Errors exit with status 1 and one line on stderr;
the save path is written atomically, so a failed run leaves nothing there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    from nanolight.models.pretrained import convert_nanolight_to_hf
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nanolight.models.pretrained import convert_nanolight_to_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint-path",
        required=True,
        help="a nanolight checkpoint directory (pretrained, or a training step-N)",
    )
    parser.add_argument(
        "--save-path", required=True, help="output directory (a Hugging Face LlamaForCausalLM directory)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty save path")
    args = parser.parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    try:
        out = convert_nanolight_to_hf(args.checkpoint_path, args.save_path, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
