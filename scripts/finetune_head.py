"""Continue training a saved draft head on a record store, with or without training-time test.

Starts from a head that ``jaxcert train-drafter --head`` trained (``models.eagle.save_head``
format) and trains it ``--steps`` more steps on a record store (a run's ``store/``), with
the loss over ``--depth`` drafted tokens a round (``jaxcert.training.eagle.window_loss``;
``--depth 1`` is plain teacher forcing). Two runs that differ only in ``--depth`` compare
training-time test against more of the same training at equal steps; evaluate them with
``scripts/compare_heads.py --depth D`` (method and figures in ``docs/training.md``,
"Training-time test").

Resumable: the checkpoint (head, optimiser state, history) is written to ``--out`` every
``--every`` steps, and a rerun with the same options continues from it; the trained head is
``--out``/head.

Usage::

  python scripts/finetune_head.py --head RUN/kl+tv-seed0/head --store RUN/store \\
      --depth 3 --steps 40 --learning-rate 1e-4 --out jaxcert-out/ft-ttt3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

_OBJECTIVES = ("kl", "kl+tv")


def parse_args(argv=None) -> argparse.Namespace:
    from jaxcert.cli.argtypes import positive, positive_float, unit_float

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", type=pathlib.Path, required=True, help="the saved head to start from")
    p.add_argument("--store", type=pathlib.Path, required=True, help="a record store folder")
    p.add_argument("--depth", type=positive, default=1, help="drafted tokens a round (default 1)")
    p.add_argument(
        "--decay",
        type=unit_float,
        default=0.8,
        help="weight decay**k of pass k, in (0, 1] (default 0.8)",
    )
    p.add_argument("--objective", choices=_OBJECTIVES, default="kl+tv")
    p.add_argument("--steps", type=positive, default=40)
    p.add_argument("--batch-size", type=positive, default=4)
    p.add_argument(
        "--learning-rate", type=positive_float, default=1e-4, help="peak rate (default 1e-4)"
    )
    p.add_argument("--seed", type=int, default=0, help="batch order (default 0)")
    p.add_argument("--every", type=positive, default=10, help="steps between checkpoints")
    p.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint folder")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxcert.base.folders import check_options
    from jaxcert.models.eagle import load_head
    from jaxcert.training import head_data
    from jaxcert.training.eagle import train_head_on_records
    from jaxcert.training.train import Objective

    key = {k: str(v) for k, v in vars(args).items() if k not in ("every", "out")}
    args.out.mkdir(parents=True, exist_ok=True)
    try:  # a fine-tune goes on only with the options it began with
        check_options(args.out, key, name="finetune.json", advice="choose another --out")
    except ValueError as err:
        raise SystemExit(str(err)) from None
    store = head_data.read_store(args.store)
    head = load_head(args.head)
    if tuple(head.taps) != tuple(store.spec.taps):
        raise SystemExit(
            f"the head reads target blocks {tuple(head.taps)}, the store holds "
            f"{tuple(store.spec.taps)}"
        )
    records = store.load()
    objective = Objective(args.objective, tv_weight=1.0 if args.objective == "kl+tv" else 0.0)
    start = time.perf_counter()

    def log(i: int, entry: dict[str, float]) -> None:
        print(
            f"[finetune] step {i + 1}/{args.steps} loss {entry['loss']:.3f} kl {entry['kl']:.3f} "
            f"tv {entry['tv']:.3f} ({entry['seconds']:.1f} s)",
            file=sys.stderr,
        )

    train_head_on_records(
        head,
        records,
        objective,
        rule_names=store.spec.rules,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        checkpoint=args.out,
        every=args.every,
        log=log,
        depth=args.depth,
        decay=args.decay,
    )
    print(f"[finetune] {time.perf_counter() - start:.0f} s; head: {args.out / 'head'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
