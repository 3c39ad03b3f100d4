"""OpenAI request schemas, strict: what kvroute cannot honour is refused, not ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Parameters of the OpenAI API that kvroute does not implement: a request that sets
# them to anything but their neutral value gets 400 naming the parameter.
UNSUPPORTED_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are refused (extra='forbid')."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # Accepted only at their neutral values (see UNSUPPORTED_NEUTRAL).
    n: int | None = None
    best_of: int | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None

    def unsupported_parameter(self) -> str | None:
        """The first parameter set to a value kvroute cannot honour, if any."""
        for name, neutral in UNSUPPORTED_NEUTRAL.items():
            if getattr(self, name, None) not in neutral:
                return name
        return None

    def stop_strings(self) -> list[str]:
        """The non-empty stop strings; their number and length are bounded by
        ``orchestrator.input_limits`` (settings, so not here)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    store: bool | None = None
    metadata: dict | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt

    @model_validator(mode="after")
    def _non_empty_prompt(self):
        prompts = self.prompt if isinstance(self.prompt, list) else [self.prompt]
        if prompts and isinstance(prompts[0], int):  # one prompt of token ids (pydantic checked them all)
            return self
        if not prompts or any(p == [] or p == "" for p in prompts):
            raise ValueError("prompt must not be empty")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)
