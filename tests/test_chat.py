"""``picompile chat`` / ``serve.chat.Conversation``: the chat template applied as transformers applies it, the KV
cache kept between turns, /reset and /exit, and a clear refusal for a model without a template."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from picompile.runtime.sampling import SamplingParams

TEMPLATE = ("{% for m in messages %}{{ '<|endoftext|>' if loop.first else '' }}{{ m['role'] | upper }}:\n"
            "{{ m['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")


def test_history_kept_and_template_applied(default_artifact: Path) -> None:
    from transformers import AutoTokenizer

    import picompile
    from picompile.serve.chat import Conversation

    session = picompile.load(default_artifact)
    chat = Conversation(session, TEMPLATE)
    fed: list[list[int]] = []
    feed = chat.decoder.feed
    chat.decoder.feed = lambda ids, **kw: (fed.append(list(ids)), feed(ids, **kw))[1]  # type: ignore[method-assign]
    greedy = SamplingParams(stop=("\n\n",))
    first = [g.delta for g in chat.say("Who art thou?", 24, greedy)]
    n_first = len(fed[0])
    list(chat.say("And whence comest thou?", 24, greedy))
    ref = AutoTokenizer.from_pretrained(str(default_artifact / "tokenizer"))
    messages = chat.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == "".join(first) and messages[1]["content"]
    want = ref.apply_chat_template(messages[:3], chat_template=TEMPLATE, add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    second_prompt = chat.decoder.history[:len(want)]
    assert second_prompt == list(want)  # the cache holds exactly the templated conversation
    assert chat.last_stats.cached_tokens >= n_first  # the first turn was not prefilled again
    assert chat.last_stats.prompt_tokens == len(want)
    chat.reset()
    assert chat.decoder.length == 0 and chat.messages == []


def test_chat_cli(default_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  capsys: pytest.CaptureFixture[str]) -> None:
    from picompile.cli import main

    tpl = tmp_path / "t.jinja"
    tpl.write_text(TEMPLATE)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n/reset\nGood morrow\n/exit\nnever read\n"))
    assert main(["chat", str(default_artifact), "--template", str(tpl), "--max-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") >= 2 and "conversation reset" in captured.err
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert main(["chat", str(default_artifact)]) == 2
    assert "has no chat template" in capsys.readouterr().err
