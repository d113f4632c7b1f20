"""scripts/bench_decode_calls.py on tiny checkpoints: the split of a decode's time by
program adds up, and a policy that never drafts runs only target-only steps."""

import json

import pytest

from tests.helpers import tiny_lm
from tests.helpers.scripts_loader import load_script


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("calls")
    target = tiny_lm.save_tiny_checkpoint(root / "target", seed=0)
    drafter = tiny_lm.save_tiny_checkpoint(root / "drafter", seed=1, layers=1)
    lines = [{"prompt": t, "category": "c"} for t in ("a b c a b c a b", "hello world hello")]
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return root, target, drafter, prompts


def _run(setup, policy, *extra):
    root, target, drafter, prompts = setup
    out = root / f"{policy.replace(':', '_')}.json"
    argv = [
        "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
        "--prompt-indices", "1,0", "--max-new-tokens", "12", "--max-draft", "4",
        "--repeats", "2", "--policy", policy, "--out", str(out), *extra,
    ]  # fmt: skip
    assert load_script("bench_decode_calls").main(argv) == 0
    return json.loads(out.read_text())


def test_the_split_adds_up_to_the_decode(setup):
    record = _run(setup, "constant:3")
    assert [(r["prompt"], r["run"]) for r in record["rows"]] == [(1, 1), (1, 2), (0, 1), (0, 2)]
    for row in record["rows"]:
        split = row["programs"]
        assert split["steps"]["calls"] == 0  # a fixed policy never hands off
        assert split["rounds"]["tokens"] == row["speculative_tokens"] == 12
        assert split["rounds"]["seconds"] == pytest.approx(row["speculative_s"], abs=1e-3)
        per_token = row["target_s"] / row["target_tokens"]
        want = row["speculative_s"] - 12 * per_token
        assert split["rounds"]["excess_s"] == pytest.approx(want, abs=2e-3)
    total = sum(r["programs"]["rounds"]["excess_s"] for r in record["rows"])
    assert record["excess_s"]["rounds"] == pytest.approx(total, abs=1e-3)


def test_goodput_that_does_not_draft_runs_target_only_steps(setup):
    """A prior acceptance of 0.01: drafting does not pay, so ``goodput`` hands most of the
    decode to target-only steps, and the split shows them."""
    record = _run(setup, "goodput:0.01:patience=0")
    for row in record["rows"]:
        split = row["programs"]
        assert split["steps"]["tokens"] + split["rounds"]["tokens"] == 12
        assert split["steps"]["tokens"] > 0


def test_bad_prompt_index_is_refused(setup):
    with pytest.raises(SystemExit, match=r"--prompt-indices \[5\]: .* has 2 prompts"):
        _run(setup, "constant:3", "--prompt-indices", "5")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "garbage"], "argument --policy: unknown policy 'garbage'"),
        (["--verify", "sample"], "--verify / --temperature: temperature 0.0 does not fit"),
        (["--temperature", "1", "--verify", "greedy"], "temperature 1.0 does not fit"),
        (["--prompt-indices", "1,x"], "--prompt-indices: comma-separated integers"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens"),
    ],
)
def test_bad_options_are_refused_when_the_command_line_is_read(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        load_script("bench_decode_calls").parse_args(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused_before_decoding(tmp_path, capsys):
    script = load_script("bench_decode_calls")
    for out, message in [
        (tmp_path, "a folder, not a file"),
        ("/proc/jaxcert/x.json", "--out /proc/jaxcert/x.json"),
    ]:
        with pytest.raises(SystemExit):
            script.parse_args(["--out", str(out)])
        assert message in capsys.readouterr().err


def test_a_drafter_of_another_vocabulary_is_refused_before_loading(setup, tmp_path):
    root, target, _, prompts = setup
    other = tiny_lm.save_tiny_checkpoint(tmp_path / "other", seed=2)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 64}))
    argv = ["--target", str(target), "--drafter", str(other), "--prompts", str(prompts)]
    with pytest.raises(SystemExit, match="vocabulary"):
        load_script("bench_decode_calls").main([*argv, "--prompt-indices", "0"])
