"""``jaxcert export-head`` and ``jaxcert export-model``: heads and models in the layouts the
serving engines load (`jaxcert.models.eagle3`, `jaxcert.models.export`)."""

from __future__ import annotations

import os
import pathlib

from jaxcert.base.folders import check_new_folder

__all__ = ["add_parser", "run_head", "run_model"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export-head",
        help="write a draft head as an EAGLE-3 (SpecForge) or speculators folder for vLLM / SGLang",
        description="Writes an eagle3-arch draft head (a folder of jaxcert's, from "
        "train-drafter --head eagle3 --arch eagle3, or an EAGLE-3 / speculators folder) in the "
        "layout SpecForge (eagle3) or the speculators library writes: config.json and "
        "model.safetensors, which vLLM (speculative_config method 'eagle3') and SGLang "
        "(EAGLE3) load. The folder is written whole or not at all.",
    )
    p.add_argument("head", help="the head's folder")
    p.add_argument("--format", choices=("eagle3", "speculators"), default="eagle3")
    p.add_argument("--out", type=pathlib.Path, required=True, help="the folder to write")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--target",
        default=None,
        help="the head's target (asset, folder or .gguf): needed to read an EAGLE-3 or "
        "speculators folder, and recorded as the verifier of a speculators export",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run_head)

    m = sub.add_parser(
        "export-model",
        help="write a model (asset, GGUF or folder) as a Hugging Face folder vLLM loads",
        description="Writes a model as a Hugging Face folder (config.json, "
        "generation_config.json, safetensors, tokenizer and chat template) that transformers "
        "and vLLM load; jaxcert loads it back bit-exact. The folder is written whole or not "
        "at all.",
    )
    m.add_argument("model", help="asset name, Hugging Face folder or .gguf file")
    m.add_argument("--out", type=pathlib.Path, required=True, help="the folder to write")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    m.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    m.set_defaults(func=run_model)


def run_head(args) -> int:
    from jaxcert.models import eagle, eagle3

    keep = [args.head] + ([args.target] if args.target and os.path.exists(args.target) else [])
    check_new_folder(args.out, overwrite=args.overwrite, keep=keep)
    target = None
    if not eagle.is_head_folder(args.head) and eagle3.engine_format(args.head) is not None:
        if args.target is None:
            raise ValueError("--target: an EAGLE-3 or speculators folder is read with its target")
        from jaxcert import models

        target = models.load(args.target).model
    head = eagle3.read_head(args.head, target)
    out = eagle3.export_head(
        head,
        args.out,
        format=args.format,
        dtype=args.dtype,
        verifier=args.target,
        overwrite=args.overwrite,
        keep=keep,
    )
    size = head.draft_size
    print(
        f"wrote {out} ({args.format}, {args.dtype}; aux layers "
        f"{[i + 1 for i in head.taps]} counted as vLLM does, draft vocabulary {size:,})"
    )
    return 0


def run_model(args) -> int:
    from jaxcert import models
    from jaxcert.models.export import save_hf

    check_new_folder(args.out, overwrite=args.overwrite, keep=[args.model])
    loaded = models.load(args.model)
    out = save_hf(loaded, args.out, dtype=args.dtype, overwrite=args.overwrite, keep=[args.model])
    print(f"wrote {out} ({loaded.config.architecture}, {args.dtype})")
    return 0
