"""Prompt-set filters: the editing task of the n-gram benchmark."""

from __future__ import annotations

from jaxcert.base import prompts

CODE = "```\n" + "\n".join(f"x{i} = {i}" for i in range(6)) + "\n```"


def _p(i: int, text: str) -> prompts.Prompt:
    return prompts.Prompt(str(i), text)


def test_editing_prompts_keep_edit_requests_on_quoted_code():
    pad = " please" * 40  # long enough
    cases = {
        "edit": "Refactor this function:" + pad + "\n" + CODE,
        "no verb": "What does this print?" + pad + "\n" + CODE,
        "verb only inside the code": "Look:" + pad + "\n```\nfix = 1\n" + CODE[4:],
        "no code": "Rewrite my essay about otters." + pad,
        "short code": "Fix this:" + pad + "\n```\nx = 1\n```",
        "unclosed fence": "Fix this:" + pad + "\n```\n" + "a\n" * 8,
        "too long": "Fix this:" + pad * 20 + "\n" + CODE,
        "too short": "Fix:\n" + CODE,
    }
    items = [_p(i, t) for i, t in enumerate(cases.values())]
    got = prompts.editing_prompts(items, skip=0)
    assert [p.id for p in got] == ["0"]
    assert got[0].category == "edit" and got[0].text == items[0].text
    # The first `skip` prompts are passed over.
    assert prompts.editing_prompts(items[:1] * 3, skip=2) == [got[0]]
    assert prompts.editing_prompts(items[:1], skip=1) == []
