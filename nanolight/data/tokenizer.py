"""Tokenizers: the embedded byte-level BPE (trained once on the embedded corpus) or any HF one,
and `Encoder`, which turns documents into token ids with it.

The embedded tokenizer is saved as a normal Hugging Face tokenizer directory, so everything
downstream -- tokenization, checkpoints that ship a tokenizer, `AutoTokenizer.from_pretrained`
in user code -- treats it exactly like `HuggingFaceTB/SmolLM-135M`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np

from nanolight.data.cache import build_once, fingerprint
from nanolight.data.config import EMBEDDED, DataConfig, DataError, DataNotFound

# transformers is imported where a tokenizer is loaded or trained (1 s): not by every importer of data/
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EOS = "<|endoftext|>"
_FORMAT = 1


def train_bpe_tokenizer(texts: Iterator[str], out_dir: str, vocab_size: int) -> None:
    """Train a byte-level BPE on `texts` and save it as a HF tokenizer directory.

    Byte-level means no unknown characters ever (every byte is a token), which matters for code.
    One special token, `<|endoftext|>`, doubles as eos/bos/unk/pad: the model only needs the
    document separator, and a single id keeps `len(tokenizer) == vocab_size` exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS
    )
    fast.save_pretrained(out_dir)


def _jsonl_texts(path: str, max_bytes: int) -> Iterator[str]:
    """Documents of a JSONL corpus, in order, until `max_bytes` of text have been yielded."""
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            total += len(text)
            if total > max_bytes:
                return
            yield text


def embedded_tokenizer_dir(cfg: DataConfig, corpus_path: str) -> str:
    """Directory of the embedded tokenizer trained on `corpus_path`, trained on first use."""
    key = fingerprint(
        {
            "corpus": os.path.basename(os.path.dirname(corpus_path)),  # its directory: the content key
            "vocab": cfg.embedded_vocab_size,
            "train_mb": cfg.tokenizer_train_mb,
            "format": _FORMAT,
        }
    )
    path = os.path.join(cfg.cache_root, "tokenizers", f"embedded-{key}")

    def build(tmp: str) -> None:
        texts = _jsonl_texts(corpus_path, int(cfg.tokenizer_train_mb * 1e6))
        first = list(itertools.islice(texts, 1))
        if not first:
            raise RuntimeError(f"cannot train the embedded tokenizer: {corpus_path} holds no text")
        train_bpe_tokenizer(itertools.chain(first, texts), tmp, cfg.embedded_vocab_size)

    return build_once(path, build)


def _unreachable_hub(timeout_s: float = 3.0) -> str | None:
    """The hub's host when one TCP connection to it fails within `timeout_s` (None: reachable, or
    offline mode / a proxy already decides how the hub client behaves)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(
        os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")
    ):
        return None
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return host
    return None


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained` with fix-it errors; the tokenizer must define an EOS token."""
    looks_local = name_or_path.startswith(("/", "./", "../", "~")) or os.path.isdir(name_or_path)
    path = os.path.expanduser(name_or_path)
    if looks_local and not os.path.isdir(path):
        raise DataNotFound(
            f"data.tokenizer={name_or_path!r}: no such directory. Point it at a directory written by "
            "save_pretrained (with tokenizer.json), a hub name like HuggingFaceTB/SmolLM-135M, or `embedded`"
        )
    from transformers import AutoTokenizer

    hub = None if looks_local else _unreachable_hub()
    try:  # an unreachable hub: only the local cache (the hub client would retry for a minute)
        tok = AutoTokenizer.from_pretrained(path, **({"local_files_only": True} if hub else {}))
    except (OSError, ValueError) as err:
        if looks_local:
            why = f"{path} holds no loadable tokenizer (tokenizer.json or a slow tokenizer's files)"
        elif hub:
            why = f"it is not in the local Hugging Face cache and {hub} is unreachable (offline?)"
        else:
            why = f"{err}".splitlines()[0]
        raise DataError(
            f"data.tokenizer={name_or_path!r} could not be loaded: {why}. Point it at a directory written "
            "by save_pretrained, a reachable hub name, or use data.tokenizer=embedded (trained locally, offline)"
        ) from err
    if tok.eos_token_id is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no eos_token: documents are separated by EOS when packed. "
            "Use a tokenizer with an eos_token (or set tokenizer.eos_token before building the data)"
        )
    return tok


def tokenizer_identity(tok: PreTrainedTokenizerBase) -> str:
    """Hash of the tokenizer's full definition (vocab, merges, normalizer), for cache keys.

    Hashing the definition rather than the name means a re-trained or edited tokenizer at the
    same path invalidates the token cache, and the same tokenizer under two names shares it.
    """
    backend = getattr(tok, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    blob += f"|eos={tok.eos_token_id}|len={len(tok)}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def vocab_size(tok: PreTrainedTokenizerBase) -> int:
    """Token ids the model's embedding must cover (`len(tokenizer)`, added tokens included): the
    recipe checks it against `model.vocab_size`, since a larger tokenizer would index past it."""
    return len(tok)


def resolve_tokenizer(cfg: DataConfig, corpus_path: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer `cfg.tokenizer` names; `embedded` trains one on `corpus_path` (once)."""
    if cfg.tokenizer != EMBEDDED:
        return load_tokenizer(cfg.tokenizer)
    if corpus_path is None:
        raise ValueError("data.tokenizer=embedded needs the embedded corpus; internal call without it")
    return load_tokenizer(embedded_tokenizer_dir(cfg, corpus_path))


class Encoder:
    """Documents -> token ids through the Rust tokenizer directly (`encode_batch_fast`: no offsets,
    no Python BatchEncoding), since at corpus scale the wrappers cost more than the merges.

    Called on a batch of rows it is the `datasets.map` function ({"ids": token ids per row,
    "keep": has text}); a class rather than a closure so it pickles into the map workers by value
    (the tokenizer travels as its JSON definition). Rows whose text is empty or missing are
    skipped: every kept document becomes its tokens followed by EOS.
    """

    def __init__(self, backend: Any, text_field: str, dtype: np.dtype, worker: bool = False) -> None:
        self.backend, self.text_field, self.dtype = backend, text_field, np.dtype(dtype)
        self.worker = worker  # runs in a map worker process: one thread, one worker per core

    @classmethod
    def of(cls, tokenizer: Any, text_field: str, dtype: np.dtype) -> Encoder:
        """The encoder of a Hugging Face tokenizer; it needs the fast (Rust) backend."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise DataError(
                f"tokenizer {tokenizer.name_or_path!r} has no fast (Rust) backend: load it with "
                "AutoTokenizer (use_fast=True) and save it with save_pretrained, which writes tokenizer.json"
            )
        return cls(backend, text_field, dtype)

    def encode(self, texts: list[str | None]) -> tuple[list[np.ndarray], list[bool]]:
        keep = [bool(t) for t in texts]
        batch = [t for t, k in zip(texts, keep, strict=True) if k]
        fast = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encoded = iter(fast(batch, add_special_tokens=False))
        empty = np.zeros(0, dtype=self.dtype)
        ids = [np.asarray(next(encoded).ids, dtype=self.dtype) if k else empty for k in keep]
        return ids, keep

    def documents(self, texts: list[str | None], eos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, document end offsets, kept) of `texts`: every non-empty text's ids then EOS.

        The tokenizer gets 16k texts a call: enough for its threads, few Rust objects alive at once."""
        ids: list[np.ndarray] = []
        keep: list[bool] = []
        for i in range(0, len(texts), 1 << 14):
            part_ids, part_keep = self.encode(texts[i : i + (1 << 14)])
            ids += part_ids
            keep += part_keep
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        values = np.concatenate(ids) if ids else np.zeros(0, dtype=self.dtype)
        kept = np.asarray(keep, dtype=bool)
        return (*with_eos(values, lengths[kept], eos), kept)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self.worker:  # this forked worker's own setting: N workers x N tokenizer threads oversubscribe
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        ids, keep = self.encode(batch[self.text_field])
        return {"ids": ids, "keep": keep}


def with_eos(values: np.ndarray, lengths: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(the documents of `lengths` tokens laid end to end in `values`, each followed by EOS; their
    end offsets): the packed stream every token format and loader reads."""
    tokens = np.insert(values, np.cumsum(lengths), np.asarray(eos, dtype=values.dtype))
    return tokens, np.cumsum(lengths + 1)
