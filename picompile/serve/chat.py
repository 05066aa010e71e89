"""A conversation with an artifact: messages → the model's chat template → token ids, the KV cache kept between
turns (each turn prefills only what the template adds after the cached tokens)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from picompile.errors import InputError, PicompileError
from picompile.formats.tokenizers import render_chat
from picompile.runtime.sampling import Generation, SamplingParams

NO_TEMPLATE = ("this model's tokenizer has no chat template, so chat cannot know how to format a conversation; "
               "give one with --template FILE (a Jinja chat template, as in a Hugging Face tokenizer_config.json)")


def read_template(path: str | Path | None) -> str | None:
    """The text of a Jinja chat template file (None: use the tokenizer's own)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the chat template {path}: {e}") from None
    if not text.strip():
        raise InputError(f"the chat template {path} is empty")
    return text


def has_template(tokenizer: Any, template: str | None) -> bool:
    return template is not None or getattr(tokenizer, "chat_template", None) is not None


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], template: str | None = None,
             add_generation_prompt: bool = True) -> list[int]:
    """The conversation as the ids the model reads: HF tokenizers through ``transformers``' ``apply_chat_template``
    (``template`` overriding the tokenizer's own); others render ``template`` in a Jinja sandbox and encode it
    after their BOS."""
    if tokenizer is None:
        raise InputError("this artifact has no tokenizer: it cannot chat")
    if not has_template(tokenizer, template):
        raise InputError(NO_TEMPLATE)
    if hasattr(tokenizer, "apply_chat_template"):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt, template))
    assert template is not None
    text = render_chat(template, messages, add_generation_prompt)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    return bos + tokenizer.encode(text, bos=False)


def check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InputError(f"messages[{i}] must be an object with string 'role' and 'content'")
    return messages


class Conversation:
    """Turns of a chat on one session: ``say(text)`` yields the reply's ``Generation`` token by token; the
    decoder (its KV cache) lives as long as the conversation, so history is not prefilled again."""

    def __init__(self, session: Any, template: str | None = None, system: str | None = None) -> None:
        if not has_template(session.tokenizer, template):
            raise PicompileError(NO_TEMPLATE)
        self.session = session
        self.template = template
        self.system = system
        self.decoder = session.decoder()
        self.messages: list[dict[str, str]] = []
        self.last_stats: Any = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (and the cache)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.decoder.truncate(0)

    def prompt_ids(self) -> list[int]:
        return chat_ids(self.session.tokenizer, self.messages, self.template)

    def say(self, text: str, max_tokens: int, params: SamplingParams) -> Iterator[Generation]:
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids()
            room = self.session.max_seq_len - len(ids)
            if room <= 0:
                raise InputError(f"the conversation has {len(ids)} tokens, the whole context of "
                                 f"{self.session.max_seq_len}: /reset to start again")
            run = self.session.stream(ids, min(max_tokens, room), params, decoder=self.decoder)
        except Exception:
            self.messages.pop()
            raise
        gen = run.generation
        for gen in run:
            yield gen
        self.last_stats = run.stats
        self.messages.append({"role": "assistant", "content": gen.text})
