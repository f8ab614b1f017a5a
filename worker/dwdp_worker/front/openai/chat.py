"""Chat messages → prompt token ids with the checkpoint's own chat template.

Invariants:
  * The template is the tokenizer's (``tokenizer_config.json`` ``chat_template`` or
    ``chat_template.jinja`` beside it, as ``save_pretrained`` writes it). No fallback template is
    invented: without one, chat is a 400 that names what is missing and where it would live — a
    guessed format would silently give a different model input than the model was trained on.
  * ``render`` returns text; the front tokenizes it like any text prompt, without adding special
    tokens (the template already writes BOS and turn markers).
  * Template errors (a ``raise_exception`` in the template, e.g. "roles must alternate") are 400s
    with the template's own message, never a 500.
"""

from __future__ import annotations

from .requests import OpenAIRequestError


def template_of(tokenizer) -> str | None:
    return getattr(tokenizer, "chat_template", None) or None


def _text_only(messages: list[dict]) -> list[dict]:
    """Content given as a list of parts (the newer OpenAI shape) becomes its joined text parts;
    images, audio and files are refused (this server has a text model)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            kinds = {p.get("type") for p in content} - {"text"}
            if kinds:
                raise OpenAIRequestError(f"messages[{i}].content: only text parts are served, got "
                                         f"{', '.join(sorted(map(str, kinds)))}", param="messages")
            m = {**m, "content": "".join(str(p.get("text", "")) for p in content)}
        out.append(m)
    return out


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True, *, model_dir: str = "") -> str:
    """``messages`` rendered with the tokenizer's chat template (text)."""
    if template_of(tokenizer) is None:
        where = f" of {model_dir}" if model_dir else ""
        raise OpenAIRequestError(
            f"the tokenizer{where} has no chat template (no 'chat_template' in tokenizer_config.json and no "
            f"chat_template.jinja): /v1/chat/completions needs one; use /v1/completions, or add the model's "
            f"template to the checkpoint", param="messages", code="chat_template_missing")
    messages = _text_only(messages)
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja TemplateError and template raise_exception → 400
        raise OpenAIRequestError(f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                                 param="messages", code="chat_template_error") from None
    if not isinstance(rendered, str):  # some tokenizer versions return a list for a batch of one
        rendered = rendered[0]
    return rendered
