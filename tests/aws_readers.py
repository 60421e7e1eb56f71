"""Stream readers written the way the ecosystem's own client code reads SageMaker streams.

``LineIterator`` follows the pattern of the class in AWS's SageMaker response-streaming examples
(LMI / TGI notebooks and the "Elevating the generative AI experience" streaming post): it takes the
``Body`` event stream of ``invoke_endpoint_with_response_stream``, buffers each ``PayloadPart``'s
bytes and yields complete lines. The readers then do what those notebooks do with every line:
TGI's ``json.loads(line[line.find(b"{"):])["token"]["text"]`` (skipping a stop token) and LMI's
``json.loads(line)["token"]["text"]``. Nothing here tolerates a line without a token object:
a reply these readers cannot parse to the end fails the test, as it would fail the user.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from typing import Any


class LineIterator:
    """Yield the complete lines of a SageMaker response stream's ``PayloadPart`` bytes."""

    def __init__(self, stream: Iterable[dict[str, Any]]) -> None:
        self.byte_iterator = iter(stream)
        self.buffer = io.BytesIO()
        self.read_pos = 0

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        while True:
            self.buffer.seek(self.read_pos)
            line = self.buffer.readline()
            if line and line[-1] == ord("\n"):
                self.read_pos += len(line)
                return line[:-1]
            try:
                chunk = next(self.byte_iterator)
            except StopIteration:
                if self.read_pos < self.buffer.getbuffer().nbytes:  # a last line without its newline
                    self.buffer.seek(self.read_pos)
                    rest = self.buffer.read()
                    self.read_pos += len(rest)
                    return rest
                raise
            if "PayloadPart" not in chunk:
                continue  # other event types are skipped, as in the examples
            self.buffer.seek(0, io.SEEK_END)
            self.buffer.write(chunk["PayloadPart"]["Bytes"])


def tgi_reader_text(lines: Iterable[bytes], stop_token: str = "</s>") -> str:
    """The TGI streaming notebooks' loop: every line with a JSON object, its token's text printed."""
    out = []
    for line in lines:
        if line != b"" and b"{" in line:
            data = json.loads(line[line.find(b"{") :].decode("utf-8"))
            if data["token"]["text"] != stop_token:
                out.append(data["token"]["text"])
    return "".join(out)


def lmi_reader_text(lines: Iterable[bytes]) -> str:
    """The LMI streaming notebooks' loop: ``json.loads(line)["token"]["text"]`` on every line."""
    out = []
    for line in lines:
        resp = json.loads(line)
        out.append(resp["token"]["text"])
    return "".join(out)


def chat_reader_chunks(lines: Iterable[bytes]) -> list[dict[str, Any]]:
    """AWS's chat-streaming loop over LMI / vLLM endpoints: every line, a leading ``data:`` stripped,
    blank lines and ``[DONE]`` skipped, the rest ``json.loads``-ed (a chunk, or an error object)."""
    chunks = []
    for line in lines:
        text = line.decode("utf-8").strip()
        if text.startswith("data:"):
            text = text[len("data:") :].strip()
        if not text or text == "[DONE]":
            continue
        chunks.append(json.loads(text))
    return chunks


def chat_reader_text(lines: Iterable[bytes]) -> str:
    """The content those loops print: ``choices[0].delta.content`` of every chunk that has a choice."""
    out = []
    for chunk in chat_reader_chunks(lines):
        for choice in chunk["choices"]:
            out.append(choice["delta"].get("content") or "")
    return "".join(out)
