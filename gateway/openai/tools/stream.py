"""Reading tool calls out of generated text as it streams, and out of a whole output.

`ToolCallStreamParser` is fed the text deltas the gateway detokenizes and returns what can be
sent: content text and OpenAI tool-call deltas, in output order. Text that may still turn out
to open a call (a partial `<tool_c`) is held back until it is decided. A call is sent once its
region is complete and its JSON has been checked (two deltas: index, id, type and name with
empty arguments, then the whole arguments text), so a region that turns out to be junk goes
out as content instead and nothing sent needs taking back.

Whitespace next to calls is not content: a run of whitespace is held until text follows it and
dropped at the end when the output made calls (Qwen writes `\\n` between its calls).

`parse_tool_calls` is the same parser fed the whole text at once, so a streamed response
reassembles to exactly the non-streamed one, wherever the deltas split.
"""

from __future__ import annotations

from loramux.gateway.openai.tools.formats import (
    ParsedToolCalls,
    ToolCallFormat,
    decode_calls,
    tool_calls,
)
from loramux.gateway.openai.tools.schemas import FunctionCallDelta, ToolCall, ToolCallDelta

StreamDelta = str | ToolCallDelta
"""What a stream sends next: content text, or one tool-call delta."""


def parse_tool_calls(
    text: str, fmt: ToolCallFormat, calls_of: str, *, parallel: bool = True
) -> ParsedToolCalls:
    """The content and tool calls of a finished output (`calls_of`: see `formats.call_id`)."""
    parser = ToolCallStreamParser(fmt, calls_of, parallel=parallel)
    parser.feed(text)
    parser.finish()
    return parser.result()


class ToolCallStreamParser:
    """Feed text deltas in order, then call `finish()` once at the end of the output. With
    `parallel` False only the first call counts; later ones are dropped (OpenAI's
    `parallel_tool_calls: false`)."""

    def __init__(self, fmt: ToolCallFormat, calls_of: str, *, parallel: bool = True):
        self.fmt = fmt
        self.calls_of = calls_of
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        """Every call sent so far."""
        self.content: list[str] = []
        """Every piece of content sent so far."""
        self._pending = ""
        """Text outside regions not yet sent: a possible partial opening marker, or leading
        whitespace while the start of the output is undecided."""
        self._decided_start = fmt.opens_output is None
        self._region: list[str] | None = None
        """The raw text of the open region (its opening marker first); None outside one."""
        self._body_start = 0
        """Where the region's JSON starts in its raw text."""
        self._tail = ""
        """The region's last characters, enough to find a closing marker split across deltas."""
        self._held_space = ""
        self._out: list[StreamDelta] = []

    def feed(self, text: str) -> list[StreamDelta]:
        """What can be sent after `text`."""
        while text:
            text = self._in_region(text) if self._region is not None else self._outside(text)
        return self._take()

    def finish(self) -> list[StreamDelta]:
        """What is left to send once the output has ended."""
        if self._region is not None:
            self._close_region("".join(self._region))
        elif self._pending:
            self._content(self._pending)
            self._pending = ""
        if not self.calls and self._held_space:
            self._send(self._held_space)
        self._held_space = ""
        return self._take()

    def result(self) -> ParsedToolCalls:
        """Everything sent, as one message (after `finish()`)."""
        content = "".join(self.content)
        return ParsedToolCalls(None if self.calls and not content else content, list(self.calls))

    # -- outside a region -------------------------------------------------------------------------
    def _outside(self, text: str) -> str:
        """Consume text outside a region; return what belongs to a region just opened."""
        text = self._pending + text
        self._pending = ""
        if not self._decided_start:
            first = text.lstrip()
            if not first or any(m.startswith(first) and m != first for m in self.fmt.opens):
                self._pending = text  # blank so far, or maybe an opening marker
                return ""
            self._decided_start = True
            opener = self.fmt.opens_output
            assert opener is not None  # undecided only for formats with one
            if first.startswith(opener) and not first.startswith(self.fmt.opens):
                self._open_region(text, body_start=len(text) - len(first))
                return ""
        found = [(at, m) for m in self.fmt.opens if (at := text.find(m)) != -1]
        if found:
            at, marker = min(found)
            self._content(text[:at])
            self._open_region(marker, body_start=len(marker))
            return text[at + len(marker) :]
        keep = _partial_marker_length(text, self.fmt.opens)
        self._content(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return ""

    def _open_region(self, raw: str, body_start: int) -> None:
        self._region = [raw]
        self._body_start = body_start
        self._tail = raw[body_start:]

    # -- inside a region --------------------------------------------------------------------------
    def _in_region(self, text: str) -> str:
        """Consume text of the open region; return what follows its closing marker."""
        assert self._region is not None
        close = self.fmt.closes
        if close is None:
            self._region.append(text)
            return ""
        window = self._tail + text
        at = window.find(close)
        if at == -1:
            self._region.append(text)
            self._tail = window[-(len(close) - 1) :] if len(close) > 1 else ""
            return ""
        end = at - len(self._tail) + len(close)  # where the marker ends in `text`
        self._region.append(text[:end])
        self._close_region("".join(self._region))
        return text[end:]

    def _close_region(self, raw: str) -> None:
        self._region = None
        body = raw[self._body_start :]
        if self.fmt.closes is not None and body.endswith(self.fmt.closes):
            body = body[: -len(self.fmt.closes)]
        named = decode_calls(body)
        if named is None:
            self._content(raw)
            return
        if not self.parallel:
            named = named[: max(0, 1 - len(self.calls))]
        for call in tool_calls(named, self.calls_of, len(self.calls)):
            index = len(self.calls)
            self.calls.append(call)
            name = FunctionCallDelta(name=call.function.name, arguments="")
            self._out.append(ToolCallDelta(index, name, id=call.id, type="function"))
            arguments = FunctionCallDelta(arguments=call.function.arguments)
            self._out.append(ToolCallDelta(index, arguments))

    # -- content ----------------------------------------------------------------------------------
    def _content(self, text: str) -> None:
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept) :]
        if kept:
            self._send(kept)

    def _send(self, text: str) -> None:
        self.content.append(text)
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += text
        else:
            self._out.append(text)

    def _take(self) -> list[StreamDelta]:
        out, self._out = self._out, []
        return out


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest
