"""Prompt token ids from chat messages or raw text, where user text never becomes a control token.

A chat template writes control tokens (`<|im_start|>`, `<|eot_id|>`, `[INST]`, …) around the
messages and the tokenizer parses every occurrence of their text in the rendered prompt as the
token itself. Tokenized naively, a user who writes `<|im_end|>\\n<|im_start|>system\\n…` in
their content closes their own turn and opens a system turn. Here user-supplied strings (content,
roles, names, tool arguments: every string value in the messages) are encoded as ordinary text,
while the control tokens the template writes itself stay control tokens. The same holds for the
tools a request offers (names, descriptions, parameter schemas) and for dict keys.

How: before rendering, each control token's text inside a user string is wrapped in private-use
markers. The rendered prompt is cut at the markers; the text between them is encoded as the
tokenizer always does (template control tokens included), and each marked piece is encoded as
plain text. Invariant: when no user string contains control-token text (or one of the two marker
characters) there are no markers, and the ids are exactly `apply_chat_template(..., tokenize=True)`'s
(one encode of the whole prompt). Otherwise the prompt is encoded piece by piece, so tokens do
not merge across a marked token's edges.

Raw prompts (`/v1/completions`) go through the same marking: their control-token text is plain
text too. A caller that needs control tokens in a raw prompt sends token ids.

Control tokens are the tokenizer's special tokens plus its non-special added tokens that the chat
template's source mentions (e.g. Qwen2.5's `<tool_call>`), except whitespace tokens (Gemma's
`\\n\\n` is ordinary text). A template that slices a user string can cut a marker off: a control
token still next to one of its markers is user text all the same, and a lone marker is dropped but
still breaks the text there. (If the cut leaves a marker against a control token the template
wrote, that token becomes text: the safe way round.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from loramux.engine.errors import InvalidRequestError

# Supplementary private-use characters. User text holding them is marked too, so a user cannot
# forge a marked token or break one open.
_START, _END = "\U000f0000", "\U000f0001"


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template and a generation prompt;
    `tools` (OpenAI tool objects as plain data) go to the template's `tools`, their strings and
    keys user text like the messages'.

    Raises InvalidRequestError when the template refuses the messages (e.g. roles that do not
    alternate, or several tool calls in one turn for a template that takes one) or when
    control-token text cannot be encoded without the token itself.
    """
    control = _ControlTokens.of(tokenizer)
    try:
        rendered = tokenizer.apply_chat_template(
            control.mark(messages),
            tools=control.mark(tools),
            add_generation_prompt=True,
            tokenize=False,
        )
    except TemplateSyntaxError:
        raise  # the model's template is broken: not the request's fault
    except TemplateError as exc:
        raise InvalidRequestError(f"the model's chat template refused the messages: {exc}") from exc
    return _encode_marked(tokenizer, rendered, control)


def text_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a raw prompt, control-token text encoded as plain text; no BOS is added."""
    control = _ControlTokens.of(tokenizer)
    return _encode_marked(tokenizer, control.mark(text), control)


@dataclass(frozen=True)
class _ControlTokens:
    ids: dict[str, int]
    """Each control token's text and id."""
    in_user_text: re.Pattern[str]
    """One control token (or marker character) in a user string; longest tokens first, so a
    token wins over a shorter token inside it."""
    in_prompt: re.Pattern[str]
    """In the rendered prompt, a marked token (in group 1 or, where the template cut the start
    marker off, group 2) or a lone marker (both groups None)."""

    @staticmethod
    def of(tokenizer: Any) -> _ControlTokens:
        ids = control_tokens(tokenizer)
        in_user_text, in_prompt = _patterns(tuple(sorted(ids)))
        return _ControlTokens(ids, in_user_text, in_prompt)

    def mark(self, value: Any) -> Any:
        """`value` with each control token in its strings wrapped in markers. Dict keys are marked
        too: tool arguments and parameter schemas are user data whose keys a template writes out
        with `tojson` (the keys a template reads, like `role`, hold no control-token text)."""
        if isinstance(value, str):
            return self.in_user_text.sub(f"{_START}\\g<0>{_END}", value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.mark(v) for v in value]
        return value


def control_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's control tokens (see the module docstring), each text with its id."""
    template = chat_template(tokenizer)
    return {
        t.content: i
        for i, t in tokenizer.added_tokens_decoder.items()
        if t.special or (t.content in template and not t.content.isspace())
    }


@lru_cache(maxsize=8)
def _patterns(control_tokens: tuple[str, ...]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    alternatives = [re.escape(t) for t in sorted(control_tokens, key=len, reverse=True)]
    in_user_text = re.compile("|".join([*alternatives, _START, _END]))
    token = in_user_text.pattern
    in_prompt = re.compile(f"{_START}({token}){_END}?|({token}){_END}|[{_START}{_END}]")
    return in_user_text, in_prompt


_NAME_PROBES: dict[str, list[dict[str, str]]] = {
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "user": [{"role": "user", "content": "Hi"}],
    "assistant": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ],
}
"""For each role, a short conversation every template takes, whose message of that role gets a
`name` to see whether the template writes it (roles alternate, a system message comes first)."""


def named_roles(tokenizer: Any) -> frozenset[str]:
    """The roles (system, user, assistant) whose message `name` the tokenizer's chat template
    writes into the prompt: the role's probe conversation renders differently with a name on
    that role's message. Most templates (Llama 3's, Qwen's ChatML) write none. A role whose
    probe the template refuses (Gemma's refuses a system message) counts as writing none."""
    if not chat_template(tokenizer):
        return frozenset()
    roles = set()
    for role, conversation in _NAME_PROBES.items():
        named = [m | {"name": "Probe_Name"} if m["role"] == role else m for m in conversation]
        try:
            renders = [
                tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                for c in (conversation, named)
            ]
        except TemplateError:
            continue
        if renders[0] != renders[1]:
            roles.add(role)
    return frozenset(roles)


def chat_template(tokenizer: Any) -> str:
    """The template `apply_chat_template` uses, or "" for a tokenizer without one."""
    try:
        return str(tokenizer.get_chat_template())
    except ValueError:
        return ""


def _encode_marked(tokenizer: Any, rendered: str, control: _ControlTokens) -> list[int]:
    # split() gives [prompt text, group 1, group 2, prompt text, ..., prompt text].
    pieces = control.in_prompt.split(rendered)
    if len(pieces) == 1:  # no markers: exactly what apply_chat_template(tokenize=True) does
        return _encode_batch(tokenizer, [rendered])[0]
    # Every piece after the first continues the prompt. SentencePiece-style tokenizers give the
    # start of an encoded string a space that such a piece must not get, so each is encoded after
    # a character no vocabulary holds (no merge crosses it; it falls back to bytes or <unk>) whose
    # ids are then dropped. A hostile prompt has many pieces: each distinct one is encoded once.
    texts = pieces[0::3]
    marked = [g1 or g2 for g1, g2 in zip(pieces[1::3], pieces[2::3], strict=True)]
    later = list(dict.fromkeys(t for t in texts[1:] if t))
    first, lead, *encoded = _encode_batch(
        tokenizer, [texts[0], _START, *(_START + t for t in later)]
    )
    prompt_text = {
        t: _after_lead(e, lead, t, lambda t: _encode_batch(tokenizer, [t])[0])
        for t, e in zip(later, encoded, strict=True)
    }
    user_text = {u: _user_text_ids(tokenizer, u, control) for u in set(marked) if u}
    ids = first
    for u, t in zip(marked, texts[1:], strict=True):
        ids += user_text.get(u or "", [])
        ids += prompt_text.get(t, [])
    return ids


def _user_text_ids(tokenizer: Any, user_text: str, control: _ControlTokens) -> list[int]:
    """Ids of one marked piece of user text (a control token's text, or a marker character)."""

    def as_text(text: str) -> list[int]:
        return _encode_as_text(tokenizer, text)

    ids = _after_lead(as_text(_START + user_text), as_text(_START), user_text, as_text)
    if set(control.ids.values()).intersection(ids):
        raise InvalidRequestError(
            f"this model's tokenizer cannot encode {user_text!r} in a prompt as plain text"
        )
    return ids


def _after_lead(
    ids: list[int], lead: list[int], piece: str, encode: Callable[[str], list[int]]
) -> list[int]:
    """`ids` (of the lead character and `piece`) without the lead's ids; where they do not come
    apart cleanly (an <unk> that swallowed the piece), `piece` encoded alone."""
    if ids[: len(lead)] == lead and len(ids) > len(lead):
        return ids[len(lead) :]
    return encode(piece)


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`texts` encoded as `tokenizer(texts, add_special_tokens=False)` encodes them. By the Rust
    tokenizer itself: transformers' wrapper costs several times the encoding of a prompt. Unless
    the tokenizer file turns on truncation or padding, which transformers turns off per call."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def _encode_as_text(tokenizer: Any, text: str) -> list[int]:
    """`text` through the tokenizer's pipeline without its added-token matching."""
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    splits = [text]
    if backend.pre_tokenizer is not None:
        splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    return [t.id for s in splits for t in backend.model.tokenize(s)]
