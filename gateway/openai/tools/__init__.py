"""Tool calling: the request and response shapes of OpenAI's tools."""
