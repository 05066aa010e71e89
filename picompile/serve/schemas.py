"""The OpenAI API's request and response bodies that ``picompile serve`` speaks, as pydantic models.

Requests are validated here: a wrong type or a value out of range is a 422 with an OpenAI-style error body
(``app.py``). Parameters are named as the OpenAI API names them; ``top_k``, ``min_p``,
``repetition_penalty`` and ``ignore_eos`` are the common extensions (vLLM, llama.cpp's server). Fields of the API that change
nothing here (``user``, ``logit_bias`` when empty, ``stream_options`` but ``include_usage``) are accepted and
ignored; ones whose meaning cannot be honoured (``n`` > 1, ``logprobs``, ``tools``, ``best_of`` > 1,
``suffix``) are refused with the reason.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_TOKENS = 1 << 20
MAX_STOPS = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(default=0, ge=0, le=MAX_TOKENS)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, ge=1e-3, le=1e3, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    seed: Optional[StrictInt] = Field(default=None, ge=0, le=(1 << 63) - 1)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = Field(default=1, ge=1, le=1)
    logprobs: Any = None
    ignore_eos: StrictBool = False  # extension (vLLM): generate max_tokens whatever the model says
    user: Optional[StrictStr] = None

    def stops(self) -> tuple[str, ...]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(x for x in s if x)

    def unsupported(self) -> str | None:
        """Why this request cannot be served as asked (None: it can)."""
        if self.logprobs not in (None, False, 0):
            return "logprobs are not supported"
        if len(self.stops()) > MAX_STOPS or any(len(s) > 256 for s in self.stops()):
            return f"stop takes at most {MAX_STOPS} strings of at most 256 characters"
        for key in ("tools", "functions", "suffix", "response_format"):
            if (self.model_extra or {}).get(key) not in (None, [], {}, {"type": "text"}):
                return f"{key} is not supported"
        if (self.model_extra or {}).get("best_of") not in (None, 1):
            return "best_of is not supported"
        return None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    echo: StrictBool = False


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=MAX_TOKENS)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body: {"error": {message, type, param, code}}."""
    return {"error": ErrorBody(message=message, type=type_, param=param, code=code).model_dump()}
