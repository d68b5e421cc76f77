"""From protocol-neutral chat messages to prompt token ids, and the token budget that is left."""
from __future__ import annotations

import jinja2

from infernix_jax.tokenizer import TokenizerError

from .errors import invalid

MAX_TOKENS_ABSURD = 10_000_000   # above this a max_tokens is a mistake, not a wish for "as much as fits"


def render(engine, messages: list[dict], tools: list | None, template_kwargs: dict | None = None,
           param: str = "messages") -> tuple[list[int], str]:
    """messages in the chat-template form (role, content, tool_calls, reasoning_content, ...) ->
    (prompt ids, prompt text). Raises a 400 when the template refuses or the prompt fills the context."""
    tok = engine.tokenizer
    try:
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **(template_kwargs or {}))
    except (jinja2.TemplateError, TokenizerError) as e:
        raise invalid(f"the chat template rejected these messages: {e}", param) from None
    ids = tok.encode(text, add_special_tokens=False)
    check_room(engine, len(ids), param)
    return ids, text


def check_room(engine, n_prompt: int, param: str = "messages") -> int:
    room = engine.max_context - n_prompt
    if n_prompt < 1:
        raise invalid("the prompt is empty", param)
    if room < 1:
        raise invalid(f"the prompt has {n_prompt} tokens, which fills this model's context of "
                      f"{engine.max_context} tokens; shorten the conversation", param)
    return room


def budget(engine, n_prompt: int, requested: int | None, param: str = "max_tokens") -> int:
    """The max_tokens to run with: what was asked, capped at what fits in the context (agents ask for
    32K or more whatever the model; the reply then ends with finish reason "length"); all that fits
    when nothing was asked."""
    room = engine.max_context - n_prompt
    if requested is None:
        return room
    if requested > MAX_TOKENS_ABSURD:
        raise invalid(f"'{param}' is {requested}; this model's context is {engine.max_context} tokens", param)
    return min(requested, room)
