"""A `transformers` fast tokenizer built from GGUF `tokenizer.ggml.*` metadata, without torch.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == 'gpt2'`) are supported, with the
pre-tokenizers of Qwen2 ('qwen2'), Llama 3 ('llama-bpe'), SmolLM ('smollm') and GPT-2 ('default').
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, NFC normalisation) for a `tokenizer.ggml.pre` value."""
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(_QWEN2_SPLIT), True
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"):
        return _split_then_bytes(_LLAMA3_SPLIT), False
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ), False
    if pre in (None, "default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    raise ValueError(f"Unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}.")


def tokenizer_from_gguf(metadata: Mapping[str, Any]):
    """Builds a `transformers.PreTrainedTokenizerFast` from GGUF metadata.

    Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
    tokens; bos/eos/unk/pad and the chat template come from the metadata.

    Raises:
      ValueError: no tokenizer in the metadata, a model other than 'gpt2' (byte-level BPE), an
        unsupported pre-tokenizer, or a malformed merge.
    """
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"Unsupported GGUF tokenizer.ggml.model={kind!r}; only 'gpt2' (byte-level BPE)."
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = []
    for merge in metadata.get("tokenizer.ggml.merges") or ():
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"Malformed GGUF merge {merge!r} (expected 'left right').")
        merges.append((parts[0], parts[1]))
    pre = metadata.get("tokenizer.ggml.pre")
    pre_tokenizer, nfc = _pre_tokenizer(pre)
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3"),
    )
    tok = Tokenizer(bpe)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None or not 0 <= i < len(tokens) else tokens[i]

    bos, eos = token("bos"), token("eos")
    post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        post.append(template)
    tok.post_processor = processors.Sequence(post)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
