"""OpenAI-compatible HTTP server of Ember: protocol models, routes, errors and SSE framing."""
