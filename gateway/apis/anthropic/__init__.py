"""Anthropic's Messages API (`POST /v1/messages`): its errors, its request checks, and its translation to and from
a pool that speaks OpenAI chat completions.

A Messages request becomes a chat-completions request, and the chat answer (a body, or a stream of chunks) becomes
a Message (or Anthropic's stream events), so that an `anthropic` SDK client cannot tell. The shapes follow the
public references: docs.anthropic.com "Messages" API reference and "Streaming Messages" guide, the "Errors" page,
platform.openai.com's chat-completions reference, and vLLM's extensions to it (`top_k`; a choice's `stop_reason`
naming the stop string that ended it; `reasoning_content`, or `reasoning` in newer releases, in message and delta).
Examples of each shape are recorded under tests/api_reference/.

What has no counterpart is named where it is decided: a tool result's `is_error` travels in its text; thinking
blocks sent back in history are dropped (a chat model takes no reasoning as input); server tools, file sources
and non-text documents are refused with a 400, never dropped silently; reasoning comes back as thinking blocks
only when the request asked for thinking, with an empty signature (the gateway cannot sign it).

One concern a module: `errors` (Anthropic's error bodies), `checks` (what a valid request is), `to_chat` (the
request for a chat pool), `from_chat` (its answer and stream back), `carriers` (what a request carries, for the
content inventory).
"""
