"""Translators between a peer's wire format and the service's one request: OpenAI chat, the Responses API,
Anthropic messages, legacy completions and embeddings. Each maps a body onto the seed request (validated by
the same rules) and a result back onto its own shapes; none runs anything."""
