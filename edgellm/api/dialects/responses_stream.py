"""The Responses API's stream: the chat stream's message deltas -> its typed events, in order.

Apart from the response object (responses_object.py, whose items the events open and close) because it
is a state machine of its own: which item is open, what text it holds, the sequence numbers.
"""

from __future__ import annotations

from typing import Any

from edgellm.api.dialects.responses_object import call_item, message_item, output_text, reasoning_item, whole_arguments


class EventStream:
    """The typed events of a streamed response, from the chat stream's message deltas (api/reply.py:
    {"reasoning_content"}, {"content"}, {"tool_calls"}), in order, each with its sequence_number.

    Items open as their first delta arrives and close when the next kind begins or the reply ends:
    reasoning, then the message (opened only once its text is more than whitespace, or at the end
    when nothing else came, as the final object has it), then one function_call per call."""

    def __init__(self, hexid: str) -> None:
        self.hexid = hexid
        self.seq = 0
        self.count = 0  # output items opened so far (the next one's output_index)
        self.current: dict[str, Any] | None = None  # the open item: kind, index, text, its item
        self.pending = ""  # leading whitespace of a message not opened yet
        self.calls = 0
        self.message_opened = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return body

    def start(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._content(delta["content"])
            for part in delta.get("tool_calls") or []:
                events += self._call(part)
        return events

    def finish(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events, then the terminal one for the response's status."""
        events: list[dict[str, Any]] = []
        has_message = any(item["type"] == "message" for item in response["output"])
        if has_message and not self.message_opened:  # only whitespace (or nothing) came: the message is that
            events += self._close(response)
            events += self._open("message")
        if self.pending and self.current is not None and self.current["kind"] == "message":
            events += self._delta(self.pending)
        self.pending = ""
        events += self._close(response)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed"
        )
        events.append(self.event(kind, response=response))
        return events

    # -- items --------------------------------------------------------------------------------------
    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.current is None or self.current["kind"] != "message":
            if not (self.pending + text).strip():
                self.pending += text  # not known yet whether a message follows (or only calls)
                return []
            text, self.pending = self.pending + text, ""
        return self._text("message", text)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.current is None or self.current["kind"] != kind:
            events += self._close(None)
            events += self._open(kind)
        events += self._delta(text)
        return events

    def _open(self, kind: str) -> list[dict[str, Any]]:
        index = self.count
        self.count += 1
        if kind == "reasoning":
            item, part = reasoning_item(self.hexid, None, "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(self.hexid, None, "in_progress"), output_text("")
            self.message_opened = True
        self.current = {"kind": kind, "index": index, "text": "", "item": item}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            ),
        ]

    def _delta(self, text: str) -> list[dict[str, Any]]:
        cur = self.current
        cur["text"] += text
        if cur["kind"] == "reasoning":
            fields = {"item_id": cur["item"]["id"], "output_index": cur["index"], "content_index": 0, "delta": text}
            return [self.event("response.reasoning_text.delta", **fields)]
        if cur["kind"] == "function_call":
            fields = {"item_id": cur["item"]["id"], "output_index": cur["index"], "delta": text}
            return [self.event("response.function_call_arguments.delta", **fields)]
        fields = {"item_id": cur["item"]["id"], "output_index": cur["index"], "content_index": 0, "delta": text}
        return [self.event("response.output_text.delta", **fields, logprobs=[])]

    def _call(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        fn = part.get("function") or {}
        if part.get("id") is not None:  # a new call's header: its id and name, arguments to follow
            events += self._close(None)
            index = self.count
            self.count += 1
            item = call_item(self.hexid, self.calls, part["id"], fn.get("name"), "", "in_progress")
            self.calls += 1
            self.current = {"kind": "function_call", "index": index, "text": "", "item": item}
            events.append(self.event("response.output_item.added", output_index=index, item=item))
        if fn.get("arguments") and self.current is not None and self.current["kind"] == "function_call":
            events += self._delta(fn["arguments"])
        return events

    def _close(self, response: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The open item's closing events; `response`: the final object, whose item statuses they take."""
        cur, self.current = self.current, None
        if cur is None:
            return []
        index, item, text = cur["index"], dict(cur["item"]), cur["text"]
        status = "completed"
        if response is not None and response["status"] != "completed":
            # A call is whole unless max_tokens cut it (its arguments as far as they go: output_items).
            if response["status"] != "incomplete" or cur["kind"] != "function_call" or not whole_arguments(text):
                status = "incomplete"
        item["status"] = status
        events = []
        if cur["kind"] == "function_call":
            item["arguments"] = text
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        elif cur["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self.event("response.reasoning_text.done", **ids, text=text))
            events.append(self.event("response.content_part.done", **ids, part=part))
        else:
            part = output_text(text)
            item["content"] = [part]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self.event("response.output_text.done", **ids, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **ids, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events
