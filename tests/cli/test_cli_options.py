"""The help of ``jaxcert decode`` and ``jaxcert train-drafter`` (every default shown), and
train-drafter's vocabulary check before any weights are read."""

import argparse
import json
import re
import shutil

import pytest

from jaxcert import cli, models
from jaxcert.cli import decode, train_drafter
from jaxcert.models import gguf as gguf_loader
from jaxcert.models import hf as hf_loader
from tests.helpers import tiny_lm


def _parser(module, name: str) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser(prog="jaxcert").add_subparsers()
    module.add_parser(sub)
    return sub.choices[name]


def _helps(parser) -> dict[str, str]:
    """Each option's help as ``--help`` prints it (``%(default)s`` expanded)."""
    formatter = parser._get_formatter()
    return {
        a.option_strings[-1]: formatter._expand_help(a) if a.help else ""
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }


def _flags(parser) -> set[str]:
    return {
        a.option_strings[-1]
        for a in parser._actions
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
    }


DECODE_DEFAULTS = {
    "--target": "qwen2.5-coder-1.5b-instruct",
    "--drafter": "qwen2.5-coder-0.5b-instruct",
    "--prompts": "mtbench",
    "--turn": "0",
    "--policy": "svip:0.3",
    "--verify": "greedy",
    "--temperature": "0",
    "--top-p": "1.0",
    "--max-new-tokens": "128",
    "--batch-size": "1",
    "--max-prompts": "4",
    "--seed": "0",
    "--out": "jaxcert-out/decode",
}
TRAIN_DEFAULTS = {
    "--target": "qwen2.5-coder-0.5b-instruct",
    "--exit-layer": "6",
    "--prompts": "mtbench",
    "--max-prompts": "80",
    "--heldout": "0.25",
    "--continuation": "128",
    "--train-steps": "150",
    "--batch-size": "64",
    "--learning-rate": "0.001",
    "--width": "1024",
    "--weight": "1.0",
    "--margin": "0.0",
    "--draft-length": "5",
    "--decode-tokens": "64",
    "--seed": "0",
    "--out": "jaxcert-out/train-drafter",
    "--head": "off",
    "--data": "replies",
    "--positions": "100000",
    "--heldout-sequences": "48",
    "--draft-vocab": "32768",
    "--head-layers": "1",
    "--ttt-depth": "1",
    "--objectives": "kl,kl+greedy,kl+tree4,kl+tv",
    "--seeds": "0,1",
}


@pytest.mark.parametrize(
    "module, name, defaults",
    [(decode, "decode", DECODE_DEFAULTS), (train_drafter, "train-drafter", TRAIN_DEFAULTS)],
    ids=["decode", "train-drafter"],
)
def test_every_option_has_help_with_its_default(module, name, defaults):
    parser = _parser(module, name)
    helps, flags = _helps(parser), _flags(parser)
    for option, text in helps.items():
        assert text, f"{option} has no help"
        if option not in flags:
            assert "default" in text, f"{option}: {text!r} does not give its default"
    for option, value in defaults.items():
        assert re.search(rf"\(default:? {re.escape(value)}[,;)]", helps[option]), (
            option,
            helps[option],
        )


def test_train_drafter_says_how_long_its_default_run_takes():
    parser = _parser(train_drafter, "train-drafter")
    assert "about 21 minutes on 2 CPU cores" in " ".join(parser.description.split())


def test_train_drafter_refuses_mismatched_vocabularies_before_reading_weights(
    tmp_path, monkeypatch, capsys
):
    target = tiny_lm.save_tiny_checkpoint(tmp_path / "t")  # vocabulary 48
    drafter = tmp_path / "d"
    shutil.copytree(target, drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps(config | {"vocab_size": 44}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the cat"}\n{"prompt": "an otter"}\n')

    def boom(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(models, "load", boom)
    monkeypatch.setattr(hf_loader, "model_from_tensors", boom)
    monkeypatch.setattr(hf_loader, "SafetensorsFolder", boom)
    monkeypatch.setattr(gguf_loader, "model_from_tensors", boom)
    argv = ["train-drafter", "--target", str(target), "--drafter", str(drafter),
            "--prompts", str(prompts), "--out", str(tmp_path / "out")]  # fmt: skip
    assert cli.main(argv) == 2
    assert "the target has 48 logit rows, the drafter 44" in capsys.readouterr().err
